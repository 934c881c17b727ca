//! The switch-over waits for a destination behind (protocol 12, issue 31
//! item 3): a real source and destination through a proxy that holds back
//! the destination's `PassApplied` frames, so that to the source the
//! destination never applied a pass until the test lets them through.

use std::io::Write;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common;

use common::*;
use tern_engine::{Address, GuestControl, MigrationParameters, MigrationStatus, Source};
use tern_wire::FrameKind;

/// The destination's main channel as the source gets it: every frame but
/// the passes applied goes through at once; those wait, in order, while
/// the gate is closed.
struct AckGate {
    to_source: Mutex<Option<TcpStream>>,
    held: Mutex<Option<Vec<Vec<u8>>>>,
    /// The source sent its `Complete` (so it had paused its guest) while
    /// the passes applied were held.
    completed_while_held: AtomicBool,
}

impl AckGate {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            to_source: Mutex::new(None),
            held: Mutex::new(Some(Vec::new())),
            completed_while_held: AtomicBool::new(false),
        })
    }

    /// Forwards a frame from the destination, or holds it back.
    fn forward_to_source(&self, frame: Vec<u8>) -> bool {
        let mut held = self.held.lock().unwrap();
        if frame[0] == FrameKind::PassApplied as u8
            && let Some(held) = held.as_mut()
        {
            held.push(frame);
            return true;
        }
        let mut to_source = self.to_source.lock().unwrap();
        to_source.as_mut().unwrap().write_all(&frame).is_ok()
    }

    /// Notes a frame from the source.
    fn note_to_destination(&self, frame: &[u8]) {
        if frame[0] == FrameKind::Complete as u8 && self.held.lock().unwrap().is_some() {
            self.completed_while_held.store(true, Ordering::SeqCst);
        }
    }

    /// Opens the gate: what was held goes to the source, in order, and so
    /// does everything after it. Returns how many frames were held.
    fn release(&self) -> usize {
        let mut held = self.held.lock().unwrap();
        let frames = held.take().unwrap_or_default();
        let mut to_source = self.to_source.lock().unwrap();
        for frame in &frames {
            to_source.as_mut().unwrap().write_all(frame).unwrap();
        }
        frames.len()
    }
}

/// A proxy in front of `destination` whose first connection (the main
/// channel) goes through `gate`, frame by frame; the page channels pass
/// byte for byte. Returns the address the source connects to.
fn gated_proxy(destination: &Address, gate: Arc<AckGate>) -> Address {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = Address::Tcp(listener.local_addr().unwrap().to_string());
    let Address::Tcp(upstream) = destination.clone() else {
        panic!("a TCP destination")
    };
    std::thread::spawn(move || {
        for (index, downstream) in listener.incoming().enumerate() {
            let Ok(mut downstream) = downstream else {
                return;
            };
            let mut upstream = TcpStream::connect(&upstream).unwrap();
            if index == 0 {
                *gate.to_source.lock().unwrap() = Some(downstream.try_clone().unwrap());
                let (mut down, mut up) = (
                    downstream.try_clone().unwrap(),
                    upstream.try_clone().unwrap(),
                );
                let back = gate.clone();
                std::thread::spawn(move || {
                    while let Some(frame) = read_raw_frame(&mut up)
                        && back.forward_to_source(frame)
                    {}
                    let _ = downstream.shutdown(Shutdown::Both);
                });
                let forth = gate.clone();
                std::thread::spawn(move || {
                    while let Some(frame) = read_raw_frame(&mut down) {
                        forth.note_to_destination(&frame);
                        if upstream.write_all(&frame).is_err() {
                            break;
                        }
                    }
                    let _ = upstream.shutdown(Shutdown::Both);
                });
            } else {
                let (mut down, mut up) = (
                    downstream.try_clone().unwrap(),
                    upstream.try_clone().unwrap(),
                );
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut down, &mut upstream);
                    let _ = upstream.shutdown(Shutdown::Both);
                });
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut up, &mut downstream);
                    let _ = downstream.shutdown(Shutdown::Both);
                });
            }
        }
    });
    address
}

/// The source iterates (a 1 ms downtime limit, a paced link and a dirtying
/// guest never fit) while the destination's passes applied are held back;
/// then the limit is raised so that the rules choose to switch over. The
/// source must not pause its guest while, to it, the destination is more
/// than one pass behind: it waits, says so in its live report, and
/// switches over only once the passes applied come through (or, on a host
/// so loaded that the test could not let them through within the wait's
/// budget, with the lag in its report).
#[test]
fn the_source_does_not_pause_until_the_destination_applied_all_but_the_last_pass() {
    let (listener, address) = tcp_listener();
    let receiving = spawn_destination(listener);
    let gate = AckGate::new();
    let through = gated_proxy(&address, gate.clone());
    let mut config = migration_config(2);
    config.downtime_limit = Duration::from_millis(1);
    config.auto_converge = false;
    config.max_bandwidth = Some(64 * MIB);
    let source = Source::new(config).unwrap();
    let handle = source.handle();
    let mut guest = guest(16 * MIB, 8 * MIB);
    guest.resume().unwrap();
    let migrating = std::thread::spawn(move || {
        let result = source.migrate(&mut guest, &through);
        (result, guest)
    });
    wait_until("three passes sent, none acknowledged", || {
        handle.query().ram.iterations >= 3
    });
    handle
        .set_parameters(&{
            let mut patch = MigrationParameters::default();
            patch.downtime_limit = Some(600_000);
            patch
        })
        .unwrap();
    wait_until("the source waits for the destination, or pauses", || {
        let query = handle.query();
        query.destination_catch_up.is_some() || query.status != MigrationStatus::Active
    });
    let query = handle.query();
    assert!(
        query.destination_catch_up.is_some(),
        "the source switched over without waiting for a destination that applied no pass \
         of {}: status {}",
        query.ram.iterations,
        query.status.as_str()
    );
    let held = gate.release();
    assert!(held > 0, "the destination sent no pass applied");
    let (result, guest) = join_within(migrating, "the migration");
    let stats = result.unwrap_or_else(|failure| panic!("{}", failure.error.chain()));
    let received = join_within(receiving, "the destination").unwrap();
    assert!(received.guest.is_running() && !guest.is_running());
    let catch_up = stats
        .destination_catch_up
        .expect("the report says the switch-over waited");
    assert!(
        !gate.completed_while_held.load(Ordering::SeqCst) || catch_up.behind_at_pause > 0,
        "the source paused while the destination's passes applied were held, and its report \
         does not say the destination was behind: {catch_up:?}"
    );
    assert!(stats.downtime_limit == 600_000 && !stats.forced_switch_over);
    eprintln!(
        "{held} passes applied held; the source waited {:.1} ms, paused with the destination \
         {} passes behind, after {} iterations",
        catch_up.waited_ms, catch_up.behind_at_pause, stats.ram.iterations
    );
}
