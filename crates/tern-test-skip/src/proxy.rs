//! A TCP proxy that a test cuts, holds and lets through again: a severed
//! network, a stopped peer and a slow link, with real sockets.
//!
//! Shared by the postcopy recovery tests of tern-engine (synthetic guest)
//! and tern-vmm (KVM guest), which need the same three faults.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const PASS: u8 = 0;
/// Every connection is shut down, new ones are closed at once: a severed
/// network.
const CUT: u8 = 1;
/// Nothing moves, nothing closes: a stopped peer (as SIGSTOP would leave
/// its sockets).
const HOLD: u8 = 2;
/// Bytes keep moving, but those from client to target arrive as 0xFF: a
/// peer (or a link) that sends garbage, which the target must refuse as a
/// protocol error (0xFF is no frame kind). The other direction passes.
const CORRUPT: u8 = 3;

/// A TCP proxy on 127.0.0.1 in front of `target`, with a link of `rate`
/// bytes/s from client to target (so that a transfer lasts long enough to
/// be cut); the other direction is not paced.
pub struct Proxy {
    address: String,
    mode: Arc<AtomicU8>,
    /// How many more new connections pass ([`UNLIMITED`]: all of them),
    /// and how many were turned away past that count.
    admissions: Arc<Admissions>,
    /// The sockets of the connections open now, for a cut, each with the
    /// number of its connection (0 for the first let through): weak, so
    /// that a connection whose copies have ended closes its sockets, and a
    /// peer that writes on gets a reset, as it would without a proxy.
    streams: Arc<Mutex<Vec<Numbered>>>,
    done: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

/// A socket of an open connection, with the number of its connection.
type Numbered = (usize, Weak<TcpStream>);

/// No limit on the new connections a passing proxy lets through.
const UNLIMITED: usize = usize::MAX;

/// The new connections a passing proxy still lets through, and those it
/// turned away past that count.
struct Admissions {
    left: AtomicUsize,
    turned_away: AtomicUsize,
    /// Connections let through by a count that their target closed
    /// before their client did.
    counted_closed_by_target: AtomicUsize,
}

/// Whether a new connection passes, and how.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Admission {
    TurnedAway,
    /// Let through with no count in force.
    Unlimited,
    /// Let through by a [`Proxy::pass_first`] count.
    Counted,
}

impl Admissions {
    /// Takes one admission, or counts the connection as turned away.
    fn admit(&self) -> Admission {
        match self
            .left
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| match left {
                0 => None,
                UNLIMITED => Some(UNLIMITED),
                left => Some(left - 1),
            }) {
            Ok(UNLIMITED) => Admission::Unlimited,
            Ok(_) => Admission::Counted,
            Err(_) => {
                self.turned_away.fetch_add(1, Ordering::AcqRel);
                Admission::TurnedAway
            }
        }
    }
}

/// What a copy does when its side of the connection closes.
enum End {
    /// Client to target: marks that the client closed first.
    Client(Arc<AtomicBool>),
    /// Target to client: counts a target that closed first, for a
    /// connection a [`Proxy::pass_first`] count let through.
    Target {
        client_closed: Arc<AtomicBool>,
        counted: Option<Arc<Admissions>>,
    },
}

impl End {
    fn closed(&self) {
        match self {
            Self::Client(closed) => closed.store(true, Ordering::Release),
            Self::Target {
                client_closed,
                counted: Some(admissions),
            } if !client_closed.load(Ordering::Acquire) => {
                admissions
                    .counted_closed_by_target
                    .fetch_add(1, Ordering::AcqRel);
            }
            Self::Target { .. } => {}
        }
    }
}

/// A link of `rate` bytes per second for one direction, shared by every
/// connection, without burst credit: an idle moment never lets later
/// bytes through faster.
struct Link {
    rate: u64,
    /// When the bytes handed to the link so far have left it.
    free_at: Mutex<Instant>,
}

impl Link {
    /// Paces a copy of `bytes`: the link's clock, not a wait for a
    /// condition.
    fn pace(&self, bytes: usize) {
        let took = Duration::from_secs_f64(bytes as f64 / self.rate as f64);
        let done = {
            let mut free_at = self.free_at.lock().unwrap_or_else(|e| e.into_inner());
            *free_at = (*free_at).max(Instant::now()) + took;
            *free_at
        };
        std::thread::sleep(done.saturating_duration_since(Instant::now()));
    }
}

impl Proxy {
    /// Starts a proxy to `target` (`HOST:PORT`) with a client-to-target
    /// link of `rate` bytes per second.
    ///
    /// # Panics
    /// When no local port can be bound (a broken test machine).
    pub fn start(target: &str, rate: u64) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        listener.set_nonblocking(true).expect("non-blocking accept");
        let address = listener.local_addr().expect("proxy address").to_string();
        let mode = Arc::new(AtomicU8::new(PASS));
        let admissions = Arc::new(Admissions {
            left: AtomicUsize::new(UNLIMITED),
            turned_away: AtomicUsize::new(0),
            counted_closed_by_target: AtomicUsize::new(0),
        });
        let streams: Arc<Mutex<Vec<Numbered>>> = Arc::default();
        let done = Arc::new(AtomicBool::new(false));
        let link = Arc::new(Link {
            rate: rate.max(1),
            free_at: Mutex::new(Instant::now()),
        });
        let target = target.to_string();
        let accept = {
            let (mode, streams, done) = (mode.clone(), streams.clone(), done.clone());
            let admissions = admissions.clone();
            std::thread::spawn(move || {
                let gate = Gate {
                    mode: &mode,
                    admissions: &admissions,
                };
                accept_loop(&listener, &target, &gate, &streams, &done, &link)
            })
        };
        Self {
            address,
            mode,
            admissions,
            streams,
            done,
            accept: Some(accept),
        }
    }

    /// Where clients connect: `127.0.0.1:PORT`.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Severs every connection and refuses new ones.
    pub fn cut(&self) {
        self.mode.store(CUT, Ordering::Release);
        self.sever(|_| true);
    }

    /// Severs connection `number` alone (0 for the first the proxy let
    /// through, in the order it accepted them), if it is still open: one
    /// broken connection while the others, and new ones, carry on.
    /// Returns whether it was open.
    pub fn cut_connection(&self, number: usize) -> bool {
        self.sever(|candidate| candidate == number) > 0
    }

    /// Shuts down the open sockets of the connections `chosen` picks by
    /// number, and forgets them; returns how many sockets were open.
    fn sever(&self, chosen: impl Fn(usize) -> bool) -> usize {
        let mut streams = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        let mut severed = 0;
        streams.retain(|(number, stream)| {
            if !chosen(*number) {
                return true;
            }
            if let Some(stream) = stream.upgrade() {
                let _ = stream.shutdown(Shutdown::Both);
                severed += 1;
            }
            false
        });
        severed
    }

    /// Stops moving bytes, closing nothing.
    pub fn hold(&self) {
        self.mode.store(HOLD, Ordering::Release);
    }

    /// From now on every byte from client to target (on every connection,
    /// open or new) arrives as 0xFF; the other direction passes unchanged.
    pub fn corrupt(&self) {
        self.mode.store(CORRUPT, Ordering::Release);
    }

    /// Lets everything through again (new connections; a cut one stays
    /// closed).
    pub fn pass(&self) {
        self.admissions.left.store(UNLIMITED, Ordering::Release);
        self.mode.store(PASS, Ordering::Release);
    }

    /// Lets the next `connections` new connections through and closes
    /// every newer one at once, as a cut would (those let through keep
    /// passing): a network that breaks again half-way through a
    /// reconnection.
    pub fn pass_first(&self, connections: usize) {
        self.admissions.left.store(connections, Ordering::Release);
        self.mode.store(PASS, Ordering::Release);
    }

    /// The new connections closed at once because a [`Proxy::pass_first`]
    /// count was used up (not those closed while cut).
    pub fn turned_away(&self) -> usize {
        self.admissions.turned_away.load(Ordering::Acquire)
    }

    /// How many of the connections a [`Proxy::pass_first`] count let
    /// through were closed by the target before the client closed them:
    /// the target gave up on them.
    pub fn counted_closed_by_target(&self) -> usize {
        self.admissions
            .counted_closed_by_target
            .load(Ordering::Acquire)
    }
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mode = match self.mode.load(Ordering::Acquire) {
            PASS => "pass",
            CUT => "cut",
            CORRUPT => "corrupt",
            _ => "hold",
        };
        f.debug_struct("Proxy")
            .field("address", &self.address)
            .field("mode", &mode)
            .finish_non_exhaustive()
    }
}

/// Dropped, the proxy first stops listening (its accept thread ends with
/// the listener), then severs every connection: a client that notices
/// the cut and dials again finds nothing listening, as after the end of
/// the process it stood for.
impl Drop for Proxy {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Release);
        if let Some(accept) = self.accept.take() {
            let _ = accept.join();
        }
        self.cut();
    }
}

/// What decides whether a new connection passes.
struct Gate<'a> {
    mode: &'a Arc<AtomicU8>,
    admissions: &'a Arc<Admissions>,
}

impl Gate<'_> {
    /// Whether a new connection passes: not while cut, nor past a
    /// [`Proxy::pass_first`] count.
    fn admits(&self) -> Admission {
        if self.mode.load(Ordering::Acquire) == CUT {
            return Admission::TurnedAway;
        }
        self.admissions.admit()
    }
}

/// Accepts clients until the proxy is dropped, and pairs each with a new
/// connection to `target` while the gate admits it.
fn accept_loop(
    listener: &TcpListener,
    target: &str,
    gate: &Gate<'_>,
    streams: &Mutex<Vec<Numbered>>,
    done: &AtomicBool,
    link: &Arc<Link>,
) {
    let mut next_number = 0;
    while !done.load(Ordering::Acquire) {
        let Ok((client, _)) = listener.accept() else {
            // Non-blocking: nothing to accept; look again shortly (the
            // proxy's own poll, not a test waiting for a condition).
            std::thread::sleep(Duration::from_millis(2));
            continue;
        };
        let admission = gate.admits();
        if admission == Admission::TurnedAway {
            drop(client);
            continue;
        }
        let Ok(server) = TcpStream::connect(target) else {
            continue;
        };
        if client.set_nonblocking(false).is_err() {
            continue;
        }
        let (client, server) = (Arc::new(client), Arc::new(server));
        let number = next_number;
        next_number += 1;
        {
            let mut kept = streams.lock().unwrap_or_else(|e| e.into_inner());
            kept.retain(|(_, stream)| stream.strong_count() > 0);
            for stream in [&client, &server] {
                // A short read timeout so a copy notices a cut or hold soon.
                let _ = stream.set_read_timeout(Some(Duration::from_millis(10)));
                kept.push((number, Arc::downgrade(stream)));
            }
        }
        let (up_from, up_to) = (client.clone(), server.clone());
        let (mode_up, mode_down) = (gate.mode.clone(), gate.mode.clone());
        let link = link.clone();
        let client_closed = Arc::new(AtomicBool::new(false));
        let up_end = End::Client(client_closed.clone());
        let down_end = End::Target {
            client_closed,
            counted: (admission == Admission::Counted).then(|| gate.admissions.clone()),
        };
        std::thread::spawn(move || copy(&up_from, &up_to, &mode_up, Some(&link), &up_end));
        std::thread::spawn(move || copy(&server, &client, &mode_down, None, &down_end));
    }
}

/// Copies `from` to `to` while the proxy passes; ends (shutting both
/// down) when either side closes (told to `end`) or the proxy cuts. The
/// sockets close once both copies of their connection have ended.
fn copy(from: &TcpStream, to: &TcpStream, mode: &AtomicU8, link: Option<&Link>, end: &End) {
    let (mut from, mut to) = (from, to);
    let mut buf = vec![0u8; 16 << 10];
    loop {
        match mode.load(Ordering::Acquire) {
            CUT => break,
            HOLD => {
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            _ => {}
        }
        match from.read(&mut buf) {
            Ok(0) => {
                end.closed();
                break;
            }
            Ok(read) => {
                if let Some(link) = link {
                    link.pace(read);
                }
                if matches!(end, End::Client(_)) && mode.load(Ordering::Acquire) == CORRUPT {
                    buf[..read].fill(0xFF);
                }
                if to.write_all(&buf[..read]).is_err() {
                    break;
                }
            }
            Err(error)
                if matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => break,
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server on 127.0.0.1 that answers one connection.
    fn echo() -> (String, JoinHandle<()>) {
        echo_each(1)
    }

    /// An echo server on 127.0.0.1 that answers `connections`
    /// connections, each on a thread of its own.
    fn echo_each(connections: usize) -> (String, JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            let echoes: Vec<_> = (0..connections)
                .map(|_| {
                    let (mut stream, _) = listener.accept().unwrap();
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 64];
                        while let Ok(read) = stream.read(&mut buf) {
                            if read == 0 || stream.write_all(&buf[..read]).is_err() {
                                break;
                            }
                        }
                    })
                })
                .collect();
            for echo in echoes {
                echo.join().unwrap();
            }
        });
        (address, server)
    }

    /// A client of `proxy` whose reads give up after a minute, never hang.
    fn client_of(proxy: &Proxy) -> TcpStream {
        let client = TcpStream::connect(proxy.address()).unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        client
    }

    /// Sends `bytes` through `client` and returns the echo's answer.
    fn round_trip(client: &mut TcpStream, bytes: &[u8; 4]) -> [u8; 4] {
        let mut answer = [0u8; 4];
        client.write_all(bytes).unwrap();
        client.read_exact(&mut answer).unwrap();
        answer
    }

    #[test]
    fn bytes_pass_both_ways_and_a_cut_closes_the_connection() {
        let (target, server) = echo();
        let proxy = Proxy::start(&target, 1 << 30);
        let mut client = client_of(&proxy);
        assert_eq!(&round_trip(&mut client, b"ping"), b"ping");
        proxy.cut();
        let mut rest = Vec::new();
        // The cut closes the client's connection: EOF or a reset, never
        // a hang (the read timeout above bounds it).
        let end = client.read_to_end(&mut rest);
        assert!(end.as_ref().map_or(true, |&read| read == 0), "{end:?}");
        drop(proxy);
        crate::wait::join_within(server, "the target");
    }

    #[test]
    fn cutting_one_connection_leaves_the_others_passing() {
        let (target, server) = echo_each(2);
        let proxy = Proxy::start(&target, 1 << 30);
        let connect = || {
            let mut client = client_of(&proxy);
            // An answer: the proxy has let this connection through (and
            // numbered it) before the next one arrives.
            round_trip(&mut client, b"ping");
            client
        };
        let (mut first, mut second) = (connect(), connect());
        assert!(proxy.cut_connection(1));
        assert!(!proxy.cut_connection(1), "already cut");
        let end = second.read_to_end(&mut Vec::new());
        assert!(end.as_ref().map_or(true, |&read| read == 0), "{end:?}");
        assert_eq!(&round_trip(&mut first, b"pong"), b"pong");
        drop(first);
        drop(proxy);
        crate::wait::join_within(server, "the target");
    }

    #[test]
    fn a_corrupting_proxy_turns_client_bytes_into_0xff_and_passes_the_answers() {
        let (target, server) = echo();
        let proxy = Proxy::start(&target, 1 << 30);
        let mut client = client_of(&proxy);
        assert_eq!(&round_trip(&mut client, b"ping"), b"ping");
        proxy.corrupt();
        // The echo sends back what reached it: the garbage, unchanged on
        // the way back.
        assert_eq!(round_trip(&mut client, b"pong"), [0xFF; 4]);
        drop(client);
        drop(proxy);
        crate::wait::join_within(server, "the target");
    }

    #[test]
    fn past_its_count_a_passing_proxy_closes_new_connections_at_once() {
        let (target, server) = echo();
        let proxy = Proxy::start(&target, 1 << 30);
        proxy.pass_first(1);
        let mut first = TcpStream::connect(proxy.address()).unwrap();
        first
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let mut second = TcpStream::connect(proxy.address()).unwrap();
        second
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        // The second is closed unanswered: EOF or a reset, never a hang.
        let mut rest = Vec::new();
        let end = second.read_to_end(&mut rest);
        assert!(end.as_ref().map_or(true, |&read| read == 0), "{end:?}");
        assert_eq!(proxy.turned_away(), 1);
        // The first still passes.
        first.write_all(b"ping").unwrap();
        let mut answer = [0u8; 4];
        first.read_exact(&mut answer).unwrap();
        assert_eq!(&answer, b"ping");
        drop(first);
        drop(proxy);
        crate::wait::join_within(server, "the target");
    }

    #[test]
    fn a_counted_connection_the_target_closes_is_counted_and_others_are_not() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let target = listener.local_addr().unwrap().to_string();
        // The target closes each connection as soon as it accepts it.
        let server = std::thread::spawn(move || {
            for _ in 0..2 {
                drop(listener.accept().unwrap());
            }
        });
        let proxy = Proxy::start(&target, 1 << 30);
        let mut uncounted = TcpStream::connect(proxy.address()).unwrap();
        uncounted
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let _ = uncounted.read_to_end(&mut Vec::new());
        // Its copy counted (or not) before it closed the client.
        assert_eq!(proxy.counted_closed_by_target(), 0);
        proxy.pass_first(1);
        let _counted = TcpStream::connect(proxy.address()).unwrap();
        crate::wait::wait_until("the proxy counts the target's close", || {
            proxy.counted_closed_by_target() == 1
        });
        crate::wait::join_within(server, "the target");
        drop(proxy);
    }
}
