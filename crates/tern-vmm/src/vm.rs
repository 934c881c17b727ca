//! [`KvmGuest`]: a KVM VM with one vCPU running the test guest, and the
//! engine's guest traits over it.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kvm_bindings::{
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_MAX_CPUID_ENTRIES,
    kvm_irqchip, kvm_segment,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use tern_engine::{
    DeviceState, DirtyBitmap, DirtyLog, GuestControl, GuestMemory, GuestResult, HandedFile,
    MemoryRegion, PAGE_SIZE, StateSection,
};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use crate::dirty::{MemorySlot, ProtectMode};
use crate::guest_code::{
    CODE_ADDR, CODE_SELECTOR, DATA_SELECTOR, GDT_ADDR, PASS_COUNTER_ADDR, STACK_TOP,
    WORKING_SET_BASE, gdt,
};
use crate::memory::{self, GuestRam, RamRegion};
use crate::serial::Serial;
use crate::state::{
    self, GUEST_SECTION, GuestLayout, SERIAL_SECTION, SerialState, VCPU_SECTION, VM_SECTION,
    VcpuState, VmState,
};
use crate::vcpu::{Vcpu, VcpuStatus};
use crate::{Result, VmmError, kvm_available};

const PAGE: u64 = PAGE_SIZE as u64;
/// Where KVM on Intel places the real-mode TSS (three pages), kept out of RAM.
const TSS_ADDR: usize = 0xfffb_d000;
/// Largest guest RAM: everything stays below the TSS and 32-bit reachable.
pub const MAX_MEMORY: u64 = 3 << 30;

/// This guest's [`DeviceState::guest_kind`]: its sections (vCPU, VM, serial,
/// test program) are only restored by another `KvmGuest`.
pub const GUEST_KIND: &str = "KVM test";

/// How to build a source VM.
#[derive(Clone, Debug)]
pub struct VmConfig {
    /// Guest RAM in bytes (a multiple of 4 KiB, at most 3 GiB).
    pub memory_bytes: u64,
    /// Pages the test guest dirties, from 1 MiB up.
    pub working_set_pages: u32,
    /// What the test guest does to them.
    pub workload: crate::guest_code::Workload,
    /// A file whose contents the RAM starts from (mapped privately: the
    /// guest's writes never reach it). The test guest's code, GDT and
    /// counter overwrite its first pages.
    pub image: Option<PathBuf>,
    /// RAM in a memfd mapped shared instead of anonymous memory, so that a
    /// same-host migration can hand it over (`memory_handover`) rather
    /// than copy it. An image is then copied into the memfd.
    pub memfd: bool,
}

impl Default for VmConfig {
    fn default() -> Self {
        Self {
            memory_bytes: 128 << 20,
            working_set_pages: 1024,
            workload: crate::guest_code::Workload::Increment,
            image: None,
            memfd: false,
        }
    }
}

impl VmConfig {
    fn validate(&self) -> Result<()> {
        let config = |message: String| Err(VmmError::Config(message));
        if self.memory_bytes == 0 || !self.memory_bytes.is_multiple_of(PAGE) {
            return config(format!(
                "memory size {} is not a non-zero multiple of {PAGE_SIZE}",
                self.memory_bytes
            ));
        }
        if self.memory_bytes > MAX_MEMORY {
            return config(format!(
                "memory size {} is above the VMM's limit of {MAX_MEMORY} bytes",
                self.memory_bytes
            ));
        }
        if self.working_set_pages == 0 {
            return config("the working set needs at least one page".into());
        }
        let mut end = WORKING_SET_BASE + u64::from(self.working_set_pages) * PAGE;
        if self.workload == crate::guest_code::Workload::Rewrite {
            // Its random buffer follows the working set.
            end += crate::guest_code::REWRITE_BUFFER_BYTES;
        }
        if end > self.memory_bytes {
            return config(format!(
                "a working set of {} pages from 1 MiB ({:?} workload) ends at {end:#x}, past the \
                 {} bytes of RAM",
                self.working_set_pages, self.workload, self.memory_bytes
            ));
        }
        Ok(())
    }
}

/// The result of [`KvmGuest::consistency_check`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConsistencyReport {
    /// Whether every property held.
    pub passed: bool,
    /// Working-set pages checked.
    pub pages: u32,
    /// Places where a byte is one less than its predecessor (at most one:
    /// where the guest was in its pass).
    pub edges: u32,
    /// First byte of the first working-set page.
    pub first_byte: u8,
    /// First byte of the last working-set page.
    pub last_byte: u8,
    /// The pass counter.
    pub pass_count: u64,
    /// Whether the last page's byte agrees with the counter (equal to its
    /// low byte, or one ahead just before the counter is updated).
    pub counter_matches: bool,
    /// What failed, when something did.
    pub failure: Option<String>,
}

/// A KVM virtual machine running the test guest (see
/// [`crate::guest_code`]), migratable by tern.
///
/// Fields drop in order: the vCPU thread ends before the VM is closed, and
/// the VM is closed before its RAM is unmapped.
pub struct KvmGuest {
    vcpu: Vcpu,
    slot: MemorySlot,
    vm: VmFd,
    _kvm: Kvm,
    regions: Vec<MemoryRegion>,
    layout: GuestLayout,
    ram: GuestRam,
}

impl std::fmt::Debug for KvmGuest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvmGuest")
            .field("memory", &self.memory_bytes())
            .field("layout", &self.layout)
            .field("vcpu", &self.vcpu)
            .field("dirty_log", &self.slot)
            .finish()
    }
}

/// The parts shared by source and destination VMs, before any memory.
struct Machine {
    kvm: Kvm,
    vm: VmFd,
    mode: ProtectMode,
    vcpu: VcpuFd,
    msrs: Vec<u32>,
}

/// Builds a VM with its interrupt controllers and configured vCPU but no
/// memory slot. Creating the interrupt controllers and the memory slot are
/// the slow steps under load (each waits for KVM SRCU grace periods, see
/// docs/vmm.md), which is why a destination does this part before the
/// source connects.
fn machine() -> Result<Machine> {
    if !kvm_available() {
        return Err(VmmError::KvmUnavailable);
    }
    let mut phases = SetupPhases::start();
    let kvm = Kvm::new().map_err(VmmError::kvm("open /dev/kvm"))?;
    let vm = kvm.create_vm().map_err(VmmError::kvm("create VM"))?;
    phases.end("create-vm");
    for (cap, name) in [
        (Cap::Irqchip, "IRQCHIP"),
        (Cap::ImmediateExit, "IMMEDIATE_EXIT"),
        (Cap::Xsave, "XSAVE"),
        (Cap::Xcrs, "XCRS"),
        (Cap::VcpuEvents, "VCPU_EVENTS"),
        (Cap::Debugregs, "DEBUGREGS"),
        (Cap::AdjustClock, "ADJUST_CLOCK"),
    ] {
        if !vm.check_extension(cap) {
            return Err(VmmError::MissingCapability(name));
        }
    }
    // A guest whose XSAVE area outgrows the legacy 4 KiB buffer (AMX) would
    // need KVM_GET_XSAVE2; this VMM keeps to the legacy buffer.
    if vm.check_extension_int(Cap::Xsave2) > 4096 {
        return Err(VmmError::MissingCapability("XSAVE state of at most 4 KiB"));
    }
    vm.set_tss_address(TSS_ADDR)
        .map_err(VmmError::kvm("set TSS address"))?;
    vm.create_irq_chip()
        .map_err(VmmError::kvm("create interrupt controllers"))?;
    phases.end("irqchip");
    let mode = ProtectMode::enable(&vm);
    let vcpu = vm.create_vcpu(0).map_err(VmmError::kvm("create vCPU"))?;
    phases.end("create-vcpu");
    let cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(VmmError::kvm("get supported CPUID"))?;
    vcpu.set_cpuid2(&cpuid)
        .map_err(VmmError::kvm("set CPUID"))?;
    phases.end("cpuid");
    let msrs = readable_msrs(&kvm, &vcpu)?;
    phases.end("msrs");
    Ok(Machine {
        kvm,
        vm,
        mode,
        vcpu,
        msrs,
    })
}

/// Registers `ram` as the VM's only memory slot.
///
/// # Safety
/// `ram` must outlive the VM `vm`.
unsafe fn register_ram(vm: &VmFd, ram: &GuestRam, mode: ProtectMode) -> Result<MemorySlot> {
    let mut phases = SetupPhases::start();
    // SAFETY: the caller promised that `ram` outlives the VM.
    let slot = unsafe { MemorySlot::register(vm, 0, ram_region(ram), mode) }?;
    phases.end("memory-slot");
    Ok(slot)
}

/// Times the steps of building a VM, for `RUST_LOG=tern_vmm=debug`.
struct SetupPhases {
    last: Instant,
}

impl SetupPhases {
    fn start() -> Self {
        Self {
            last: Instant::now(),
        }
    }

    fn end(&mut self, phase: &'static str) {
        let now = Instant::now();
        let micros = now.duration_since(self.last).as_micros();
        tracing::debug!(phase, micros, "VM setup phase done");
        self.last = now;
    }
}

/// The MSRs KVM lists that this vCPU can actually read.
fn readable_msrs(kvm: &Kvm, vcpu: &VcpuFd) -> Result<Vec<u32>> {
    let list = kvm
        .get_msr_index_list()
        .map_err(VmmError::kvm("get MSR index list"))?;
    let mut readable = Vec::new();
    for &index in list.as_slice() {
        let mut one = kvm_bindings::Msrs::from_entries(&[kvm_bindings::kvm_msr_entry {
            index,
            ..Default::default()
        }])
        .map_err(|error| VmmError::Config(format!("MSR list: {error:?}")))?;
        if matches!(vcpu.get_msrs(&mut one), Ok(1)) {
            readable.push(index);
        }
    }
    Ok(readable)
}

fn flat_segment(selector: u16, kind: u8) -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector,
        type_: kind,
        present: 1,
        dpl: 0,
        db: 1,
        s: 1,
        l: 0,
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

/// Puts the vCPU at the guest's entry point in flat 32-bit protected mode.
fn enter_protected_mode(vcpu: &VcpuFd) -> Result<()> {
    let mut sregs = vcpu
        .get_sregs()
        .map_err(VmmError::kvm("get special registers"))?;
    sregs.cs = flat_segment(CODE_SELECTOR, 0xb);
    let data = flat_segment(DATA_SELECTOR, 0x3);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.gdt.base = GDT_ADDR;
    sregs.gdt.limit =
        u16::try_from(std::mem::size_of_val(&gdt()) - 1).expect("a GDT of a few entries");
    // CR0: protection enabled, extension type; paging and caching-disable
    // bits off.
    sregs.cr0 = 0x11;
    sregs.cr4 = 0;
    sregs.efer = 0;
    vcpu.set_sregs(&sregs)
        .map_err(VmmError::kvm("set special registers"))?;
    let mut regs = vcpu.get_regs().map_err(VmmError::kvm("get registers"))?;
    regs.rip = CODE_ADDR;
    regs.rsp = STACK_TOP;
    // Bit 1 is reserved and always set; IF stays clear.
    regs.rflags = 0x2;
    vcpu.set_regs(&regs).map_err(VmmError::kvm("set registers"))
}

/// The one region of this VMM's RAM (see `memory::anonymous`).
fn ram_region(ram: &GuestRam) -> &RamRegion {
    ram.iter().next().expect("guest RAM has one region")
}

/// The one region length of a destination for a source with `region_lens`.
fn destination_len(region_lens: &[u64]) -> Result<u64> {
    let [len] = region_lens else {
        return Err(VmmError::Config(format!(
            "the source has {} memory regions; this VMM has one",
            region_lens.len()
        )));
    };
    if *len > MAX_MEMORY {
        return Err(VmmError::Config(format!(
            "memory size {len} is above the VMM's limit of {MAX_MEMORY} bytes"
        )));
    }
    Ok(*len)
}

/// A destination VM built before the source's memory layout is known:
/// everything but the memory, with the vCPU thread started and paused.
///
/// Building a VM costs 10-30 ms on an idle host and far more on a loaded
/// one, mostly in KVM grace periods; a receiver that builds it while it
/// waits for the source keeps that out of the migration's setup time.
/// [`DestinationVm::with_memory`] then only maps the memory and registers
/// it, once the source has said how much there is.
pub struct DestinationVm {
    vcpu: Vcpu,
    mode: ProtectMode,
    vm: VmFd,
    kvm: Kvm,
}

impl std::fmt::Debug for DestinationVm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DestinationVm")
            .field("vcpu", &self.vcpu)
            .finish_non_exhaustive()
    }
}

impl DestinationVm {
    /// Creates the VM and its paused vCPU.
    pub fn new() -> Result<Self> {
        let machine = machine()?;
        let vcpu = Vcpu::spawn(machine.vcpu, Serial::new(), machine.msrs)?;
        Ok(Self {
            vcpu,
            mode: machine.mode,
            vm: machine.vm,
            kvm: machine.kvm,
        })
    }

    /// Adds zeroed memory for a source whose regions have lengths
    /// `region_lens` (this VMM has exactly one).
    pub fn with_memory(self, region_lens: &[u64]) -> Result<KvmGuest> {
        let len = destination_len(region_lens)?;
        let ram = memory::anonymous(len)?;
        // SAFETY: `ram` outlives the VM: `KvmGuest` owns both and drops the
        // VM (field `vm`) before the memory (field `ram`).
        let slot = unsafe { register_ram(&self.vm, &ram, self.mode) }?;
        Ok(KvmGuest {
            vcpu: self.vcpu,
            slot,
            vm: self.vm,
            _kvm: self.kvm,
            // SAFETY: `KvmGuest` owns `ram` and drops it after the regions.
            regions: unsafe { memory::engine_regions(&ram) },
            layout: GuestLayout::default(),
            ram,
        })
    }

    /// Adds the memory a source on this host handed over (this VMM has one
    /// region): the source's memfd, mapped shared, so no page is copied.
    pub fn with_handed_files(self, files: Vec<HandedFile>) -> Result<KvmGuest> {
        let lens: Vec<u64> = files.iter().map(|file| file.len).collect();
        destination_len(&lens)?;
        let Some(file) = files.into_iter().next() else {
            return Err(VmmError::Config("no memory was handed over".into()));
        };
        let ram = memory::from_handed_file(file)?;
        // SAFETY: `ram` outlives the VM: `KvmGuest` owns both and drops the
        // VM (field `vm`) before the memory (field `ram`).
        let slot = unsafe { register_ram(&self.vm, &ram, self.mode) }?;
        Ok(KvmGuest {
            vcpu: self.vcpu,
            slot,
            vm: self.vm,
            _kvm: self.kvm,
            // SAFETY: `KvmGuest` owns `ram` and drops it after the regions.
            regions: unsafe { memory::engine_regions(&ram) },
            layout: GuestLayout::default(),
            ram,
        })
    }
}

impl KvmGuest {
    /// Creates a VM, loads the test guest and starts it running.
    pub fn new(config: &VmConfig) -> Result<Self> {
        config.validate()?;
        if !kvm_available() {
            return Err(VmmError::KvmUnavailable);
        }
        let ram = match &config.image {
            _ if config.memfd => memory::memfd(config.memory_bytes, config.image.as_deref())?,
            Some(path) => memory::from_image(config.memory_bytes, path)?,
            None => memory::anonymous(config.memory_bytes)?,
        };
        let machine = machine()?;
        // SAFETY: `ram` outlives the VM: `KvmGuest` owns both and drops the
        // VM (field `vm`) before the memory (field `ram`).
        let slot = unsafe { register_ram(&machine.vm, &ram, machine.mode) }?;
        let gdt_bytes: Vec<u8> = gdt().iter().flat_map(|entry| entry.to_le_bytes()).collect();
        let load = |addr, bytes: &[u8]| {
            ram.write_slice(bytes, GuestAddress(addr))
                .map_err(|error| VmmError::Config(format!("loading the test guest: {error}")))
        };
        load(GDT_ADDR, &gdt_bytes)?;
        load(
            CODE_ADDR,
            &crate::guest_code::code_for(config.working_set_pages, config.workload),
        )?;
        load(PASS_COUNTER_ADDR, &[0; 4])?;
        enter_protected_mode(&machine.vcpu)?;
        let vcpu = Vcpu::spawn(machine.vcpu, Serial::new(), machine.msrs)?;
        let guest = Self {
            vcpu,
            slot,
            vm: machine.vm,
            _kvm: machine.kvm,
            // SAFETY: `KvmGuest` owns `ram` and drops it after the regions.
            regions: unsafe { memory::engine_regions(&ram) },
            layout: GuestLayout {
                working_set_pages: config.working_set_pages,
            },
            ram,
        };
        guest.vcpu.resume()?;
        Ok(guest)
    }

    /// Creates a destination VM of the same shape as a source whose regions
    /// have lengths `region_lens` (this VMM has exactly one), memory zero,
    /// vCPU created but paused until state is restored and it is resumed.
    /// [`DestinationVm`] does the same in two steps.
    pub fn for_destination(region_lens: &[u64]) -> Result<Self> {
        destination_len(region_lens)?;
        DestinationVm::new()?.with_memory(region_lens)
    }

    /// The guest's pass counter: full passes over the working set since it
    /// booted (32 bits wide in the guest).
    pub fn pass_count(&self) -> u64 {
        u64::from(self.load::<u32>(PASS_COUNTER_ADDR))
    }

    /// One untorn (atomic) load: the guest may be writing the value.
    fn load<T: vm_memory::AtomicAccess>(&self, addr: u64) -> T {
        self.ram
            .load(GuestAddress(addr), Ordering::Relaxed)
            .unwrap_or_else(|error| panic!("load at {addr:#x}: {error}"))
    }

    /// Waits until the pass counter exceeds `than`; false on timeout or when
    /// the vCPU has stopped.
    pub fn wait_for_pass_count_above(&self, than: u64, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            if self.pass_count() > than {
                return true;
            }
            if Instant::now() >= deadline || matches!(self.vcpu.status(), VcpuStatus::Failed(_)) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Bytes the guest has written to its serial port since boot.
    pub fn serial_transmitted(&self) -> u64 {
        self.vcpu.with_serial(|serial| serial.transmitted())
    }

    /// Passes the paused guest has counted but not yet reported on its
    /// serial port: 1 when the vCPU stopped between the counter's increment
    /// and the `out` that sends its byte (a pause lands between any two
    /// instructions), else 0. Whenever the guest is paused and no serial
    /// byte was lost or repeated, `serial_transmitted() +
    /// unreported_passes() == pass_count()`. Errors when the vCPU is not
    /// paused.
    pub fn unreported_passes(&self) -> Result<u64> {
        // Flat segments with base 0: the instruction pointer is the
        // guest-physical address of the next instruction.
        let next = self.vcpu.instruction_pointer()?;
        let report = crate::guest_code::pass_report();
        let mut bytes = vec![0u8; report.bytes.len()];
        let in_window = report.unreported_at.iter().any(|&offset| {
            next.checked_sub(offset as u64).is_some_and(|start| {
                self.ram.read_slice(&mut bytes, GuestAddress(start)).is_ok()
                    && bytes == report.bytes
            })
        });
        Ok(u64::from(in_window))
    }

    /// The last bytes the guest wrote to its serial port on this host.
    pub fn serial_tail(&self) -> Vec<u8> {
        self.vcpu.with_serial(|serial| serial.tail())
    }

    /// The vCPU thread's status.
    pub fn vcpu_status(&self) -> VcpuStatus {
        self.vcpu.status()
    }

    /// Whether the vCPU is running the guest.
    pub fn is_running(&self) -> bool {
        self.vcpu.status() == VcpuStatus::Running
    }

    /// VM exits the vCPU thread has handled.
    pub fn exits(&self) -> u64 {
        self.vcpu.exits()
    }

    /// How the dirty log re-arms pages on this host.
    pub fn dirty_log_mode(&self) -> ProtectMode {
        self.slot.mode()
    }

    /// Pages in the test guest's working set (0 on a destination before
    /// its state is restored).
    pub fn working_set_pages(&self) -> u32 {
        self.layout.working_set_pages
    }

    /// Guest RAM in bytes.
    pub fn memory_bytes(&self) -> u64 {
        self.ram.iter().map(vm_memory::GuestMemoryRegion::len).sum()
    }

    /// Guest RAM, as an embedding VMM's devices would see it. Writes through
    /// it are marked in its bitmap and so reach the dirty log.
    pub fn guest_memory(&self) -> &GuestRam {
        &self.ram
    }

    /// Copies guest RAM at `offset` into `buf`.
    ///
    /// # Panics
    /// When the range lies outside RAM.
    pub fn read_memory(&self, offset: u64, buf: &mut [u8]) {
        self.ram
            .read_slice(buf, GuestAddress(offset))
            .unwrap_or_else(|error| panic!("read at {offset:#x}: {error}"));
    }

    /// Copies `bytes` into guest RAM at `offset`; a migration running from
    /// this guest sends them again.
    ///
    /// # Panics
    /// When the range lies outside RAM.
    pub fn write_memory(&self, offset: u64, bytes: &[u8]) {
        self.ram
            .write_slice(bytes, GuestAddress(offset))
            .unwrap_or_else(|error| panic!("write at {offset:#x}: {error}"));
    }

    /// The QEMU-style check of the working set, best called while paused:
    /// walking the first byte of each page, every byte equals its
    /// predecessor or is exactly one less (modulo 256) at no more than one
    /// place, where the guest was in its pass; and the last page's byte
    /// agrees with the pass counter. Errors when the guest's layout is not
    /// known (a destination before restore).
    pub fn consistency_check(&self) -> std::result::Result<ConsistencyReport, String> {
        let pages = self.layout.working_set_pages;
        if pages == 0 {
            return Err("the test guest's layout is unknown (no state restored)".into());
        }
        let bytes: Vec<u8> = (0..pages)
            .map(|page| self.load::<u8>(WORKING_SET_BASE + u64::from(page) * PAGE))
            .collect();
        Ok(check_working_set(&bytes, self.pass_count()))
    }

    fn save_vm(&self) -> Result<VmState> {
        let chip = |id| -> Result<kvm_irqchip> {
            let mut chip = kvm_irqchip {
                chip_id: id,
                ..Default::default()
            };
            self.vm
                .get_irqchip(&mut chip)
                .map_err(VmmError::kvm("get interrupt controller"))?;
            Ok(chip)
        };
        Ok(VmState {
            pic_master: chip(KVM_IRQCHIP_PIC_MASTER)?,
            pic_slave: chip(KVM_IRQCHIP_PIC_SLAVE)?,
            ioapic: chip(KVM_IRQCHIP_IOAPIC)?,
            clock: self.vm.get_clock().map_err(VmmError::kvm("get clock"))?,
        })
    }

    fn restore_vm(&self, state: &VmState) -> Result<()> {
        for chip in [&state.pic_master, &state.pic_slave, &state.ioapic] {
            self.vm
                .set_irqchip(chip)
                .map_err(VmmError::kvm("set interrupt controller"))?;
        }
        // Only the clock value travels: the flags describe the source
        // host's TSC and realtime pairing.
        let mut clock = state.clock;
        clock.flags = 0;
        self.vm
            .set_clock(&clock)
            .map_err(VmmError::kvm("set clock"))
    }

    /// Saves every state section (the vCPU must be paused).
    pub fn save_sections(&self) -> Result<Vec<StateSection>> {
        let vcpu = self.vcpu.save()?;
        Ok(vec![
            self.layout.to_section(),
            self.save_vm()?.to_section(),
            vcpu.to_section(),
            self.vcpu.with_serial(|serial| serial.save()).to_section(),
        ])
    }

    /// The bytes [`KvmGuest::save_sections`] returns, known without
    /// pausing: every section has a fixed layout (KVM's structures, one
    /// entry per saved MSR), so encoding default values gives the size.
    pub fn state_size(&self) -> u64 {
        let vcpu = VcpuState {
            msrs: vec![(0, 0); self.vcpu.msr_count()],
            ..VcpuState::default()
        };
        [
            self.layout.to_section(),
            VmState::default().to_section(),
            vcpu.to_section(),
            SerialState::default().to_section(),
        ]
        .iter()
        .map(|section| (section.name.len() + section.data.len()) as u64)
        .sum()
    }

    /// Restores sections saved by [`KvmGuest::save_sections`] into a
    /// paused destination VM. Everything is decoded before anything is
    /// applied.
    pub fn restore_sections(&mut self, sections: &[StateSection]) -> Result<()> {
        let layout = GuestLayout::from_section(state::find(sections, GUEST_SECTION)?)?;
        let vm = VmState::from_section(state::find(sections, VM_SECTION)?)?;
        let vcpu = VcpuState::from_section(state::find(sections, VCPU_SECTION)?)?;
        let serial = SerialState::from_section(state::find(sections, SERIAL_SECTION)?)?;
        if u64::from(layout.working_set_pages) * PAGE + WORKING_SET_BASE > self.memory_bytes() {
            return Err(VmmError::BadState {
                section: GUEST_SECTION.into(),
                reason: "the working set does not fit this VM's memory".into(),
            });
        }
        self.restore_vm(&vm)?;
        self.vcpu.restore(&vcpu)?;
        self.vcpu
            .with_serial(|current| *current = Serial::restore(&serial));
        self.layout = layout;
        Ok(())
    }
}

/// The consistency check over the first bytes of the working set's pages
/// (`bytes[i]` of page `i`) and the pass counter.
pub fn check_working_set(bytes: &[u8], pass_count: u64) -> ConsistencyReport {
    let mut edges = 0;
    let mut failure = None;
    for (page, pair) in bytes.windows(2).enumerate() {
        let (previous, current) = (pair[0], pair[1]);
        let page = page + 1;
        if current == previous.wrapping_sub(1) {
            edges += 1;
            if edges > 1 && failure.is_none() {
                failure = Some(format!("a second edge at page {page}"));
            }
        } else if current != previous && failure.is_none() {
            failure = Some(format!(
                "page {page} holds {current}, its predecessor {previous}"
            ));
        }
    }
    let first_byte = bytes.first().copied().unwrap_or(0);
    let last_byte = bytes.last().copied().unwrap_or(0);
    // The counter's low byte, as the guest writes it.
    let counter_low = pass_count.to_le_bytes()[0];
    let counter_matches = last_byte == counter_low || last_byte == counter_low.wrapping_add(1);
    if !counter_matches && failure.is_none() {
        failure = Some(format!(
            "the last page holds {last_byte}, the pass counter is {pass_count}"
        ));
    }
    if bytes.is_empty() {
        failure = Some("no pages to check".into());
    }
    ConsistencyReport {
        passed: failure.is_none(),
        pages: u32::try_from(bytes.len()).unwrap_or(u32::MAX),
        edges,
        first_byte,
        last_byte,
        pass_count,
        counter_matches,
        failure,
    }
}

impl GuestMemory for KvmGuest {
    fn regions(&self) -> &[MemoryRegion] {
        &self.regions
    }

    /// The memfd, when the RAM is one ([`VmConfig::memfd`], or handed
    /// over to this VM).
    fn region_files(&self) -> Option<Vec<tern_engine::RegionFile<'_>>> {
        memory::region_files(&self.ram)
    }
}

impl DirtyLog for KvmGuest {
    fn start_dirty_log(&mut self) -> GuestResult<()> {
        Ok(self.slot.start(&self.vm, ram_region(&self.ram))?)
    }

    fn sync_dirty_log(&mut self, bitmaps: &mut [DirtyBitmap]) -> GuestResult<()> {
        let [bitmap] = bitmaps else {
            return Err(VmmError::Config(format!(
                "{} bitmaps for one memory region",
                bitmaps.len()
            ))
            .into());
        };
        self.slot.sync(&self.vm, ram_region(&self.ram), bitmap)?;
        Ok(())
    }

    fn stop_dirty_log(&mut self) -> GuestResult<()> {
        Ok(self.slot.stop(&self.vm)?)
    }
}

impl GuestControl for KvmGuest {
    fn pause(&mut self) -> GuestResult<()> {
        Ok(self.vcpu.pause()?)
    }

    fn resume(&mut self) -> GuestResult<()> {
        Ok(self.vcpu.resume()?)
    }

    fn set_throttle(&mut self, percent: u8) -> GuestResult<()> {
        self.vcpu.set_throttle(percent);
        Ok(())
    }
}

impl DeviceState for KvmGuest {
    fn save_state(&mut self) -> GuestResult<Vec<StateSection>> {
        Ok(self.save_sections()?)
    }

    fn restore_state(&mut self, sections: &[StateSection]) -> GuestResult<()> {
        Ok(self.restore_sections(sections)?)
    }

    fn state_size_hint(&self) -> u64 {
        self.state_size()
    }

    fn guest_kind(&self) -> &str {
        GUEST_KIND
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_configurations() {
        let small = VmConfig {
            memory_bytes: 2 << 20,
            working_set_pages: 1024,
            workload: crate::guest_code::Workload::Increment,
            image: None,
            memfd: false,
        };
        assert!(matches!(small.validate(), Err(VmmError::Config(_))));
        let huge = VmConfig {
            memory_bytes: 4 << 30,
            ..VmConfig::default()
        };
        assert!(huge.validate().is_err());
        assert!(VmConfig::default().validate().is_ok());
    }

    #[test]
    fn consistency_check_accepts_one_edge_and_wrap_around() {
        assert!(check_working_set(&[5, 5, 5, 5], 5).passed);
        // Mid-pass: pages 0-1 already incremented, the counter not yet.
        let report = check_working_set(&[6, 6, 5, 5], 5);
        assert!(report.passed && report.edges == 1, "{report:?}");
        // All pages incremented, counter update pending.
        assert!(check_working_set(&[6, 6, 6, 6], 5).passed);
        // Wrap-around from 255 to 0 at the edge and in the counter.
        assert!(check_working_set(&[0, 0, 255, 255], 255).passed);
        assert!(check_working_set(&[0, 0, 0], 256).passed);
        assert!(check_working_set(&[0, 255], 511).passed);
    }

    #[test]
    fn consistency_check_rejects_what_a_migration_could_break() {
        // Two edges: a page went missing from one iteration.
        let report = check_working_set(&[7, 6, 6, 5], 5);
        assert!(!report.passed && report.edges == 2);
        // A page behind by two, or ahead of its predecessor.
        assert!(!check_working_set(&[7, 5, 5], 5).passed);
        assert!(!check_working_set(&[5, 6, 6], 6).passed);
        // A page zeroed (never transferred).
        assert!(!check_working_set(&[9, 9, 0, 9], 9).passed);
        // Bytes fine, counter off.
        let report = check_working_set(&[5, 5], 9);
        assert!(!report.passed && !report.counter_matches);
        assert!(!check_working_set(&[], 0).passed);
    }
}
