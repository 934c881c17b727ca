//! The source side: handshake, dirty iterations, convergence, switch-over.

mod cancellable;
mod connect;
pub(crate) mod convergence;
mod dictionary;
mod handover;
mod live;
mod peer;
mod postcopy;
mod recover;
mod switch_over;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use crate::config::{MigrationConfig, Verify, ZeroPageDetection};
pub use crate::control::CancelToken;
use crate::control::{MigrationHandle, SourceControl};
use crate::digest::{AuditPace, PageHashes};
use crate::error::MigrationError;
use crate::guest::{MemoryRegion, SourceGuest};
use crate::pipeline::{CompressionSetup, Pipeline, PipelineSetup};
use crate::stats::thread_cpu_seconds;
use crate::stats::{DestinationStats, LiveStats, MigrationStats, MigrationStatus, SessionSecurity};
use crate::transport::{Address, Channel, Connect, Connector};
use peer::{peer_reason, send_abort};

/// A migration that did not complete, with the statistics up to the
/// failure. The source guest has been resumed, except after
/// [`MigrationError::OutcomeUnknown`] (status `outcome-unknown`), when it
/// stays paused.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
#[non_exhaustive]
pub struct MigrationFailure {
    /// The cause.
    #[source]
    pub error: MigrationError,
    /// Statistics up to the failure (status `failed`, `cancelled` or
    /// `outcome-unknown`).
    pub stats: Box<MigrationStats>,
}

/// Migrates a guest's memory and state to a destination.
#[derive(Debug)]
pub struct Source {
    config: MigrationConfig,
    compression: CompressionSetup,
    zero_offload: Option<Arc<dyn tern_page::ZeroPageOffload>>,
    stats: Arc<LiveStats>,
    cancel: CancelToken,
    control: Arc<SourceControl>,
}

/// What the guest was left in, so a failure can undo it.
#[derive(Default)]
struct GuestChanges {
    dirty_log: bool,
    paused: bool,
    throttled: bool,
    /// The destination has been told why the migration stops.
    abort_sent: bool,
    /// The source committed the switch-over: the guest may run on the
    /// destination, so it is never resumed here.
    committed: bool,
    /// The destination resumed the guest in postcopy: it runs there, and
    /// a failure now is a postcopy failure, not an unknown outcome.
    postcopy_resumed: bool,
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
            deflate_through_qpl: false,
            packet_frames: config.packet_frames,
            stream_frames: config.stream_frames,
            dictionary: None,
            dictionary_report: None,
            dictionary_refresh: None,
            auto_decisions: Vec::new(),
        };
        let mut levels = Vec::new();
        for codec in compression.codecs() {
            let compressor =
                compression
                    .compressor(codec)
                    .map_err(|error| MigrationError::InvalidConfig {
                        field: "compression",
                        reason: format!("{}: {error}", config.compression),
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
                None => open_default_dsa().map_err(|reason| MigrationError::InvalidConfig {
                    field: "zero_page_detection",
                    reason: format!("dsa: {reason}"),
                })?,
            }),
            _ => None,
        };
        let stats = Arc::new(LiveStats::new());
        let cancel = CancelToken::new();
        let control = Arc::new(SourceControl::new(&config, stats.clone(), cancel.clone()));
        Ok(Self {
            config,
            compression,
            zero_offload,
            stats,
            cancel,
            control,
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

    /// A handle to query, steer, cancel and watch the migration from any
    /// thread (see [`crate::control`]).
    pub fn handle(&self) -> MigrationHandle {
        MigrationHandle::new(self.control.clone())
    }

    /// Runs the migration to `address`. On success the guest stays paused
    /// (it now runs on the destination); on failure it runs on here.
    pub fn migrate<G: SourceGuest>(
        &self,
        guest: &mut G,
        address: &Address,
    ) -> Result<MigrationStats, MigrationFailure> {
        match Connector::for_address(address) {
            Ok(connector) => self.migrate_via(guest, &connector),
            Err(error) => self.migrate_via(guest, &Unreachable(address.clone(), error.to_string())),
        }
    }

    /// Runs the migration over channels that `connector` opens: an
    /// embedder's own sockets or transport. TLS and the shared-key
    /// handshake of [`MigrationConfig::security`] run on top of them.
    pub fn migrate_via<G: SourceGuest>(
        &self,
        guest: &mut G,
        connector: &dyn Connect,
    ) -> Result<MigrationStats, MigrationFailure> {
        self.stats.start_clock();
        self.stats.set_downtime_limit(self.config.downtime_limit);
        self.control.events.status(MigrationStatus::Setup, None);
        let cpu_start = thread_cpu_seconds();
        let mut changes = GuestChanges::default();
        let mut main: Option<Channel> = None;
        let result = self.run(guest, connector, &mut changes, &mut main);
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
                if let Some(cause) = stats.downtime_exceeded_cause {
                    let expected = stats.expected_downtime_parts.unwrap_or_default();
                    tracing::warn!(
                        downtime_ms = stats.downtime,
                        limit_ms = stats.downtime_limit,
                        expected_ms = stats.expected_downtime,
                        expected_source_ms = expected.source,
                        expected_destination_ms = expected.destination,
                        cause = cause.as_str(),
                        overran = stats.downtime_overrun.map_or("", |side| side.as_str()),
                        "the downtime broke its limit"
                    );
                }
                self.control.finish(&stats);
                Ok(stats)
            }
            Err(error) => {
                if let Some(channel) = main.as_mut() {
                    if !changes.abort_sent && !changes.committed {
                        send_abort(channel, &error);
                    }
                    channel.shutdown();
                }
                let failed_in = self.stats.status();
                let status = failure_status(guest, &changes, &error);
                self.stats.set_status(status);
                let error = if failed_in == MigrationStatus::Setup {
                    name_non_tern_peer(error, &connector.address(), &self.config)
                } else {
                    error
                };
                let mut stats = self.stats.snapshot();
                stats.error_desc = Some(error.chain());
                stats.failed_in = Some(failed_in);
                self.control.finish(&stats);
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

    // long: connect, live phase and switch-over (precopy or postcopy) in one scope of threads.
    fn run<G: SourceGuest>(
        &self,
        guest: &mut G,
        connector: &dyn Connect,
        changes: &mut GuestChanges,
        main_slot: &mut Option<Channel>,
    ) -> Result<Option<DestinationStats>, MigrationError> {
        if self.config.memory_handover {
            return self.run_handover(guest, connector, changes, main_slot);
        }
        let config = &self.config;
        let address = connector.address();
        config.check_address(&address)?;
        let regions: Vec<MemoryRegion> = guest.regions().to_vec();
        let compression = dictionary::session_compression(&self.compression, config, &regions);
        let setup = connect::session_setup(&regions, guest.guest_kind(), config, &compression)?;
        let total: u64 = regions.iter().map(MemoryRegion::len).sum();
        self.stats.total.store(total, Ordering::Relaxed);
        self.stats.remaining.store(total, Ordering::Relaxed);
        let session_id = connect::random_session_id();
        let page_channels = connect::connect(
            config,
            &cancellable::CancellableConnect::new(connector, &self.cancel),
            &setup,
            session_id,
            main_slot,
            compression.dictionary.as_ref(),
        )
        .map_err(|error| self.cancelled_or(error))?;
        let postcopy_channels = postcopy_channels(config, &page_channels)?;
        let main = self.note_connected(main_slot, &address)?;
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
        let page_hashes = config
            .verify
            .compares()
            .then(|| Arc::new(PageHashes::new(&regions, true)));
        std::thread::scope(|scope| {
            let mut pipeline = Pipeline::start(
                scope,
                self.pipeline_setup(&regions, page_hashes.clone(), compression),
                page_channels,
            )?;
            // Strict rehashes everything while paused: an audit would find
            // nothing that rehash does not.
            if let Some(hashes) = &page_hashes
                && config.verify != Verify::Strict
            {
                self.spawn_auditor(scope, hashes.clone());
            }
            let result = self
                .live_phase(
                    guest,
                    main,
                    &regions,
                    changes,
                    &mut pipeline,
                    dirty_log_started,
                )
                .and_then(|live| {
                    self.enter_device_phase();
                    match live.postcopy {
                        Some(trigger) => self.switch_over_postcopy(
                            guest,
                            main,
                            changes,
                            &mut pipeline,
                            live,
                            postcopy::Handover {
                                trigger,
                                channels: postcopy_channels,
                                setup: &setup,
                                regions: &regions,
                                connector,
                                session_id,
                            },
                        ),
                        None => self.switch_over(guest, main, changes, &mut pipeline, live),
                    }
                })
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
                    if !changes.committed {
                        send_abort(main, &error);
                        changes.abort_sent = true;
                    }
                    error
                });
            if let Some(hashes) = &page_hashes {
                hashes.stop_audit();
            }
            pipeline.shut_down(result.is_err());
            result.map(Some)
        })
    }

    /// A connect that failed because the migration was cancelled is a
    /// cancellation, whatever the dial reported.
    fn cancelled_or(&self, error: MigrationError) -> MigrationError {
        if self.cancel.is_cancelled() {
            MigrationError::Cancelled
        } else {
            error
        }
    }

    /// Every channel is open: records the session's security and the setup
    /// time, and returns the main channel.
    fn note_connected<'slot>(
        &self,
        main_slot: &'slot mut Option<Channel>,
        address: &Address,
    ) -> Result<&'slot mut Channel, MigrationError> {
        let Some(main) = main_slot.as_mut() else {
            return Err(MigrationError::Internal("main channel missing".into()));
        };
        self.stats.record_security(SessionSecurity {
            transport: address.transport().to_string(),
            authenticated: main.security().authenticated(),
            tls: main.security().tls.clone(),
        });
        self.stats.set_setup_time(self.stats.started().elapsed());
        Ok(main)
    }

    /// The switch-over starts: the status and its event.
    fn enter_device_phase(&self) {
        self.stats.set_status(MigrationStatus::Device);
        self.control.events.status(MigrationStatus::Device, None);
    }

    /// Starts the thread that audits the dirty log during the live phase:
    /// it reads memory at a bounded pace and marks pages whose memory no
    /// longer matches their hash, which the switch-over hashes again.
    fn spawn_auditor<'scope>(
        &'scope self,
        scope: &'scope std::thread::Scope<'scope, '_>,
        hashes: Arc<PageHashes>,
    ) {
        let stats = self.stats.clone();
        let spawned = std::thread::Builder::new()
            .name("tern-audit".into())
            .spawn_scoped(scope, move || {
                let sent_data = || stats.normal_bytes.load(Ordering::Relaxed);
                // SAFETY: the regions stay mapped for the whole migration,
                // and the thread ends (`stop_audit`) before `run` returns.
                let cpu = unsafe {
                    hashes.audit(&AuditPace::proportional(&sent_data), &|_, _| false, &|| {
                        stats.record_audit_pass();
                    })
                };
                stats.record_cpu("digest-audit", cpu);
            });
        if let Err(error) = spawned {
            // The audit adds to the digest's reach; the migration is sound
            // without it.
            tracing::warn!(%error, "cannot start the dirty-log audit");
        }
    }

    fn pipeline_setup(
        &self,
        regions: &[MemoryRegion],
        page_hashes: Option<Arc<PageHashes>>,
        compression: CompressionSetup,
    ) -> PipelineSetup {
        let config = &self.config;
        PipelineSetup {
            regions: regions.to_vec(),
            workers: config.worker_count(),
            detection: config.zero_page_detection,
            zero_offload: self.zero_offload.clone(),
            zero_as_normal: config.zero_page_as_normal,
            compression,
            max_bandwidth: config.max_bandwidth,
            bandwidth_cap: self.control.parameters.bandwidth_cap(),
            stats: self.stats.clone(),
            cancel: self.cancel.flag(),
            page_hashes,
            dedup: config.dedup_active(),
            delta_cache_size: config.delta_cache_size,
            delta_offload: config.delta_offload.clone(),
            delta_cache_allowance: auto_delta_allowance(config, regions),
        }
    }
}

/// The memory `auto` may give a delta cache: the configured allowance, or
/// half of guest memory up to [`crate::config::DEFAULT_DELTA_CACHE_ALLOWANCE_MAX`];
/// `None` when auto does not decide it (a configured cache size, another
/// codec choice, zero-copy).
fn auto_delta_allowance(config: &MigrationConfig, regions: &[MemoryRegion]) -> Option<u64> {
    let decides = config.compression == tern_page::codec::CodecChoice::Auto
        && config.delta_cache_size == 0
        && !config.zero_copy;
    let guest: u64 = regions.iter().map(MemoryRegion::len).sum();
    decides.then(|| {
        config
            .delta_cache_allowance
            .unwrap_or_else(|| (guest / 2).min(crate::config::DEFAULT_DELTA_CACHE_ALLOWANCE_MAX))
    })
}

/// Second handles on the page channels for postcopy's background push,
/// taken before the pipeline owns them (none when postcopy is off).
fn postcopy_channels(
    config: &MigrationConfig,
    page_channels: &[crate::pipeline::PageSender],
) -> Result<Vec<Channel>, MigrationError> {
    if config.postcopy == crate::postcopy::PostcopyMode::Off {
        return Ok(Vec::new());
    }
    page_channels
        .iter()
        .map(|sender| sender.channel().try_clone())
        .collect::<Result<_, _>>()
        .map_err(|error| MigrationError::InvalidConfig {
            field: "postcopy",
            reason: format!(
                "postcopy pushes pages on second handles of the page channels, which \
                 this transport cannot give ({error}); user-space TLS cannot, kernel TLS can"
            ),
        })
}

/// A destination whose sockets could not be taken (a bad `fd:` list): each
/// connection attempt reports why, so the failure takes the usual path.
#[derive(Debug)]
struct Unreachable(Address, String);

impl Connect for Unreachable {
    fn connect(
        &self,
        _index: u16,
        _timeout: std::time::Duration,
    ) -> Result<Channel, crate::error::ChannelError> {
        Err(crate::error::ChannelError::Connect(
            self.0.to_string(),
            std::io::Error::other(self.1.clone()),
        ))
    }

    fn address(&self) -> Address {
        self.0.clone()
    }
}

/// A handshake on the main channel that failed the way a peer speaking
/// another protocol makes it fail (a frame kind or magic tern never sends,
/// silence past the handshake timeout), as [`MigrationError::NotTern`].
fn name_non_tern_peer(
    error: MigrationError,
    address: &Address,
    config: &MigrationConfig,
) -> MigrationError {
    use crate::error::ChannelError;
    use tern_wire::WireError;
    let MigrationError::Channel { index: 0, source } = &error else {
        return error;
    };
    let detail = match source {
        ChannelError::Protocol(WireError::UnknownFrameKind(kind)) => {
            let shown = char::from(*kind);
            if shown.is_ascii_graphic() {
                format!("it sent a byte tern never starts a frame with ({kind}, {shown:?})")
            } else {
                format!("it sent a byte tern never starts a frame with ({kind})")
            }
        }
        ChannelError::Protocol(WireError::BadMagic) => {
            "it answered without tern's magic bytes".to_string()
        }
        ChannelError::Protocol(WireError::FrameTooLong { .. }) => {
            "it answered with a frame no tern destination sends".to_string()
        }
        ChannelError::Timeout(_) => format!(
            "it did not answer the handshake within {} s (handshake_timeout)",
            config
                .handshake_timeout
                .min(config.io_timeout)
                .as_secs_f64()
        ),
        _ => return error,
    };
    MigrationError::NotTern {
        address: address.to_string(),
        detail,
    }
}

/// The status a failure ends in, with the guest resumed only when it runs
/// nowhere else: never after the commit.
fn failure_status<G: SourceGuest>(
    guest: &mut G,
    changes: &GuestChanges,
    error: &MigrationError,
) -> MigrationStatus {
    if changes.postcopy_resumed {
        tracing::error!(
            error = %error.chain(),
            "postcopy failed after the point of no return: the source guest stays paused"
        );
        MigrationStatus::Failed
    } else if changes.committed {
        tracing::error!(
            error = %error.chain(),
            "the switch-over's outcome is unknown: the guest stays paused"
        );
        MigrationStatus::OutcomeUnknown
    } else {
        restore_guest(guest, changes);
        if matches!(error, MigrationError::Cancelled) {
            MigrationStatus::Cancelled
        } else {
            MigrationStatus::Failed
        }
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

/// The host's DSA work queues, as `tern_dsa::DsaConfig::default()` finds
/// them: what `zero_page_detection: Dsa` uses when no offload is given.
#[cfg(feature = "dsa")]
fn open_default_dsa() -> Result<Arc<dyn tern_page::ZeroPageOffload>, String> {
    tern_dsa::open_dsa(&tern_dsa::DsaConfig::default()).map_err(|error| error.to_string())
}

/// Without the `dsa` feature there is no driver to open.
#[cfg(not(feature = "dsa"))]
fn open_default_dsa() -> Result<Arc<dyn tern_page::ZeroPageOffload>, String> {
    Err("tern-engine was built without the dsa feature (give zero_page_offload instead)".into())
}
