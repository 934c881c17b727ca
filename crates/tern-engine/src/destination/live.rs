//! The live phase: one receiver thread per page channel writes pages while
//! this thread reads the state sections and the completion on the main
//! channel.

use std::sync::atomic::Ordering;
use std::thread::{Scope, ScopedJoinHandle};
use std::time::{Duration, Instant};

use tern_page::codec::CodecId;
use tern_wire::{Complete, FrameDecoder, HEARTBEAT_INTERVAL, Message, WireError};

use super::handshake::peer_aborted;
use super::live_figures::FigureWindow;
use super::order::MainChannelState;
use super::receiver::receive_pages;
use super::shared::ReceiverShared;
use super::stream::{FrameSink, FrameSource, PageStream, read_message, read_message_within};
use crate::digest::AuditPace;
use crate::error::{ChannelError, MigrationError};
use crate::guest::{PAGE_SIZE, StateSection};
use crate::stats::thread_cpu_seconds;

/// What the source sent once every page channel ended.
pub(super) struct Delivered {
    pub(super) sections: Vec<StateSection>,
    pub(super) complete: Complete,
    /// The last iteration of each page channel.
    pub(super) final_iterations: Vec<u32>,
    /// The stale pages of a postcopy switch, when the source made one.
    pub(super) postcopy: Option<Vec<tern_wire::PageRun>>,
}

/// Runs the receivers and reads the main channel until the source's
/// `Complete`; any failure stops every thread and the first one is returned.
// long: the live phase's threads started, watched and joined in one scope, in order
pub(super) fn receive_all<P: PageStream>(
    shared: &ReceiverShared<'_>,
    main: &mut (impl FrameSource + FrameSink),
    decoder: &mut FrameDecoder,
    channels: Vec<P>,
    codecs: &[CodecId],
) -> Result<Delivered, MigrationError> {
    let shutdown_handles: Vec<P::Interrupt> = channels
        .iter()
        .enumerate()
        .map(|(index, channel)| {
            channel
                .interrupt_handle()
                .map_err(MigrationError::channel(index + 1))
        })
        .collect::<Result<_, _>>()?;
    std::thread::scope(|scope| {
        // Dropped when this closure returns, early or not, before the scope
        // joins what it started: no thread may wait on a missing page then.
        let _release = ReleaseUserfault(shared);
        let handles = spawn_receivers(scope, shared, channels, codecs)?;
        let decoders = spawn_decoders(scope, shared, codecs);
        spawn_auditor(scope, shared);
        spawn_fault_server(scope, shared);
        let main_result =
            read_main_channel(shared, main, decoder, handles.len()).and_then(|done| {
                watch_after_completion(shared, main, decoder, &handles)?;
                shared.stats.timeline.mark("receivers-ended");
                Ok(done)
            });
        let main_result = match main_result {
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
                P::interrupt(channel);
            }
        }
        let mut final_iterations = Vec::new();
        let mut receivers_failed = false;
        if let Some(hashes) = &shared.page_hashes {
            hashes.stop_audit();
        }
        // Before the joins: a failed receiver may still be writing, and must
        // not wait on a page nobody will place.
        shared.release_userfault();
        for handle in handles {
            match handle.join() {
                Ok(Ok(iteration)) => final_iterations.push(iteration),
                Ok(Err(_)) => receivers_failed = true,
                Err(_) => {
                    receivers_failed = true;
                    shared.fail(MigrationError::Internal("a receiver panicked".into()));
                }
            }
        }
        shared.stats.timeline.mark("receivers-joined");
        receivers_failed |= join_decoders(shared, decoders);
        shared.stats.timeline.mark("decoders-joined");
        match main_result {
            Some((sections, complete, postcopy)) if !receivers_failed => Ok(Delivered {
                sections,
                complete,
                final_iterations,
                postcopy,
            }),
            _ => Err(shared
                .first_failure()
                .unwrap_or_else(|| MigrationError::Internal("the migration stopped".into()))),
        }
    })
}

/// Ends the userfaultfd registration when dropped.
struct ReleaseUserfault<'s, 'a>(&'s ReceiverShared<'a>);

impl Drop for ReleaseUserfault<'_, '_> {
    fn drop(&mut self) {
        self.0.release_userfault();
    }
}

/// Starts the thread that serves page faults on guest memory registered
/// with a userfaultfd (`userfault.rs`) from anyone but the receivers. A
/// thread that cannot start ends the registration instead: fresh pages then
/// fault in as usual.
fn spawn_fault_server<'scope>(
    scope: &'scope Scope<'scope, '_>,
    shared: &'scope ReceiverShared<'_>,
) {
    let Some(userfault) = &shared.userfault else {
        return;
    };
    let spawned = std::thread::Builder::new()
        .name("tern-faults".into())
        .spawn_scoped(scope, move || {
            shared.failing_on_panic("fault server", || userfault.serve_faults());
        });
    if let Err(error) = spawned {
        tracing::warn!(%error, "cannot start the userfaultfd thread: pages fault in");
        userfault.release();
    }
}

/// Starts the thread that audits received memory while pages arrive: a
/// page changed since its hash was recorded (by something other than a
/// receiver, which records again) is hashed again at switch-over, so the
/// digest describes memory as it is, not as it was received.
fn spawn_auditor<'scope>(scope: &'scope Scope<'scope, '_>, shared: &'scope ReceiverShared<'_>) {
    let Some(hashes) = &shared.page_hashes else {
        return;
    };
    let spawned = std::thread::Builder::new()
        .name("tern-audit".into())
        .spawn_scoped(scope, move || {
            let populated = &shared.populated;
            let received_data =
                || shared.stats.normal_pages.load(Ordering::Relaxed) * PAGE_SIZE as u64;
            shared.failing_on_panic("audit", || {
                // SAFETY: guest memory stays mapped for the whole migration,
                // beyond this scope, which ends after `stop_audit`.
                unsafe {
                    hashes.audit(
                        &AuditPace::proportional(&received_data),
                        &|region, page| !populated[region].get(page),
                        &|| shared.stats.record_audit_pass(),
                    )
                }
            });
            shared.stats.timeline.mark("auditor-ended");
        });
    if let Err(error) = spawned {
        // The audit adds to the digest's reach; the migration is sound
        // without it.
        tracing::warn!(%error, "cannot start the audit of received memory");
    }
}

/// Starts the decoder pool's threads (`decode.rs`). A thread that cannot
/// start is only a lost core: the receivers decode what no decoder takes.
fn spawn_decoders<'scope>(
    scope: &'scope Scope<'scope, '_>,
    shared: &'scope ReceiverShared<'_>,
    codecs: &'scope [CodecId],
) -> Vec<ScopedJoinHandle<'scope, ()>> {
    let mut handles = Vec::new();
    for index in 0..shared.pool.threads() {
        let spawned = std::thread::Builder::new()
            .name(format!("tern-decoder-{index}"))
            .spawn_scoped(scope, move || {
                shared.failing_on_panic("decoder", || {
                    shared.pool.run_decoder(index, shared, codecs);
                });
            });
        match spawned {
            Ok(handle) => handles.push(handle),
            Err(error) => tracing::warn!(%error, "cannot start a decoder thread"),
        }
    }
    handles
}

/// Stops the decoder pool once the receivers have ended (each waited for
/// its packets to land) and joins its threads; true if one panicked.
fn join_decoders(shared: &ReceiverShared<'_>, decoders: Vec<ScopedJoinHandle<'_, ()>>) -> bool {
    shared.pool.close();
    let mut panicked = false;
    for handle in decoders {
        if handle.join().is_err() {
            panicked = true;
            shared.fail(MigrationError::Internal("a decoder panicked".into()));
        }
    }
    shared.stats.record_decoder_cpu(shared.pool.cpu_seconds());
    panicked
}

type ReceiverHandle<'scope> = ScopedJoinHandle<'scope, Result<u32, ()>>;

/// Starts one receiver thread per page channel; each records its failure
/// in `shared` (stopping the others) and its CPU time in the statistics.
fn spawn_receivers<'scope, P: PageStream + 'scope>(
    scope: &'scope Scope<'scope, '_>,
    shared: &'scope ReceiverShared<'_>,
    channels: Vec<P>,
    codecs: &'scope [CodecId],
) -> Result<Vec<ReceiverHandle<'scope>>, MigrationError> {
    let mut handles = Vec::with_capacity(channels.len());
    for (index, channel) in channels.into_iter().enumerate() {
        let handle = std::thread::Builder::new()
            .name(format!("tern-receiver-{index}"))
            .spawn_scoped(scope, move || {
                let cpu_start = thread_cpu_seconds();
                let received = shared
                    .failing_on_panic("receiver", || receive_pages(shared, index, channel, codecs));
                // A panic has failed the migration already.
                let result = match received {
                    Some(result) => result.map_err(|error| shared.fail(error)),
                    None => Err(()),
                };
                shared
                    .stats
                    .record_receiver_cpu(index, thread_cpu_seconds() - cpu_start);
                result
            })
            .map_err(MigrationError::Thread)?;
        handles.push(handle);
    }
    Ok(handles)
}

/// At most this many state sections per session: a VMM has one per device
/// and vCPU, a few dozen; the bound keeps a source from growing the
/// receiver without limit after the handshake.
pub(super) const MAX_STATE_SECTIONS: usize = 1024;
/// At most this many bytes of state-section frames in all (each is also
/// bounded by `tern_wire::MAX_SECTION_BYTES`), the one being read included,
/// so the receiver holds no more than this of state at any time.
pub(super) const MAX_STATE_BYTES: usize = 64 << 20;

/// A frame any main-channel message but a state section fits in (an abort
/// with its longest text, a completion).
const SMALL_FRAME: usize = 8 << 10;

/// A state section's frame beyond its data: header, version, the longest
/// name and the two lengths.
const SECTION_FRAMING: usize = tern_wire::FRAME_HEADER_LEN + 4 + 4 + tern_wire::MAX_NAME_LEN + 4;

/// Keeps one state section from the source: a name sent twice, or more
/// sections or bytes than a destination accepts, is refused before it is
/// kept. `state_bytes` counts the bytes kept so far.
pub(super) fn keep_state_section(
    sections: &mut Vec<StateSection>,
    state_bytes: &mut usize,
    section: tern_wire::StateSectionMsg,
) -> Result<(), MigrationError> {
    if sections.iter().any(|known| known.name == section.name) {
        return Err(MigrationError::Protocol(format!(
            "state section '{}' sent twice",
            section.name
        )));
    }
    *state_bytes = state_bytes.saturating_add(section.data.len());
    if sections.len() >= MAX_STATE_SECTIONS || *state_bytes > MAX_STATE_BYTES {
        return Err(too_much_state());
    }
    sections.push(StateSection {
        name: section.name,
        version: section.version,
        data: section.data,
    });
    Ok(())
}

pub(super) fn too_much_state() -> MigrationError {
    MigrationError::Protocol(format!(
        "more state than a destination accepts ({MAX_STATE_SECTIONS} sections, {} MiB in all)",
        MAX_STATE_BYTES >> 20
    ))
}

/// What the main channel delivered: the state, the completion, and a
/// postcopy switch's stale runs.
type MainDelivery = (Vec<StateSection>, Complete, Option<Vec<tern_wire::PageRun>>);

/// The stale runs of a postcopy switch, frame by frame.
#[derive(Default)]
struct PostcopyList {
    runs: Option<Vec<tern_wire::PageRun>>,
    ended: bool,
}

impl PostcopyList {
    /// Takes a switch frame; the runs can never outnumber guest pages
    /// (each names at least one, and none twice), which bounds the list
    /// whatever the source sends.
    fn add(&mut self, switch: tern_wire::PostcopySwitch, pages: u64) -> Result<(), MigrationError> {
        if self.ended {
            return Err(MigrationError::Protocol(
                "a postcopy switch frame after the last one".into(),
            ));
        }
        let runs = self.runs.get_or_insert_with(Vec::new);
        if (runs.len() + switch.stale.len()) as u64 > pages {
            return Err(MigrationError::Protocol(format!(
                "more stale runs than the guest's {pages} pages"
            )));
        }
        runs.extend(switch.stale);
        self.ended = !switch.more;
        Ok(())
    }

    fn finish(self) -> Result<Option<Vec<tern_wire::PageRun>>, MigrationError> {
        if self.runs.is_some() && !self.ended {
            return Err(MigrationError::Protocol(
                "the postcopy switch's last frame never came".into(),
            ));
        }
        Ok(self.runs)
    }
}

/// Reads refreshed dictionaries and state sections until `Complete`
/// arrives on the main channel, refusing anything out of order.
fn read_main_channel(
    shared: &ReceiverShared<'_>,
    main: &mut (impl FrameSource + FrameSink),
    decoder: &mut FrameDecoder,
    receivers: usize,
) -> Result<MainDelivery, MigrationError> {
    let mut sections: Vec<StateSection> = Vec::new();
    let mut postcopy = PostcopyList::default();
    let mut state_bytes = 0usize;
    let mut state = MainChannelState::Live;
    let mut heartbeat = Heartbeat::new(receivers);
    loop {
        wait_for_main(shared, main, decoder, &mut heartbeat)?;
        // Only state sections are large: the rest of the budget (of
        // section data, plus one frame's framing) bounds the next frame, so
        // a section past the total is refused at its header, and one
        // section of the largest size fits.
        let budget = MAX_STATE_BYTES
            .saturating_sub(state_bytes)
            .saturating_add(SECTION_FRAMING)
            .max(SMALL_FRAME);
        let message = read_message_within(main, decoder, budget).map_err(|error| match error {
            ChannelError::Protocol(WireError::FieldTooLong { field: "frame", .. }) => {
                too_much_state()
            }
            other => MigrationError::channel(0)(other),
        })?;
        state = state
            .next(message.kind())
            .map_err(MigrationError::Protocol)?;
        match message {
            Message::StateSection(section) => {
                keep_state_section(&mut sections, &mut state_bytes, section)?;
            }
            Message::Dictionary(dictionary) => shared.dictionaries.receive(dictionary)?,
            Message::PostcopySwitch(switch) => {
                postcopy.add(switch, shared.setup.total_bytes() / PAGE_SIZE as u64)?;
            }
            Message::Complete(complete) => {
                shared.stats.timeline.origin("complete-read");
                shared.set_final_iteration(complete.final_iteration);
                return Ok((sections, complete, postcopy.finish()?));
            }
            Message::Abort(abort) => return Err(peer_aborted(abort)),
            other => {
                // The state machine lets nothing else through.
                return Err(MigrationError::Protocol(format!(
                    "unexpected {:?} on the main channel",
                    other.kind()
                )));
            }
        }
    }
}

/// How long the main thread waits on the main channel between looks at the
/// receivers once the source's completion is in: the guest is paused then,
/// and a receiver's end must not wait for a longer poll to be noticed.
const AFTER_COMPLETION_POLL: Duration = Duration::from_millis(1);

/// After the source's completion, and until every receiver has ended, the
/// main channel may carry only an abort: the source waits for the verdict.
fn watch_after_completion<T>(
    shared: &ReceiverShared<'_>,
    main: &mut impl FrameSource,
    decoder: &mut FrameDecoder,
    receivers: &[ScopedJoinHandle<'_, T>],
) -> Result<(), MigrationError> {
    while !receivers.iter().all(ScopedJoinHandle::is_finished) {
        if shared.failed() {
            // The receivers have stopped or are stopping; they say why.
            return Ok(());
        }
        if !main
            .wait_readable(AFTER_COMPLETION_POLL)
            .map_err(MigrationError::channel(0))?
        {
            continue;
        }
        let message = match read_message(main, decoder) {
            Ok(message) => message,
            // A source that closes its side after its completion breaks no
            // order; sending the verdict will tell whether it is gone.
            Err(ChannelError::Closed) => return Ok(()),
            Err(error) => return Err(MigrationError::channel(0)(error)),
        };
        MainChannelState::Completed
            .next(message.kind())
            .map_err(MigrationError::Protocol)?;
        if let Message::Abort(abort) = message {
            return Err(peer_aborted(abort));
        }
    }
    Ok(())
}

/// When the next heartbeat is due. Heartbeats are due on a fixed schedule
/// (one per [`HEARTBEAT_INTERVAL`] since the live phase began), not an
/// interval after the previous one, so a late one is followed by the ones
/// missed and the source can count them against its own clock. Each
/// carries what the destination measured (`live_figures.rs`), among it how
/// late this thread woke for the heartbeat: its scheduling delay.
struct Heartbeat {
    next: Instant,
    figures: FigureWindow,
    /// How late the previous heartbeat went out: the figure sent is the
    /// larger of two, so one lucky wake-up does not hide a loaded host.
    previous_lateness: Duration,
    /// Passes applied the source has been told of.
    passes_told: u32,
}

impl Heartbeat {
    fn new(receivers: usize) -> Self {
        Self {
            next: Instant::now() + HEARTBEAT_INTERVAL,
            figures: FigureWindow::new(receivers),
            previous_lateness: Duration::ZERO,
            passes_told: 0,
        }
    }

    /// Tells the source of the passes applied since it was last told, with
    /// the latest one's lag behind the link: it pauses its guest only when
    /// this side is within one pass of it, and counts the lag in its
    /// downtime estimate.
    fn tell_passes(
        &mut self,
        main: &mut impl FrameSink,
        shared: &ReceiverShared<'_>,
    ) -> Result<(), MigrationError> {
        let applied = shared.last_pass_applied();
        if applied.passes > self.passes_told {
            tracing::debug!(
                passes = applied.passes,
                lag_ms = f64::from(applied.lag_micros) / 1e3,
                "pass applied"
            );
            main.send_message(&Message::PassApplied(applied))
                .map_err(MigrationError::channel(0))?;
            self.passes_told = applied.passes;
        }
        Ok(())
    }

    /// How long until the next heartbeat is due.
    fn due_in(&self) -> Duration {
        self.next.saturating_duration_since(Instant::now())
    }

    /// Sends the heartbeats that are due.
    fn beat(
        &mut self,
        main: &mut impl FrameSink,
        stats: &super::ReceiveStats,
    ) -> Result<(), MigrationError> {
        while let Some(lateness) = Instant::now().checked_duration_since(self.next) {
            let figures = self
                .figures
                .next(&stats.placing, lateness.max(self.previous_lateness));
            self.previous_lateness = lateness;
            main.send_message(&Message::Heartbeat(figures))
                .map_err(MigrationError::channel(0))?;
            self.next += HEARTBEAT_INTERVAL;
        }
        Ok(())
    }
}

/// How often the main thread looks for passes applied to tell the source
/// (it is woken by the main channel only): a source about to switch over
/// waits for the word, so it should not wait for a long poll. A wake-up
/// that finds nothing costs a few microseconds.
const PASS_POLL: Duration = Duration::from_millis(5);

/// Waits for the main channel, which carries little from the source during
/// the live phase (refreshed dictionaries), looking at the failure flag and sending heartbeats
/// meanwhile.
fn wait_for_main(
    shared: &ReceiverShared<'_>,
    main: &mut (impl FrameSource + FrameSink),
    decoder: &mut FrameDecoder,
    heartbeat: &mut Heartbeat,
) -> Result<(), MigrationError> {
    // Until the page channels end, their receivers time out on a silent
    // source; after, only this wait can.
    let mut pages_ended_at: Option<Instant> = None;
    loop {
        heartbeat.beat(main, shared.stats)?;
        heartbeat.tell_passes(main, shared)?;
        if shared.pages_ended()
            && pages_ended_at.get_or_insert_with(Instant::now).elapsed() > shared.io_timeout()
        {
            return Err(MigrationError::Channel {
                index: 0,
                source: ChannelError::Timeout("the source's state after its last pages"),
            });
        }
        if shared.failed() {
            if shared.cancel.is_cancelled() {
                return Err(MigrationError::Cancelled);
            }
            // The source closes its page channels right after telling why
            // on this one: prefer its reason to the closed channels. A
            // protocol violation a receiver found needs no explanation.
            if !shared.failed_on_protocol()
                && main
                    .wait_readable(Duration::from_millis(500))
                    .unwrap_or(false)
                && let Ok(Message::Abort(abort)) = read_message(main, decoder)
            {
                return Err(peer_aborted(abort));
            }
            return Err(MigrationError::Internal("a page channel failed".into()));
        }
        // Woken when the next heartbeat is due, so its lateness is this
        // thread's scheduling delay, not the poll's granularity; and often
        // enough that a pass applied is told while the source decides.
        if main
            .wait_readable(PASS_POLL.min(heartbeat.due_in()))
            .map_err(MigrationError::channel(0))?
        {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::destination::ReceiveStats;
    use crate::destination::test_memory::AnonymousMemory;
    use crate::source::CancelToken;
    use crate::transport::Segment;

    /// A main channel on which the source keeps quiet, as it does while
    /// pages flow: the destination's wait for it has no deadline of its own
    /// then (the page channels' receivers have theirs). A real socket whose
    /// peer sends nothing.
    struct QuietMain {
        socket: std::net::TcpStream,
        _peer: std::net::TcpStream,
    }

    impl QuietMain {
        fn new() -> Self {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let peer = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (socket, _) = listener.accept().unwrap();
            Self {
                socket,
                _peer: peer,
            }
        }
    }

    impl FrameSource for QuietMain {
        fn wait_readable(&self, timeout: Duration) -> Result<bool, ChannelError> {
            self.socket
                .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
                .unwrap();
            // Nothing ever comes: the read waits out its timeout.
            Ok(self.socket.peek(&mut [0u8; 1]).is_ok())
        }

        fn read_exact(&mut self, _: &mut [u8]) -> Result<(), ChannelError> {
            Err(ChannelError::Closed)
        }

        unsafe fn read_scattered(&mut self, _: &[Segment]) -> Result<(), ChannelError> {
            Err(ChannelError::Closed)
        }
    }

    impl FrameSink for QuietMain {
        fn send_message(&mut self, _: &Message) -> Result<(), ChannelError> {
            Ok(())
        }
    }

    /// A page channel whose reading panics, as a bug on the receive path
    /// would.
    struct PanickingChannel;

    impl FrameSource for PanickingChannel {
        fn wait_readable(&self, _: Duration) -> Result<bool, ChannelError> {
            panic!("a bug on the receive path");
        }

        fn read_exact(&mut self, _: &mut [u8]) -> Result<(), ChannelError> {
            panic!("a bug on the receive path");
        }

        unsafe fn read_scattered(&mut self, _: &[Segment]) -> Result<(), ChannelError> {
            panic!("a bug on the receive path");
        }
    }

    impl PageStream for PanickingChannel {
        type Interrupt = ();

        fn interrupt_handle(&self) -> Result<(), ChannelError> {
            Ok(())
        }

        fn interrupt(_: &()) {}
    }

    #[test]
    fn a_receiver_that_panics_fails_the_migration_with_its_message() {
        let memory = AnonymousMemory::new(16);
        let (setup, regions) = (memory.setup(5), [memory.region(5)]);
        let (stats, cancel) = (ReceiveStats::default(), CancelToken::new());
        let shared = ReceiverShared::new(
            &setup,
            &regions,
            1,
            &stats,
            Duration::from_secs(30),
            &cancel,
        )
        .with_decode_threads(1);
        // Without the failure the panic sets, the quiet main channel is
        // waited on for good: the watchdog ends the test as failed.
        let result = tern_test_skip::wait::exit_after_deadline(
            "the receiver's panic ends the migration",
            || {
                receive_all(
                    &shared,
                    &mut QuietMain::new(),
                    &mut FrameDecoder::new(),
                    vec![PanickingChannel],
                    &[CodecId::Zstd],
                )
            },
        );
        let error = result
            .err()
            .expect("a migration whose receiver panicked fails");
        assert!(
            error
                .to_string()
                .contains("the destination's receiver thread panicked: a bug on the receive path"),
            "{error}"
        );
    }
}
