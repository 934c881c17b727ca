//! Attacks on the protocol's invariants, by a hand-driven source over TCP
//! against a real destination: the same page on two channels in one
//! iteration, channels that disagree on the last iteration, messages out of
//! order around the completion. Each must end in a clear error, sent to the
//! attacker in an abort, within a bounded time. No real source is involved,
//! so there is no source guest to keep running.
//!
//! Each test prints its time to reject (`--nocapture` shows it), the figure
//! docs/security.md reports.

use crate::common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::raw_pages_prefix;
use tern_engine::{
    Address, Channel, Destination, GuestError, Listener, MigrationError, ReceiveConfig, Received,
};
use tern_synthetic::SyntheticGuest;
use tern_wire::{
    ChannelHello, Complete, DigestAlgorithm, Handshake, Hello, Message, RegionInfo, SessionSetup,
    StateSectionMsg, Sync,
};

const SESSION: u64 = 0xa77a_c4ed;
const REGION_BYTES: u64 = 4 << 20;
const PAGE: usize = 4096;

/// How long a test waits for what should happen at once: far beyond any
/// scheduling delay on a loaded machine, so only a hang fails.
const DEADLINE: Duration = Duration::from_secs(60);

type DestinationResult = Result<Received<SyntheticGuest>, MigrationError>;

/// A destination receiving on a free port of 127.0.0.1, on its own thread.
struct RunningDestination {
    address: Address,
    result: mpsc::Receiver<DestinationResult>,
}

fn start_destination() -> RunningDestination {
    let listener = Listener::bind(&Address::Tcp("127.0.0.1:0".into())).expect("bind");
    let address = listener.local_address().expect("address");
    let (sender, result) = mpsc::channel();
    std::thread::spawn(move || {
        // The rest stays default, whatever limits ReceiveConfig grows.
        #[allow(clippy::needless_update)]
        let config = {
            let mut config = ReceiveConfig::default();
            config.accept_timeout = Duration::from_secs(30);
            config.io_timeout = Duration::from_secs(30);
            config
        };
        let received = Destination::new(config).receive(&listener, |setup: &SessionSetup| {
            let lens: Vec<u64> = setup.regions.iter().map(|region| region.len).collect();
            SyntheticGuest::empty(&lens).map_err(|e| GuestError::with_source("destination", e))
        });
        let _ = sender.send(received);
    });
    RunningDestination { address, result }
}

impl RunningDestination {
    /// The destination's error, which must come within [`DEADLINE`] and
    /// contain `needle`.
    fn expect_error(&self, needle: &str) -> MigrationError {
        self.expect_error_of(&[needle])
    }

    /// The destination's error, which must come within [`DEADLINE`] and
    /// contain one of `needles`.
    fn expect_error_of(&self, needles: &[&str]) -> MigrationError {
        let error = self
            .result
            .recv_timeout(DEADLINE)
            .unwrap_or_else(|_| panic!("the destination did not end within {DEADLINE:?}"))
            .expect_err("the destination must refuse the session");
        assert!(
            needles.iter().any(|needle| error.chain().contains(needle)),
            "none of {needles:?} in: {}",
            error.chain()
        );
        error
    }
}

/// A source driven by hand: the main channel and the page channels, all
/// past their handshakes.
struct Attacker {
    main: Channel,
    pages: Vec<Channel>,
}

fn connect(address: &Address) -> Channel {
    let mut channel = Channel::connect(address, Duration::from_secs(10)).expect("connect");
    // Generous: a read that outlives it fails the test instead of hanging.
    channel.set_timeouts(DEADLINE).expect("timeouts");
    channel
}

fn handshake(address: &Address, channels: u16) -> Attacker {
    let mut main = connect(address);
    main.send_message(&Message::Hello(Hello {
        handshake: Handshake {
            session_id: SESSION,
            channel_index: 0,
        },
        setup: SessionSetup {
            page_size: 4096,
            channel_count: channels,
            codecs: 0,
            digest: DigestAlgorithm::Xxh3Pages,
            regions: vec![RegionInfo {
                id: 0,
                guest_addr: 0,
                len: REGION_BYTES,
            }],
            guest_kind: "synthetic".into(),
            dictionaries: 0,
            vmm_config_len: 0,
        },
    }))
    .expect("hello");
    assert!(matches!(main.read_message(), Ok(Message::Welcome(_))));
    let pages = (1..=channels)
        .map(|channel_index| {
            let mut channel = connect(address);
            channel
                .send_message(&Message::ChannelHello(ChannelHello {
                    handshake: Handshake {
                        session_id: SESSION,
                        channel_index,
                    },
                }))
                .expect("channel hello");
            assert!(matches!(channel.read_message(), Ok(Message::Welcome(_))));
            channel
        })
        .collect();
    Attacker { main, pages }
}

/// One packet of raw pages of iteration `iteration`.
fn raw_pages(iteration: u32, pages: &[u32]) -> Vec<u8> {
    let mut bytes = raw_pages_prefix(iteration, pages);
    for &page in pages {
        bytes.extend(std::iter::repeat_n(page.to_le_bytes()[0] ^ 0x5a, PAGE));
    }
    bytes
}

fn sync(iteration: u32, last: bool) -> Vec<u8> {
    Message::Sync(Sync {
        iteration,
        last,
        dictionaries: 0,
    })
    .to_bytes()
}

impl Attacker {
    /// Writes on page channel `index` (from 0). The destination may already
    /// have closed it, having refused something earlier: that is the point.
    fn send_pages(&mut self, index: usize, bytes: &[u8]) {
        let _ = self.pages[index].write_all(bytes);
    }

    /// The abort the destination sends on the main channel, which must
    /// mention `needle`; returns when it came.
    fn expect_abort(&mut self, needle: &str) -> Instant {
        self.expect_abort_of(&[needle])
    }

    /// The abort the destination sends on the main channel, which must
    /// mention one of `needles`; returns when it came.
    fn expect_abort_of(&mut self, needles: &[&str]) -> Instant {
        // The destination's heartbeats (and passes applied) may come
        // first, on a slow machine.
        let answer = loop {
            match self.main.read_message() {
                Ok(Message::Heartbeat(_) | Message::PassApplied(_)) => {}
                other => break other,
            }
        };
        match answer {
            Ok(Message::Abort(abort)) => {
                assert!(
                    needles.iter().any(|needle| abort.message.contains(needle)),
                    "none of {needles:?} in the abort: {}",
                    abort.message
                );
                Instant::now()
            }
            other => panic!("expected an abort mentioning one of {needles:?}, got {other:?}"),
        }
    }
}

fn report(attack: &str, started: Instant, rejected: Instant) {
    eprintln!(
        "{attack}: rejected in {:.1} ms",
        rejected.duration_since(started).as_secs_f64() * 1e3
    );
}

#[test]
fn the_same_page_on_two_channels_in_one_iteration_is_refused() {
    let destination = start_destination();
    let mut attacker = handshake(&destination.address, 2);
    let started = Instant::now();
    attacker.send_pages(0, &raw_pages(0, &[1, 7, 9]));
    attacker.send_pages(1, &raw_pages(0, &[3, 7]));
    let needle = "page 7 of region 0 arrived twice in iteration 0";
    let rejected = attacker.expect_abort(needle);
    destination.expect_error(needle);
    report("same page on two channels", started, rejected);
}

#[test]
fn the_same_page_twice_in_one_packet_is_refused() {
    let destination = start_destination();
    let mut attacker = handshake(&destination.address, 1);
    let started = Instant::now();
    attacker.send_pages(0, &raw_pages(0, &[4, 4]));
    let needle = "page 4 of region 0 arrived twice in iteration 0";
    let rejected = attacker.expect_abort(needle);
    destination.expect_error(needle);
    report("same page twice in one packet", started, rejected);
}

#[test]
fn the_same_page_in_two_iterations_is_still_accepted_up_to_the_end() {
    // A page sent again in a later iteration is normal; here the attacker
    // then stops with an abort of its own, which the destination reports.
    let destination = start_destination();
    let mut attacker = handshake(&destination.address, 2);
    attacker.send_pages(0, &raw_pages(0, &[7]));
    for index in 0..2 {
        attacker.send_pages(index, &sync(0, false));
    }
    attacker.send_pages(1, &raw_pages(1, &[7]));
    for index in 0..2 {
        attacker.send_pages(index, &sync(1, false));
    }
    attacker
        .main
        .send_message(&Message::Abort(tern_wire::Abort {
            reason: tern_wire::AbortReason::Cancelled,
            message: "the attacker gives up".into(),
        }))
        .expect("abort");
    destination.expect_error("the attacker gives up");
}

#[test]
fn channels_that_disagree_on_the_last_iteration_are_refused() {
    // Used to hang: the channel that said "last" left, the other waited
    // at the next iteration's barrier for ever.
    let destination = start_destination();
    let mut attacker = handshake(&destination.address, 2);
    let started = Instant::now();
    attacker.send_pages(0, &sync(0, true));
    attacker.send_pages(1, &sync(0, false));
    let needle = "the page channels disagree on whether iteration 0 is the last";
    let rejected = attacker.expect_abort(needle);
    destination.expect_error(needle);
    report("channels disagree on the last sync", started, rejected);
}

#[test]
fn a_page_channel_going_on_after_the_final_iteration_is_refused() {
    let destination = start_destination();
    let mut attacker = handshake(&destination.address, 1);
    attacker
        .main
        .send_message(&Message::Complete(Complete {
            final_iteration: 0,
            sections: 0,
            digest: 0,
        }))
        .expect("complete");
    // The completion names iteration 0 as the final one; the page channel
    // goes on to iteration 1. Whichever the destination reads first, the
    // page channel's state machine (as soon as it knows the final
    // iteration) or the switch-over's comparison refuses it.
    let started = Instant::now();
    attacker.send_pages(0, &sync(0, false));
    attacker.send_pages(0, &sync(1, true));
    let needles = ["the final one", "the source says 0"];
    let rejected = attacker.expect_abort_of(&needles);
    destination.expect_error_of(&needles);
    report(
        "sync beyond the completion's final iteration",
        started,
        rejected,
    );
}

#[test]
fn a_state_section_after_the_completion_is_refused() {
    let destination = start_destination();
    let mut attacker = handshake(&destination.address, 1);
    let started = Instant::now();
    attacker
        .main
        .send_message(&Message::Complete(Complete {
            final_iteration: 0,
            sections: 0,
            digest: 0,
        }))
        .expect("complete");
    // The page channel stays open and silent, so the destination is still
    // waiting for its last sync when the section comes.
    attacker
        .main
        .send_message(&Message::StateSection(StateSectionMsg {
            name: "late".into(),
            version: 1,
            data: vec![1; 64],
        }))
        .expect("section");
    let needle = "StateSection on the main channel after the source's completion";
    let rejected = attacker.expect_abort(needle);
    destination.expect_error(needle);
    report("state section after the completion", started, rejected);
}

#[test]
fn a_flood_of_state_sections_is_refused() {
    let destination = start_destination();
    let mut attacker = handshake(&destination.address, 1);
    let started = Instant::now();
    // Distinct names, so only the bound stops them: the 64th 1 MiB section
    // crosses the 64 MiB total and is refused at its header, before its
    // body is read. The attacker's writes after that may fail: the
    // destination has closed the channel.
    for index in 0..65 {
        let sent = attacker
            .main
            .send_message(&Message::StateSection(StateSectionMsg {
                name: format!("flood-{index}"),
                version: 1,
                data: vec![7; 1 << 20],
            }));
        if sent.is_err() {
            break;
        }
    }
    let needle = "more state than a destination accepts";
    let rejected = attacker.expect_abort(needle);
    destination.expect_error(needle);
    report(
        "a flood of distinct 1 MiB state sections",
        started,
        rejected,
    );
}

/// Issue 23: one state section of the largest size fits the 64 MiB total
/// (version 6 counted its framing too, so it never did). The section is
/// taken; the session then fails only at the digest, which the attacker
/// does not know.
#[test]
fn one_state_section_of_the_largest_size_fits_the_total() {
    let destination = start_destination();
    let mut attacker = handshake(&destination.address, 1);
    attacker
        .main
        .send_message(&Message::StateSection(StateSectionMsg {
            name: "largest".into(),
            version: 1,
            data: vec![7; tern_wire::MAX_SECTION_BYTES],
        }))
        .expect("section");
    attacker
        .main
        .send_message(&Message::Complete(Complete {
            final_iteration: 0,
            sections: 1,
            digest: 0,
        }))
        .expect("complete");
    attacker.send_pages(0, &sync(0, true));
    let error = destination.expect_error("digest");
    assert!(
        matches!(error, MigrationError::DigestMismatch { .. }),
        "{}",
        error.chain()
    );
}
