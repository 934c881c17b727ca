//! Lazy restore: the guest resumes at once; the fault service brings its
//! memory in from the file.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tern_wire::snapshot::CHUNK_PAGES;

use crate::fault::{FaultConfig, FaultService, FaultStats};
use crate::guest::DestinationGuest;
use crate::snapshot::{RestoreConfig, SnapshotError, SnapshotFile, check_shape, sections};

/// A guest running on memory that is still being loaded.
pub struct LazyRestore<G: DestinationGuest> {
    guest: G,
    service: Option<FaultService>,
    file: Arc<SnapshotFile>,
    started: Instant,
    resumed_after: Duration,
    startup: StartupTimes,
}

impl<G: DestinationGuest> std::fmt::Debug for LazyRestore<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyRestore")
            .field("file", &self.file.path())
            .field("resumed_after", &self.resumed_after)
            .finish_non_exhaustive()
    }
}

/// Where the time to a running guest went, in order, each in ms: what a
/// lazy restore does before the guest runs, measured so it stays short.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct StartupTimes {
    /// Opening the files and checking header, metadata and trailer.
    pub open_ms: f64,
    /// Building what of the guest does not depend on the file (a VM),
    /// alongside the opening ([`restore_lazy_prepared`]).
    pub prepare_ms: f64,
    /// From the file opened to the guest built (waiting for the prepared
    /// part, then its memory mapped and registered).
    pub guest_ms: f64,
    /// Registering memory with userfaultfd and starting the service.
    pub register_ms: f64,
    /// Restoring the device state.
    pub state_ms: f64,
    /// Resuming the guest.
    pub resume_ms: f64,
}

/// What a lazy restore did.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct LazyStats {
    /// From opening the file to the guest resumed.
    pub resumed_after_ms: f64,
    /// From opening the file to every page loaded.
    pub loaded_after_ms: f64,
    /// Where the time to the guest resumed went.
    pub startup: StartupTimes,
    /// The fault service's statistics.
    pub faults: FaultStats,
    /// The memory digest, checked against the file's.
    pub digest: String,
    /// Pages whose faults loaded them, in order: a working set to record
    /// for the next restore (`WorkingSet` in tern-wire).
    #[serde(skip)]
    pub faulted_pages: Vec<(u32, u32)>,
}

/// Opens `path`, builds the guest, registers its memory with the fault
/// service and resumes it at once; pages come in as the guest touches
/// them, and in the background (the working set first). Call
/// [`LazyRestore::wait_loaded`] to learn that the guest no longer depends
/// on the file.
pub fn restore_lazy<G: DestinationGuest>(
    path: &Path,
    config: &RestoreConfig,
    make_guest: impl FnOnce(&[u64]) -> crate::guest::GuestResult<G>,
) -> Result<LazyRestore<G>, SnapshotError> {
    restore_lazy_prepared(path, config, || Ok(()), |(), lens| make_guest(lens))
}

/// [`restore_lazy`] for a guest built in two steps: `prepare` builds what
/// does not depend on the file (a VM and its vCPU, which take
/// milliseconds of KVM work) on its own thread while the file is opened
/// and checked, then `make_guest` adds memory of the snapshot's region
/// lengths. Both are on the way to a running guest; done side by side,
/// the restore waits for the longer, not the sum. A file that fails its
/// checks is refused as before, and the prepared part is dropped without
/// having run.
pub fn restore_lazy_prepared<G: DestinationGuest, P: Send>(
    path: &Path,
    config: &RestoreConfig,
    prepare: impl FnOnce() -> crate::guest::GuestResult<P> + Send,
    make_guest: impl FnOnce(P, &[u64]) -> crate::guest::GuestResult<G>,
) -> Result<LazyRestore<G>, SnapshotError> {
    let started = Instant::now();
    let mut startup = StartupTimes::default();
    let (file, prepared) = std::thread::scope(|scope| {
        let preparing = std::thread::Builder::new()
            .name("tern-prepare".into())
            .spawn_scoped(scope, || {
                let began = Instant::now();
                (prepare(), Lap(began).ms())
            })
            .map_err(|error| {
                SnapshotError::Guest(crate::guest::GuestError::with_source(
                    "cannot start the thread that builds the guest",
                    error,
                ))
            });
        let file = SnapshotFile::open_layers(&config.bases, path);
        startup.open_ms = Lap(started).ms();
        let prepared = preparing.map(|thread| {
            let (prepared, ms) = thread
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            startup.prepare_ms = ms;
            prepared
        });
        (file, prepared)
    });
    // The file's verdict first: a bad file is refused whatever the guest.
    let file = Arc::new(file?);
    let guest = make_guest(prepared??, &file.region_lens())?;
    let mut lap = Lap(started);
    check_shape(&file, guest.regions(), guest.guest_kind())?;
    startup.guest_ms = lap.ms() - startup.open_ms;
    let working_set = match (&config.working_set, config.prefetch_working_set) {
        (_, false) => Vec::new(),
        (Some(recorded), true) => recorded.clone(),
        (None, true) => file.trailer().working_set.pages.clone(),
    };
    let service = FaultService::register_and_start(
        guest.regions(),
        Arc::clone(&file) as Arc<dyn crate::fault::PageSource>,
        FaultConfig {
            unit_pages: CHUNK_PAGES,
            loaders: if config.background {
                config.threads.max(1)
            } else {
                0
            },
            working_set,
            release_on_failure: true,
        },
    )?;
    startup.register_ms = lap.ms();
    let mut restore = LazyRestore {
        guest,
        service: Some(service),
        file,
        started,
        resumed_after: Duration::ZERO,
        startup,
    };
    restore.guest.restore_state(&sections(&restore.file))?;
    restore.startup.state_ms = lap.ms();
    restore.guest.resume()?;
    restore.startup.resume_ms = lap.ms();
    restore.resumed_after = started.elapsed();
    Ok(restore)
}

/// Milliseconds since the last lap.
struct Lap(Instant);

impl Lap {
    fn ms(&mut self) -> f64 {
        let now = Instant::now();
        let ms = now.duration_since(self.0).as_secs_f64() * 1000.0;
        self.0 = now;
        ms
    }
}

impl<G: DestinationGuest> LazyRestore<G> {
    /// The running guest.
    pub fn guest(&self) -> &G {
        &self.guest
    }

    /// The running guest, mutably.
    pub fn guest_mut(&mut self) -> &mut G {
        &mut self.guest
    }

    /// Time from opening the file to the guest resumed.
    pub fn resumed_after(&self) -> Duration {
        self.resumed_after
    }

    /// Time since the restore began (opening the file).
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// The fault service's statistics so far.
    pub fn fault_stats(&self) -> FaultStats {
        self.service
            .as_ref()
            .map(FaultService::stats)
            .unwrap_or_default()
    }

    /// Pages whose faults loaded them so far, in order: a working set for
    /// the next restore.
    pub fn faulted_pages(&self) -> Vec<(u32, u32)> {
        self.service
            .as_ref()
            .map(FaultService::faulted_pages)
            .unwrap_or_default()
    }

    /// Starts `threads` background loaders (at least one) for a restore
    /// begun with [`RestoreConfig::background`] off: until now only the
    /// guest's faults brought pages in, so [`LazyRestore::faulted_pages`]
    /// holds everything it touched (REAP's recording run); from now on
    /// everything else loads too, and [`LazyRestore::wait_loaded`] can end.
    pub fn start_loading(&mut self, threads: usize) -> Result<(), SnapshotError> {
        let service = self
            .service
            .as_mut()
            .ok_or_else(|| SnapshotError::Config("already waited".into()))?;
        service.add_loaders(threads.max(1))?;
        Ok(())
    }

    /// Whether the fault service has stopped on an error.
    pub fn has_failed(&self) -> bool {
        self.service.as_ref().is_some_and(FaultService::has_failed)
    }

    /// Pauses a guest whose memory failed its checks. A pause that fails
    /// is logged as an error: the caller's error still says what was wrong
    /// with the memory.
    fn pause_unverified(&mut self) {
        if let Err(error) = self.guest.pause() {
            tracing::error!(%error, "cannot pause the lazily restored guest after a failed load");
        }
    }

    /// Waits (up to `deadline`) until every page is in memory, ends the
    /// registration and checks the digest of what was loaded. On an error
    /// (a chunk that does not match its hash, a read error, the deadline)
    /// the guest is paused and the error returned: it does not run on
    /// unverified memory.
    pub fn wait_loaded(mut self, deadline: Duration) -> Result<(G, LazyStats), SnapshotError> {
        let Some(service) = self.service.take() else {
            return Err(SnapshotError::Config("already waited".into()));
        };
        if let Err(error) = service.wait_loaded(deadline) {
            // The registration ended with the failure, so nothing waits on
            // a page any more and the pause completes.
            drop(service);
            self.pause_unverified();
            return Err(error.into());
        }
        let faulted_pages = service.faulted_pages();
        let faults = service.stop();
        let digest = self.file.verified_digest();
        let expected = self.file.metadata().header.digest;
        if digest != expected {
            self.pause_unverified();
            return Err(SnapshotError::LazyDigestMismatch {
                expected,
                actual: digest,
            });
        }
        let stats = LazyStats {
            resumed_after_ms: self.resumed_after.as_secs_f64() * 1000.0,
            loaded_after_ms: self.started.elapsed().as_secs_f64() * 1000.0,
            startup: self.startup,
            faults,
            digest: format!("{digest:032x}"),
            faulted_pages,
        };
        Ok((self.guest, stats))
    }
}
