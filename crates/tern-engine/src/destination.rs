//! The destination side: accept the channels, write received pages straight
//! into guest memory, verify, restore and resume.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::Xxh3;

use tern_wire::{
    Abort, AbortReason, DigestAlgorithm, FrameKind, Message, Outcome, PageEntry, PageKind,
    PagesHeader, SessionSetup, Welcome, decode_page_table,
};

use tern_page::codec::{CodecId, PageDecompressor};

use crate::config::ReceiveConfig;
use crate::digest::{add_region, page_hash, zero_page_hash};
use crate::error::{ChannelError, MigrationError};
use crate::guest::{DestinationGuest, GuestError, MemoryRegion, PAGE_SIZE, StateSection};
use crate::source::CancelToken;
use crate::stats::{DestinationStats, millis, thread_cpu_seconds};
use crate::transport::{Channel, Listener, Segment};

/// How often blocked threads look at the failure flag.
const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// Where a destination is, for progress display.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
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
}

impl ReceivePhase {
    fn from_u8(value: u8) -> Self {
        match value {
            0 => Self::Waiting,
            1 => Self::Receiving,
            2 => Self::Verifying,
            3 => Self::Resumed,
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
        }
    }
}

/// Live counters of the destination, readable while [`Destination::receive`]
/// runs (through the accessor methods) for progress display.
#[derive(Debug, Default)]
pub struct ReceiveStats {
    phase: AtomicU8,
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
    cpu: Mutex<std::collections::BTreeMap<String, f64>>,
}

impl ReceiveStats {
    /// Where the destination is.
    pub fn phase(&self) -> ReceivePhase {
        ReceivePhase::from_u8(self.phase.load(Ordering::Acquire))
    }

    fn set_phase(&self, phase: ReceivePhase) {
        self.phase.store(phase as u8, Ordering::Release);
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

    fn record_cpu(&self, thread: &str, seconds: f64) {
        let mut map = self.cpu.lock().unwrap_or_else(|e| e.into_inner());
        *map.entry(thread.to_string()).or_insert(0.0) += seconds;
    }

    fn snapshot(&self, digest_time: Duration) -> DestinationStats {
        DestinationStats {
            received: self.received.load(Ordering::Relaxed),
            zero_pages: self.zero_pages.load(Ordering::Relaxed),
            zero_pages_cleared: self.zero_pages_cleared.load(Ordering::Relaxed),
            normal_pages: self.normal_pages.load(Ordering::Relaxed),
            digest_time: millis(digest_time),
            cpu_seconds: self.cpu.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        }
    }
}

/// A completed incoming migration: the guest, restored and running.
#[derive(Debug)]
pub struct Received<G> {
    /// The guest, resumed.
    pub guest: G,
    /// The destination's statistics.
    pub stats: DestinationStats,
    /// The session setup the source sent.
    pub setup: SessionSetup,
}

/// Receives one migration.
#[derive(Debug)]
pub struct Destination {
    config: ReceiveConfig,
    stats: Arc<ReceiveStats>,
    cancel: CancelToken,
}

impl Destination {
    /// A destination with these settings.
    pub fn new(config: ReceiveConfig) -> Self {
        Self {
            config,
            stats: Arc::new(ReceiveStats::default()),
            cancel: CancelToken::new(),
        }
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
        let cpu_start = thread_cpu_seconds();
        let mut main = self
            .accept_main(listener)
            .and_then(|main| {
                main.set_timeouts(self.config.io_timeout)
                    .map_err(MigrationError::channel(0))?;
                Ok(main)
            })
            .inspect_err(|_| self.stats.set_phase(ReceivePhase::Failed))?;
        let result = self.run(listener, &mut main, make_guest, cpu_start);
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
        listener: &Listener,
        main: &mut Channel,
        make_guest: F,
        cpu_start: f64,
    ) -> Result<Received<G>, MigrationError>
    where
        G: DestinationGuest,
        F: FnOnce(&SessionSetup) -> Result<G, GuestError>,
    {
        let hello = match main.read_message().map_err(MigrationError::channel(0))? {
            Message::Hello(hello) => hello,
            Message::Abort(abort) => return Err(peer_aborted(abort)),
            other => {
                return Err(MigrationError::Protocol(format!(
                    "expected a hello on the main channel, got {:?}",
                    other.kind()
                )));
            }
        };
        let setup = hello.setup;
        let session_id = hello.handshake.session_id;
        let codecs = announced_codecs(setup.codecs)?;
        let mut guest = make_guest(&setup).map_err(MigrationError::guest("create guest"))?;
        check_guest_kind(&setup.guest_kind, guest.guest_kind())?;
        let regions: Vec<MemoryRegion> = guest.regions().to_vec();
        check_layout(&setup, &regions)?;
        self.stats
            .total
            .store(setup.total_bytes(), Ordering::Relaxed);
        self.stats.set_phase(ReceivePhase::Receiving);
        main.send_message(&Message::Welcome(Welcome {
            session_id,
            channel_index: 0,
        }))
        .map_err(MigrationError::channel(0))?;

        let channels =
            self.accept_page_channels(listener, main, session_id, setup.channel_count)?;
        tracing::info!(channels = channels.len(), "all channels connected");

        let shared = ReceiverShared {
            setup: &setup,
            regions: &regions,
            populated: regions
                .iter()
                .map(|region| AtomicBitmap::new(region.pages()))
                .collect(),
            page_hashes: (setup.digest != DigestAlgorithm::None).then(|| {
                regions
                    .iter()
                    .map(|region| {
                        (0..region.pages())
                            .map(|_| AtomicU64::new(zero_page_hash()))
                            .collect()
                    })
                    .collect()
            }),
            barrier: SyncBarrier::new(channels.len()),
            failed: AtomicBool::new(false),
            first_failure: Mutex::new(None),
            stats: &self.stats,
            io_timeout: self.config.io_timeout,
            cancel: &self.cancel,
        };
        let shutdown_handles: Vec<Channel> = channels
            .iter()
            .enumerate()
            .map(|(index, channel)| {
                channel
                    .try_clone()
                    .map_err(MigrationError::channel(index + 1))
            })
            .collect::<Result<_, _>>()?;

        let (sections, complete, final_iterations) = std::thread::scope(|scope| {
            let mut handles = Vec::with_capacity(channels.len());
            for (index, channel) in channels.into_iter().enumerate() {
                let shared = &shared;
                let codecs = &codecs;
                let handle = std::thread::Builder::new()
                    .name(format!("tern-receiver-{index}"))
                    .spawn_scoped(scope, move || {
                        let cpu_start = thread_cpu_seconds();
                        let result = receive_pages(shared, index, channel, codecs)
                            .map_err(|error| shared.fail(error));
                        shared.stats.record_cpu(
                            &format!("receiver-{index}"),
                            thread_cpu_seconds() - cpu_start,
                        );
                        result
                    })
                    .map_err(MigrationError::Thread)?;
                handles.push(handle);
            }
            let main_result = match read_main_channel(&shared, main) {
                Ok(done) => Some(done),
                // A peer abort on the main channel explains whatever the
                // receivers saw next.
                Err(error @ MigrationError::PeerAborted { .. }) => {
                    shared.fail_first(error);
                    None
                }
                Err(error) => {
                    shared.fail(error);
                    None
                }
            };
            if main_result.is_none() {
                for channel in &shutdown_handles {
                    channel.shutdown();
                }
            }
            let mut final_iterations = Vec::new();
            let mut receivers_failed = false;
            for handle in handles {
                match handle.join() {
                    Ok(Ok(iteration)) => final_iterations.push(iteration),
                    Ok(Err(_)) => receivers_failed = true,
                    Err(_) => {
                        receivers_failed = true;
                        shared.fail(MigrationError::Protocol("a receiver panicked".into()));
                    }
                }
            }
            let (sections, complete) = match main_result {
                Some(done) if !receivers_failed => done,
                _ => {
                    return Err(shared.first_failure().unwrap_or_else(|| {
                        MigrationError::Protocol("the migration stopped".into())
                    }));
                }
            };
            Ok((sections, complete, final_iterations))
        })?;

        if final_iterations
            .iter()
            .any(|&iteration| iteration != complete.final_iteration)
        {
            return Err(MigrationError::Protocol(format!(
                "channels ended at iterations {final_iterations:?}, the source says {}",
                complete.final_iteration
            )));
        }
        if sections.len() != complete.sections as usize {
            return Err(MigrationError::Protocol(format!(
                "received {} state sections, the source sent {}",
                sections.len(),
                complete.sections
            )));
        }

        tracing::debug!("all pages and state received");
        self.stats.set_phase(ReceivePhase::Verifying);
        let digest_started = Instant::now();
        let digest = match &shared.page_hashes {
            Some(page_hashes) => {
                let mut hasher = Xxh3::new();
                for (region, hashes) in regions.iter().zip(page_hashes) {
                    add_region(
                        &mut hasher,
                        region.id(),
                        hashes.iter().map(|hash| hash.load(Ordering::Relaxed)),
                    );
                }
                hasher.digest128()
            }
            None => 0,
        };
        let digest_time = digest_started.elapsed();
        if setup.digest != DigestAlgorithm::None && digest != complete.digest {
            let error = MigrationError::DigestMismatch {
                source_digest: complete.digest,
                destination: digest,
            };
            let _ = main.send_message(&Message::Outcome(Outcome {
                verified: false,
                digest,
                detail: error.to_string(),
                stats: Vec::new(),
            }));
            return Err(error);
        }
        // Auto-converge throttling belongs to the migration, not to the
        // guest's life on the destination.
        let restored = guest
            .restore_state(&sections)
            .map_err(MigrationError::guest("restore state"))
            .and_then(|()| {
                guest
                    .set_throttle(0)
                    .map_err(MigrationError::guest("throttle"))
            })
            .and_then(|()| guest.resume().map_err(MigrationError::guest("resume")));
        if let Err(error) = restored {
            let _ = main.send_message(&Message::Outcome(Outcome {
                verified: false,
                digest,
                detail: error.chain(),
                stats: Vec::new(),
            }));
            return Err(error);
        }
        self.stats
            .record_cpu("main", thread_cpu_seconds() - cpu_start);
        let stats = self.stats.snapshot(digest_time);
        let stats_json = serde_json::to_vec(&stats).unwrap_or_default();
        main.send_message(&Message::Outcome(Outcome {
            verified: true,
            digest,
            detail: String::new(),
            stats: stats_json,
        }))
        .map_err(MigrationError::channel(0))?;
        self.stats.set_phase(ReceivePhase::Resumed);
        Ok(Received {
            guest,
            stats,
            setup,
        })
    }

    /// Waits for the source's main channel, looking at the cancel token
    /// meanwhile.
    fn accept_main(&self, listener: &Listener) -> Result<Channel, MigrationError> {
        let deadline = Instant::now() + self.config.accept_timeout;
        loop {
            if self.cancel.is_cancelled() {
                return Err(MigrationError::Cancelled);
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(MigrationError::Channel {
                    index: 0,
                    source: ChannelError::Timeout("the source to connect"),
                });
            }
            match listener.accept_timeout(remaining.min(POLL_INTERVAL)) {
                Ok(channel) => return Ok(channel),
                Err(ChannelError::Timeout(_)) => continue,
                Err(error) => return Err(MigrationError::channel(0)(error)),
            }
        }
    }

    /// Accepts the page channels. The source may give up meanwhile (a page
    /// channel it cannot set up, a cancel): it says so on the main channel,
    /// which is therefore watched too, so the reason ends the wait at once.
    fn accept_page_channels(
        &self,
        listener: &Listener,
        main: &mut Channel,
        session_id: u64,
        count: u16,
    ) -> Result<Vec<Channel>, MigrationError> {
        let mut slots: Vec<Option<Channel>> = (0..count).map(|_| None).collect();
        let mut seen = HashSet::new();
        let deadline = Instant::now() + self.config.accept_timeout;
        while seen.len() < usize::from(count) {
            if self.cancel.is_cancelled() {
                return Err(MigrationError::Cancelled);
            }
            if main
                .wait_readable(Duration::ZERO)
                .map_err(MigrationError::channel(0))?
            {
                return Err(match main.read_message() {
                    Ok(Message::Abort(abort)) => peer_aborted(abort),
                    Ok(other) => MigrationError::Protocol(format!(
                        "expected page channels, got {:?} on the main channel",
                        other.kind()
                    )),
                    Err(error) => MigrationError::channel(0)(error),
                });
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(MigrationError::Channel {
                    index: seen.len() + 1,
                    source: ChannelError::Timeout("the source's page channels"),
                });
            }
            let mut channel = match listener.accept_timeout(remaining.min(POLL_INTERVAL)) {
                Ok(channel) => channel,
                Err(ChannelError::Timeout(_)) => continue,
                Err(error) => return Err(MigrationError::channel(0)(error)),
            };
            let _ = channel.set_timeouts(self.config.io_timeout);
            let verdict = match channel.read_message() {
                Ok(Message::ChannelHello(hello)) => {
                    let index = hello.handshake.channel_index;
                    if hello.handshake.session_id != session_id {
                        Err(format!(
                            "session {:#x} is not the migration in progress ({session_id:#x})",
                            hello.handshake.session_id
                        ))
                    } else if index == 0 || index > count {
                        Err(format!("channel index {index} is outside 1..={count}"))
                    } else if !seen.insert(index) {
                        Err(format!("channel {index} connected twice"))
                    } else {
                        Ok(index)
                    }
                }
                Ok(other) => Err(format!("expected a channel hello, got {:?}", other.kind())),
                Err(error) => Err(error.to_string()),
            };
            match verdict {
                Ok(index) => {
                    channel
                        .send_message(&Message::Welcome(Welcome {
                            session_id,
                            channel_index: index,
                        }))
                        .map_err(MigrationError::channel(usize::from(index)))?;
                    slots[usize::from(index) - 1] = Some(channel);
                }
                Err(reason) => {
                    // A stray or broken connection must not end the migration.
                    tracing::warn!("rejected a connection: {reason}");
                    let _ = channel.send_message(&Message::Abort(Abort {
                        reason: AbortReason::ProtocolError,
                        message: reason,
                    }));
                }
            }
        }
        Ok(slots.into_iter().flatten().collect())
    }
}

fn peer_aborted(abort: Abort) -> MigrationError {
    MigrationError::PeerAborted {
        reason: abort.reason,
        message: abort.message,
    }
}

/// A destination refuses a guest of another kind than its own, unless one
/// side does not say what its kind is.
fn check_guest_kind(offered: &str, expected: &str) -> Result<(), MigrationError> {
    if offered.is_empty() || expected.is_empty() || offered == expected {
        return Ok(());
    }
    Err(MigrationError::GuestKindMismatch {
        expected: expected.to_string(),
        offered: offered.to_string(),
    })
}

/// The codecs the hello announces, each of which this build must decode.
fn announced_codecs(bits: u8) -> Result<Vec<CodecId>, MigrationError> {
    (1..8u8)
        .filter(|id| bits & (1 << id) != 0)
        .map(|id| {
            CodecId::from_wire(id).map_err(|_| {
                MigrationError::Incompatible(format!(
                    "the source compresses with codec {id}, which this destination cannot decode"
                ))
            })
        })
        .collect()
}

/// The destination's regions must be exactly the source's.
fn check_layout(setup: &SessionSetup, regions: &[MemoryRegion]) -> Result<(), MigrationError> {
    if setup.regions.len() != regions.len() {
        return Err(MigrationError::Incompatible(format!(
            "the source has {} memory regions, the destination {}",
            setup.regions.len(),
            regions.len()
        )));
    }
    for (theirs, ours) in setup.regions.iter().zip(regions) {
        if theirs.id != ours.id()
            || theirs.len != ours.len()
            || theirs.guest_addr != ours.guest_addr()
        {
            return Err(MigrationError::Incompatible(format!(
                "source region {} at {:#x} has {} bytes; destination region {} at {:#x} has {}",
                theirs.id,
                theirs.guest_addr,
                theirs.len,
                ours.id(),
                ours.guest_addr(),
                ours.len()
            )));
        }
    }
    Ok(())
}

struct ReceiverShared<'a> {
    setup: &'a SessionSetup,
    regions: &'a [MemoryRegion],
    /// Pages that hold received data: a zero page must be written only over
    /// these (other pages are still fresh zero memory, and touching them
    /// would cost a page fault for nothing).
    populated: Vec<AtomicBitmap>,
    /// The hash of each page as written, read back from guest memory right
    /// after each write, so that the digest at the end costs no second pass
    /// over memory. `None` when the session does not verify.
    page_hashes: Option<Vec<Vec<AtomicU64>>>,
    barrier: SyncBarrier,
    failed: AtomicBool,
    /// The first failure; later ones are its consequences. Taken once per
    /// failure, never on the per-page path.
    first_failure: Mutex<Option<MigrationError>>,
    stats: &'a ReceiveStats,
    io_timeout: Duration,
    cancel: &'a CancelToken,
}

impl ReceiverShared<'_> {
    /// Records `error` if it is the first failure, and stops everyone.
    fn fail(&self, error: MigrationError) {
        {
            let mut slot = self.first_failure.lock().unwrap_or_else(|e| e.into_inner());
            if slot.is_none() {
                *slot = Some(error);
            }
        }
        self.stop();
    }

    /// Records `error` as the cause, replacing what was recorded.
    fn fail_first(&self, error: MigrationError) {
        *self.first_failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(error);
        self.stop();
    }

    fn stop(&self) {
        self.failed.store(true, Ordering::Release);
        self.barrier.abort();
    }

    fn first_failure(&self) -> Option<MigrationError> {
        self.first_failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire) || self.cancel.is_cancelled()
    }

    fn region_index(&self, id: u32) -> Option<usize> {
        self.setup.regions.iter().position(|region| region.id == id)
    }

    /// Waits for data, looking at the failure flag meanwhile.
    fn wait_for_data(&self, channel: &Channel, index: usize) -> Result<(), MigrationError> {
        let started = Instant::now();
        loop {
            if self.failed() {
                return Err(if self.cancel.is_cancelled() {
                    MigrationError::Cancelled
                } else {
                    MigrationError::Protocol("another channel failed".into())
                });
            }
            if channel
                .wait_readable(POLL_INTERVAL)
                .map_err(MigrationError::channel(index))?
            {
                return Ok(());
            }
            if started.elapsed() > self.io_timeout {
                return Err(MigrationError::Channel {
                    index,
                    source: ChannelError::Timeout("data from the source"),
                });
            }
        }
    }
}

/// Reads state sections until `Complete` arrives on the main channel.
fn read_main_channel(
    shared: &ReceiverShared<'_>,
    main: &mut Channel,
) -> Result<(Vec<StateSection>, tern_wire::Complete), MigrationError> {
    let mut sections: Vec<StateSection> = Vec::new();
    loop {
        // The main channel is silent during the whole live phase.
        loop {
            if shared.failed() {
                if shared.cancel.is_cancelled() {
                    return Err(MigrationError::Cancelled);
                }
                // The source closes its page channels right after telling
                // why on this one: prefer its reason to the closed channels.
                if main
                    .wait_readable(Duration::from_millis(500))
                    .unwrap_or(false)
                    && let Ok(Message::Abort(abort)) = main.read_message()
                {
                    return Err(peer_aborted(abort));
                }
                return Err(MigrationError::Protocol("a page channel failed".into()));
            }
            if main
                .wait_readable(POLL_INTERVAL)
                .map_err(MigrationError::channel(0))?
            {
                break;
            }
        }
        match main.read_message().map_err(MigrationError::channel(0))? {
            Message::StateSection(section) => {
                if sections.iter().any(|known| known.name == section.name) {
                    return Err(MigrationError::Protocol(format!(
                        "state section '{}' sent twice",
                        section.name
                    )));
                }
                sections.push(StateSection {
                    name: section.name,
                    version: section.version,
                    data: section.data,
                });
            }
            Message::Complete(complete) => return Ok((sections, complete)),
            Message::Abort(abort) => return Err(peer_aborted(abort)),
            other => {
                return Err(MigrationError::Protocol(format!(
                    "unexpected {:?} on the main channel",
                    other.kind()
                )));
            }
        }
    }
}

/// One page channel's receiver. Returns the final iteration.
fn receive_pages(
    shared: &ReceiverShared<'_>,
    index: usize,
    mut channel: Channel,
    codecs: &[CodecId],
) -> Result<u32, MigrationError> {
    let channel_index = index + 1;
    let mut decompressors: [Option<PageDecompressor>; 8] = Default::default();
    for &codec in codecs {
        decompressors[codec as usize] = Some(PageDecompressor::new(codec).map_err(|error| {
            MigrationError::Incompatible(format!("cannot decode {}: {error}", codec.name()))
        })?);
    }
    // Compressed payloads land here, then decode straight into their page.
    let mut compressed = vec![0u8; tern_wire::MAX_PAGES_PER_PACKET * PAGE_SIZE];
    let on_channel = MigrationError::channel(channel_index);
    let mut entries: Vec<PageEntry> = Vec::with_capacity(tern_wire::MAX_PAGES_PER_PACKET);
    let mut table = vec![0u8; tern_wire::MAX_PAGES_PER_PACKET * PageEntry::ENCODED_LEN];
    let mut segments: Vec<Segment> = Vec::with_capacity(tern_wire::MAX_PAGES_PER_PACKET);
    let mut iteration: u32 = 0;
    loop {
        shared.wait_for_data(&channel, channel_index)?;
        let header = channel
            .read_frame_header()
            .map_err(MigrationError::channel(channel_index))?;
        let body_len = header.body_len as usize;
        match header.kind {
            FrameKind::Pages => {
                let mut head = [0u8; PagesHeader::ENCODED_LEN];
                channel
                    .read_exact(&mut head)
                    .map_err(MigrationError::channel(channel_index))?;
                let (pages, payload_len) = PagesHeader::decode(&head, body_len, shared.setup)
                    .map_err(|e| MigrationError::channel(channel_index)(e.into()))?;
                if pages.iteration != iteration {
                    return Err(MigrationError::Protocol(format!(
                        "channel {channel_index}: packet of iteration {} during iteration {iteration}",
                        pages.iteration
                    )));
                }
                let table = &mut table[..pages.table_len()];
                channel
                    .read_exact(table)
                    .map_err(MigrationError::channel(channel_index))?;
                decode_page_table(&pages, table, payload_len, shared.setup, &mut entries)
                    .map_err(|e| MigrationError::channel(channel_index)(e.into()))?;
                let region_index = shared
                    .region_index(pages.region_id)
                    .ok_or(MigrationError::Protocol("region vanished".into()))?;
                let region = &shared.regions[region_index];
                segments.clear();
                let mut compressed_len = 0;
                for entry in &entries {
                    match entry.kind {
                        PageKind::Raw => {
                            let ptr =
                                region
                                    .page_ptr(u64::from(entry.page_index))
                                    .ok_or_else(|| {
                                        MigrationError::Protocol("page outside its region".into())
                                    })?;
                            segments.push(Segment {
                                ptr,
                                len: PAGE_SIZE,
                            });
                        }
                        PageKind::Compressed => {
                            // The table was validated: each compressed page
                            // is shorter than a page, and there are at most
                            // 128 of them, so this stays inside the buffer.
                            let len = entry.encoded_len as usize;
                            segments.push(Segment {
                                ptr: compressed[compressed_len..compressed_len + len].as_mut_ptr(),
                                len,
                            });
                            compressed_len += len;
                        }
                        PageKind::Zero => {}
                    }
                }
                // SAFETY: every segment is either a whole page inside the
                // region (bounds-checked by `page_ptr`) — within one
                // iteration each page arrives on exactly one channel, so no
                // other thread touches it during the read — or a slice of
                // this receiver's own compressed-payload buffer.
                unsafe { channel.read_scattered(&segments) }
                    .map_err(MigrationError::channel(channel_index))?;
                let populated = &shared.populated[region_index];
                let hashes = shared.page_hashes.as_ref().map(|all| &all[region_index]);
                let mut zero = 0;
                let mut cleared = 0;
                let mut normal = 0;
                let mut compressed_offset = 0;
                for entry in &entries {
                    let page = u64::from(entry.page_index);
                    if entry.kind == PageKind::Compressed {
                        let len = entry.encoded_len as usize;
                        let input = &compressed[compressed_offset..compressed_offset + len];
                        compressed_offset += len;
                        let decompressor = decompressors[usize::from(pages.codec)]
                            .as_mut()
                            .ok_or_else(|| {
                                MigrationError::Protocol(format!(
                                    "channel {channel_index}: codec {} was not announced",
                                    pages.codec
                                ))
                            })?;
                        let ptr = region.page_ptr(page).ok_or_else(|| {
                            MigrationError::Protocol("page outside its region".into())
                        })?;
                        // SAFETY: `ptr` is a whole page inside the region
                        // (bounds-checked by `page_ptr`), owned by this
                        // receiver for this iteration; the decoder writes
                        // exactly one page or fails.
                        unsafe { decompressor.decompress_page(input, ptr) }.map_err(|error| {
                            MigrationError::Protocol(format!(
                                "channel {channel_index}: page {page} of region {}: {error}",
                                pages.region_id
                            ))
                        })?;
                    }
                    match entry.kind {
                        PageKind::Raw | PageKind::Compressed => {
                            populated.set(page);
                            normal += 1;
                            if let Some(hashes) = hashes {
                                let ptr = region.page_ptr(page).ok_or_else(|| {
                                    MigrationError::Protocol("page outside its region".into())
                                })?;
                                // SAFETY: a whole page inside the region,
                                // written by this receiver just now and owned
                                // by it for this iteration.
                                let hash = unsafe { page_hash(ptr) };
                                hashes[page as usize].store(hash, Ordering::Relaxed);
                            }
                        }
                        PageKind::Zero => {
                            zero += 1;
                            if let Some(hashes) = hashes {
                                hashes[page as usize].store(zero_page_hash(), Ordering::Relaxed);
                            }
                            if populated.get(page) {
                                let ptr = region.page_ptr(page).ok_or_else(|| {
                                    MigrationError::Protocol("page outside its region".into())
                                })?;
                                // SAFETY: a whole page inside the region,
                                // owned by this receiver for this iteration.
                                unsafe { std::ptr::write_bytes(ptr, 0, PAGE_SIZE) };
                                populated.clear(page);
                                cleared += 1;
                            }
                        }
                    }
                }
                let stats = shared.stats;
                stats.received.fetch_add(
                    (tern_wire::FRAME_HEADER_LEN + body_len) as u64,
                    Ordering::Relaxed,
                );
                stats.zero_pages.fetch_add(zero, Ordering::Relaxed);
                stats
                    .zero_pages_cleared
                    .fetch_add(cleared, Ordering::Relaxed);
                stats.normal_pages.fetch_add(normal, Ordering::Relaxed);
            }
            FrameKind::Sync | FrameKind::Abort => {
                let mut body = vec![0u8; body_len];
                channel
                    .read_exact(&mut body)
                    .map_err(MigrationError::channel(channel_index))?;
                match Message::decode(header.kind, &body)
                    .map_err(|e| on_channel_err(channel_index, e))?
                {
                    Message::Sync(sync) => {
                        shared.stats.received.fetch_add(
                            (tern_wire::FRAME_HEADER_LEN + body_len) as u64,
                            Ordering::Relaxed,
                        );
                        if sync.iteration != iteration {
                            return Err(MigrationError::Protocol(format!(
                                "channel {channel_index}: sync for iteration {} during iteration {iteration}",
                                sync.iteration
                            )));
                        }
                        shared.barrier.wait()?;
                        if index == 0 {
                            shared
                                .stats
                                .iteration
                                .store(u64::from(iteration) + 1, Ordering::Relaxed);
                        }
                        if sync.last {
                            return Ok(iteration);
                        }
                        iteration += 1;
                    }
                    Message::Abort(abort) => return Err(peer_aborted(abort)),
                    _ => unreachable!("decoded kind matches the frame kind"),
                }
            }
            other => {
                return Err(on_channel(ChannelError::Protocol(
                    tern_wire::WireError::Unexpected {
                        got: other,
                        expected: "pages or a sync on a page channel",
                    },
                )));
            }
        }
    }
}

fn on_channel_err(index: usize, error: tern_wire::WireError) -> MigrationError {
    MigrationError::channel(index)(error.into())
}

/// A bitmap threads update concurrently without locks.
struct AtomicBitmap {
    words: Vec<AtomicU64>,
}

impl AtomicBitmap {
    fn new(pages: u64) -> Self {
        Self {
            words: (0..pages.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn set(&self, page: u64) {
        if let Some(word) = self.words.get((page / 64) as usize) {
            word.fetch_or(1 << (page % 64), Ordering::Relaxed);
        }
    }

    fn clear(&self, page: u64) {
        if let Some(word) = self.words.get((page / 64) as usize) {
            word.fetch_and(!(1 << (page % 64)), Ordering::Relaxed);
        }
    }

    fn get(&self, page: u64) -> bool {
        self.words
            .get((page / 64) as usize)
            .is_some_and(|word| word.load(Ordering::Relaxed) & (1 << (page % 64)) != 0)
    }
}

/// The per-iteration barrier between receivers. It can be aborted, so a
/// failed channel never leaves the others waiting forever. It is crossed
/// once per iteration, not per page, so a mutex is fine here.
struct SyncBarrier {
    parties: usize,
    state: Mutex<(usize, u64)>,
    condvar: Condvar,
    aborted: AtomicBool,
}

impl SyncBarrier {
    fn new(parties: usize) -> Self {
        Self {
            parties,
            state: Mutex::new((0, 0)),
            condvar: Condvar::new(),
            aborted: AtomicBool::new(false),
        }
    }

    fn abort(&self) {
        self.aborted.store(true, Ordering::Release);
        self.condvar.notify_all();
    }

    fn wait(&self) -> Result<(), MigrationError> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let generation = state.1;
        state.0 += 1;
        if state.0 == self.parties {
            state.0 = 0;
            state.1 += 1;
            self.condvar.notify_all();
            return Ok(());
        }
        while state.1 == generation {
            if self.aborted.load(Ordering::Acquire) {
                return Err(MigrationError::Protocol("another channel failed".into()));
            }
            state = self
                .condvar
                .wait_timeout(state, POLL_INTERVAL)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }
}
