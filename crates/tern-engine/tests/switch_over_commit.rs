//! The switch-over commit (docs/protocol.md, "Switch-over") with a fault at
//! every step, and the deadlines of the live phase: the guest never runs on
//! both hosts, is never left paused without a bounded wait, and a silent or
//! trickling peer is detected.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use common::*;
use tern_engine::{
    Channel, Destination, DeviceState, GuestControl, GuestError, GuestMemory, Listener,
    MemoryRegion, MigrationError, MigrationStatus, Source, StateSection,
};
use tern_synthetic::SyntheticGuest;
use tern_wire::{
    ChannelHello, Complete, DigestAlgorithm, Handshake, Hello, Message, Outcome, OutcomeStats,
    Ready, RegionInfo, SessionSetup, Sync, Welcome,
};

/// What a fake destination does once the source's completion is in.
#[derive(Clone, Copy, Debug)]
enum AtSwitchOver {
    /// Says nothing more (a destination stopped or cut off).
    Silent,
    /// Says ready, reads the commit, then says nothing more.
    ReadyThenSilent,
    /// Says ready, reads the commit, then says it could not resume.
    ReadyThenRefuse,
    /// Says ready, reads the commit and acknowledges: a good destination.
    ReadyThenAcknowledge,
    /// Says ready, reads the commit, then aborts (it failed before
    /// resuming).
    ReadyThenAbort,
    /// Says ready with a digest other than the source's (memory that
    /// arrived differently), then reads whatever comes: the source must
    /// not commit.
    ReadyWithAnotherDigest,
    /// Refuses instead of saying ready, with the source's digest (another
    /// reason, such as a state it cannot restore) or with another digest.
    RefuseWithDigest { same: bool },
}

/// What the fake destination saw on the main channel after the completion.
type Seen = Vec<Message>;

/// A destination that speaks the handshake, drains the page channels,
/// reads the main channel up to the completion and then behaves as told.
/// It sends heartbeats only when `heartbeats` is set.
fn fake_destination(
    listener: Listener,
    channels: u16,
    heartbeats: bool,
    at_switch_over: AtSwitchOver,
) -> JoinHandle<Seen> {
    std::thread::spawn(move || {
        let accept = || listener.accept_timeout(DEADLINE).expect("accept");
        let mut main = accept();
        main.set_timeouts(DEADLINE).unwrap();
        let Message::Hello(hello) = main.read_message().unwrap() else {
            panic!("no hello")
        };
        let session_id = hello.handshake.session_id;
        main.send_message(&Message::Welcome(Welcome {
            session_id,
            channel_index: 0,
        }))
        .unwrap();
        let drains: Vec<_> = (0..channels)
            .map(|_| {
                let mut channel = accept();
                let Message::ChannelHello(hello) = channel.read_message().unwrap() else {
                    panic!("no channel hello")
                };
                channel
                    .send_message(&Message::Welcome(Welcome {
                        session_id,
                        channel_index: hello.handshake.channel_index,
                    }))
                    .unwrap();
                // Drains until the source closes the channel (the last
                // partial block is of no interest).
                std::thread::spawn(move || {
                    let mut sink = vec![0u8; 1 << 16];
                    while channel.read_exact(&mut sink).is_ok() {}
                })
            })
            .collect();
        let seen = match read_until_complete(&mut main, heartbeats) {
            Ok(complete) => switch_over(&mut main, complete, at_switch_over),
            Err(before) => before,
        };
        drop(main);
        for drain in drains {
            join_within(drain, "a page channel's drain");
        }
        seen
    })
}

/// Reads the main channel until the source's completion, sending a
/// heartbeat about twice a second when asked to. A source that gives up
/// first: what it said instead (its abort), as `Err`.
fn read_until_complete(main: &mut Channel, heartbeats: bool) -> Result<Complete, Seen> {
    loop {
        if heartbeats && !main.wait_readable(Duration::from_millis(500)).unwrap() {
            main.send_message(&Message::Heartbeat(Default::default()))
                .unwrap();
            continue;
        }
        match main.read_message() {
            Ok(Message::Complete(complete)) => return Ok(complete),
            Ok(Message::StateSection(_)) => {}
            Ok(other) => return Err(vec![other]),
            Err(_) => return Err(Vec::new()),
        }
    }
}

fn switch_over(main: &mut Channel, complete: Complete, at: AtSwitchOver) -> Seen {
    let mut seen = Vec::new();
    if matches!(at, AtSwitchOver::Silent) {
        // Whatever the source says next (its abort), until it closes.
        while let Ok(message) = main.read_message() {
            seen.push(message);
        }
        return seen;
    }
    if let AtSwitchOver::RefuseWithDigest { same } = at {
        main.send_message(&Message::Outcome(Outcome {
            verified: false,
            digest: if same {
                complete.digest
            } else {
                complete.digest ^ 1
            },
            detail: "cannot restore the device state".into(),
            stats: OutcomeStats::default(),
        }))
        .unwrap();
        while let Ok(message) = main.read_message() {
            seen.push(message);
        }
        return seen;
    }
    if matches!(at, AtSwitchOver::ReadyWithAnotherDigest) {
        main.send_message(&Message::Ready(Ready {
            digest: complete.digest ^ 1,
        }))
        .unwrap();
        while let Ok(message) = main.read_message() {
            seen.push(message);
        }
        return seen;
    }
    main.send_message(&Message::Ready(Ready {
        digest: complete.digest,
    }))
    .unwrap();
    let commit = main.read_message().expect("an answer to ready");
    seen.push(commit);
    match at {
        AtSwitchOver::ReadyThenSilent => {
            while let Ok(message) = main.read_message() {
                seen.push(message);
            }
        }
        AtSwitchOver::ReadyThenRefuse | AtSwitchOver::ReadyThenAcknowledge => {
            let verified = matches!(at, AtSwitchOver::ReadyThenAcknowledge);
            main.send_message(&Message::Outcome(Outcome {
                verified,
                digest: complete.digest,
                detail: if verified {
                    String::new()
                } else {
                    "cannot start the vCPUs".into()
                },
                stats: OutcomeStats::default(),
            }))
            .unwrap();
        }
        AtSwitchOver::ReadyThenAbort => {
            main.send_message(&Message::Abort(tern_wire::Abort {
                reason: tern_wire::AbortReason::GuestError,
                message: "restoring the vCPUs failed".into(),
            }))
            .unwrap();
        }
        AtSwitchOver::Silent
        | AtSwitchOver::ReadyWithAnotherDigest
        | AtSwitchOver::RefuseWithDigest { .. } => unreachable!(),
    }
    seen
}

/// A paused 8 MiB guest migrated to a fake destination with a short
/// switch-over timeout.
fn migrate_to_fake(at: AtSwitchOver) -> (tern_synthetic::SyntheticGuest, MigrationResult, Seen) {
    let (listener, address) = tcp_listener();
    let fake = fake_destination(listener, 1, true, at);
    let mut guest = guest(8 * MIB, 0);
    let mut config = migration_config(1);
    config.switch_over_timeout = Duration::from_secs(1);
    let result = exit_after_deadline("the source's migration to a fake destination", || {
        Source::new(config).unwrap().migrate(&mut guest, &address)
    });
    let seen = join_within(fake, "the fake destination");
    (guest, result, seen)
}

type MigrationResult = Result<tern_engine::MigrationStats, tern_engine::MigrationFailure>;

/// The failure `result` must be, with `status` and `needle` in its cause.
fn expect_failure(
    result: MigrationResult,
    status: MigrationStatus,
    needle: &str,
) -> tern_engine::MigrationFailure {
    let failure = result.expect_err("the migration must fail");
    assert_eq!(failure.stats.status, status);
    assert!(
        failure.error.chain().contains(needle),
        "'{needle}' not in: {}",
        failure.error.chain()
    );
    failure
}

#[test]
fn no_ready_in_time_resumes_the_source_and_tells_the_destination() {
    let (guest, result, seen) = migrate_to_fake(AtSwitchOver::Silent);
    let failure = expect_failure(result, MigrationStatus::Failed, "switch-over answer");
    // Paused past the 1 s switch-over timeout: reported, not 0.
    assert!(
        failure.stats.downtime > 0,
        "the downtime of a failed switch-over is reported: {}",
        failure.stats.downtime
    );
    eprintln!(
        "no ready in time (switch-over timeout 1 s): failed, downtime reported {} ms",
        failure.stats.downtime
    );
    assert!(guest.is_running(), "without a commit the source resumes");
    assert!(
        matches!(seen.first(), Some(Message::Abort(_))),
        "the destination is told, so it never resumes: {seen:?}"
    );
}

#[test]
fn a_commit_without_acknowledgement_is_an_unknown_outcome_and_the_guest_stays_paused() {
    let (guest, result, seen) = migrate_to_fake(AtSwitchOver::ReadyThenSilent);
    assert!(matches!(seen.first(), Some(Message::Commit)), "{seen:?}");
    assert_eq!(
        seen.len(),
        1,
        "nothing, no abort, follows the commit: {seen:?}"
    );
    let failure = expect_failure(result, MigrationStatus::OutcomeUnknown, "outcome unknown");
    assert!(
        matches!(failure.error, MigrationError::OutcomeUnknown(_)),
        "{}",
        failure.error.chain()
    );
    // Paused until the acknowledgement's deadline at least: reported, not 0.
    assert!(
        failure.stats.downtime > 0,
        "the downtime of an unknown outcome is reported: {}",
        failure.stats.downtime
    );
    eprintln!(
        "a commit without acknowledgement: outcome-unknown, downtime reported {} ms",
        failure.stats.downtime
    );
    assert!(
        !guest.is_running(),
        "after a commit the source never resumes by itself"
    );
}

#[test]
fn a_destination_that_could_not_resume_after_the_commit_gives_the_guest_back() {
    let (guest, result, _) = migrate_to_fake(AtSwitchOver::ReadyThenRefuse);
    expect_failure(result, MigrationStatus::Failed, "cannot start the vCPUs");
    assert!(guest.is_running(), "the guest runs nowhere else");
}

#[test]
fn an_abort_after_the_commit_means_the_destination_did_not_resume() {
    let (guest, result, seen) = migrate_to_fake(AtSwitchOver::ReadyThenAbort);
    assert!(matches!(seen.first(), Some(Message::Commit)), "{seen:?}");
    let failure = expect_failure(
        result,
        MigrationStatus::Failed,
        "the destination did not resume the guest",
    );
    assert!(
        failure.error.chain().contains("restoring the vCPUs failed"),
        "{}",
        failure.error.chain()
    );
    assert!(
        guest.is_running(),
        "the guest runs nowhere else: it resumes"
    );
}

#[test]
fn ready_commit_acknowledge_completes() {
    let (guest, result, seen) = migrate_to_fake(AtSwitchOver::ReadyThenAcknowledge);
    let stats = result.unwrap_or_else(|failure| panic!("{}", failure.error.chain()));
    assert_eq!(stats.status, MigrationStatus::Completed);
    assert!(matches!(seen.first(), Some(Message::Commit)), "{seen:?}");
    assert!(!guest.is_running(), "the guest now runs on the destination");
}

#[test]
fn a_ready_with_another_digest_is_a_mismatch_and_the_source_never_commits() {
    let (guest, result, seen) = migrate_to_fake(AtSwitchOver::ReadyWithAnotherDigest);
    let failure = expect_failure(result, MigrationStatus::Failed, "digest");
    let MigrationError::DigestMismatch {
        source_digest,
        destination,
    } = failure.error
    else {
        panic!("expected a digest mismatch: {}", failure.error.chain());
    };
    assert_eq!(destination, source_digest ^ 1, "the values compared");
    assert!(
        !failure.stats.digest_verified,
        "a mismatch is not a verified digest"
    );
    assert!(guest.is_running(), "without a commit the source resumes");
    assert!(
        !seen
            .iter()
            .any(|message| matches!(message, Message::Commit)),
        "no commit after a ready with another digest: {seen:?}"
    );
}

/// A refusal carrying the source's own digest is a refusal for its stated
/// reason, not a digest mismatch; one carrying another digest is a
/// mismatch. Either way the source never commits and runs on.
#[test]
fn a_refusal_instead_of_ready_is_reported_for_what_it_is() {
    let (guest, result, seen) = migrate_to_fake(AtSwitchOver::RefuseWithDigest { same: true });
    let failure = expect_failure(result, MigrationStatus::Failed, "cannot restore");
    assert!(
        matches!(failure.error, MigrationError::Protocol(_)),
        "{}",
        failure.error.chain()
    );
    assert!(guest.is_running());
    assert!(
        !seen
            .iter()
            .any(|message| matches!(message, Message::Commit))
    );
    let (guest, result, seen) = migrate_to_fake(AtSwitchOver::RefuseWithDigest { same: false });
    let failure = expect_failure(result, MigrationStatus::Failed, "digest");
    let MigrationError::DigestMismatch {
        source_digest,
        destination,
    } = failure.error
    else {
        panic!("expected a digest mismatch: {}", failure.error.chain());
    };
    assert_eq!(destination, source_digest ^ 1);
    assert!(guest.is_running());
    assert!(
        !seen
            .iter()
            .any(|message| matches!(message, Message::Commit))
    );
}

#[test]
fn a_destination_without_heartbeats_is_detected_during_the_live_phase() {
    let (listener, address) = tcp_listener();
    // It never answers the switch-over either; the source must not get
    // that far.
    let fake = fake_destination(listener, 1, false, AtSwitchOver::Silent);
    let mut guest = guest(8 * MIB, 0);
    tern_engine::GuestControl::resume(&mut guest).unwrap();
    let mut config = migration_config(1);
    config.io_timeout = Duration::from_secs(1);
    // The first iteration alone then outlasts the I/O timeout, so the
    // first look at the heartbeats finds too few, whatever the machine's
    // load; the fake drains the pages, so no send is ever blocked.
    config.max_bandwidth = Some(MIB);
    let failure = exit_after_deadline("the source's migration to a silent destination", || {
        Source::new(config).unwrap().migrate(&mut guest, &address)
    })
    .expect_err("the destination is silent");
    assert!(
        failure.error.chain().contains("heartbeat"),
        "{}",
        failure.error.chain()
    );
    assert!(guest.is_running());
    join_within(fake, "the fake destination");
}

// The destination's side: a hand-driven source.

const SESSION: u64 = 0xc0_ffee;

fn setup() -> SessionSetup {
    SessionSetup {
        page_size: 4096,
        channel_count: 1,
        codecs: 0,
        // No digest: the fake source does not hash; the commit is what
        // these tests are about.
        digest: DigestAlgorithm::None,
        regions: vec![RegionInfo {
            id: 0,
            guest_addr: 0,
            len: 4 * MIB,
        }],
        guest_kind: "synthetic".into(),
        dictionaries: 0,
        vmm_config_len: 0,
    }
}

/// A hand-driven source's handshake: its main channel and its one page
/// channel, both welcomed, with generous timeouts.
fn fake_source_handshake(
    address: &tern_engine::Address,
    setup: SessionSetup,
) -> (Channel, Channel) {
    let connect = || {
        let mut channel = Channel::connect(address, DEADLINE).expect("connect");
        channel.set_timeouts(DEADLINE).unwrap();
        channel
    };
    let mut main = connect();
    main.send_message(&Message::Hello(Hello {
        handshake: Handshake {
            session_id: SESSION,
            channel_index: 0,
        },
        setup,
    }))
    .unwrap();
    assert!(matches!(main.read_message().unwrap(), Message::Welcome(_)));
    let mut page = connect();
    page.send_message(&Message::ChannelHello(ChannelHello {
        handshake: Handshake {
            session_id: SESSION,
            channel_index: 1,
        },
    }))
    .unwrap();
    assert!(matches!(page.read_message().unwrap(), Message::Welcome(_)));
    (main, page)
}

/// What a destination guest saw of its own resumption, kept where the test
/// can read it after the destination has dropped the guest.
#[derive(Debug, Default)]
struct ResumeLog {
    /// Set by the fake source just before it sends its commit.
    commit_sent: AtomicBool,
    /// Calls of `resume`.
    resumed: AtomicUsize,
    /// Calls of `resume` before the commit was sent: the guest would have
    /// run on both hosts.
    resumed_before_commit: AtomicUsize,
    /// State sections restored, by count of calls.
    restored: AtomicUsize,
    /// Calls of `set_throttle(0)`: auto-converge's throttle is the
    /// migration's, not the guest's life after it.
    throttle_cleared: AtomicUsize,
}

impl ResumeLog {
    fn resumed(&self) -> usize {
        self.resumed.load(Ordering::SeqCst)
    }
}

/// A synthetic destination guest that records every resumption in a
/// [`ResumeLog`].
#[derive(Debug)]
struct WatchedGuest {
    guest: SyntheticGuest,
    log: Arc<ResumeLog>,
}

impl GuestMemory for WatchedGuest {
    fn regions(&self) -> &[MemoryRegion] {
        self.guest.regions()
    }
}

impl GuestControl for WatchedGuest {
    fn pause(&mut self) -> Result<(), GuestError> {
        self.guest.pause()
    }

    fn resume(&mut self) -> Result<(), GuestError> {
        if !self.log.commit_sent.load(Ordering::SeqCst) {
            self.log
                .resumed_before_commit
                .fetch_add(1, Ordering::SeqCst);
        }
        self.log.resumed.fetch_add(1, Ordering::SeqCst);
        self.guest.resume()
    }

    fn set_throttle(&mut self, percent: u8) -> Result<(), GuestError> {
        if percent == 0 {
            self.log.throttle_cleared.fetch_add(1, Ordering::SeqCst);
        }
        self.guest.set_throttle(percent)
    }
}

impl DeviceState for WatchedGuest {
    fn save_state(&mut self) -> Result<Vec<StateSection>, GuestError> {
        self.guest.save_state()
    }

    fn restore_state(&mut self, sections: &[StateSection]) -> Result<(), GuestError> {
        self.log.restored.fetch_add(1, Ordering::SeqCst);
        self.guest.restore_state(sections)
    }

    fn guest_kind(&self) -> &str {
        self.guest.guest_kind()
    }
}

type WatchedResult = Result<tern_engine::Received<WatchedGuest>, MigrationError>;

/// A real destination with a short switch-over timeout, a fake source that
/// has sent everything (one empty iteration, the completion), the
/// destination's first answer, and what its guest saw of its resumption.
fn destination_ready() -> (
    JoinHandle<WatchedResult>,
    Channel,
    Channel,
    Message,
    Arc<ResumeLog>,
) {
    // The device state a synthetic destination guest needs to restore.
    let mut source_guest = guest(4 * MIB, 0);
    source_guest.pause().unwrap();
    let sections = source_guest.save_state().unwrap();
    let (listener, address) = tcp_listener();
    let log = Arc::new(ResumeLog::default());
    let guest_log = Arc::clone(&log);
    let destination = std::thread::spawn(move || {
        let config = {
            let mut config = receive_config();
            config.switch_over_timeout = Duration::from_secs(1);
            // The fake source does not hash: skipping the digest is the
            // destination's choice.
            config.allow_unverified = true;
            config
        };
        Destination::new(config).receive(&listener, |setup: &SessionSetup| {
            Ok(WatchedGuest {
                guest: make_destination_guest(setup)?,
                log: guest_log,
            })
        })
    });
    let (mut main, mut page) = fake_source_handshake(&address, setup());
    page.send_message(&Message::Sync(Sync {
        iteration: 0,
        last: true,
        dictionaries: 0,
    }))
    .unwrap();
    for section in &sections {
        main.send_message(&Message::StateSection(tern_wire::StateSectionMsg {
            name: section.name.clone(),
            version: section.version,
            data: section.data.clone(),
        }))
        .unwrap();
    }
    main.send_message(&Message::Complete(Complete {
        final_iteration: 0,
        sections: u32::try_from(sections.len()).unwrap(),
        digest: 0,
    }))
    .unwrap();
    let answer = loop {
        match main.read_message().expect("the destination's answer") {
            Message::Heartbeat(_) | Message::PassApplied(_) => {}
            other => break other,
        }
    };
    (destination, main, page, answer, log)
}

/// The destination failed and its guest never ran.
fn assert_never_resumed(log: &ResumeLog) {
    assert_eq!(
        log.resumed(),
        0,
        "the destination resumed its guest without a commit"
    );
}

#[test]
fn the_destination_says_ready_and_resumes_only_on_commit() {
    let (destination, mut main, _page, answer, log) = destination_ready();
    assert!(matches!(answer, Message::Ready(_)), "{answer:?}");
    assert_eq!(log.resumed(), 0, "resumed before the commit");
    // Ready means everything short of running: the state is restored and
    // the migration's throttle cleared before it is sent.
    assert_eq!(log.restored.load(Ordering::SeqCst), 1, "state restored");
    assert!(
        log.throttle_cleared.load(Ordering::SeqCst) >= 1,
        "throttle cleared"
    );
    log.commit_sent.store(true, Ordering::SeqCst);
    main.send_message(&Message::Commit).unwrap();
    match main.read_message().expect("the acknowledgement") {
        Message::Outcome(outcome) => assert!(outcome.verified, "{outcome:?}"),
        other => panic!("expected the outcome, got {other:?}"),
    }
    let received = join_within(destination, "the destination")
        .unwrap_or_else(|error| panic!("{}", error.chain()));
    assert!(received.guest.guest.is_running());
    assert_eq!(log.resumed(), 1);
    assert_eq!(log.resumed_before_commit.load(Ordering::SeqCst), 0);
}

#[test]
fn no_commit_in_time_and_the_destination_does_not_resume() {
    let (destination, _main, _page, answer, log) = destination_ready();
    assert!(matches!(answer, Message::Ready(_)), "{answer:?}");
    let error = join_within(destination, "the destination").expect_err("no commit came");
    assert!(
        error.chain().contains("the source's commit"),
        "{}",
        error.chain()
    );
    assert_never_resumed(&log);
}

#[test]
fn an_abort_instead_of_a_commit_and_the_destination_does_not_resume() {
    let (destination, mut main, _page, answer, log) = destination_ready();
    assert!(matches!(answer, Message::Ready(_)), "{answer:?}");
    main.send_message(&Message::Abort(tern_wire::Abort {
        reason: tern_wire::AbortReason::Other,
        message: "the source gave up waiting".into(),
    }))
    .unwrap();
    let error = join_within(destination, "the destination").expect_err("an abort came");
    assert!(
        matches!(error, MigrationError::PeerAborted { .. }),
        "{}",
        error.chain()
    );
    assert!(
        error.chain().contains("the source gave up waiting"),
        "{}",
        error.chain()
    );
    assert_never_resumed(&log);
}

#[test]
fn a_closed_main_channel_instead_of_a_commit_and_the_destination_does_not_resume() {
    let (destination, main, page, answer, log) = destination_ready();
    assert!(matches!(answer, Message::Ready(_)), "{answer:?}");
    drop(main);
    drop(page);
    let error = join_within(destination, "the destination").expect_err("the source is gone");
    assert!(
        matches!(error, MigrationError::Channel { index: 0, .. }),
        "the main channel's loss: {}",
        error.chain()
    );
    assert_never_resumed(&log);
}

#[test]
fn the_destination_sends_heartbeats_while_pages_flow() {
    let (listener, address) = tcp_listener();
    let _destination = spawn_destination(listener);
    let mut hello_setup = setup();
    hello_setup.digest = DigestAlgorithm::Xxh3Pages;
    let (mut main, _page) = fake_source_handshake(&address, hello_setup);
    assert!(matches!(
        main.read_message().unwrap(),
        Message::Heartbeat(_)
    ));
    assert!(matches!(
        main.read_message().unwrap(),
        Message::Heartbeat(_)
    ));
}

/// Reads the destination's main channel until it says it applied
/// `passes` passes, skipping its heartbeats; every count it tells on the
/// way must grow and stay within `passes`. Fails at the deadline.
/// Reads the destination's main channel until it says it applied
/// `passes` passes; returns the lag the last word carried.
fn read_until_applied(main: &mut Channel, passes: u32, told: &mut u32) -> Duration {
    let until = std::time::Instant::now() + DEADLINE;
    let mut lag = Duration::ZERO;
    while *told < passes {
        assert!(
            std::time::Instant::now() < until,
            "the destination never said it applied {passes} passes (it said {told})"
        );
        match main.read_message().expect("the destination's main channel") {
            Message::Heartbeat(_) => {}
            Message::PassApplied(applied) => {
                assert!(
                    applied.passes > *told && applied.passes <= passes,
                    "told {} after {told}, with {passes} sent",
                    applied.passes
                );
                *told = applied.passes;
                lag = Duration::from_micros(applied.lag_micros.into());
            }
            other => panic!("expected passes applied, got {other:?}"),
        }
    }
    lag
}

#[test]
fn the_destination_tells_the_source_each_pass_it_applied() {
    let (listener, address) = tcp_listener();
    let _destination = spawn_destination(listener);
    let mut verified = setup();
    verified.digest = DigestAlgorithm::Xxh3Pages;
    let (mut main, mut page) = fake_source_handshake(&address, verified);
    let mut told = 0;
    for iteration in 0..3 {
        let sent = std::time::Instant::now();
        page.send_message(&Message::Sync(Sync {
            iteration,
            last: false,
            dictionaries: 0,
        }))
        .unwrap();
        let lag = read_until_applied(&mut main, iteration + 1, &mut told);
        // Protocol 13: the pass's lag behind the link. Nothing follows the
        // sync, so it arrived after it was sent: the lag cannot be longer
        // than the time from sending it to the word that it was applied.
        assert!(
            lag <= sent.elapsed(),
            "pass {iteration}: a lag of {lag:?}, {:?} after the sync was sent",
            sent.elapsed()
        );
    }
}

#[test]
fn a_source_trickling_a_packet_is_cut_off_at_the_transfer_deadline() {
    let (listener, address) = tcp_listener();
    let destination = std::thread::spawn(move || {
        let config = {
            let mut config = receive_config();
            config.io_timeout = Duration::from_secs(1);
            config.allow_unverified = true;
            config
        };
        Destination::new(config).receive(&listener, make_destination_guest)
    });
    let (main, mut page) = fake_source_handshake(&address, setup());
    // A sync frame, one byte at a time, each byte well inside the I/O
    // timeout: only a deadline on the whole frame stops it. The trickle
    // ends when the destination closes the channel (or after 60 bytes).
    let frame = Message::Sync(Sync {
        iteration: 0,
        last: false,
        dictionaries: 0,
    })
    .to_bytes();
    let trickle = std::thread::spawn(move || {
        for byte in frame.iter().cycle().take(60) {
            if page.write_all(std::slice::from_ref(byte)).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    });
    let error = join_within(destination, "the destination").expect_err("the trickle is cut off");
    assert!(
        error.chain().contains("outlasted the I/O timeout"),
        "{}",
        error.chain()
    );
    drop(main);
    join_within(trickle, "the trickling peer");
}

// Trickling peers (issue 23): every frame after the handshake, header and
// body, is one transfer with one deadline; the switch-over deadline holds
// whatever the peer trickles.

/// Sends `pieces` one after another, `pause` apart, until the peer closes.
fn trickle(mut channel: Channel, pieces: Vec<Vec<u8>>, pause: Duration) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for piece in pieces {
            if channel.write_all(&piece).is_err() {
                return;
            }
            std::thread::sleep(pause);
        }
        // Keep the channel open until the destination gives up on it.
        let _ = channel.wait_readable(DEADLINE);
    })
}

/// A real destination with `io_timeout`, a fake source past its handshake.
fn destination_with_io_timeout(
    io_timeout: Duration,
) -> (JoinHandle<DestinationResult>, Channel, Channel) {
    let (listener, address) = tcp_listener();
    let destination = std::thread::spawn(move || {
        let config = {
            let mut config = receive_config();
            config.io_timeout = io_timeout;
            config.allow_unverified = true;
            config
        };
        Destination::new(config).receive(&listener, make_destination_guest)
    });
    let (main, page) = fake_source_handshake(&address, setup());
    (destination, main, page)
}

/// Once every page channel has passed its last sync, only the main
/// channel can carry more, and a source that then says nothing (no state,
/// no completion) is cut off at the I/O timeout, as a silent page channel
/// would have been.
#[test]
fn a_source_silent_after_its_last_pages_is_cut_off_at_the_io_timeout() {
    let (destination, _main, mut page) = destination_with_io_timeout(Duration::from_secs(1));
    page.send_message(&Message::Sync(Sync {
        iteration: 0,
        last: true,
        dictionaries: 0,
    }))
    .unwrap();
    let error = join_within(destination, "the destination").expect_err("the source fell silent");
    assert!(
        error
            .chain()
            .contains("the source's state after its last pages"),
        "{}",
        error.chain()
    );
}

#[test]
fn a_commit_trickled_past_the_switch_over_deadline_is_not_taken() {
    // Switch-over timeout 1 s, I/O timeout 10 s: one byte of the commit
    // every 300 ms would take 4.8 s, each byte well inside the I/O timeout.
    let (destination, main, _page, answer, log) = destination_ready();
    assert!(matches!(answer, Message::Ready(_)), "{answer:?}");
    let ready_at = std::time::Instant::now();
    let bytes: Vec<Vec<u8>> = Message::Commit
        .to_bytes()
        .into_iter()
        .map(|byte| vec![byte])
        .collect();
    let trickling = trickle(main, bytes, Duration::from_millis(300));
    let error = join_within(destination, "the destination")
        .expect_err("a commit that is not whole by the deadline is not one");
    eprintln!(
        "a trickled commit: the destination gave up {:?} after its ready (switch-over \
         timeout 1 s)",
        ready_at.elapsed()
    );
    assert!(
        error.chain().contains("the source's commit"),
        "{}",
        error.chain()
    );
    assert_never_resumed(&log);
    join_within(trickling, "the trickling peer");
}

#[test]
fn a_state_section_trickled_in_pieces_is_cut_off_at_the_transfer_deadline() {
    let (destination, main, mut page) = destination_with_io_timeout(Duration::from_secs(1));
    page.send_message(&Message::Sync(Sync {
        iteration: 0,
        last: true,
        dictionaries: 0,
    }))
    .unwrap();
    // 1 MiB in 64 KiB pieces 400 ms apart: each piece well inside the I/O
    // timeout, the whole section 6.4 s.
    let section = Message::StateSection(tern_wire::StateSectionMsg {
        name: "trickled".into(),
        version: 1,
        data: vec![1; 1 << 20],
    })
    .to_bytes();
    let pieces = section.chunks(64 << 10).map(<[u8]>::to_vec).collect();
    let started = std::time::Instant::now();
    let trickling = trickle(main, pieces, Duration::from_millis(400));
    let error = join_within(destination, "the destination").expect_err("the trickle is cut off");
    eprintln!(
        "a trickled state section: cut off after {:?} (I/O timeout 1 s)",
        started.elapsed()
    );
    assert!(
        error.chain().contains("outlasted the I/O timeout"),
        "{}",
        error.chain()
    );
    join_within(trickling, "the trickling peer");
    drop(page);
}

#[test]
fn a_page_packet_trickled_in_pieces_is_cut_off_at_the_transfer_deadline() {
    let (destination, main, page) = destination_with_io_timeout(Duration::from_secs(1));
    // Header, then the packet header and table, then the payload, 600 ms
    // apart: each read alone is within the I/O timeout, the packet not.
    let mut packet = raw_pages_prefix(0, &[0]);
    packet.extend_from_slice(&[7; 4096]);
    let pieces = vec![
        packet[..8].to_vec(),
        packet[8..packet.len() - 4096].to_vec(),
        packet[packet.len() - 4096..].to_vec(),
    ];
    let started = std::time::Instant::now();
    let trickling = trickle(page, pieces, Duration::from_millis(600));
    let error = join_within(destination, "the destination").expect_err("the trickle is cut off");
    eprintln!(
        "a trickled page packet: cut off after {:?} (I/O timeout 1 s)",
        started.elapsed()
    );
    assert!(
        error.chain().contains("outlasted the I/O timeout"),
        "{}",
        error.chain()
    );
    join_within(trickling, "the trickling peer");
    drop(main);
}
