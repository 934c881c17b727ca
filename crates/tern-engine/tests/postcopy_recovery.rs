//! Postcopy recovery end to end (docs/postcopy.md, "Recovery"): real
//! sockets through a small TCP proxy the test cuts, holds and lets through
//! again, real userfaultfd, the synthetic guest's dirtier faulting on the
//! destination. Skipped visibly without userfaultfd.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use common::*;
use tern_engine::{
    Address, Destination, EventBody, MigrationConfig, MigrationStats, MigrationStatus,
    PostcopyMode, ReceiveConfig, ReceiveHandle, Security, Source,
};
use tern_synthetic::{ContentMix, SyntheticConfig, SyntheticGuest};
use tern_test_skip::proxy::Proxy;

use tern_test_skip::userfaultfd_works;

/// A guest whose working set is rewritten much faster than the link
/// moves it: most of it is stale at the switch.
fn busy_guest() -> SyntheticGuest {
    guest_with(SyntheticConfig {
        memory_bytes: 16 * MIB,
        regions: 1,
        mix: ContentMix::new(20, 60, 20).unwrap(),
        seed: 5,
        dirty_rate_bytes_per_sec: 64 * MIB,
        working_set_bytes: 8 * MIB,
        dirtier_threads: 2,
    })
}

fn source_config(recover_timeout: Duration) -> MigrationConfig {
    let mut config = migration_config(2);
    config.postcopy = PostcopyMode::AfterFirstPass;
    config.io_timeout = Duration::from_secs(2);
    config.postcopy_recover_timeout = recover_timeout;
    config
}

fn destination_config(recover_timeout: Duration) -> ReceiveConfig {
    let mut config = receive_config();
    config.io_timeout = Duration::from_secs(2);
    config.postcopy_request_timeout = Duration::from_secs(1);
    config.postcopy_recover_timeout = recover_timeout;
    config
}

/// A migration running through a proxy: the source on one thread, the
/// destination on another, their handles here.
struct Running {
    proxy: Proxy,
    destination: JoinHandle<DestinationResult>,
    receive: ReceiveHandle,
    source: JoinHandle<(
        Result<MigrationStats, tern_engine::MigrationFailure>,
        SyntheticGuest,
    )>,
    handle: tern_engine::MigrationHandle,
    listen: Address,
}

fn start(recover_timeout: Duration) -> Running {
    start_with(recover_timeout, Security::default())
}

fn start_with(recover_timeout: Duration, security: Security) -> Running {
    start_configured(recover_timeout, security, |_, _| {})
}

/// [`start_with`], with both configurations changed by `tune` first.
fn start_configured(
    recover_timeout: Duration,
    security: Security,
    tune: impl FnOnce(&mut MigrationConfig, &mut ReceiveConfig),
) -> Running {
    // 8 MiB/s: the first pass takes about a second and a half, the stale
    // pages about as long.
    let link = Link {
        rate: 8 * MIB,
        guest: busy_guest,
    };
    start_on(&link, recover_timeout, security, tune)
}

/// The proxy's pace and the guest it carries.
struct Link {
    /// Bytes per second from source to destination.
    rate: u64,
    guest: fn() -> SyntheticGuest,
}

/// [`start_configured`] over `link`.
fn start_on(
    link: &Link,
    recover_timeout: Duration,
    security: Security,
    tune: impl FnOnce(&mut MigrationConfig, &mut ReceiveConfig),
) -> Running {
    let (listener, listen) = tcp_listener();
    let mut receive = destination_config(recover_timeout);
    receive.security = security.clone();
    let mut config = source_config(recover_timeout);
    config.security = security;
    tune(&mut config, &mut receive);
    let destination = Destination::new(receive);
    let receive = destination.handle();
    let destination =
        std::thread::spawn(move || destination.receive(&listener, make_destination_guest));
    let Address::Tcp(target) = &listen else {
        panic!("a TCP destination");
    };
    let proxy = Proxy::start(target, link.rate);
    let source = Source::new(config).unwrap();
    let handle = source.handle();
    let address = Address::Tcp(proxy.address().to_string());
    let make_guest = link.guest;
    let source = std::thread::spawn(move || {
        let mut guest = make_guest();
        let result = source.migrate(&mut guest, &address);
        (result, guest)
    });
    Running {
        proxy,
        destination,
        receive,
        source,
        handle,
        listen,
    }
}

/// A migration in postcopy whose network the proxy cut: both sides
/// paused.
fn paused_by_a_cut(recover_timeout: Duration) -> Running {
    paused_by_a_cut_with(recover_timeout, Security::default())
}

fn paused_by_a_cut_with(recover_timeout: Duration, security: Security) -> Running {
    paused_by_a_cut_of(start_with(recover_timeout, security))
}

fn paused_by_a_cut_of(running: Running) -> Running {
    running.wait_postcopy_active();
    running.proxy.cut();
    running.wait_both_paused();
    running
}

impl Running {
    fn wait_postcopy_active(&self) {
        wait_until("postcopy starts", || {
            self.assert_both_live("started postcopy");
            self.handle.query().status == MigrationStatus::PostcopyActive
        });
    }

    fn wait_both_paused(&self) {
        wait_until("the source pauses postcopy", || {
            self.assert_both_live("paused");
            self.handle.query().status == MigrationStatus::PostcopyPaused
        });
        wait_until("the destination pauses postcopy", || {
            self.assert_both_live("paused");
            self.receive.query().status == MigrationStatus::PostcopyPaused
        });
    }

    /// A side that ended fails the wait at once, with its error, instead
    /// of at the wait's deadline.
    fn assert_both_live(&self, awaited: &str) {
        assert!(
            !self.source.is_finished(),
            "the migration ended before it {awaited}: {:?}",
            self.handle.query().error_desc
        );
        assert!(
            !self.destination.is_finished(),
            "the destination ended before it {awaited}: {:?}",
            self.receive.query().error_desc
        );
    }

    /// Both sides end: the source completed with the digests compared and
    /// equal, after at least one recovery on each side.
    fn finish(self) {
        let (result, guest) = join_within(self.source, "the source");
        let stats = result.expect("the migration completes after recovering");
        let mut received = join_within(self.destination, "the destination").expect("destination");
        assert_eq!(stats.status, MigrationStatus::Completed);
        assert!(stats.digest_verified, "{:?}", stats.digest_comparison);
        assert!(received.digest_comparison.unwrap().matched());
        let postcopy = stats.postcopy.expect("source postcopy report");
        assert!(postcopy.postcopy_recoveries >= 1, "{postcopy:?}");
        assert!(postcopy.postcopy_paused_ms > 0.0, "{postcopy:?}");
        let here = received.stats.postcopy.clone().expect("destination report");
        assert!(here.postcopy_recoveries >= 1, "{here:?}");
        eprintln!("source: {postcopy:?}\ndestination: {here:?}");
        assert!(!guest.is_running(), "the source guest stays paused");
        tern_engine::GuestControl::pause(&mut received.guest).unwrap();
    }
}

/// Also holds the statuses both sides report, QEMU's on each side: the
/// destination is `postcopy-active` from the commit on (before it acked
/// the commit, so as soon as the source is), `postcopy-paused` while
/// paused, `postcopy-recover` while a welcomed reconnection exchanges
/// what is missing, then `postcopy-active` again.
#[test]
fn severed_channels_pause_both_sides_and_recover_automatically() {
    if !userfaultfd_works() {
        return;
    }
    let running = start(Duration::from_secs(60));
    running.wait_postcopy_active();
    assert_eq!(
        running.receive.query().status,
        MigrationStatus::PostcopyActive
    );
    running.proxy.cut();
    running.wait_both_paused();
    running.proxy.pass();
    let (handle, receive) = (running.handle.clone(), running.receive.clone());
    running.finish();
    use MigrationStatus::{
        Active, Completed, Device, PostcopyActive, PostcopyPaused, PostcopyRecover,
    };
    let recovered = [
        Active,
        Device,
        PostcopyActive,
        PostcopyPaused,
        PostcopyRecover,
        PostcopyActive,
        Completed,
    ];
    for (side, events) in [
        ("source", handle.history().events),
        ("destination", receive.history().events),
    ] {
        let seen = statuses(&events);
        assert!(
            in_order(&recovered, &seen),
            "the {side}'s statuses: {seen:?}"
        );
    }
}

/// The statuses of the `MIGRATION` events in `events`, in order.
fn statuses(events: &[tern_engine::Event]) -> Vec<MigrationStatus> {
    events
        .iter()
        .filter_map(|event| match &event.body {
            EventBody::Migration(change) => Some(change.status),
            _ => None,
        })
        .collect()
}

/// Whether `expected` appears in `seen` in order (other statuses may come
/// between, such as a second pause).
fn in_order(expected: &[MigrationStatus], seen: &[MigrationStatus]) -> bool {
    let mut seen = seen.iter();
    expected
        .iter()
        .all(|status| seen.any(|candidate| candidate == status))
}

#[test]
fn a_stopped_source_past_the_deadline_pauses_then_recovers() {
    if !userfaultfd_works() {
        return;
    }
    let running = start(Duration::from_secs(60));
    running.wait_postcopy_active();
    // Nothing moves and nothing closes: the destination's faults pass
    // postcopy_request_timeout, the source's writes its I/O timeout.
    running.proxy.hold();
    running.wait_both_paused();
    running.proxy.pass();
    running.finish();
}

/// One page channel broken mid-postcopy while the main channel and the
/// other page channel carry on: the round ends on both sides (the side
/// that sees the break first pauses, and its shutdown tells the other),
/// the source reconnects every channel, and the migration completes with
/// the memory verified, after a recovery on each side.
#[test]
fn one_page_channel_broken_while_the_others_carry_on_pauses_both_sides_and_recovers() {
    if !userfaultfd_works() {
        return;
    }
    let running = start(Duration::from_secs(60));
    running.wait_postcopy_active();
    // The source opens its channels one after the other: the main channel
    // is the proxy's connection 0, the page channels 1 and 2.
    assert!(
        running.proxy.cut_connection(2),
        "the second page channel is open"
    );
    // The pause may be short (the network is up): the events keep it.
    wait_until("the source pauses postcopy", || {
        ever_paused(&running.handle.history().events)
    });
    wait_until("the destination pauses postcopy", || {
        ever_paused(&running.receive.history().events)
    });
    let causes: Vec<String> = [running.handle.history(), running.receive.history()]
        .iter()
        .flat_map(|history| pause_causes(&history.events))
        .collect();
    // The broken channel is what paused postcopy, on the side that saw
    // it first (the other sees the main channel shut down).
    assert!(
        causes.iter().any(|cause| cause.starts_with("Channel 2 ")),
        "{causes:?}"
    );
    running.finish();
}

/// The causes (`error-desc`) of the `postcopy-paused` status changes in
/// `events`.
fn pause_causes(events: &[tern_engine::Event]) -> Vec<String> {
    events
        .iter()
        .filter_map(|event| match &event.body {
            EventBody::Migration(change) if change.status == MigrationStatus::PostcopyPaused => {
                change.error_desc.clone()
            }
            _ => None,
        })
        .collect()
}

/// A stopped destination (nothing moves, nothing closes, and its own
/// deadlines do not run: here they are longer than the test) past the
/// source's deadlines: the source pauses on its own I/O timeout, not a
/// hang nor a failure, and tries to reconnect while the destination,
/// which noticed nothing, is still `postcopy-active`. Once the
/// destination runs again it finds the source's channels closed, pauses,
/// accepts the reconnection, and the migration completes with the memory
/// verified.
#[test]
fn a_stopped_destination_past_the_sources_deadline_pauses_the_source_then_recovers() {
    if !userfaultfd_works() {
        return;
    }
    let running = start_configured(
        Duration::from_secs(60),
        Security::default(),
        |_, destination| {
            destination.io_timeout = Duration::from_secs(600);
            destination.postcopy_request_timeout = Duration::from_secs(600);
        },
    );
    running.wait_postcopy_active();
    running.proxy.hold();
    wait_until("the source pauses postcopy", || {
        running.assert_both_live("paused");
        running.handle.query().status == MigrationStatus::PostcopyPaused
    });
    assert_eq!(
        running.receive.query().status,
        MigrationStatus::PostcopyActive,
        "the destination noticed nothing: the source paused on its own deadline"
    );
    assert!(!ever_paused(&running.receive.history().events));
    running.proxy.pass();
    running.finish();
}

/// Whether `events` hold a `postcopy-paused` status change whose cause
/// says the recovery timed out.
fn says_recovery_timed_out(events: &[tern_engine::Event]) -> bool {
    events.iter().any(|event| match &event.body {
        EventBody::Migration(change) => {
            change.status == MigrationStatus::PostcopyPaused
                && change
                    .error_desc
                    .as_deref()
                    .is_some_and(|desc| desc.contains("recovery timed out"))
        }
        _ => false,
    })
}

#[test]
fn past_the_recovery_timeout_both_sides_stay_paused_for_the_operator() {
    if !userfaultfd_works() {
        return;
    }
    let running = paused_by_a_cut(Duration::from_millis(500));
    wait_until("the source reports the recovery timeout", || {
        says_recovery_timed_out(&running.handle.history().events)
    });
    wait_until("the destination reports the recovery timeout", || {
        says_recovery_timed_out(&running.receive.history().events)
    });
    // Still paused, never failed: the network comes back, and nothing
    // happens until the operator says so.
    running.proxy.pass();
    assert_eq!(
        running.handle.query().status,
        MigrationStatus::PostcopyPaused
    );
    assert_eq!(
        running.receive.query().status,
        MigrationStatus::PostcopyPaused
    );
    assert!(!running.source.is_finished() && !running.destination.is_finished());
    running.receive.recover_postcopy().expect("migrate-recover");
    running
        .handle
        .resume_postcopy()
        .expect("migrate resume=true");
    running.finish();
}

/// Sends `message` on a fresh connection to the destination and returns
/// the abort's text it answers with.
fn refused_text(listen: &Address, message: &tern_wire::Message) -> String {
    let Address::Tcp(listen) = listen else {
        panic!("a TCP destination");
    };
    let mut stream = TcpStream::connect(listen).unwrap();
    stream
        .set_read_timeout(Some(DEADLINE))
        .expect("read timeout");
    stream.write_all(&message.to_bytes()).unwrap();
    let mut header = [0u8; tern_wire::FRAME_HEADER_LEN];
    stream.read_exact(&mut header).expect("an answer");
    let header = tern_wire::FrameHeader::decode(&header).unwrap();
    let mut body = vec![0u8; header.body_len as usize];
    stream.read_exact(&mut body).unwrap();
    match tern_wire::Message::decode(header.kind, &body).unwrap() {
        tern_wire::Message::Abort(abort) => abort.message,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_reconnection_naming_another_session_is_refused() {
    if !userfaultfd_works() {
        return;
    }
    let running = paused_by_a_cut(Duration::from_secs(60));
    let refused = running.receive.query().refused_connections;
    // Straight to the destination, past the proxy: a resume of another
    // session, and a new migration's hello, while postcopy is paused.
    let resume = tern_wire::Message::PostcopyResume(tern_wire::PostcopyResume {
        handshake: tern_wire::Handshake {
            session_id: 0x5eed,
            channel_index: 0,
        },
    });
    let text = refused_text(&running.listen, &resume);
    assert!(text.contains("is not the paused postcopy"), "{text}");
    let channel = tern_wire::Message::ChannelHello(tern_wire::ChannelHello {
        handshake: tern_wire::Handshake {
            session_id: 0x5eed,
            channel_index: 1,
        },
    });
    let text = refused_text(&running.listen, &channel);
    assert!(text.contains("expected the source's resume"), "{text}");
    assert!(running.receive.query().refused_connections >= refused + 2);
    assert_eq!(
        running.receive.query().status,
        MigrationStatus::PostcopyPaused
    );
    // The real source still gets back in.
    running.proxy.pass();
    running.finish();
}

#[test]
fn with_an_auth_key_the_source_proves_it_again_and_a_keyless_resume_is_refused() {
    if !userfaultfd_works() {
        return;
    }
    let security = {
        let mut security = Security::default();
        security.auth_key = Some(Arc::new(
            tern_engine::AuthKey::from_bytes(b"a shared secret of the test").unwrap(),
        ));
        security
    };
    let running = paused_by_a_cut_with(Duration::from_secs(60), security);
    // Whoever does not hold the key cannot resume the session, whatever
    // session it names.
    let resume = tern_wire::Message::PostcopyResume(tern_wire::PostcopyResume {
        handshake: tern_wire::Handshake {
            session_id: 0x5eed,
            channel_index: 0,
        },
    });
    let text = refused_text(&running.listen, &resume);
    assert!(text.contains("requires an auth key"), "{text}");
    assert_eq!(
        running.receive.query().status,
        MigrationStatus::PostcopyPaused
    );
    running.proxy.pass();
    running.finish();
}

#[test]
fn migrate_recover_on_a_new_address_moves_the_reconnection_there() {
    if !userfaultfd_works() {
        return;
    }
    // The old path stays dead for good: only the new address can mend it.
    let running = paused_by_a_cut(Duration::from_secs(60));
    let fresh = running
        .receive
        .recover_postcopy_at(&Address::Tcp("127.0.0.1:0".into()))
        .expect("migrate-recover on a new address");
    assert_ne!(fresh, running.listen, "a new listener, not the first one");
    running
        .handle
        .resume_postcopy_to(fresh)
        .expect("migrate resume=true with the new URI");
    running.finish();
}

#[test]
fn a_new_recovery_address_is_refused_before_postcopy_pauses_and_when_it_cannot_listen() {
    if !userfaultfd_works() {
        return;
    }
    let running = start(Duration::from_secs(60));
    running.wait_postcopy_active();
    let early = running
        .receive
        .recover_postcopy_at(&Address::Tcp("127.0.0.1:0".into()))
        .expect_err("nothing to recover yet");
    assert!(early.to_string().contains("postcopy-paused"), "{early}");
    let early = running
        .handle
        .resume_postcopy_to(Address::Tcp("127.0.0.1:1".into()))
        .expect_err("nothing to resume yet");
    assert!(early.to_string().contains("postcopy-paused"), "{early}");
    running.proxy.cut();
    running.wait_both_paused();
    // The first listener's own address is taken: a clear error, and the
    // destination stays paused, still listening where it was.
    let busy = running
        .receive
        .recover_postcopy_at(&running.listen)
        .expect_err("the address is in use");
    assert!(busy.to_string().contains("cannot listen on"), "{busy}");
    let inherited = running
        .handle
        .resume_postcopy_to(Address::Fd(vec![3]))
        .expect_err("fd: cannot be dialled again");
    assert!(inherited.to_string().contains("not fd:"), "{inherited}");
    assert_eq!(
        running.receive.query().status,
        MigrationStatus::PostcopyPaused
    );
    running.proxy.pass();
    running.finish();
}

/// A reconnection broken again half-way (its main channel back, its page
/// channel closed at once) does not end the migration: the source dials
/// again (here the page channel, within the same attempt: seen with the
/// proxy's log), and the migration completes with the memory verified.
/// It does not force a whole failed attempt on the destination's side:
/// the next test does.
#[test]
fn a_reconnection_that_fails_half_way_is_tried_again() {
    if !userfaultfd_works() {
        return;
    }
    let running = paused_by_a_cut(Duration::from_secs(60));
    running.proxy.pass_first(1);
    wait_until(
        "the proxy closes a channel of the first reconnection",
        || running.proxy.turned_away() > 0,
    );
    running.proxy.pass();
    running.finish();
}

/// A reconnection the destination gives up on half-way (its main channel
/// welcomed, its page channels turned away by the network until the
/// destination's accept deadline) is one failed attempt: the destination
/// waits on for the next, and the source's next attempt completes the
/// migration with the memory verified. The source dials its page channel
/// for far longer than the destination waits, so the destination is the
/// side that gives up (the proxy sees it close the main channel).
#[test]
fn a_reconnection_the_destination_gives_up_on_is_followed_by_the_next() {
    if !userfaultfd_works() {
        return;
    }
    let running = paused_by_a_cut_of(start_configured(
        Duration::from_secs(60),
        Security::default(),
        |source, destination| {
            destination.accept_timeout = Duration::from_secs(5);
            source.connect_timeout = Duration::from_secs(50);
        },
    ));
    running.proxy.pass_first(1);
    wait_until(
        "the destination gives up the first reconnection and closes it",
        || running.proxy.counted_closed_by_target() > 0,
    );
    running.proxy.pass();
    running.finish();
}

/// Whether `events` hold a `postcopy-paused` status change.
fn ever_paused(events: &[tern_engine::Event]) -> bool {
    statuses(events).contains(&MigrationStatus::PostcopyPaused)
}

/// A destination that fails on a protocol error after the point of no
/// return (every byte the source sends turns to garbage on the way) gives
/// up, pauses its guest, and says so to the source, which does not take
/// the end of the connection for a broken link to mend: it ends at once
/// with `PostcopyFailed` (exit status 6 in the CLI), its guest paused,
/// instead of waiting `postcopy-paused` for a destination that will never
/// take it back. The recovery window is far longer than the test's
/// deadline: a source that paused would hang the test.
#[test]
fn a_destination_that_fails_on_a_protocol_error_says_so_and_the_source_reports_the_guest_lost() {
    if !userfaultfd_works() {
        return;
    }
    // A push that outlasts the sockets' buffers: the source's pushers are
    // still writing when the destination gives up, so that they see their
    // channels end, as they would without a proxy.
    let link = Link {
        rate: 32 * MIB,
        guest: || {
            guest_with(SyntheticConfig {
                memory_bytes: 64 * MIB,
                regions: 1,
                mix: ContentMix::new(20, 60, 20).unwrap(),
                seed: 6,
                dirty_rate_bytes_per_sec: 128 * MIB,
                working_set_bytes: 48 * MIB,
                dirtier_threads: 2,
            })
        },
    };
    let running = start_on(
        &link,
        Duration::from_secs(600),
        Security::default(),
        |_, _| {},
    );
    running.wait_postcopy_active();
    running.proxy.corrupt();
    let Err(failed) = join_within(running.destination, "the destination") else {
        panic!("the destination completed on garbage");
    };
    match &failed {
        tern_engine::MigrationError::PostcopyFailed { fate, cause } => {
            assert!(fate.contains("paused on the destination"), "{fate}");
            // The garbage itself, not one of its consequences (a page
            // refused once the failure had released guest memory).
            assert_eq!(
                cause.abort_reason(),
                tern_wire::AbortReason::ProtocolError,
                "{}",
                cause.chain()
            );
        }
        other => panic!("the destination: {other:?}"),
    }
    // The destination's report names the phase it failed in: postcopy's.
    let report = running.receive.query();
    assert_eq!(report.status, MigrationStatus::Failed);
    assert_eq!(report.failed_in, Some(MigrationStatus::PostcopyActive));
    let (result, guest) = join_within(running.source, "the source");
    let failure = result.expect_err("the source reports the guest's fate");
    match &failure.error {
        tern_engine::MigrationError::PostcopyFailed { fate, cause } => {
            assert!(
                matches!(
                    **cause,
                    tern_engine::MigrationError::PeerAborted {
                        reason: tern_wire::AbortReason::ProtocolError,
                        ..
                    }
                ),
                "the destination's own word, not a lost link: {cause:?}"
            );
            assert!(fate.contains("destination gave up"), "{fate}");
        }
        other => panic!("the source: {other:?}"),
    }
    assert_eq!(failure.stats.status, MigrationStatus::Failed);
    assert!(
        !ever_paused(&running.handle.history().events),
        "the source never waited for a recovery"
    );
    assert!(!guest.is_running(), "the source guest stays paused");
}
