//! The destination side: accept the channels, write received pages straight
//! into guest memory, verify, restore and resume.

mod decode;
mod dictionary;
mod handle;
mod handover;
pub(crate) mod handshake;
mod in_memory;
mod landing_pool;
mod live;
mod live_figures;
mod order;
mod populate;
mod postcopy;
mod receiver;
mod recover;
mod reuse;
mod shared;
mod stream;
mod switch_over;
#[cfg(test)]
pub(crate) mod test_memory;
mod vmm_config;
// The userfaultfd wrapper lives with the fault service, which shares it.
use crate::fault::uffd as userfault;

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tern_wire::{Abort, FrameDecoder, Message, OutcomeStats, SessionSetup};

use crate::config::ReceiveConfig;
use crate::control::{CancelToken, GuestState};
use crate::error::MigrationError;
use crate::guest::{DestinationGuest, GuestError, PAGE_SIZE};
use crate::stats::{
    DestinationStats, DigestComparison, MigrationStatus, SessionSecurity, thread_cpu_seconds,
};
use crate::transport::{Channel, Listener};

use handle::DestinationControl;
pub use handle::ReceiveHandle;
use handshake::Greeted;
use shared::ReceiverShared;

/// How often blocked threads look at the failure flag.
const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// Where a destination is, for progress display.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
#[non_exhaustive]
pub enum ReceivePhase {
    /// Waiting for the source to connect and announce the guest.
    Waiting = 0,
    /// The guest's layout is known (`total_bytes`); receiving pages.
    Receiving = 1,
    /// All pages and state are in; comparing digests, restoring, resuming.
    Verifying = 2,
    /// The guest runs here.
    Resumed = 3,
    /// The migration failed or was cancelled.
    Failed = 4,
    /// Verified and committed; the guest is kept paused for the embedder
    /// ([`ReceiveConfig::keep_paused`]).
    Paused = 5,
    /// The guest runs here, postcopy lost its connection, and the pages
    /// it lacks wait for the source's reconnection (docs/postcopy.md,
    /// "Recovery").
    PostcopyPaused = 6,
    /// The guest runs here and fetches the pages it lacks from the
    /// source: the postcopy commit is past (docs/postcopy.md).
    PostcopyActive = 7,
    /// A paused postcopy reconnects: the source's resume was welcomed,
    /// its page channels and the missing pages are on their way.
    PostcopyRecover = 8,
}

impl ReceivePhase {
    fn from_u8(value: u8) -> Self {
        match value {
            0 => Self::Waiting,
            1 => Self::Receiving,
            2 => Self::Verifying,
            3 => Self::Resumed,
            5 => Self::Paused,
            6 => Self::PostcopyPaused,
            7 => Self::PostcopyActive,
            8 => Self::PostcopyRecover,
            _ => Self::Failed,
        }
    }

    /// The name users see.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Waiting => "waiting",
            Self::Receiving => "receiving",
            Self::Verifying => "verifying",
            Self::Resumed => "resumed",
            Self::Failed => "failed",
            Self::Paused => "paused",
            Self::PostcopyPaused => "postcopy-paused",
            Self::PostcopyActive => "postcopy-active",
            Self::PostcopyRecover => "postcopy-recover",
        }
    }
}

/// Live counters of the destination, readable while [`Destination::receive`]
/// runs (through the accessor methods) for progress display.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct ReceiveStats {
    phase: AtomicU8,
    /// The phase before it became `Failed`.
    failed_in: AtomicU8,
    /// Bytes read from all channels.
    pub received: AtomicU64,
    /// Zero pages received.
    pub zero_pages: AtomicU64,
    /// Zero pages written over data received earlier.
    pub zero_pages_cleared: AtomicU64,
    /// Pages received with data.
    pub normal_pages: AtomicU64,
    /// Highest iteration all channels have finished.
    pub iteration: AtomicU64,
    /// Guest memory size, once known.
    pub total: AtomicU64,
    /// Complete passes the audit of received memory made.
    audit_passes: AtomicU64,
    /// CPU nanoseconds of the main thread.
    main_cpu: AtomicU64,
    /// CPU nanoseconds of each receiver thread, by receiver.
    receiver_cpu: Mutex<Vec<u64>>,
    /// Connections closed before or instead of joining the session.
    refused_connections: AtomicU64,
    /// Why the latest of them was closed.
    last_refusal: Mutex<Option<String>>,
    /// CPU nanoseconds of the decoder threads, together.
    decoder_cpu: AtomicU64,
    /// The digests the switch-over compared, once it compared them.
    digest_comparison: Mutex<Option<DigestComparison>>,
    /// The receivers' busy time and pages, for the heartbeats' figures.
    placing: live_figures::PlacingMeter,
    /// The receivers' lag behind the link, told with each pass applied.
    lag: live_figures::PassLagMeter,
    /// The switch-over's steps (`switch_over_timeline.rs`).
    pub(crate) timeline: crate::switch_over_timeline::TimelineRecorder,
}

impl ReceiveStats {
    /// Where the destination is.
    pub fn phase(&self) -> ReceivePhase {
        ReceivePhase::from_u8(self.phase.load(Ordering::Acquire))
    }

    fn set_phase(&self, phase: ReceivePhase) {
        let previous = ReceivePhase::from_u8(self.phase.swap(phase as u8, Ordering::AcqRel));
        if phase == ReceivePhase::Failed && previous != ReceivePhase::Failed {
            self.failed_in.store(previous as u8, Ordering::Relaxed);
        }
    }

    /// The phase the reception was in when it failed.
    pub(crate) fn failed_in(&self) -> ReceivePhase {
        ReceivePhase::from_u8(self.failed_in.load(Ordering::Relaxed))
    }

    /// Bytes read from all page channels so far.
    pub fn received_bytes(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Pages received so far (with data, and zero pages), counting a page
    /// again each time an iteration resends it.
    pub fn pages(&self) -> u64 {
        self.normal_pages.load(Ordering::Relaxed) + self.zero_pages.load(Ordering::Relaxed)
    }

    /// Dirty iterations every channel has finished (syncs passed); the
    /// first (0) sends every page once, so while this is 0, [`Self::pages`]
    /// of [`Self::total_pages`] is the progress of the first copy.
    pub fn iterations_done(&self) -> u64 {
        self.iteration.load(Ordering::Relaxed)
    }

    /// Guest memory size in bytes, 0 until the source's setup arrives.
    pub fn total_bytes(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// Guest memory size in pages.
    pub fn total_pages(&self) -> u64 {
        self.total_bytes() / PAGE_SIZE as u64
    }

    /// Complete passes the audit made over the memory received so far (a
    /// page changed after it landed is found by the first pass that starts
    /// after the change).
    pub fn audit_passes(&self) -> u64 {
        self.audit_passes.load(Ordering::Relaxed)
    }

    /// Connections refused so far: failed handshakes (TLS, key, first
    /// message), handshakes past their deadline, and sessions or channels
    /// this destination does not accept. Each was also logged.
    pub fn refused_connections(&self) -> u64 {
        self.refused_connections.load(Ordering::Relaxed)
    }

    /// The one-line reason the latest refused connection was closed, as
    /// logged; an embedder without a log shows it from here.
    pub fn last_refusal(&self) -> Option<String> {
        self.last_refusal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Logs a refused connection and keeps its reason.
    pub(crate) fn record_refusal(&self, reason: String) {
        tracing::warn!("{reason}");
        self.refused_connections.fetch_add(1, Ordering::Relaxed);
        *self.last_refusal.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason);
    }

    /// Counts a refused connection without logging it (one of a flood,
    /// which is logged as a summary).
    pub(crate) fn count_refusal(&self) {
        self.refused_connections.fetch_add(1, Ordering::Relaxed);
    }

    fn record_audit_pass(&self) {
        self.audit_passes.fetch_add(1, Ordering::Relaxed);
    }

    fn record_main_cpu(&self, seconds: f64) {
        self.main_cpu.fetch_add(nanos(seconds), Ordering::Relaxed);
    }

    /// CPU seconds the decoder pool's threads used (decompression of
    /// packets the receivers handed off), known once the pages have all
    /// landed. Not in the outcome message, whose wire format has no field
    /// for it yet.
    pub fn decoder_cpu_seconds(&self) -> f64 {
        self.decoder_cpu.load(Ordering::Relaxed) as f64 / 1e9
    }

    fn record_decoder_cpu(&self, seconds: f64) {
        self.decoder_cpu
            .fetch_add(nanos(seconds), Ordering::Relaxed);
    }

    fn record_receiver_cpu(&self, receiver: usize, seconds: f64) {
        let mut cpu = self.receiver_cpu.lock().unwrap_or_else(|e| e.into_inner());
        if cpu.len() <= receiver {
            cpu.resize(receiver + 1, 0);
        }
        cpu[receiver] += nanos(seconds);
    }

    /// The figures so far, as the final report gives them (digest time 0
    /// until verified; the decoders' CPU time once the pages have landed).
    pub(crate) fn live_destination_stats(&self) -> DestinationStats {
        let mut stats = DestinationStats::from_wire(&self.snapshot(Duration::ZERO));
        stats
            .cpu_seconds
            .insert("decoders".into(), self.decoder_cpu_seconds());
        stats
    }

    /// Records the digests the switch-over compared.
    fn set_digest_comparison(&self, comparison: DigestComparison) {
        *self
            .digest_comparison
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(comparison);
    }

    /// The digests the switch-over compared, if it did.
    pub fn digest_comparison(&self) -> Option<DigestComparison> {
        *self
            .digest_comparison
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The statistics the outcome message carries.
    fn snapshot(&self, digest_time: Duration) -> OutcomeStats {
        OutcomeStats {
            received_bytes: self.received.load(Ordering::Relaxed),
            zero_pages: self.zero_pages.load(Ordering::Relaxed),
            zero_pages_cleared: self.zero_pages_cleared.load(Ordering::Relaxed),
            normal_pages: self.normal_pages.load(Ordering::Relaxed),
            digest_micros: u64::try_from(digest_time.as_micros()).unwrap_or(u64::MAX),
            main_cpu_nanos: self.main_cpu.load(Ordering::Relaxed),
            receiver_cpu_nanos: self
                .receiver_cpu
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }
    }
}

fn nanos(seconds: f64) -> u64 {
    // CPU time is never negative; an overflow saturates.
    crate::numeric::saturating_u64_from_f64(seconds * 1e9)
}

/// A completed incoming migration: the guest, restored and running (or
/// paused, with [`ReceiveConfig::keep_paused`]).
#[derive(Debug)]
#[non_exhaustive]
pub struct Received<G> {
    /// The guest, resumed (or paused, handed over: see `resumed`).
    pub guest: G,
    /// Whether the destination resumed the guest; false when
    /// [`ReceiveConfig::keep_paused`] handed it over paused, for the
    /// embedder to resume.
    pub resumed: bool,
    /// The destination's statistics.
    pub stats: DestinationStats,
    /// The session setup the source sent.
    pub setup: SessionSetup,
    /// How the session's channels were carried and protected, as the main
    /// channel's handshake established it (the same fields as the
    /// source's report).
    pub security: SessionSecurity,
    /// The source's digest and this side's, compared equal before the
    /// guest resumed; `None` when the session did not verify (the source
    /// asked for no digest).
    pub digest_comparison: Option<DigestComparison>,
}

/// Receives one migration.
#[derive(Debug)]
pub struct Destination {
    config: ReceiveConfig,
    stats: Arc<ReceiveStats>,
    cancel: CancelToken,
    control: Arc<DestinationControl>,
}

impl Destination {
    /// The statistics of a received migration as this side knows them:
    /// the outcome message's, plus the decoder threads' CPU time under
    /// `decoders` (the message has no field for it).
    fn local_stats(&self, outcome: &OutcomeStats) -> DestinationStats {
        let mut stats = DestinationStats::from_wire(outcome);
        stats
            .cpu_seconds
            .insert("decoders".into(), self.stats.decoder_cpu_seconds());
        stats.switch_over_timeline = self.stats.timeline.report();
        stats
    }

    /// A destination with these settings.
    pub fn new(config: ReceiveConfig) -> Self {
        let stats = Arc::new(ReceiveStats::default());
        let cancel = CancelToken::new();
        let control = Arc::new(DestinationControl::new(stats.clone(), cancel.clone()));
        Self {
            config,
            stats,
            cancel,
            control,
        }
    }

    /// A handle to query, cancel and watch the reception from any thread
    /// (see [`crate::control`]).
    pub fn handle(&self) -> ReceiveHandle {
        ReceiveHandle::new(self.control.clone())
    }

    /// Live counters.
    pub fn stats(&self) -> Arc<ReceiveStats> {
        self.stats.clone()
    }

    /// A token that cancels the reception.
    pub fn cancel_token(&self) -> CancelToken {
        self.cancel.clone()
    }

    /// Accepts a migration on `listener`. `make_guest` builds the guest
    /// (paused, memory zero) once the source's setup is known; its regions
    /// must match the setup's.
    pub fn receive<G, F>(
        &self,
        listener: &Listener,
        make_guest: F,
    ) -> Result<Received<G>, MigrationError>
    where
        G: DestinationGuest,
        F: FnOnce(&SessionSetup) -> Result<G, GuestError>,
    {
        self.receive_with_vmm_config(listener, |setup, _| make_guest(setup))
    }

    /// As [`Destination::receive`], and `make_guest` is also given the
    /// source VMM's opaque configuration
    /// ([`crate::MigrationConfig::vmm_config`], at most
    /// [`ReceiveConfig::max_vmm_config`] bytes; empty when the source sent
    /// none), to build the guest from.
    pub fn receive_with_vmm_config<G, F>(
        &self,
        listener: &Listener,
        make_guest: F,
    ) -> Result<Received<G>, MigrationError>
    where
        G: DestinationGuest,
        F: FnOnce(&SessionSetup, &[u8]) -> Result<G, GuestError>,
    {
        self.control.events.status(MigrationStatus::Setup, None);
        let result = self.receive_session(listener, |handshakes, main, decoder, hello, cpu| {
            self.run(handshakes, main, decoder, hello, make_guest, cpu)
        });
        self.record_outcome(&result);
        result
    }

    /// Keeps the outcome for the handle's report and sends the final event.
    fn record_outcome<G>(&self, result: &Result<Received<G>, MigrationError>) {
        let mut outcome = self.control.outcome();
        let status = match result {
            Ok(received) => {
                // Evidence, not configuration: the digests this side compared.
                outcome.digest_verified = received
                    .digest_comparison
                    .is_some_and(|comparison| comparison.matched());
                outcome.guest = Some(if received.resumed {
                    GuestState::Running
                } else {
                    GuestState::Paused
                });
                outcome.stats = Some(received.stats.clone());
                outcome.security = Some(received.security.clone());
                MigrationStatus::Completed
            }
            Err(error) => {
                outcome.failed_in = Some(handle::phase_status(self.stats.failed_in()));
                outcome.error_desc = Some(error.chain());
                outcome.stats = Some(self.stats.live_destination_stats());
                if self.cancel.is_cancelled() || matches!(error, MigrationError::Cancelled) {
                    MigrationStatus::Cancelled
                } else {
                    MigrationStatus::Failed
                }
            }
        };
        outcome.status = Some(status);
        let error_desc = outcome.error_desc.clone();
        // Under the outcome's lock: a report that says the status never
        // comes before the history holds its event.
        self.control.events.status(status, error_desc);
        drop(outcome);
    }

    /// Accepts the main channel and runs the session on it with `run`
    /// (a copy or a hand-over); a failure is told to the source.
    fn receive_session<G, R>(
        &self,
        listener: &Listener,
        run: R,
    ) -> Result<Received<G>, MigrationError>
    where
        R: FnOnce(
            &mut handshake::Handshakes<'_>,
            &mut Channel,
            &mut FrameDecoder,
            Message,
            f64,
        ) -> Result<Received<G>, MigrationError>,
    {
        let cpu_start = thread_cpu_seconds();
        self.check_policy(listener)
            .inspect_err(|_| self.stats.set_phase(ReceivePhase::Failed))?;
        // One accept loop for the whole session: connections accepted while
        // the main channel is greeted (an embedder's sockets, handed over
        // all at once) keep their handshakes for the page channels.
        let mut handshakes = handshake::Handshakes::new(listener, &self.config, &self.stats);
        let handshake::Arrived {
            channel: mut main,
            mut decoder,
            message: hello,
        } = self
            .accept_main(&mut handshakes)
            .and_then(|mut arrived| {
                arrived
                    .channel
                    .set_timeouts(self.config.io_timeout)
                    .map_err(MigrationError::channel(0))?;
                Ok(arrived)
            })
            .inspect_err(|_| self.stats.set_phase(ReceivePhase::Failed))?;
        let security = SessionSecurity {
            transport: listener
                .local_address()
                .map_or("unknown", |address| address.transport())
                .to_string(),
            authenticated: main.security().authenticated(),
            tls: main.security().tls.clone(),
        };
        let result =
            run(&mut handshakes, &mut main, &mut decoder, hello, cpu_start).map(|received| {
                Received {
                    security,
                    ..received
                }
            });
        if let Err(error) = &result {
            self.stats.set_phase(ReceivePhase::Failed);
            if !matches!(error, MigrationError::PeerAborted { .. }) {
                let _ = main.send_message(&Message::Abort(Abort {
                    reason: error.abort_reason(),
                    message: error.chain(),
                }));
            }
            // Returned to the caller, who reports it.
            tracing::debug!(error = %error.chain(), "incoming migration failed");
        }
        result
    }

    fn run<G, F>(
        &self,
        handshakes: &mut handshake::Handshakes<'_>,
        main: &mut Channel,
        decoder: &mut FrameDecoder,
        hello: Message,
        make_guest: F,
        cpu_start: f64,
    ) -> Result<Received<G>, MigrationError>
    where
        G: DestinationGuest,
        F: FnOnce(&SessionSetup, &[u8]) -> Result<G, GuestError>,
    {
        // Sent right after the hello, before the welcome: the guest is
        // built from both.
        let vmm_config = vmm_config::receive(main, decoder, &hello, self.config.max_vmm_config)?;
        let Greeted {
            setup,
            session_id,
            codecs,
            mut guest,
            regions,
        } = self.greet(main, hello, |setup| make_guest(setup, &vmm_config))?;
        self.control.events.status(MigrationStatus::Active, None);
        let dictionaries = dictionary::receive_dictionaries(main, decoder, &setup)?;
        let channels =
            self.accept_page_channels(handshakes, main, decoder, session_id, setup.channel_count)?;
        tracing::info!(channels = channels.len(), "all channels connected");
        let shared = ReceiverShared::new(
            &setup,
            &regions,
            channels.len(),
            &self.stats,
            self.config.io_timeout,
            &self.cancel,
        )
        .with_qpl_path(self.config.qpl_path)
        .with_decode_threads(self.config.decode_threads())
        .with_dictionaries(dictionaries)
        .with_pass_events(&self.control.events)
        .with_userfault();
        // Second handles for a postcopy push, should the source switch to
        // it (none on a channel that cannot give one: postcopy is refused).
        let push_channels: Vec<Channel> = channels
            .iter()
            .filter_map(|channel| channel.try_clone().ok())
            .collect();
        self.stats.timeline.clear();
        let delivered = live::receive_all(&shared, main, decoder, channels, &codecs)?;
        self.stats.timeline.mark("live-phase-ended");
        self.control.events.status(MigrationStatus::Device, None);
        if delivered.postcopy.is_some() {
            let report = self.postcopy_switch_over(
                &shared,
                recover::Session {
                    session_id,
                    identity: main.security().peer_identity.clone(),
                    channel_count: setup.channel_count,
                    handshakes,
                },
                main,
                decoder,
                &mut guest,
                delivered,
                push_channels,
                &codecs,
                cpu_start,
            )?;
            let mut stats = self.local_stats(&self.stats.snapshot(Duration::ZERO));
            stats.postcopy = Some(report);
            return Ok(Received {
                resumed: !self.config.keep_paused,
                guest,
                stats,
                setup,
                security: SessionSecurity::default(),
                digest_comparison: self.stats.digest_comparison(),
            });
        }
        let stats = self.switch_over(&shared, main, decoder, &mut guest, delivered, cpu_start)?;
        Ok(Received {
            resumed: !self.config.keep_paused,
            guest,
            stats: self.local_stats(&stats),
            setup,
            security: SessionSecurity::default(),
            digest_comparison: self.stats.digest_comparison(),
        })
    }
}
