//! Guest RAM as a KVM memory slot, and KVM's dirty log over it.
//!
//! Logging is switched on by re-registering the slot with
//! `KVM_MEM_LOG_DIRTY_PAGES`; KVM then write-protects the slot and records
//! each page the guest writes. `KVM_GET_DIRTY_LOG` returns the record in the
//! layout of [`DirtyBitmap`] (64-bit words, bit `i` = page `i`), so it is
//! ORed straight in.
//!
//! Where the kernel offers `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2`, the VM
//! enables it (without `KVM_DIRTY_LOG_INITIALLY_SET`, so the first sync
//! reports only pages written since logging started): `KVM_GET_DIRTY_LOG`
//! then only reads the record, and the VMM re-protects exactly the pages it
//! got with `KVM_CLEAR_DIRTY_LOG`. Otherwise `KVM_GET_DIRTY_LOG` reads and
//! re-protects in one call. Either way a page reported by a sync was
//! re-armed before the engine reads it, so a later write is reported by a
//! later sync.
//!
//! KVM does not see what the VMM itself writes into guest RAM; vm-memory's
//! bitmap of the region does (see [`crate::memory`]), and each sync ORs it
//! in too.

use kvm_bindings::{
    KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2, KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE,
    KVM_MEM_LOG_DIRTY_PAGES, kvm_clear_dirty_log, kvm_enable_cap, kvm_userspace_memory_region,
};
use kvm_ioctls::VmFd;
use tern_engine::{DirtyBitmap, PAGE_SIZE};
use vm_memory::GuestMemoryRegion;

use crate::memory::{self, RamRegion};
use crate::{Result, VmmError};

/// The one KVM ioctl kvm-ioctls 0.24 does not wrap.
mod ioctls {
    use kvm_bindings::{KVMIO, kvm_clear_dirty_log};
    vmm_sys_util::ioctl_iowr_nr!(KVM_CLEAR_DIRTY_LOG, KVMIO, 0xc0, kvm_clear_dirty_log);
}

/// How dirty pages are re-armed after a sync.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProtectMode {
    /// `KVM_GET_DIRTY_LOG` reads and re-protects.
    GetClears,
    /// `KVM_GET_DIRTY_LOG` reads, `KVM_CLEAR_DIRTY_LOG` re-protects the
    /// pages reported (`KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2`).
    ManualClear,
}

impl ProtectMode {
    /// A short name for reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::GetClears => "get-dirty-log",
            Self::ManualClear => "manual-protect (clear-dirty-log)",
        }
    }

    /// Chooses the mode for a new VM (before any memory slot exists),
    /// enabling manual protection where the kernel has it.
    pub fn enable(vm: &VmFd) -> Self {
        let supported =
            vm.check_extension_raw(libc::c_ulong::from(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2));
        let wanted = u64::from(KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE);
        if supported > 0 && u64::from(supported.unsigned_abs()) & wanted != 0 {
            let mut cap = kvm_enable_cap {
                cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
                ..Default::default()
            };
            cap.args[0] = wanted;
            if vm.enable_cap(&cap).is_ok() {
                return Self::ManualClear;
            }
        }
        Self::GetClears
    }
}

/// Guest RAM registered with KVM as one memory slot.
#[derive(Debug)]
pub struct MemorySlot {
    slot: u32,
    guest_addr: u64,
    len: u64,
    host_addr: u64,
    mode: ProtectMode,
    logging: bool,
}

impl MemorySlot {
    /// Registers `region` at its guest address as slot `slot`.
    ///
    /// # Safety
    /// `region` must stay mapped for as long as the VM `vm` may access the
    /// slot, that is until the VM is closed.
    pub unsafe fn register(
        vm: &VmFd,
        slot: u32,
        region: &RamRegion,
        mode: ProtectMode,
    ) -> Result<Self> {
        let slot = Self {
            slot,
            guest_addr: region.start_addr().0,
            len: region.len(),
            host_addr: region.as_ptr() as u64,
            mode,
            logging: false,
        };
        // SAFETY: the caller promised the mapping outlives the VM.
        unsafe { slot.set(vm, 0) }?;
        Ok(slot)
    }

    /// # Safety
    /// The mapping recorded in `self` must still be valid (see `register`).
    unsafe fn set(&self, vm: &VmFd, flags: u32) -> Result<()> {
        let region = kvm_userspace_memory_region {
            slot: self.slot,
            flags,
            guest_phys_addr: self.guest_addr,
            memory_size: self.len,
            userspace_addr: self.host_addr,
        };
        // SAFETY: the host range is the guest RAM mapping, valid while the
        // VM lives (the contract of `register`).
        unsafe { vm.set_user_memory_region(region) }.map_err(VmmError::kvm("set memory region"))
    }

    /// The re-arming mode.
    pub fn mode(&self) -> ProtectMode {
        self.mode
    }

    /// Whether logging is on.
    pub fn logging(&self) -> bool {
        self.logging
    }

    fn pages(&self) -> u64 {
        self.len / PAGE_SIZE as u64
    }

    /// Starts logging: every page is write-protected, the next sync reports
    /// the pages written from now on, by the guest or by the VMM into
    /// `region` (the one registered).
    pub fn start(&mut self, vm: &VmFd, region: &RamRegion) -> Result<()> {
        // SAFETY: `self` was created by `register`, whose caller keeps the
        // mapping valid.
        unsafe { self.set(vm, KVM_MEM_LOG_DIRTY_PAGES) }?;
        memory::forget_vmm_writes(region);
        self.logging = true;
        Ok(())
    }

    /// Stops logging.
    pub fn stop(&mut self, vm: &VmFd) -> Result<()> {
        // SAFETY: as in `start`.
        unsafe { self.set(vm, 0) }?;
        self.logging = false;
        Ok(())
    }

    /// ORs the pages written since the previous sync (or `start`) into
    /// `bitmap` and re-arms them: the guest's from KVM, the VMM's from
    /// `region`'s bitmap. Returns how many pages the guest wrote.
    pub fn sync(&mut self, vm: &VmFd, region: &RamRegion, bitmap: &mut DirtyBitmap) -> Result<u64> {
        if !self.logging {
            return Err(VmmError::Config("the dirty log is not started".into()));
        }
        if bitmap.pages() != self.pages() {
            return Err(VmmError::Config(format!(
                "bitmap of {} pages for a slot of {}",
                bitmap.pages(),
                self.pages()
            )));
        }
        let len = usize::try_from(self.len).expect("RAM fits the address space");
        let mut words = vm
            .get_dirty_log(self.slot, len)
            .map_err(VmmError::kvm("get dirty log"))?;
        let dirty: u64 = words.iter().map(|word| u64::from(word.count_ones())).sum();
        if self.mode == ProtectMode::ManualClear && dirty > 0 {
            self.clear(vm, &mut words)?;
        }
        for (mine, theirs) in bitmap.words_mut().iter_mut().zip(&words) {
            *mine |= theirs;
        }
        memory::take_vmm_writes(region, bitmap);
        Ok(dirty)
    }

    fn clear(&self, vm: &VmFd, words: &mut [u64]) -> Result<()> {
        let mut clear = kvm_clear_dirty_log {
            slot: self.slot,
            num_pages: u32::try_from(self.pages())
                .map_err(|_| VmmError::Config("slot too large to clear in one call".into()))?,
            first_page: 0,
            ..Default::default()
        };
        clear.__bindgen_anon_1.dirty_bitmap = words.as_mut_ptr().cast();
        // SAFETY: `clear` describes the whole slot and points at a bitmap of
        // `pages` bits (`words` came from KVM_GET_DIRTY_LOG for this slot);
        // the kernel only reads it during the call.
        let ret = unsafe {
            vmm_sys_util::ioctl::ioctl_with_ref(vm, ioctls::KVM_CLEAR_DIRTY_LOG(), &clear)
        };
        if ret != 0 {
            return Err(VmmError::Kvm {
                operation: "clear dirty log",
                source: kvm_ioctls::Error::last(),
            });
        }
        Ok(())
    }
}
