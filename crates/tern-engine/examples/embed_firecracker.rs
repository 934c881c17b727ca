//! Embedding tern in a VMM whose memory is shaped like Firecracker's.
//!
//! Firecracker keeps guest memory in a
//! `vm_memory::GuestRegionCollection<GuestRegionMmapExt>`, each region
//! wrapping a `GuestRegionMmap<Option<AtomicBitmap>>` (the bitmap is there
//! when `track_dirty_pages` is on) together with its KVM slots: a DRAM
//! region is one slot, always plugged; a hot-pluggable region is split into
//! slots of `slot_size` bytes, and an unplugged slot is mapped `PROT_NONE`.
//! The module `firecracker` below copies those types' shape (fields, type
//! aliases, `Deref` to the `MmapRegion`, the `GuestMemoryRegion`
//! delegation) from `src/vmm/src/vstate/memory.rs` of
//! firecracker-microvm/firecracker at commit 004d935399ba, with `BitVec`
//! replaced by `Vec<bool>`; the code is this example's own.
//!
//! What the embedding adds is in `main`'s neighbours: the plugged slots as
//! the ranges tern migrates (`VmMemory::with_ranges`), the dirty log over
//! the `Option<AtomicBitmap>`s, and the memory layout sent ahead of memory
//! (`MigrationConfig::vmm_config`, where Firecracker's `GuestMemoryState`
//! would go) so that the destination builds the same regions and slots. No
//! `unsafe` in the embedding: the `mprotect` below stands for Firecracker's
//! own unplugging.
//!
//! Run it with
//! `cargo run -p tern-engine --release --example embed_firecracker --features vm-memory`.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

use tern_engine::vm_memory::{AtomicBitmapLog, VmMemory};
use tern_engine::{
    Address, Destination, DeviceState, DirtyBitmap, DirtyLog, GuestControl, GuestError,
    GuestMemory, GuestResult, Listener, MemoryRegion, MigrationConfig, ReceiveConfig, Source,
    StateSection,
};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use firecracker::{GuestMemoryMmap, GuestRegionMmapExt, GuestRegionType};

/// The shapes of Firecracker's memory types (see the file's comment).
mod firecracker {
    use std::ops::Deref;
    use std::sync::Mutex;

    use vm_memory::bitmap::{AtomicBitmap, BS};
    use vm_memory::{
        FileOffset, GuestAddress, GuestMemoryRegion, GuestMemoryRegionBytes, GuestUsize,
        MemoryRegionAddress, MmapRegion, VolatileSlice,
    };

    pub(crate) type GuestRegionMmap = vm_memory::GuestRegionMmap<Option<AtomicBitmap>>;
    pub(crate) type GuestMemoryMmap = vm_memory::GuestRegionCollection<GuestRegionMmapExt>;

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(crate) enum GuestRegionType {
        Dram,
        Hotpluggable,
    }

    #[derive(Debug)]
    pub(crate) struct GuestRegionMmapExt {
        pub(crate) inner: GuestRegionMmap,
        pub(crate) region_type: GuestRegionType,
        #[expect(dead_code, reason = "KVM slot numbers: this example runs no KVM")]
        pub(crate) slot_from: u32,
        pub(crate) slot_size: usize,
        /// Whether each slot is plugged (a `BitVec` in Firecracker).
        pub(crate) plugged: Mutex<Vec<bool>>,
    }

    impl Deref for GuestRegionMmapExt {
        type Target = MmapRegion<Option<AtomicBitmap>>;

        fn deref(&self) -> &Self::Target {
            &self.inner
        }
    }

    impl GuestMemoryRegionBytes for GuestRegionMmapExt {}

    impl GuestMemoryRegion for GuestRegionMmapExt {
        type B = Option<AtomicBitmap>;

        fn len(&self) -> GuestUsize {
            self.inner.len()
        }

        fn start_addr(&self) -> GuestAddress {
            self.inner.start_addr()
        }

        fn bitmap(&self) -> BS<'_, Self::B> {
            self.inner.bitmap()
        }

        fn get_host_address(
            &self,
            addr: MemoryRegionAddress,
        ) -> vm_memory::guest_memory::Result<*mut u8> {
            self.inner.get_host_address(addr)
        }

        fn file_offset(&self) -> Option<&FileOffset> {
            self.inner.file_offset()
        }

        fn get_slice(
            &self,
            offset: MemoryRegionAddress,
            count: usize,
        ) -> vm_memory::guest_memory::Result<VolatileSlice<'_, BS<'_, Self::B>>> {
            self.inner.get_slice(offset, count)
        }
    }
}

const GUEST_KIND: &str = "firecracker-shaped microVM";
const MIB: usize = 1 << 20;
const DRAM: (u64, usize) = (0, 32 * MIB);
const HOTPLUG: (u64, usize) = (1 << 32, 16 * MIB);
const SLOT: usize = 4 * MIB;
/// Slots 0 and 2 of the hot-pluggable region are plugged, 1 and 3 are not.
const PLUGGED: [bool; 4] = [true, false, true, false];

/// The memory layout the destination needs before memory arrives (in
/// Firecracker, the `GuestMemoryState` of the microVM state): here, the
/// hot-pluggable region's plugged slots, one byte each.
fn layout(memory: &GuestMemoryMmap) -> Vec<u8> {
    memory
        .iter()
        .filter(|region| region.region_type == GuestRegionType::Hotpluggable)
        .flat_map(|region| region.plugged.lock().expect("plugged").clone())
        .map(u8::from)
        .collect()
}

/// Builds the DRAM region (one slot, with a dirty bitmap) and the
/// hot-pluggable one (`plugged` slots), unplugged slots made inaccessible.
fn build_memory(plugged: &[bool]) -> Result<GuestMemoryMmap, Box<dyn std::error::Error>> {
    let region = |(start, len): (u64, usize)| -> Result<_, Box<dyn std::error::Error>> {
        let mapping = vm_memory::mmap::MmapRegionBuilder::new_with_bitmap(
            len,
            Some(vm_memory::bitmap::AtomicBitmap::new(len, 4096.try_into()?)),
        )
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE)
        .build()?;
        Ok(
            vm_memory::GuestRegionMmap::new(mapping, GuestAddress(start))
                .ok_or("region overflows")?,
        )
    };
    let dram = GuestRegionMmapExt {
        inner: region(DRAM)?,
        region_type: GuestRegionType::Dram,
        slot_from: 0,
        slot_size: DRAM.1,
        plugged: vec![true].into(),
    };
    let hotplug = GuestRegionMmapExt {
        inner: region(HOTPLUG)?,
        region_type: GuestRegionType::Hotpluggable,
        slot_from: 1,
        slot_size: SLOT,
        plugged: plugged.to_vec().into(),
    };
    for (slot, _) in plugged.iter().enumerate().filter(|(_, plugged)| !**plugged) {
        let protection = region::protect(&hotplug, slot * SLOT, SLOT, libc::PROT_NONE);
        protection.map_err(|error| format!("protecting slot {slot}: {error}"))?;
    }
    Ok(GuestMemoryMmap::from_regions(vec![dram, hotplug])?)
}

/// Stands for Firecracker's `GuestMemorySlot::protect` (its unplugging).
mod region {
    use vm_memory::{GuestMemoryRegion, MemoryRegionAddress};

    pub(crate) fn protect(
        region: &super::GuestRegionMmapExt,
        offset: usize,
        len: usize,
        prot: i32,
    ) -> std::io::Result<()> {
        let slice = region
            .get_slice(MemoryRegionAddress(offset as u64), len)
            .map_err(std::io::Error::other)?;
        // SAFETY: the range is a slice of the region's live mapping (checked
        // by `get_slice`); nothing reads it while it is inaccessible, since
        // the slot is unplugged.
        let result = unsafe { libc::mprotect(slice.ptr_guard_mut().as_ptr().cast(), len, prot) };
        if result == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
}

/// The embedding's one piece of Firecracker knowledge: tern migrates the
/// plugged slots of each region and nothing else.
fn plugged_ranges(region: &GuestRegionMmapExt) -> Vec<Range<u64>> {
    if region.region_type == GuestRegionType::Dram {
        return std::iter::once(0..region.inner.len()).collect();
    }
    let slot = region.slot_size as u64;
    let plugged = region.plugged.lock().expect("plugged");
    (0..plugged.len())
        .filter(|&index| plugged[index])
        .map(|index| index as u64)
        .map(|index| index * slot..(index + 1) * slot)
        .collect()
}

/// The source microVM: a device thread writes plugged memory through
/// vm-memory (so the writes land in the `AtomicBitmap`).
struct RunningVm {
    memory: VmMemory<GuestMemoryMmap>,
    log: AtomicBitmapLog<GuestMemoryMmap>,
    writes: Arc<AtomicU64>,
    running: Arc<AtomicBool>,
    device: Option<JoinHandle<()>>,
}

fn device_loop(memory: GuestMemoryMmap, running: Arc<AtomicBool>, writes: Arc<AtomicU64>) {
    // Pages of DRAM and of the plugged hot-plug slots 0 and 2.
    let targets = [
        (DRAM.0, 4 * MIB),
        (HOTPLUG.0, SLOT),
        (HOTPLUG.0 + 2 * SLOT as u64, SLOT),
    ];
    while running.load(Ordering::Relaxed) {
        let count = writes.fetch_add(1, Ordering::Relaxed);
        let (start, len) = targets[(count % 3) as usize];
        let page = count.wrapping_mul(2_654_435_761) % (len as u64 / 4096);
        memory
            .write_obj(count, GuestAddress(start + page * 4096 + 8))
            .expect("plugged guest memory");
    }
}

impl GuestMemory for RunningVm {
    fn regions(&self) -> &[MemoryRegion] {
        self.memory.regions()
    }
}

impl DirtyLog for RunningVm {
    fn start_dirty_log(&mut self) -> GuestResult<()> {
        self.log.start_dirty_log()
    }

    fn sync_dirty_log(&mut self, bitmaps: &mut [DirtyBitmap]) -> GuestResult<()> {
        // A Firecracker embedding ORs KVM's dirty log of each slot in here too.
        self.log.sync_dirty_log(bitmaps)
    }

    fn stop_dirty_log(&mut self) -> GuestResult<()> {
        self.log.stop_dirty_log()
    }
}

impl GuestControl for RunningVm {
    fn pause(&mut self) -> GuestResult<()> {
        self.running.store(false, Ordering::Relaxed);
        match self.device.take().map(JoinHandle::join) {
            Some(Err(_)) => Err(GuestError::new("the device thread panicked")),
            _ => Ok(()),
        }
    }

    fn resume(&mut self) -> GuestResult<()> {
        if self.device.is_none() {
            self.running.store(true, Ordering::Relaxed);
            let memory = self.memory.memory().clone();
            let (running, writes) = (self.running.clone(), self.writes.clone());
            self.device = Some(std::thread::spawn(move || {
                device_loop(memory, running, writes)
            }));
        }
        Ok(())
    }

    fn set_throttle(&mut self, _percent: u8) -> GuestResult<()> {
        Ok(())
    }
}

impl DeviceState for RunningVm {
    fn save_state(&mut self) -> GuestResult<Vec<StateSection>> {
        // Firecracker's `MicrovmState`, serialised, would be this one section.
        let writes = self.writes.load(Ordering::Relaxed).to_le_bytes().to_vec();
        Ok(vec![StateSection {
            name: "microvm".into(),
            version: 1,
            data: writes,
        }])
    }

    fn restore_state(&mut self, _sections: &[StateSection]) -> GuestResult<()> {
        Err(GuestError::new("the source never restores"))
    }

    fn guest_kind(&self) -> &str {
        GUEST_KIND
    }
}

/// The destination microVM, built from the layout before memory arrives.
struct ArrivingVm {
    memory: VmMemory<GuestMemoryMmap>,
    writes: u64,
}

impl GuestMemory for ArrivingVm {
    fn regions(&self) -> &[MemoryRegion] {
        self.memory.regions()
    }
}

impl GuestControl for ArrivingVm {
    fn pause(&mut self) -> GuestResult<()> {
        Ok(())
    }

    fn resume(&mut self) -> GuestResult<()> {
        Ok(())
    }

    fn set_throttle(&mut self, _percent: u8) -> GuestResult<()> {
        Ok(())
    }
}

impl DeviceState for ArrivingVm {
    fn save_state(&mut self) -> GuestResult<Vec<StateSection>> {
        Ok(Vec::new())
    }

    fn restore_state(&mut self, sections: &[StateSection]) -> GuestResult<()> {
        let [section] = sections else {
            return Err(GuestError::new("expected the microvm section"));
        };
        let bytes: [u8; 8] = section.data[..]
            .try_into()
            .map_err(|_| GuestError::new("the microvm section is not 8 bytes"))?;
        self.writes = u64::from_le_bytes(bytes);
        Ok(())
    }

    fn guest_kind(&self) -> &str {
        GUEST_KIND
    }
}

/// Migrates the microVM and checks the destination; `tests/vm_memory.rs`
/// runs it too.
pub(crate) fn main() -> Result<(), Box<dyn std::error::Error>> {
    let memory = build_memory(&PLUGGED)?;
    let pattern: Vec<u8> = (0..MIB)
        .map(|i| u8::try_from(i % 251).expect("below 251"))
        .collect();
    for offset in (0..8 * MIB as u64).step_by(MIB) {
        memory.write_slice(&pattern, GuestAddress(DRAM.0 + offset))?;
    }
    memory.write_slice(&pattern, GuestAddress(HOTPLUG.0 + 2 * SLOT as u64))?;
    let tern_memory = VmMemory::with_ranges(&memory, plugged_ranges)?;
    let mut source = RunningVm {
        log: tern_memory.dirty_log()?,
        memory: tern_memory,
        writes: Arc::new(AtomicU64::new(0)),
        running: Arc::new(AtomicBool::new(false)),
        device: None,
    };
    source.resume()?;

    let directory = tempfile::tempdir()?;
    let address = Address::Unix(directory.path().join("migration.sock"));
    let listener = Listener::bind(&address)?;
    let destination = std::thread::spawn(move || {
        Destination::new(ReceiveConfig::default()).receive_with_vmm_config(
            &listener,
            |_setup, layout| {
                let plugged: Vec<bool> = layout.iter().map(|&byte| byte != 0).collect();
                let memory = build_memory(&plugged)
                    .map_err(|error| GuestError::new(format!("cannot build memory: {error}")))?;
                Ok(ArrivingVm {
                    memory: VmMemory::with_ranges(&memory, plugged_ranges)?,
                    writes: 0,
                })
            },
        )
    });

    let mut config = MigrationConfig::default();
    config.vmm_config = layout(source.memory.memory());
    let stats = Source::new(config)?.migrate(&mut source, &address)?;
    let received = destination
        .join()
        .map_err(|_| "the destination thread panicked")??;
    let arrived = &received.guest;

    let same = tern_regions_equal(source.regions(), arrived.regions());
    let source_writes = source.writes.load(Ordering::Relaxed);
    println!(
        "status {}, {} tern regions (DRAM and 2 plugged slots), downtime {} ms, {} MiB sent, \
         digest verified {}, memory identical {same}, device writes {source_writes} / {}",
        stats.status.as_str(),
        arrived.regions().len(),
        stats.downtime,
        stats.ram.transferred >> 20,
        stats.digest_verified,
        arrived.writes,
    );
    if !stats.digest_verified || !same || arrived.writes != source_writes {
        return Err("the destination differs from the source".into());
    }
    if arrived.regions().len() != 3 {
        return Err("expected DRAM and two plugged slots".into());
    }
    Ok(())
}

/// Byte comparison of two sets of tern regions.
fn tern_regions_equal(from: &[MemoryRegion], to: &[MemoryRegion]) -> bool {
    from.len() == to.len()
        && from.iter().zip(to).all(|(from, to)| {
            // SAFETY: both are live mappings of `len` bytes (plugged slots, so
            // accessible) and nothing writes them now: the source is paused,
            // the destination guest has no vCPU.
            unsafe {
                std::slice::from_raw_parts(from.host_ptr(), region_len(from.len()))
                    == std::slice::from_raw_parts(to.host_ptr(), region_len(to.len()))
            }
        })
}

/// A mapped region's length, which fits the address space it is mapped in.
fn region_len(len: u64) -> usize {
    usize::try_from(len).expect("a mapped region fits the address space")
}
