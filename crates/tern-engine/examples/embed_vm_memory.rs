//! Embedding tern in a VMM built on rust-vmm's vm-memory.
//!
//! The "VMM" here owns a `GuestMemoryMmap<AtomicBitmap>` and a device thread
//! that keeps writing guest memory through vm-memory (so the writes land in
//! the `AtomicBitmap`) while the migration runs. The adapter in
//! `tern_engine::vm_memory` supplies the regions and the dirty log; the VMM
//! adds pause/resume and its device state. The destination builds its own
//! `GuestMemoryMmap` from the announced regions, receives into it, checks
//! the digest and restores the state.
//!
//! Run it with
//! `cargo run -p tern-engine --release --example embed_vm_memory --features vm-memory`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

use tern_engine::vm_memory::{AtomicBitmapLog, VmMemory};
use tern_engine::{
    Address, DeviceState, DirtyBitmap, DirtyLog, GuestControl, GuestError, GuestMemory,
    GuestResult, Listener, MemoryRegion, MigrationConfig, ReceiveConfig, Source, StateSection,
};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const GUEST_KIND: &str = "vm-memory example";
const MIB: usize = 1 << 20;

/// The source VMM's guest.
struct RunningVm {
    memory: VmMemory<GuestMemoryMmap<AtomicBitmap>>,
    log: AtomicBitmapLog<GuestMemoryMmap<AtomicBitmap>>,
    /// Writes done by the device, saved as device state.
    writes: Arc<AtomicU64>,
    running: Arc<AtomicBool>,
    device: Option<JoinHandle<()>>,
}

impl RunningVm {
    fn new(memory: GuestMemoryMmap<AtomicBitmap>) -> GuestResult<Self> {
        let memory = VmMemory::new(&memory)?;
        let mut vm = Self {
            log: memory.dirty_log()?,
            memory,
            writes: Arc::new(AtomicU64::new(0)),
            running: Arc::new(AtomicBool::new(false)),
            device: None,
        };
        vm.resume()?;
        Ok(vm)
    }
}

/// A device that writes one page in 4 MiB of the first region, round and
/// round, through vm-memory: each write marks the page in the bitmap.
fn device_loop(
    memory: GuestMemoryMmap<AtomicBitmap>,
    running: Arc<AtomicBool>,
    writes: Arc<AtomicU64>,
) {
    let pages = 4 * MIB as u64 / 4096;
    while running.load(Ordering::Relaxed) {
        let count = writes.fetch_add(1, Ordering::Relaxed);
        let page = count.wrapping_mul(2_654_435_761) % pages;
        memory
            .write_obj(count, GuestAddress(page * 4096 + 8))
            .expect("the page is inside guest memory");
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
        self.log.sync_dirty_log(bitmaps)
    }

    fn stop_dirty_log(&mut self) -> GuestResult<()> {
        self.log.stop_dirty_log()
    }
}

impl GuestControl for RunningVm {
    fn pause(&mut self) -> GuestResult<()> {
        self.running.store(false, Ordering::Relaxed);
        if let Some(device) = self.device.take() {
            device
                .join()
                .map_err(|_| GuestError::new("the device thread panicked"))?;
        }
        Ok(())
    }

    fn resume(&mut self) -> GuestResult<()> {
        if self.device.is_none() {
            self.running.store(true, Ordering::Relaxed);
            let (memory, running, writes) = (
                self.memory.memory().clone(),
                self.running.clone(),
                self.writes.clone(),
            );
            self.device = Some(std::thread::spawn(move || {
                device_loop(memory, running, writes)
            }));
        }
        Ok(())
    }

    fn set_throttle(&mut self, _percent: u8) -> GuestResult<()> {
        // A real VMM slows its vCPUs here; this device is left at full speed.
        Ok(())
    }
}

impl DeviceState for RunningVm {
    fn save_state(&mut self) -> GuestResult<Vec<StateSection>> {
        Ok(vec![StateSection {
            name: "device".into(),
            version: 1,
            data: self.writes.load(Ordering::Relaxed).to_le_bytes().to_vec(),
        }])
    }

    fn restore_state(&mut self, _sections: &[StateSection]) -> GuestResult<()> {
        Err(GuestError::new("the source never restores"))
    }

    fn guest_kind(&self) -> &str {
        GUEST_KIND
    }
}

/// The destination VMM's guest: memory shaped as the source announced.
struct ArrivingVm {
    memory: VmMemory<GuestMemoryMmap<()>>,
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
            return Err(GuestError::new("expected one state section"));
        };
        let bytes: [u8; 8] = section.data[..]
            .try_into()
            .map_err(|_| GuestError::new("the device section is not 8 bytes"))?;
        self.writes = u64::from_le_bytes(bytes);
        Ok(())
    }

    fn guest_kind(&self) -> &str {
        GUEST_KIND
    }
}

/// Migrates the guest and checks the destination; `tests/vm_memory.rs`
/// runs it too, so the suite covers what CI runs.
pub(crate) fn main() -> Result<(), Box<dyn std::error::Error>> {
    let memory: GuestMemoryMmap<AtomicBitmap> = GuestMemoryMmap::from_ranges(&[
        (GuestAddress(0), 32 * MIB),
        (GuestAddress(1 << 32), 16 * MIB),
    ])?;
    let pattern: Vec<u8> = (0..MIB)
        .map(|i| u8::try_from(i % 251).expect("below 251"))
        .collect();
    for offset in (0..8 * MIB).step_by(MIB) {
        memory.write_slice(&pattern, GuestAddress(offset as u64))?;
        memory.write_slice(&pattern, GuestAddress((1 << 32) + offset as u64))?;
    }
    let mut source = RunningVm::new(memory.clone())?;

    let directory = tempfile::tempdir()?;
    let address = Address::Unix(directory.path().join("migration.sock"));
    let listener = Listener::bind(&address)?;
    let destination = std::thread::spawn(move || {
        tern_engine::Destination::new(ReceiveConfig::default()).receive(&listener, |setup| {
            let ranges: Vec<(GuestAddress, usize)> = setup
                .regions
                .iter()
                .map(|region| {
                    Ok((
                        GuestAddress(region.guest_addr),
                        usize::try_from(region.len)?,
                    ))
                })
                .collect::<Result<_, std::num::TryFromIntError>>()
                .map_err(|error| GuestError::with_source("region too large", error))?;
            let memory: GuestMemoryMmap<()> = GuestMemoryMmap::from_ranges(&ranges)
                .map_err(|error| GuestError::with_source("cannot map guest memory", error))?;
            Ok(ArrivingVm {
                memory: VmMemory::new(&memory)?,
                writes: 0,
            })
        })
    });

    let stats = Source::new(MigrationConfig::default())?.migrate(&mut source, &address)?;
    let received = destination
        .join()
        .map_err(|_| "the destination thread panicked")??;
    let arrived = &received.guest;

    // The engine compared digests before resuming; compare the bytes too.
    let source_writes = source.writes.load(Ordering::Relaxed);
    let same = source
        .regions()
        .iter()
        .zip(arrived.regions())
        .all(|(from, to)| {
            // SAFETY: both regions are live mappings of `len` bytes, and
            // nothing writes them now (the source is paused, the destination
            // guest has no vCPU).
            unsafe {
                std::slice::from_raw_parts(from.host_ptr(), region_len(from.len()))
                    == std::slice::from_raw_parts(to.host_ptr(), region_len(to.len()))
            }
        });
    println!(
        "status {}, {} iterations, downtime {} ms, {} MiB sent, digest verified {}",
        stats.status.as_str(),
        stats.ram.iterations,
        stats.downtime,
        stats.ram.transferred >> 20,
        stats.digest_verified
    );
    println!(
        "device writes: {source_writes} on the source, {} restored on the destination; memory identical: {same}",
        arrived.writes
    );
    if !stats.digest_verified || !same || arrived.writes != source_writes {
        return Err("the destination differs from the source".into());
    }
    Ok(())
}

/// A mapped region's length, which fits the address space it is mapped in.
fn region_len(len: u64) -> usize {
    usize::try_from(len).expect("a mapped region fits the address space")
}
