//! Embedding tern in a VMM whose memory is shaped like Cloud Hypervisor's.
//!
//! Cloud Hypervisor's `MemoryManager` keeps guest RAM in a
//! `GuestMemoryAtomic<GuestMemoryMmap>` with
//! `type GuestMemoryMmap = vm_memory::GuestMemoryMmap<AtomicBitmap>` (as in
//! `vmm/src/memory_manager.rs` of cloud-hypervisor/cloud-hypervisor; the
//! issue checked ae44c29): devices load the current collection for each
//! access, and memory hot-plug swaps in a new one. Those are vm-memory's own
//! types, so this example uses them as they are.
//!
//! The pieces of Cloud Hypervisor's migration and where they go:
//! - the memory: `VmMemory::from_atomic`, and its dirty log, which stops the
//!   migration (source running) if the collection is swapped meanwhile;
//! - the `Config` message the destination builds the VM from:
//!   `MigrationConfig::vmm_config`, received by
//!   `Destination::receive_with_vmm_config` before any memory;
//! - `Pausable` / `Snapshottable`: `GuestControl` and `DeviceState`;
//! - `CompletePaused`: `ReceiveConfig::keep_paused`, the guest handed over
//!   paused for the VMM to resume.
//!
//! Run it with
//! `cargo run -p tern-engine --release --example embed_cloud_hypervisor --features vm-memory`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

use tern_engine::vm_memory::{AtomicBitmapLog, VmMemory};
use tern_engine::{
    Address, Destination, DeviceState, DirtyBitmap, DirtyLog, GuestControl, GuestError,
    GuestMemory, GuestResult, Listener, MemoryRegion, MigrationConfig, MigrationError,
    ReceiveConfig, Source, StateSection,
};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemoryAtomic};

/// Cloud Hypervisor's alias.
type GuestMemoryMmap = vm_memory::GuestMemoryMmap<AtomicBitmap>;

const GUEST_KIND: &str = "cloud-hypervisor-shaped VM";
const MIB: usize = 1 << 20;

/// Stands for Cloud Hypervisor's `Config` message: the memory size in MiB
/// of the one RAM region, as text.
fn config_message(memory_mib: usize) -> Vec<u8> {
    format!("memory_mib={memory_mib}").into_bytes()
}

fn parse_config(message: &[u8]) -> GuestResult<usize> {
    std::str::from_utf8(message)
        .ok()
        .and_then(|text| text.strip_prefix("memory_mib="))
        .and_then(|mib| mib.parse().ok())
        .ok_or_else(|| GuestError::new("the Config message is not memory_mib=N"))
}

fn guest_memory(memory_mib: usize) -> Result<GuestMemoryAtomic<GuestMemoryMmap>, GuestError> {
    let memory = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), memory_mib * MIB)])
        .map_err(|error| GuestError::with_source("cannot map guest memory", error))?;
    Ok(GuestMemoryAtomic::new(memory))
}

/// The source VM: a device thread writes guest memory through the current
/// collection of the `GuestMemoryAtomic`, as Cloud Hypervisor's devices do.
struct RunningVm {
    guest_memory: GuestMemoryAtomic<GuestMemoryMmap>,
    memory: VmMemory<GuestMemoryMmap>,
    log: AtomicBitmapLog<GuestMemoryMmap>,
    writes: Arc<AtomicU64>,
    running: Arc<AtomicBool>,
    device: Option<JoinHandle<()>>,
}

impl RunningVm {
    fn new(guest_memory: GuestMemoryAtomic<GuestMemoryMmap>) -> GuestResult<Self> {
        let memory = VmMemory::from_atomic(&guest_memory)?;
        let mut vm = Self {
            log: memory.dirty_log()?,
            memory,
            guest_memory,
            writes: Arc::new(AtomicU64::new(0)),
            running: Arc::new(AtomicBool::new(false)),
            device: None,
        };
        vm.resume()?;
        Ok(vm)
    }
}

fn device_loop(
    guest_memory: GuestMemoryAtomic<GuestMemoryMmap>,
    running: Arc<AtomicBool>,
    writes: Arc<AtomicU64>,
) {
    let pages = 4 * MIB as u64 / 4096;
    while running.load(Ordering::Relaxed) {
        let count = writes.fetch_add(1, Ordering::Relaxed);
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
}

impl DirtyLog for RunningVm {
    fn start_dirty_log(&mut self) -> GuestResult<()> {
        self.log.start_dirty_log()
    }

    fn sync_dirty_log(&mut self, bitmaps: &mut [DirtyBitmap]) -> GuestResult<()> {
        // Cloud Hypervisor ORs KVM's dirty log in here too (`dirty_log` of
        // its memory manager reads both).
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
        // Cloud Hypervisor has no vCPU throttle; auto-converge stays off.
        Ok(())
    }
}

impl DeviceState for RunningVm {
    fn save_state(&mut self) -> GuestResult<Vec<StateSection>> {
        // One section per `Snapshottable` component, named by its id.
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

/// The destination VM, built from the `Config` message.
struct ArrivingVm {
    guest_memory: GuestMemoryAtomic<GuestMemoryMmap>,
    memory: VmMemory<GuestMemoryMmap>,
    writes: u64,
    running: bool,
}

impl GuestMemory for ArrivingVm {
    fn regions(&self) -> &[MemoryRegion] {
        self.memory.regions()
    }
}

impl GuestControl for ArrivingVm {
    fn pause(&mut self) -> GuestResult<()> {
        self.running = false;
        Ok(())
    }

    fn resume(&mut self) -> GuestResult<()> {
        self.running = true;
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
    let mut config = ReceiveConfig::default();
    config.keep_paused = true;
    Destination::new(config).receive_with_vmm_config(&listener, |_setup, message| {
        let guest_memory = guest_memory(parse_config(message)?)?;
        Ok(ArrivingVm {
            memory: VmMemory::from_atomic(&guest_memory)?,
            guest_memory,
            writes: 0,
            running: false,
        })
    })
}

/// Migrates the VM, checks the destination, then shows that a hot-plug
/// during a migration stops it with the source running; `tests/vm_memory.rs`
/// runs it too.
pub(crate) fn main() -> Result<(), Box<dyn std::error::Error>> {
    const MEMORY_MIB: usize = 32;
    let guest_memory = guest_memory(MEMORY_MIB)?;
    let pattern: Vec<u8> = (0..MIB)
        .map(|i| u8::try_from(i % 251).expect("below 251"))
        .collect();
    for offset in (0..8 * MIB as u64).step_by(MIB) {
        guest_memory
            .memory()
            .write_slice(&pattern, GuestAddress(offset))?;
    }
    let mut source = RunningVm::new(guest_memory)?;

    let directory = tempfile::tempdir()?;
    let address = Address::Unix(directory.path().join("migration.sock"));
    let listener = Listener::bind(&address)?;
    let destination = std::thread::spawn(move || receive(listener));
    let mut config = MigrationConfig::default();
    config.vmm_config = config_message(MEMORY_MIB);
    config.auto_converge = false;
    let stats = Source::new(config)?.migrate(&mut source, &address)?;
    let mut received = destination
        .join()
        .map_err(|_| "the destination thread panicked")??;

    // `CompletePaused`: the VMM resumes the VM itself.
    let handed_over_paused = !received.resumed && !received.guest.running;
    received.guest.resume()?;
    let arrived = &received.guest;
    let same = {
        let (from, to) = (source.guest_memory.memory(), arrived.guest_memory.memory());
        let (mut left, mut right) = (vec![0; MEMORY_MIB * MIB], vec![0; MEMORY_MIB * MIB]);
        from.read_slice(&mut left, GuestAddress(0))?;
        to.read_slice(&mut right, GuestAddress(0))?;
        left == right
    };
    let source_writes = source.writes.load(Ordering::Relaxed);
    println!(
        "status {}, downtime {} ms, {} MiB sent, digest verified {}, handed over paused \
         {handed_over_paused}, memory identical {same}, device writes {source_writes} / {}",
        stats.status.as_str(),
        stats.downtime,
        stats.ram.transferred >> 20,
        stats.digest_verified,
        arrived.writes
    );
    if !stats.digest_verified || !same || arrived.writes != source_writes || !handed_over_paused {
        return Err("the destination differs from the source".into());
    }
    hot_plug_stops_the_migration()
}

/// A collection swapped after the migration took its regions (what Cloud
/// Hypervisor's memory hot-plug does) fails the migration at the next dirty
/// log sync; the source is resumed and its memory untouched.
fn hot_plug_stops_the_migration() -> Result<(), Box<dyn std::error::Error>> {
    let guest_memory = guest_memory(8)?;
    let mut source = RunningVm::new(guest_memory.clone())?;
    let plugged =
        guest_memory
            .memory()
            .insert_region(Arc::new(vm_memory::GuestRegionMmap::from_range(
                GuestAddress(1 << 32),
                4 * MIB,
                None,
            )?))?;
    guest_memory
        .lock()
        .map_err(|_| "the memory lock is poisoned")?
        .replace(plugged);

    let directory = tempfile::tempdir()?;
    let address = Address::Unix(directory.path().join("migration.sock"));
    let listener = Listener::bind(&address)?;
    let destination = std::thread::spawn(move || receive(listener));
    let mut config = MigrationConfig::default();
    config.vmm_config = config_message(8);
    let failure = match Source::new(config)?.migrate(&mut source, &address) {
        Ok(_) => return Err("a migration across a hot-plug completed".into()),
        Err(failure) => failure,
    };
    let destination_failed = destination
        .join()
        .map_err(|_| "the destination thread panicked")?
        .is_err();
    let source_running = source.device.is_some();
    let mut message = failure.to_string();
    let mut cause = std::error::Error::source(&failure);
    while let Some(error) = cause {
        message = format!("{message}: {error}");
        cause = error.source();
    }
    println!("hot-plug during the migration: {message}; source running {source_running}");
    if !message.contains("replaced the guest memory map") || !source_running || !destination_failed
    {
        return Err(format!("unexpected outcome of a hot-plug: {message}").into());
    }
    source.pause()?;
    Ok(())
}
