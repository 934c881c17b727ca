//! A same-host migration (a VMM upgrade) by memory hand-over, in a VMM
//! whose memory is shaped like Cloud Hypervisor's with `shared=on`.
//!
//! With `--memory shared=on` Cloud Hypervisor backs each memory zone with a
//! memfd and maps it shared: its `GuestRegionMmap`s carry a vm-memory
//! `FileOffset` (`vmm/src/memory_manager.rs` of
//! cloud-hypervisor/cloud-hypervisor, ae44c29), and its `local=on`
//! migration passes those memfds to the new process instead of copying
//! memory. The same here, with tern:
//! - the source's regions give their files through
//!   `VmMemory::region_files` (from each region's `FileOffset`), and
//!   `MigrationConfig::memory_handover` passes them over the Unix socket
//!   (`SCM_RIGHTS`) with the VMM's `Config` message and the device state;
//! - the destination, `Destination::receive_handover`, gets the files
//!   checked (one per region, regular, large enough, not write-sealed) and
//!   maps each `MAP_SHARED` at its region: no page is copied, the guest's
//!   memory is the source's, and the downtime is the device state alone;
//! - after the commit the source's mapping is made inaccessible
//!   (`PROT_NONE`): a thread of the old VMM that was not stopped faults
//!   instead of writing the guest that now runs in the new one.
//!
//! Run it with `cargo run -p tern-engine --release --example
//! embed_cloud_hypervisor_local --features vm-memory`; `tests/vm_memory.rs`
//! runs it too.

use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

use tern_engine::vm_memory::{AtomicBitmapLog, VmMemory};
use tern_engine::{
    Address, Destination, DeviceState, DirtyBitmap, DirtyLog, GuestControl, GuestError,
    GuestMemory, GuestResult, HandedFile, Listener, MemoryRegion, MigrationConfig, MigrationError,
    ReceiveConfig, RegionFile, Source, StateSection, Verify,
};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestAddressSpace, GuestMemoryAtomic, GuestRegionMmap,
};

/// Cloud Hypervisor's alias.
type GuestMemoryMmap = vm_memory::GuestMemoryMmap<AtomicBitmap>;

const GUEST_KIND: &str = "cloud-hypervisor-shaped VM (shared=on)";
const MIB: u64 = 1 << 20;
/// Two zones, as `--memory-zone` gives: one below 4 GiB, one above.
const ZONES: [(u64, u64); 2] = [(0, 16 * MIB), (4 << 30, 8 * MIB)];

/// One zone's memory in its own memfd, as `shared=on` makes it.
fn memfd_zone(len: u64) -> Result<File, GuestError> {
    // SAFETY: a NUL-terminated name and plain flags; the result is checked.
    let raw = unsafe {
        libc::memfd_create(
            c"guest-ram".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if raw < 0 {
        return Err(GuestError::with_source(
            "memfd_create",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: memfd_create returned a new descriptor nothing else owns.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(raw) });
    file.set_len(len)
        .map_err(|error| GuestError::with_source("cannot size the memfd", error))?;
    Ok(file)
}

/// A region over `file` from `offset`, mapped shared, with a dirty bitmap.
fn shared_region(
    guest_addr: u64,
    len: u64,
    file: Arc<File>,
    offset: u64,
) -> Result<Arc<GuestRegionMmap<AtomicBitmap>>, GuestError> {
    let size = usize::try_from(len).map_err(|_| GuestError::new("a zone too large"))?;
    let page = std::num::NonZeroUsize::new(4096).expect("not zero");
    let mapping = MmapRegionBuilder::new_with_bitmap(size, AtomicBitmap::new(size, page))
        .with_file_offset(FileOffset::from_arc(file, offset))
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(libc::MAP_SHARED | libc::MAP_NORESERVE)
        .build()
        .map_err(|error| GuestError::with_source("cannot map the zone", error))?;
    GuestRegionMmap::new(mapping, GuestAddress(guest_addr))
        .map(Arc::new)
        .ok_or_else(|| GuestError::new("the zone overflows the address space"))
}

fn source_memory() -> Result<GuestMemoryAtomic<GuestMemoryMmap>, GuestError> {
    let mut regions = Vec::new();
    for (guest_addr, len) in ZONES {
        regions.push(shared_region(
            guest_addr,
            len,
            Arc::new(memfd_zone(len)?),
            0,
        )?);
    }
    let memory = GuestMemoryMmap::from_arc_regions(regions)
        .map_err(|error| GuestError::with_source("cannot build guest memory", error))?;
    Ok(GuestMemoryAtomic::new(memory))
}

/// The old VMM's VM: a device thread writes guest memory, as virtio devices do.
struct RunningVm {
    guest_memory: GuestMemoryAtomic<GuestMemoryMmap>,
    memory: VmMemory<GuestMemoryMmap>,
    /// What a copying migration reads; a hand-over never syncs it.
    log: AtomicBitmapLog<GuestMemoryMmap>,
    writes: Arc<AtomicU64>,
    running: Arc<AtomicBool>,
    device: Option<JoinHandle<()>>,
}

fn device_loop(
    guest_memory: GuestMemoryAtomic<GuestMemoryMmap>,
    running: Arc<AtomicBool>,
    writes: Arc<AtomicU64>,
) {
    let pages = ZONES[0].1 / 4096;
    while running.load(Ordering::Relaxed) {
        let count = writes.fetch_add(1, Ordering::Relaxed) + 1;
        let page = count.wrapping_mul(2_654_435_761) % pages;
        guest_memory
            .memory()
            .write_obj(count, GuestAddress(page * 4096 + 8))
            .expect("the page is inside guest memory");
    }
}

impl GuestMemory for RunningVm {
    fn regions(&self) -> &[MemoryRegion] {
        self.memory.regions()
    }

    /// What a hand-over passes: the memfd behind each region.
    fn region_files(&self) -> Option<Vec<RegionFile<'_>>> {
        self.memory.region_files()
    }
}

impl DirtyLog for RunningVm {
    fn start_dirty_log(&mut self) -> GuestResult<()> {
        self.log.start_dirty_log()
    }

    fn sync_dirty_log(&mut self, bitmaps: &mut [DirtyBitmap]) -> GuestResult<()> {
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
            let memory = self.guest_memory.clone();
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
        let writes = self.writes.load(Ordering::Relaxed).to_le_bytes().to_vec();
        Ok(vec![StateSection {
            name: "device-manager".into(),
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

/// The new VMM's VM, its memory the files the old one handed over.
struct ArrivingVm {
    guest_memory: GuestMemoryAtomic<GuestMemoryMmap>,
    memory: VmMemory<GuestMemoryMmap>,
    writes: u64,
}

impl ArrivingVm {
    /// Maps each handed-over file shared at its region, as the new Cloud
    /// Hypervisor process maps the memfds it receives.
    fn adopt(files: Vec<HandedFile>) -> GuestResult<Self> {
        let mut regions = Vec::with_capacity(files.len());
        for handed in files {
            let file = Arc::new(File::from(handed.file));
            regions.push(shared_region(
                handed.guest_addr,
                handed.len,
                file,
                handed.offset,
            )?);
        }
        let memory = GuestMemoryMmap::from_arc_regions(regions)
            .map_err(|error| GuestError::with_source("cannot build guest memory", error))?;
        let guest_memory = GuestMemoryAtomic::new(memory);
        Ok(Self {
            memory: VmMemory::from_atomic(&guest_memory)?,
            guest_memory,
            writes: 0,
        })
    }
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
            return Err(GuestError::new("expected the device-manager section"));
        };
        let bytes: [u8; 8] = section.data[..]
            .try_into()
            .map_err(|_| GuestError::new("the device-manager section is not 8 bytes"))?;
        self.writes = u64::from_le_bytes(bytes);
        Ok(())
    }

    fn guest_kind(&self) -> &str {
        GUEST_KIND
    }
}

fn receive(listener: Listener) -> Result<tern_engine::Received<ArrivingVm>, MigrationError> {
    Destination::new(ReceiveConfig::default()).receive_handover(
        &listener,
        |_setup, config, files| {
            if config != b"shared=on" {
                return Err(GuestError::new("the Config message is not the source's"));
            }
            ArrivingVm::adopt(files)
        },
    )
}

/// Hands the running VM over to a destination in another thread (another
/// process in a real upgrade) and checks it there.
pub(crate) fn main() -> Result<(), Box<dyn std::error::Error>> {
    let guest_memory = source_memory()?;
    let pattern: Vec<u8> = (0..MIB)
        .map(|i| u8::try_from(i % 251).expect("below 251"))
        .collect();
    for (guest_addr, _) in ZONES {
        guest_memory
            .memory()
            .write_slice(&pattern, GuestAddress(guest_addr + MIB))?;
    }
    let memory = VmMemory::from_atomic(&guest_memory)?;
    let mut source = RunningVm {
        log: memory.dirty_log()?,
        memory,
        guest_memory,
        writes: Arc::new(AtomicU64::new(0)),
        running: Arc::new(AtomicBool::new(false)),
        device: None,
    };
    source.resume()?;

    let directory = tempfile::tempdir()?;
    let address = Address::Unix(directory.path().join("upgrade.sock"));
    let listener = Listener::bind(&address)?;
    let destination = std::thread::spawn(move || receive(listener));
    let mut config = MigrationConfig::default();
    config.memory_handover = true;
    config.vmm_config = b"shared=on".to_vec();
    // Every page in the switch-over digest, not a sample.
    config.verify = Verify::Strict;
    let stats = Source::new(config)?.migrate(&mut source, &address)?;
    let received = destination
        .join()
        .map_err(|_| "the destination thread panicked")??;

    let arrived = &received.guest;
    let memory = arrived.guest_memory.memory();
    let mut zone = vec![0u8; usize::try_from(MIB)?];
    let mut pattern_kept = true;
    for (guest_addr, _) in ZONES {
        memory.read_slice(&mut zone, GuestAddress(guest_addr + MIB))?;
        // The device writes 8 bytes at offset 8 of its pages; the rest of
        // each page is the pattern.
        pattern_kept &= zone
            .chunks(4096)
            .zip(pattern.chunks(4096))
            .all(|(got, want)| got[..8] == want[..8] && got[16..] == want[16..]);
    }
    let source_writes = source.writes.load(Ordering::Relaxed);
    let last = source_writes.wrapping_mul(2_654_435_761) % (ZONES[0].1 / 4096);
    let last_write: u64 = memory.read_obj(GuestAddress(last * 4096 + 8))?;
    println!(
        "status {}, downtime {} ms, {} bytes sent, {} pages copied, digest verified {}, \
         device writes {source_writes} / {}, last write found {}, pattern kept {pattern_kept}",
        stats.status.as_str(),
        stats.downtime,
        stats.ram.transferred,
        stats.ram.normal,
        stats.digest_verified,
        arrived.writes,
        last_write == source_writes,
    );
    let copied_nothing = stats.ram.normal == 0 && stats.ram.transferred < 64 * 1024;
    if !stats.digest_verified
        || !copied_nothing
        || arrived.writes != source_writes
        || last_write != source_writes
        || !pattern_kept
    {
        return Err("the destination's guest is not the source's".into());
    }
    Ok(())
}
