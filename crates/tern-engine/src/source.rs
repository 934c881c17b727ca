//! The source side: handshake, dirty iterations, convergence, switch-over.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tern_wire::{
    ChannelHello, Complete, DigestAlgorithm, Handshake, Hello, Message, RegionInfo, SessionSetup,
    StateSectionMsg, Welcome,
};

use crate::bitmap::DirtyBitmap;
use crate::config::ZeroCopyBackend;
use crate::config::ZeroPageDetection;
use crate::config::{LimitPolicy, MigrationConfig, Verify};
use crate::digest::{Digest, digest_threads, memory_digest};
use crate::error::{ChannelError, MigrationError};
use crate::guest::{MemoryRegion, PAGE_SIZE, SourceGuest};
use crate::pipeline::{CompressionSetup, PageSender, Pipeline, PipelineSetup};
use crate::stats::thread_cpu_seconds;
use crate::stats::{DestinationStats, LiveStats, MigrationStats, MigrationStatus, millis};
use crate::transport::{Address, Channel};
use crate::uring_zc::UringZeroCopySender;
use crate::zerocopy::{self, ZeroCopySender};

/// Cancels a running migration from another thread (a signal handler's
/// helper, a UI, a test).
#[derive(Clone, Debug, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    /// A token not yet cancelled.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks the migration to stop; it ends with status `cancelled` and the
    /// source guest running.
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// Whether cancellation was asked for.
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    fn flag(&self) -> Arc<AtomicBool> {
        self.0.clone()
    }
}

/// A migration that did not complete, with the statistics up to the
/// failure. The source guest has been resumed.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct MigrationFailure {
    /// The cause.
    #[source]
    pub error: MigrationError,
    /// Statistics up to the failure (status `failed` or `cancelled`).
    pub stats: Box<MigrationStats>,
}

/// Migrates a guest's memory and state to a destination.
#[derive(Debug)]
pub struct Source {
    config: MigrationConfig,
    compression: CompressionSetup,
    zero_offload: Option<Arc<dyn tern_page::dsa::ZeroPageOffload>>,
    stats: Arc<LiveStats>,
    cancel: CancelToken,
}

/// What the guest was left in, so a failure can undo it.
#[derive(Default)]
struct GuestChanges {
    dirty_log: bool,
    paused: bool,
    throttled: bool,
    /// The destination has been told why the migration stops.
    abort_sent: bool,
}

impl Source {
    /// Prepares a migration; rejects bad settings up front.
    ///
    /// This is also where accelerators and codecs are opened, so that an
    /// explicitly requested DSA or QPL that is missing is a clear error
    /// before anything connects.
    pub fn new(config: MigrationConfig) -> Result<Self, MigrationError> {
        config.validate()?;
        let mut compression = CompressionSetup {
            choice: config.compression,
            level: config.compression_level,
            qpl_path: config.qpl_path,
        };
        let mut levels = Vec::new();
        for codec in compression.codecs() {
            let compressor = compression.compressor(codec).map_err(|error| {
                MigrationError::Config(format!("--compression {}: {error}", config.compression))
            })?;
            levels.push(compressor.level());
        }
        // A single codec reports the level in force, after its clamping;
        // `auto` keeps the level asked for, which each codec clamps.
        if let [level] = levels[..] {
            compression.level = Some(level);
        }
        let zero_offload = match config.zero_page_detection {
            ZeroPageDetection::Dsa => Some(match &config.zero_page_offload {
                Some(offload) => offload.clone(),
                None => tern_page::dsa::open_dsa(&tern_page::dsa::DsaConfig::default()).map_err(
                    |error| MigrationError::Config(format!("--zero-page-detection dsa: {error}")),
                )?,
            }),
            _ => None,
        };
        Ok(Self {
            config,
            compression,
            zero_offload,
            stats: Arc::new(LiveStats::new()),
            cancel: CancelToken::new(),
        })
    }

    /// Live statistics, for progress display while [`Source::migrate`] runs.
    pub fn stats(&self) -> Arc<LiveStats> {
        self.stats.clone()
    }

    /// A token that cancels the migration.
    pub fn cancel_token(&self) -> CancelToken {
        self.cancel.clone()
    }

    /// Runs the migration to `address`. On success the guest stays paused
    /// (it now runs on the destination); on failure it runs on here.
    pub fn migrate<G: SourceGuest>(
        &self,
        guest: &mut G,
        address: &Address,
    ) -> Result<MigrationStats, MigrationFailure> {
        self.stats.start_clock();
        let cpu_start = thread_cpu_seconds();
        let mut changes = GuestChanges::default();
        let mut main: Option<Channel> = None;
        let result = self.run(guest, address, &mut changes, &mut main);
        self.stats
            .record_cpu("migration", thread_cpu_seconds() - cpu_start);
        match result {
            Ok(destination) => {
                if changes.dirty_log {
                    let _ = guest.stop_dirty_log();
                }
                self.stats.set_status(MigrationStatus::Completed);
                let mut stats = self.stats.snapshot();
                stats.destination = destination;
                Ok(stats)
            }
            Err(error) => {
                if let Some(channel) = main.as_mut() {
                    if !changes.abort_sent {
                        send_abort(channel, &error);
                    }
                    channel.shutdown();
                }
                restore_guest(guest, &changes);
                let status = if matches!(error, MigrationError::Cancelled) {
                    MigrationStatus::Cancelled
                } else {
                    MigrationStatus::Failed
                };
                self.stats.set_status(status);
                let mut stats = self.stats.snapshot();
                stats.error_desc = Some(error.chain());
                // Returned to the caller, who reports it: a warning here would
                // print the same failure twice.
                tracing::debug!(error = %error.chain(), "migration {}", status.as_str());
                Err(MigrationFailure {
                    error,
                    stats: Box::new(stats),
                })
            }
        }
    }

    fn run<G: SourceGuest>(
        &self,
        guest: &mut G,
        address: &Address,
        changes: &mut GuestChanges,
        main_slot: &mut Option<Channel>,
    ) -> Result<Option<DestinationStats>, MigrationError> {
        let config = &self.config;
        config.check_address(address)?;
        let regions: Vec<MemoryRegion> = guest.regions().to_vec();
        let setup = session_setup(&regions, guest.guest_kind(), config, &self.compression)?;
        let total: u64 = regions.iter().map(MemoryRegion::len).sum();
        self.stats.total.store(total, Ordering::Relaxed);
        self.stats.remaining.store(total, Ordering::Relaxed);
        let session_id = random_session_id();
        let zero_copy_window = if config.zero_copy {
            Some(zero_copy_window(config)?)
        } else {
            None
        };

        let main = main_slot.insert(
            Channel::connect(address, config.connect_timeout)
                .map_err(MigrationError::channel(0))?,
        );
        main.set_timeouts(config.io_timeout)
            .map_err(MigrationError::channel(0))?;
        main.send_message(&Message::Hello(Hello {
            handshake: Handshake {
                session_id,
                channel_index: 0,
            },
            setup: setup.clone(),
        }))
        .map_err(MigrationError::channel(0))?;
        expect_welcome(main, session_id, 0)?;

        let mut page_channels = Vec::with_capacity(usize::from(config.channels));
        for index in 1..=config.channels {
            let mut channel = Channel::connect(address, config.connect_timeout)
                .map_err(MigrationError::channel(usize::from(index)))?;
            channel
                .set_timeouts(config.io_timeout)
                .map_err(MigrationError::channel(usize::from(index)))?;
            channel
                .send_message(&Message::ChannelHello(ChannelHello {
                    handshake: Handshake {
                        session_id,
                        channel_index: index,
                    },
                }))
                .map_err(MigrationError::channel(usize::from(index)))?;
            expect_welcome(&mut channel, session_id, index)?;
            page_channels.push(match zero_copy_window {
                // Enabled as the channel connects, so a refusal fails here.
                Some(window) => match config.zero_copy_backend {
                    ZeroCopyBackend::Msg => PageSender::ZeroCopy(Box::new(
                        ZeroCopySender::enable(channel, usize::from(index), window)
                            .map_err(MigrationError::ZeroCopy)?,
                    )),
                    ZeroCopyBackend::Uring => PageSender::ZeroCopy(Box::new(
                        UringZeroCopySender::enable(channel, usize::from(index), window)
                            .map_err(MigrationError::ZeroCopy)?,
                    )),
                },
                None => PageSender::Plain(channel),
            });
        }
        self.stats.set_setup_time(self.stats.started().elapsed());
        tracing::info!(
            channels = config.channels,
            bytes = total,
            "connected to {address}"
        );

        guest
            .start_dirty_log()
            .map_err(MigrationError::guest("start dirty log"))?;
        changes.dirty_log = true;
        let dirty_log_started = Instant::now();

        std::thread::scope(|scope| {
            let pipeline = Pipeline::start(
                scope,
                PipelineSetup {
                    regions: regions.clone(),
                    workers: config.worker_count(),
                    detection: config.zero_page_detection,
                    zero_offload: self.zero_offload.clone(),
                    zero_as_normal: config.zero_page_as_normal,
                    compression: self.compression,
                    max_bandwidth: config.max_bandwidth,
                    stats: self.stats.clone(),
                    cancel: self.cancel.flag(),
                },
                page_channels,
            )?;
            let mut pipeline = Some(pipeline);
            let result = self
                .iterate(
                    guest,
                    main,
                    &regions,
                    changes,
                    &mut pipeline,
                    dirty_log_started,
                )
                .map_err(|error| {
                    // A closed page channel is usually the symptom; the
                    // destination's abort message, when it sent one, is the
                    // cause.
                    let error = match error {
                        MigrationError::Channel { .. } | MigrationError::Protocol(_) => {
                            peer_reason(main).unwrap_or(error)
                        }
                        other => other,
                    };
                    // Say why before the page channels close, so the
                    // destination reports the cause, not the closed channels.
                    send_abort(main, &error);
                    changes.abort_sent = true;
                    error
                });
            if let Some(pipeline) = pipeline.take() {
                pipeline.shut_down(result.is_err());
            }
            result
        })
    }

    fn iterate<G: SourceGuest>(
        &self,
        guest: &mut G,
        main: &mut Channel,
        regions: &[MemoryRegion],
        changes: &mut GuestChanges,
        pipeline: &mut Option<Pipeline<'_>>,
        dirty_log_started: Instant,
    ) -> Result<Option<DestinationStats>, MigrationError> {
        let config = &self.config;
        let stats = &self.stats;
        let Some(pipe) = pipeline.as_mut() else {
            return Err(MigrationError::Protocol("pipeline missing".into()));
        };
        let mut bitmaps: Vec<DirtyBitmap> = regions
            .iter()
            .map(|region| DirtyBitmap::new(region.pages()))
            .collect();
        bitmaps.iter_mut().for_each(DirtyBitmap::set_all);
        stats.set_status(MigrationStatus::Active);
        let live_start = Instant::now();
        let mut iteration: u32 = 0;
        let mut bandwidth: f64 = 0.0; // guest bytes per second
        let mut throttle: u8 = 0;
        let mut dirty_outruns = 0;
        let mut forced = false;
        let mut previous_sync = dirty_log_started;
        loop {
            let started = Instant::now();
            let totals = pipe.send_iteration(&bitmaps, iteration, false)?;
            let elapsed = started.elapsed().as_secs_f64().max(1e-6);
            // Tiny iterations measure latency, not bandwidth.
            if totals.pages >= 256 || bandwidth == 0.0 {
                bandwidth = totals.pages as f64 * PAGE_SIZE as f64 / elapsed;
            }
            check_peer(main)?;

            bitmaps.iter_mut().for_each(DirtyBitmap::clear);
            guest
                .sync_dirty_log(&mut bitmaps)
                .map_err(MigrationError::guest("sync dirty log"))?;
            let synced = Instant::now();
            let since_previous_sync = synced.duration_since(previous_sync).as_secs_f64().max(1e-6);
            previous_sync = synced;
            stats.dirty_sync_count.fetch_add(1, Ordering::Relaxed);
            let dirty_pages: u64 = bitmaps.iter().map(DirtyBitmap::count).sum();
            let remaining = dirty_pages * PAGE_SIZE as u64;
            let dirty_rate = dirty_pages as f64 / since_previous_sync;
            let expected_downtime = Duration::from_secs_f64(remaining as f64 / bandwidth.max(1.0));
            iteration += 1;
            // The next iteration's size, before it starts.
            stats.start_iteration(remaining);
            stats
                .dirty_pages_rate
                .store(dirty_rate as u64, Ordering::Relaxed);
            stats.bandwidth.store(bandwidth as u64, Ordering::Relaxed);
            stats
                .expected_downtime_ms
                .store(millis(expected_downtime), Ordering::Relaxed);
            stats
                .iteration
                .store(u64::from(iteration), Ordering::Relaxed);
            tracing::debug!(
                iteration,
                dirty_pages,
                bandwidth_mb_s = bandwidth / 1e6,
                "dirty iteration done"
            );

            if expected_downtime <= config.downtime_limit {
                break;
            }
            if self.cancel.is_cancelled() {
                return Err(MigrationError::Cancelled);
            }
            let over_iterations = config.max_iterations.is_some_and(|max| iteration >= max);
            let over_time = config
                .max_time
                .is_some_and(|max| live_start.elapsed() >= max);
            if over_iterations || over_time {
                let what = if over_iterations {
                    format!("{iteration} iterations")
                } else {
                    format!("{:.1} s", live_start.elapsed().as_secs_f64())
                };
                match config.limit_policy {
                    LimitPolicy::Cancel => {
                        return Err(MigrationError::LimitReached(format!(
                            "after {what}, {remaining} dirty bytes would need {} ms of downtime (limit {} ms)",
                            expected_downtime.as_millis(),
                            config.downtime_limit.as_millis()
                        )));
                    }
                    LimitPolicy::SwitchOver => {
                        tracing::warn!("limit reached after {what}: forcing the switch-over");
                        forced = true;
                        stats.forced_switch_over.store(true, Ordering::Relaxed);
                        break;
                    }
                }
            }
            if config.auto_converge {
                // As QEMU does: the guest outruns the link when it dirties
                // more than half of what one iteration could send.
                if dirty_pages * 2 > totals.pages.max(1) {
                    dirty_outruns += 1;
                } else {
                    dirty_outruns = 0;
                }
                if dirty_outruns >= 2 && throttle < 99 {
                    throttle = if throttle == 0 {
                        config.throttle_initial.max(1)
                    } else {
                        throttle.saturating_add(config.throttle_increment).min(99)
                    };
                    guest
                        .set_throttle(throttle)
                        .map_err(MigrationError::guest("throttle"))?;
                    changes.throttled = true;
                    stats
                        .cpu_throttle_percentage
                        .store(u64::from(throttle), Ordering::Relaxed);
                    tracing::info!(throttle, "auto-converge: throttling the guest");
                    dirty_outruns = 0;
                }
            }
        }

        // Switch-over: the guest stops, the rest goes, the destination checks.
        stats.set_status(MigrationStatus::Device);
        let paused_at = Instant::now();
        guest.pause().map_err(MigrationError::guest("pause"))?;
        changes.paused = true;
        tracing::debug!(
            elapsed_ms = paused_at.elapsed().as_millis() as u64,
            "guest paused"
        );
        guest
            .sync_dirty_log(&mut bitmaps)
            .map_err(MigrationError::guest("sync dirty log"))?;
        stats.dirty_sync_count.fetch_add(1, Ordering::Relaxed);
        // The guest is paused, so its memory no longer changes: hash it
        // while the last pages travel instead of after.
        let verify = config.verify == Verify::Full;
        let (sent, digest) = std::thread::scope(|scope| {
            let hasher = verify
                .then(|| {
                    std::thread::Builder::new()
                        .name("tern-digest".into())
                        // SAFETY: the guest is paused, and the pipeline only
                        // reads guest memory, so nothing writes it while it
                        // is hashed.
                        .spawn_scoped(scope, || unsafe {
                            memory_digest(regions, digest_threads(), &|_, _| false)
                        })
                        .map_err(MigrationError::Thread)
                })
                .transpose()?;
            let sent = pipe.send_iteration(&bitmaps, iteration, true);
            let digest = match hasher {
                Some(hasher) => hasher
                    .join()
                    .map_err(|_| MigrationError::Protocol("the digest thread panicked".into()))?,
                None => Digest {
                    value: 0,
                    cpu_seconds: 0.0,
                    elapsed: Duration::ZERO,
                },
            };
            Ok::<_, MigrationError>((sent, digest))
        })?;
        sent?;
        tracing::debug!(
            elapsed_ms = paused_at.elapsed().as_millis() as u64,
            "final pages sent and memory hashed"
        );
        stats.record_cpu("digest", digest.cpu_seconds);
        stats.set_digest_time(digest.elapsed);
        let digest = digest.value;
        stats.remaining.store(0, Ordering::Relaxed);

        let sections = guest
            .save_state()
            .map_err(MigrationError::guest("save state"))?;
        let mut send_paused = |message: Message| {
            let bytes = message.to_bytes();
            main.write_all(&bytes).map_err(MigrationError::channel(0))?;
            stats.add_sent(bytes.len() as u64, true, false);
            Ok::<_, MigrationError>(())
        };
        for section in &sections {
            send_paused(Message::StateSection(StateSectionMsg {
                name: section.name.clone(),
                version: section.version,
                data: section.data.clone(),
            }))?;
        }
        send_paused(Message::Complete(Complete {
            final_iteration: iteration,
            sections: u32::try_from(sections.len()).unwrap_or(u32::MAX),
            digest,
        }))?;

        tracing::debug!(
            elapsed_ms = paused_at.elapsed().as_millis() as u64,
            "state and digest sent"
        );
        let outcome = loop {
            match main.read_message() {
                Ok(Message::Outcome(outcome)) => break outcome,
                Ok(Message::Abort(abort)) => {
                    return Err(MigrationError::PeerAborted {
                        reason: abort.reason,
                        message: abort.message,
                    });
                }
                Ok(other) => {
                    return Err(MigrationError::Protocol(format!(
                        "expected the destination's outcome, got {:?}",
                        other.kind()
                    )));
                }
                Err(ChannelError::Timeout(_)) if !self.cancel.is_cancelled() => continue,
                Err(error) => return Err(MigrationError::channel(0)(error)),
            }
        };
        tracing::debug!(
            elapsed_ms = paused_at.elapsed().as_millis() as u64,
            "outcome received"
        );
        if !outcome.verified {
            if outcome.digest != digest {
                return Err(MigrationError::DigestMismatch {
                    source_digest: digest,
                    destination: outcome.digest,
                });
            }
            return Err(MigrationError::Protocol(format!(
                "the destination did not resume the guest: {}",
                outcome.detail
            )));
        }
        stats.set_downtime(paused_at.elapsed());
        stats.set_digest_verified(verify);
        if forced {
            tracing::info!("switch-over was forced by a limit");
        }
        Ok(Some(DestinationStats::from_wire(&outcome.stats)))
    }
}

/// The per-channel zero-copy window: the configured one, or the largest
/// that lets every channel's window fit in `RLIMIT_MEMLOCK` together, capped
/// at 16 MiB; checked against the limit either way.
fn zero_copy_window(config: &MigrationConfig) -> Result<usize, MigrationError> {
    const PREFERRED: usize = 16 << 20;
    let channels = usize::from(config.channels);
    let window = if config.zero_copy_window != 0 {
        config.zero_copy_window
    } else if zerocopy::has_cap_ipc_lock() {
        PREFERRED
    } else {
        let soft = memlock_soft_limit().unwrap_or(u64::MAX);
        let share = usize::try_from(soft / channels as u64).unwrap_or(usize::MAX);
        // Leave a quarter for the rest of the process.
        (share / 4 * 3).clamp(zerocopy::MIN_WINDOW_BYTES, PREFERRED)
    };
    zerocopy::check_memlock(window * channels).map_err(MigrationError::ZeroCopy)?;
    Ok(window)
}

fn memlock_soft_limit() -> Option<u64> {
    // SAFETY: an all-zero rlimit is a valid value to overwrite.
    let mut limit: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: `limit` is valid for writes.
    let result = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
    (result == 0 && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
}

/// Builds the session setup from the guest's regions and kind.
fn session_setup(
    regions: &[MemoryRegion],
    guest_kind: &str,
    config: &MigrationConfig,
    compression: &CompressionSetup,
) -> Result<SessionSetup, MigrationError> {
    let setup = SessionSetup {
        page_size: PAGE_SIZE as u32,
        channel_count: config.channels,
        codecs: compression
            .codecs()
            .iter()
            .fold(0, |bits, codec| bits | 1 << codec.to_wire()),
        digest: match config.verify {
            Verify::Full => DigestAlgorithm::Xxh3Pages,
            Verify::None => DigestAlgorithm::None,
        },
        regions: regions
            .iter()
            .map(|region| RegionInfo {
                id: region.id(),
                guest_addr: region.guest_addr(),
                len: region.len(),
            })
            .collect(),
        guest_kind: guest_kind.to_string(),
    };
    setup.validate().map_err(|error| {
        MigrationError::Config(format!("the guest's memory layout or kind: {error}"))
    })?;
    Ok(setup)
}

fn expect_welcome(
    channel: &mut Channel,
    session_id: u64,
    index: u16,
) -> Result<(), MigrationError> {
    match channel
        .read_message()
        .map_err(MigrationError::channel(usize::from(index)))?
    {
        Message::Welcome(Welcome {
            session_id: id,
            channel_index,
        }) if id == session_id && channel_index == index => Ok(()),
        Message::Abort(abort) => Err(MigrationError::PeerAborted {
            reason: abort.reason,
            message: abort.message,
        }),
        other => Err(MigrationError::Protocol(format!(
            "expected a welcome on channel {index}, got {other:?}"
        ))),
    }
}

/// Fails if the destination has sent something on the main channel (it only
/// speaks there before the end to abort).
fn check_peer(main: &mut Channel) -> Result<(), MigrationError> {
    match main.wait_readable(Duration::ZERO) {
        Ok(false) => Ok(()),
        Ok(true) => Err(peer_reason(main).unwrap_or(MigrationError::Channel {
            index: 0,
            source: ChannelError::Closed,
        })),
        Err(error) => Err(MigrationError::channel(0)(error)),
    }
}

/// Tells the destination why the migration stops (unless it told us).
fn send_abort(main: &mut Channel, error: &MigrationError) {
    if !matches!(error, MigrationError::PeerAborted { .. }) {
        let _ = main.send_message(&Message::Abort(tern_wire::Abort {
            reason: error.abort_reason(),
            message: error.chain(),
        }));
    }
}

/// Reads an abort message the destination may have sent, waiting briefly.
fn peer_reason(main: &mut Channel) -> Option<MigrationError> {
    if !main.wait_readable(Duration::from_millis(500)).ok()? {
        return None;
    }
    match main.read_message() {
        Ok(Message::Abort(abort)) => Some(MigrationError::PeerAborted {
            reason: abort.reason,
            message: abort.message,
        }),
        _ => None,
    }
}

fn restore_guest<G: SourceGuest>(guest: &mut G, changes: &GuestChanges) {
    if changes.throttled
        && let Err(error) = guest.set_throttle(0)
    {
        tracing::error!(%error, "cannot remove the throttle after a failed migration");
    }
    if changes.paused
        && let Err(error) = guest.resume()
    {
        tracing::error!(%error, "cannot resume the guest after a failed migration");
    }
    if changes.dirty_log
        && let Err(error) = guest.stop_dirty_log()
    {
        tracing::error!(%error, "cannot stop dirty logging after a failed migration");
    }
}

fn random_session_id() -> u64 {
    let mut bytes = [0u8; 8];
    // SAFETY: `bytes` is writable for its length.
    let filled = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), 0) };
    if filled == bytes.len() as isize {
        u64::from_le_bytes(bytes)
    } else {
        // Uniqueness, not secrecy, is what matters here.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        now.as_nanos() as u64 ^ u64::from(std::process::id()).rotate_left(32)
    }
}
