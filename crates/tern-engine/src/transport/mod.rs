//! Channels: TCP, Unix, vsock or inherited stream sockets, with vectored
//! sends from raw guest pointers and reads straight into guest memory, and
//! TLS over any of them.
//!
//! This folder holds everything that moves bytes between source and
//! destination: this file (addresses, listeners, [`Channel`], [`Segment`]),
//! [`seam`] (how the engine gets its channels: [`Connect`] and [`Accept`],
//! which an embedder may implement), [`socket`] (vsock and inherited
//! descriptors), [`auth`] (the shared-key handshake), [`tls`] (rustls and
//! kernel TLS), [`security`] (what each side requires of a channel, with the
//! leaf `channel_security`: what a handshake established) and
//! [`zerocopy`] (the zero-copy senders built on a [`Channel`]).
//! Dependencies point inwards only: the others use this file, never the
//! reverse.

pub mod auth;
mod channel_security;
mod expected;
pub(crate) mod fds;
pub mod seam;
pub mod security;
pub mod socket;
/// TLS: rustls (feature `tls`), or the same API that never makes a channel
/// TLS (without it).
#[cfg(feature = "tls")]
pub mod tls;
#[cfg(not(feature = "tls"))]
#[path = "tls_off.rs"]
pub mod tls;
mod tls_types;
pub mod zerocopy;

pub use expected::Expected;
pub use seam::{Accept, Connect, Connector};

use std::fmt;
use std::io;
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::{Duration, Instant};

use tern_wire::{Event, FRAME_HEADER_LEN, FrameDecoder, FrameHeader, Message};

use crate::cancel::CancelToken;
use crate::error::ChannelError;

/// Where a destination listens, or a source connects.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Address {
    /// `tcp:HOST:PORT` or plain `HOST:PORT`. An empty host (`tcp::PORT`, as
    /// QEMU writes it) listens on every interface and connects to this
    /// machine.
    Tcp(String),
    /// `unix:PATH`.
    Unix(PathBuf),
    /// `vsock:CID:PORT`: AF_VSOCK, between a host and its guests (or, with
    /// CID 1, on this machine where `vsock_loopback` is loaded).
    Vsock {
        /// Context id: 2 is the host, guests have their own; the listener's
        /// is ignored (it takes any).
        cid: u32,
        /// Port.
        port: u32,
    },
    /// `fd:N` or `fd:N,M,...`: stream sockets this process inherited. One
    /// listening socket (either side accepts on it), or connected sockets:
    /// the source needs one per channel (main first), the destination takes
    /// them as if accepted.
    Fd(Vec<RawFd>),
}

impl FromStr for Address {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        if let Some(rest) = text.strip_prefix("vsock:") {
            return socket::parse_vsock(rest).map(|(cid, port)| Self::Vsock { cid, port });
        }
        if let Some(rest) = text.strip_prefix("fd:") {
            return socket::parse_fds(rest).map(Self::Fd);
        }
        if let Some(path) = text.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: address needs a path".to_string());
            }
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        let (host_port, host_may_be_empty) = match text.strip_prefix("tcp:") {
            Some(rest) => (rest, true),
            None => (text, false),
        };
        match host_port.rsplit_once(':') {
            Some((host, port))
                if (host_may_be_empty || !host.is_empty()) && port.parse::<u16>().is_ok() =>
            {
                Ok(Self::Tcp(host_port.to_string()))
            }
            _ => Err(format!(
                "'{text}' is not an address: use HOST:PORT, tcp:HOST:PORT, tcp::PORT, unix:PATH, \
                 vsock:CID:PORT or fd:N"
            )),
        }
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tcp(host_port) => write!(f, "tcp:{host_port}"),
            Self::Unix(path) => write!(f, "unix:{}", path.display()),
            Self::Vsock { cid, port } => write!(f, "vsock:{cid}:{port}"),
            Self::Fd(fds) => {
                let list: Vec<String> = fds.iter().map(ToString::to_string).collect();
                write!(f, "fd:{}", list.join(","))
            }
        }
    }
}

impl Address {
    /// The transport's name in reports: `tcp`, `unix`, `vsock` or `fd`.
    pub fn transport(&self) -> &'static str {
        match self {
            Self::Tcp(_) => "tcp",
            Self::Unix(_) => "unix",
            Self::Vsock { .. } => "vsock",
            Self::Fd(_) => "fd",
        }
    }

    /// Whether only this machine can connect to a listener bound here,
    /// known before binding: `Some(true)` for a Unix socket or a TCP host
    /// that resolves only to loopback addresses, `Some(false)` for every
    /// interface (`tcp::PORT`), another TCP host, vsock or inherited
    /// sockets, `None` when the host does not resolve.
    pub fn is_local_only(&self) -> Option<bool> {
        match self {
            Self::Unix(_) => Some(true),
            Self::Vsock { .. } | Self::Fd(_) => Some(false),
            Self::Tcp(host_port) => {
                if host_port.starts_with(':') {
                    return Some(false);
                }
                let addresses: Vec<_> = host_port.to_socket_addrs().ok()?.collect();
                (!addresses.is_empty())
                    .then(|| addresses.iter().all(|address| address.ip().is_loopback()))
            }
        }
    }

    /// The host name a TLS client checks the destination's certificate
    /// against when none is given: the host of a TCP address.
    pub fn host(&self) -> Option<&str> {
        let Self::Tcp(host_port) = self else {
            return None;
        };
        let (host, _) = host_port.rsplit_once(':')?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        (!host.is_empty()).then_some(host)
    }
}

/// A bound listening socket.
#[derive(Debug)]
#[non_exhaustive]
pub enum Listener {
    /// TCP.
    Tcp(TcpListener),
    /// Unix stream socket; the path is removed on drop.
    Unix(UnixListener, PathBuf),
    /// A listening vsock or inherited socket.
    Socket(socket2::Socket),
    /// Anything else that hands out channels: connected sockets passed in,
    /// or an embedder's own [`Accept`].
    Custom(Box<dyn Accept>),
}

impl Listener {
    /// Binds `address`. A stale Unix socket file is replaced.
    pub fn bind(address: &Address) -> io::Result<Self> {
        match address {
            Address::Tcp(host_port) => match host_port.strip_prefix(':') {
                // Every interface: IPv6's wildcard also takes IPv4 on Linux,
                // unless the machine has no IPv6.
                Some(port) => TcpListener::bind(format!("[::]:{port}"))
                    .or_else(|_| TcpListener::bind(format!("0.0.0.0:{port}")))
                    .map(Self::Tcp),
                None => Ok(Self::Tcp(TcpListener::bind(host_port.as_str())?)),
            },
            Address::Unix(path) => {
                if path.exists() {
                    std::fs::remove_file(path)?;
                }
                Ok(Self::Unix(UnixListener::bind(path)?, path.clone()))
            }
            Address::Vsock { port, .. } => socket::listen_vsock(*port).map(Self::Socket),
            Address::Fd(fds) => socket::listener_from_fds(fds),
        }
    }

    /// Whether only this machine can connect: a loopback TCP address or a
    /// Unix socket (guarded by file permissions). The destination's policy
    /// on unauthenticated sessions starts from this.
    pub fn is_local_only(&self) -> bool {
        match self {
            Self::Tcp(listener) => listener
                .local_addr()
                .is_ok_and(|address| address.ip().is_loopback()),
            Self::Unix(..) => true,
            Self::Socket(_) | Self::Custom(_) => false,
        }
    }

    /// The address a source should connect to (with the actual port when
    /// bound to port 0).
    pub fn local_address(&self) -> io::Result<Address> {
        match self {
            Self::Tcp(listener) => Ok(Address::Tcp(listener.local_addr()?.to_string())),
            Self::Unix(_, path) => Ok(Address::Unix(path.clone())),
            Self::Socket(socket) => socket::local_address(socket),
            Self::Custom(accept) => Ok(accept.address()),
        }
    }

    /// The socket a connection arrives on, to poll beside other files;
    /// `None` for an embedder's listener, which only waits by itself.
    pub(crate) fn readiness_fd(&self) -> Option<RawFd> {
        match self {
            Self::Tcp(listener) => Some(listener.as_raw_fd()),
            Self::Unix(listener, _) => Some(listener.as_raw_fd()),
            Self::Socket(socket) => Some(socket.as_raw_fd()),
            Self::Custom(_) => None,
        }
    }

    /// Waits at most `timeout` for a connection.
    pub fn accept_timeout(&self, timeout: Duration) -> Result<Channel, ChannelError> {
        let fd = match self {
            Self::Tcp(listener) => listener.as_raw_fd(),
            Self::Unix(listener, _) => listener.as_raw_fd(),
            Self::Socket(socket) => socket.as_raw_fd(),
            Self::Custom(accept) => return accept.accept_timeout(timeout),
        };
        if !poll_readable(fd, timeout).map_err(ChannelError::Io)? {
            return Err(ChannelError::Timeout("a connection"));
        }
        let stream = match self {
            Self::Tcp(listener) => {
                let (stream, _) = listener.accept().map_err(ChannelError::Io)?;
                Stream::Tcp(stream)
            }
            Self::Unix(listener, _) => {
                let (stream, _) = listener.accept().map_err(ChannelError::Io)?;
                Stream::Unix(stream)
            }
            Self::Socket(socket) => {
                let (stream, _) = socket.accept().map_err(ChannelError::Io)?;
                Stream::Socket(stream)
            }
            Self::Custom(_) => unreachable!("returned above"),
        };
        Channel::new(stream)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Self::Unix(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

#[derive(Debug)]
enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
    /// vsock, an inherited socket, or a socket whose TLS records the kernel
    /// handles (kTLS): plain reads and writes either way.
    Socket(socket2::Socket),
    /// TLS in user space: every byte goes through rustls.
    #[cfg_attr(
        not(feature = "tls"),
        expect(dead_code, reason = "no TLS stream exists without the tls feature")
    )]
    Tls(Box<tls::TlsStream>),
}

/// One connected channel.
#[derive(Debug)]
pub struct Channel {
    stream: Stream,
    fd: RawFd,
    /// How long one whole transfer (a message, a packet) may take, from its
    /// first system call to its last; `None` until [`Channel::set_timeouts`].
    message_timeout: Option<Duration>,
    /// What the channel's handshake established, for the peer's checks and
    /// the statistics.
    security: channel_security::ChannelSecurity,
    /// Seals every control frame sent, once the key exchange agreed a
    /// session key (the main channel with a shared key).
    sealer: Option<Box<auth::ControlSealer>>,
    /// Decodes the control frames this channel's readers read
    /// ([`Channel::read_expected`]): refuses a kind the reader does not
    /// expect at its header, and opens sealed frames once the key exchange
    /// agreed a session key. (A destination reads its channels with its
    /// own decoder, which holds its opener.) `None` only while a read
    /// holds it.
    control: Option<Box<FrameDecoder>>,
    /// The message being read, when it spans several reads.
    transfer: Option<Transfer>,
}

/// One message read in several calls (a header, then its body, or a
/// packet's header, table and payload): its deadline is the I/O timeout
/// from its first byte, or `limit` if that comes first, however the bytes
/// trickle in.
#[derive(Clone, Copy, Debug)]
struct Transfer {
    limit: Option<Instant>,
    /// Known once the first byte has arrived.
    deadline: Option<Instant>,
}

/// A handle that shuts a channel down from another thread, waking any read
/// or write blocked on it. It can do nothing else, so it is safe to hold on
/// a TLS channel whose record state the owning thread keeps.
#[derive(Debug)]
pub struct ShutdownHandle(std::os::fd::OwnedFd);

impl ShutdownHandle {
    /// Bytes the socket holds that its peer has not acknowledged.
    pub(crate) fn unacknowledged_bytes(&self) -> Option<u64> {
        crate::switch_over_timeline::socket_unacknowledged(self.0.as_raw_fd())
    }

    /// Shuts both directions down.
    pub fn shutdown(&self) {
        // SAFETY: shutting down an open socket has no memory effects.
        unsafe {
            libc::shutdown(self.0.as_raw_fd(), libc::SHUT_RDWR);
        }
    }
}

/// A piece of a vectored send: a pointer and a length. The pointer may be
/// into guest memory; see [`Channel::send_vectored`].
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Segment {
    /// First byte.
    pub ptr: *const u8,
    /// Length in bytes.
    pub len: usize,
}

impl Segment {
    /// The segment as an iovec for `sendmsg`/`readv`; `None` when empty.
    pub(crate) fn iovec(&self) -> Option<libc::iovec> {
        (self.len > 0).then_some(libc::iovec {
            iov_base: self.ptr as *mut libc::c_void,
            iov_len: self.len,
        })
    }
}

impl Channel {
    fn new(stream: Stream) -> Result<Self, ChannelError> {
        let fd = match &stream {
            Stream::Tcp(tcp) => {
                tcp.set_nodelay(true).map_err(ChannelError::Io)?;
                tcp.as_raw_fd()
            }
            Stream::Unix(unix) => unix.as_raw_fd(),
            Stream::Socket(socket) => {
                // Not TCP (vsock, Unix) refuses the option; that is fine.
                let _ = socket.set_tcp_nodelay(true);
                socket.as_raw_fd()
            }
            Stream::Tls(tls) => tls.raw_fd(),
        };
        Ok(Self {
            stream,
            fd,
            message_timeout: None,
            security: channel_security::ChannelSecurity::default(),
            sealer: None,
            control: Some(Box::new(FrameDecoder::new())),
            transfer: None,
        })
    }

    /// From now on every control frame sent is sealed with `sealer`, and
    /// every one [`Channel::read_expected`] reads must pass `opener` (a
    /// destination passes `None`: its decoder holds the opener).
    pub(crate) fn seal_control(
        &mut self,
        sealer: auth::ControlSealer,
        opener: Option<auth::ControlOpener>,
    ) {
        // Boxed: the keys are large and most channels have none.
        self.sealer = Some(Box::new(sealer));
        if let (Some(opener), Some(control)) = (opener, &mut self.control) {
            control.seal_with(Box::new(opener));
        }
    }

    /// Whether the control frames sent on this channel are sealed.
    pub fn is_sealed(&self) -> bool {
        self.sealer.is_some()
    }

    /// Starts a message that takes several reads: until
    /// [`Channel::end_transfer`], all of them count against one deadline,
    /// the I/O timeout from the first byte (a silent peer is still allowed
    /// the I/O timeout before it), or `limit` if that comes first.
    pub fn begin_transfer(&mut self, limit: Option<Instant>) {
        self.transfer = Some(Transfer {
            limit,
            deadline: None,
        });
    }

    /// Ends the message [`Channel::begin_transfer`] started.
    pub fn end_transfer(&mut self) {
        self.transfer = None;
    }

    /// The clock of the next read: the socket's own timeout for a read of
    /// its own; within a transfer, what is left of the transfer's deadline,
    /// which is set when its first byte arrives.
    fn read_clock(&mut self) -> Result<TransferClock, ChannelError> {
        let Some(mut transfer) = self.transfer else {
            return Ok(TransferClock::new(
                self.fd,
                libc::SO_RCVTIMEO,
                self.message_timeout,
            ));
        };
        let now = Instant::now();
        let limit_left = transfer
            .limit
            .map(|limit| limit.saturating_duration_since(now));
        let deadline = match transfer.deadline {
            Some(deadline) => deadline,
            None => {
                // The wait for the first byte is the peer's silence, bounded
                // as any read (and by the limit).
                let wait = match (self.message_timeout, limit_left) {
                    (Some(timeout), Some(left)) => Some(timeout.min(left)),
                    (timeout, left) => timeout.or(left),
                };
                if let Some(wait) = wait
                    && !self.wait_readable(wait)?
                {
                    return Err(if limit_left.is_some_and(|left| left <= wait) {
                        TransferClock::OUTLASTED
                    } else {
                        ChannelError::Timeout("the peer (I/O timed out)")
                    });
                }
                let first_byte = Instant::now();
                let own = self.message_timeout.map(|timeout| first_byte + timeout);
                let deadline = match (own, transfer.limit) {
                    (Some(own), Some(limit)) => own.min(limit),
                    (own, limit) => match own.or(limit) {
                        Some(deadline) => deadline,
                        None => {
                            return Ok(TransferClock::new(self.fd, libc::SO_RCVTIMEO, None));
                        }
                    },
                };
                transfer.deadline = Some(deadline);
                self.transfer = Some(transfer);
                deadline
            }
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(TransferClock::OUTLASTED);
        }
        Ok(TransferClock::narrowed_from_start(
            self.fd,
            libc::SO_RCVTIMEO,
            left,
            self.message_timeout,
        ))
    }

    /// Both ends of a connected pair of channels over a Unix socket pair,
    /// each with 5 s timeouts: a peer for unit tests of one side.
    #[cfg(test)]
    pub(crate) fn pair() -> (Self, Self) {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut ours = Self::from_socket(ours.into()).unwrap();
        let mut theirs = Self::from_socket(theirs.into()).unwrap();
        ours.set_timeouts(Duration::from_secs(5)).unwrap();
        theirs.set_timeouts(Duration::from_secs(5)).unwrap();
        (ours, theirs)
    }

    /// A channel over a connected stream socket this process owns (one an
    /// embedder connected or accepted itself, or inherited). Fails when `fd`
    /// is not a stream socket.
    pub fn from_socket(fd: std::os::fd::OwnedFd) -> Result<Self, ChannelError> {
        Self::new(Stream::Socket(socket::stream_socket(fd)?))
    }

    /// The peer's IP address, for a TCP channel.
    pub fn peer_ip(&self) -> Option<std::net::IpAddr> {
        // SAFETY: `self.fd` is open for as long as `self` lives, which
        // covers this call.
        let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.fd) };
        let address = socket2::SockRef::from(&borrowed).peer_addr().ok()?;
        address.as_socket().map(|socket| socket.ip())
    }

    /// The transport and security the channel's handshake established.
    pub fn security(&self) -> &channel_security::ChannelSecurity {
        &self.security
    }

    /// Records that the peer proved it holds the shared key.
    pub(crate) fn mark_key_authenticated(&mut self) {
        self.security.key_authenticated = true;
    }

    /// Whether the channel's bytes are the socket's bytes (no user-space
    /// TLS in between), so that the kernel may read the sent pages straight
    /// from guest memory.
    pub fn is_raw(&self) -> bool {
        !matches!(self.stream, Stream::Tls(_))
    }

    /// A handle that shuts this channel down from another thread.
    pub fn shutdown_handle(&self) -> Result<ShutdownHandle, ChannelError> {
        // SAFETY: `self.fd` is open for as long as `self` lives, which
        // covers this call.
        let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.fd) };
        borrowed
            .try_clone_to_owned()
            .map(ShutdownHandle)
            .map_err(ChannelError::Io)
    }

    /// The underlying socket, for the TLS handshake that wraps it.
    #[cfg_attr(
        not(feature = "tls"),
        expect(dead_code, reason = "only the TLS handshake takes the socket back")
    )]
    fn into_socket(self) -> Result<socket2::Socket, ChannelError> {
        let fd: std::os::fd::OwnedFd = match self.stream {
            Stream::Tcp(tcp) => tcp.into(),
            Stream::Unix(unix) => unix.into(),
            Stream::Socket(socket) => socket.into(),
            Stream::Tls(_) => {
                return Err(ChannelError::Io(io::Error::other(
                    "the channel already runs TLS",
                )));
            }
        };
        Ok(socket2::Socket::from(fd))
    }

    /// Connects to `address`, retrying for up to `timeout` while the
    /// destination is not listening yet.
    pub fn connect(address: &Address, timeout: Duration) -> Result<Self, ChannelError> {
        Self::connect_cancellable(address, timeout, &CancelToken::new())
    }

    /// [`Channel::connect`], giving up between attempts once `cancel` is
    /// cancelled (an error of kind [`io::ErrorKind::Interrupted`]). One
    /// attempt is not interrupted: a destination that drops the SYN
    /// still holds it until `timeout`.
    pub fn connect_cancellable(
        address: &Address,
        timeout: Duration,
        cancel: &CancelToken,
    ) -> Result<Self, ChannelError> {
        let deadline = Instant::now() + timeout;
        loop {
            if cancel.is_cancelled() {
                return Err(ChannelError::Connect(
                    address.to_string(),
                    io::Error::new(io::ErrorKind::Interrupted, "the migration was cancelled"),
                ));
            }
            let attempt = match address {
                Address::Tcp(host_port) => connect_tcp(host_port, timeout).map(Stream::Tcp),
                Address::Unix(path) => UnixStream::connect(path).map(Stream::Unix),
                Address::Vsock { cid, port } => {
                    socket::connect_vsock(*cid, *port, timeout).map(Stream::Socket)
                }
                Address::Fd(_) => {
                    return Err(ChannelError::Connect(
                        address.to_string(),
                        io::Error::other("inherited sockets are taken by a Connector, not dialled"),
                    ));
                }
            };
            match attempt {
                Ok(stream) => return Self::new(stream),
                Err(error)
                    if Instant::now() < deadline
                        && matches!(
                            error.kind(),
                            io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound
                        ) =>
                {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(error) => return Err(ChannelError::Connect(address.to_string(), error)),
            }
        }
    }

    pub(crate) fn raw_fd(&self) -> RawFd {
        self.fd
    }

    /// Sets the deadline of every transfer: one whole message or packet,
    /// sent or received, must complete within `timeout` of its first system
    /// call, however its bytes trickle in or out (a peer sending one byte
    /// per second does not restart the clock).
    pub fn set_timeouts(&mut self, timeout: Duration) -> Result<(), ChannelError> {
        set_socket_timeout(self.fd, libc::SO_RCVTIMEO, timeout)
            .and_then(|()| set_socket_timeout(self.fd, libc::SO_SNDTIMEO, timeout))
            .map_err(ChannelError::Io)?;
        self.message_timeout = Some(timeout);
        Ok(())
    }

    /// Shuts both directions down, waking any thread blocked on this channel.
    pub fn shutdown(&self) {
        // SAFETY: shutting down an open socket has no memory effects.
        unsafe {
            libc::shutdown(self.fd, libc::SHUT_RDWR);
        }
    }

    /// A second handle on the same socket, for a thread that only reads
    /// (or only writes) while another thread uses this one. A user-space
    /// TLS channel has one record state and cannot be shared this way (use
    /// [`Channel::shutdown_handle`] to stop it from elsewhere).
    pub fn try_clone(&self) -> Result<Self, ChannelError> {
        let stream = match &self.stream {
            Stream::Tcp(tcp) => Stream::Tcp(tcp.try_clone().map_err(ChannelError::Io)?),
            Stream::Unix(unix) => Stream::Unix(unix.try_clone().map_err(ChannelError::Io)?),
            Stream::Socket(socket) => Stream::Socket(socket.try_clone().map_err(ChannelError::Io)?),
            Stream::Tls(_) => {
                return Err(ChannelError::Io(io::Error::other(
                    "a TLS channel cannot be duplicated",
                )));
            }
        };
        let fd = match &stream {
            Stream::Tcp(tcp) => tcp.as_raw_fd(),
            Stream::Unix(unix) => unix.as_raw_fd(),
            Stream::Socket(socket) => socket.as_raw_fd(),
            Stream::Tls(_) => unreachable!("refused above"),
        };
        if self.is_sealed() {
            return Err(ChannelError::Io(io::Error::other(
                "a channel whose control frames are sealed cannot be duplicated",
            )));
        }
        Ok(Self {
            stream,
            fd,
            security: self.security.clone(),
            message_timeout: self.message_timeout,
            sealer: None,
            control: Some(Box::new(FrameDecoder::new())),
            transfer: None,
        })
    }

    /// Writes all of `bytes`, within the transfer deadline.
    pub fn write_all(&mut self, bytes: &[u8]) -> Result<(), ChannelError> {
        let segment = Segment {
            ptr: bytes.as_ptr(),
            len: bytes.len(),
        };
        // SAFETY: the segment is `bytes`, borrowed for the whole call.
        unsafe { self.send_vectored(&[segment]) }
    }

    /// Encodes and sends one control message (sealed when the channel
    /// seals its control frames).
    pub fn send_message(&mut self, message: &Message) -> Result<(), ChannelError> {
        self.send_message_counted(message).map(|_| ())
    }

    /// [`Channel::send_message`], returning the bytes sent.
    pub fn send_message_counted(&mut self, message: &Message) -> Result<usize, ChannelError> {
        let mut bytes = message.to_bytes();
        if let Some(sealer) = &mut self.sealer {
            sealer.seal(&mut bytes);
        }
        self.write_all(&bytes)?;
        Ok(bytes.len())
    }

    /// Reads exactly `buf.len()` bytes; a clean end of stream is reported as
    /// [`ChannelError::Closed`].
    pub fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), ChannelError> {
        let segment = Segment {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
        };
        // SAFETY: the segment is `buf`, borrowed exclusively for the call.
        unsafe { self.read_scattered(&[segment]) }
    }

    /// Reads and validates a frame header.
    pub fn read_frame_header(&mut self) -> Result<FrameHeader, ChannelError> {
        let mut head = [0u8; FRAME_HEADER_LEN];
        self.read_exact(&mut head)?;
        Ok(FrameHeader::decode(&head)?)
    }

    /// Reads one control message of a kind `expected` names (frame header
    /// and body, and its seal when the channel's frames are sealed), all of
    /// it within one transfer deadline. Any other kind is refused at its
    /// header, and the channel reads nothing more after a refused frame.
    pub fn read_expected(&mut self, expected: Expected) -> Result<Message, ChannelError> {
        self.read_expected_until(expected, None)
    }

    /// [`Channel::read_expected`], cut off at `limit` whatever the peer
    /// trickles (a switch-over answer has its own deadline).
    pub fn read_expected_until(
        &mut self,
        expected: Expected,
        limit: Option<Instant>,
    ) -> Result<Message, ChannelError> {
        let Some(mut control) = self.control.take() else {
            return Err(ChannelError::Io(io::Error::other(
                "a control read is already under way on this channel",
            )));
        };
        control.restrict(Some((expected.kinds, expected.name)));
        self.begin_transfer(limit);
        let message = self.read_control(&mut control);
        self.end_transfer();
        self.control = Some(control);
        message
    }

    /// Reads any control message ([`Expected::ANY_CONTROL`]): for tools
    /// and tests that play a peer; the engine's readers say what they
    /// expect.
    pub fn read_message(&mut self) -> Result<Message, ChannelError> {
        self.read_expected(Expected::ANY_CONTROL)
    }

    /// Feeds `control` exactly the bytes it asks for until it completes a
    /// message: nothing of the next frame is read.
    fn read_control(&mut self, control: &mut FrameDecoder) -> Result<Message, ChannelError> {
        loop {
            let buf = control.buffer();
            let len = buf.len();
            self.read_exact(buf)?;
            match control.filled(len)? {
                None => {}
                Some(Event::Message(message)) => return Ok(message),
                // Refused at the header: page packets are never expected.
                Some(Event::Pages(_)) => {
                    return Err(ChannelError::Protocol(tern_wire::WireError::Unexpected {
                        got: tern_wire::FrameKind::Pages,
                        expected: "a control message",
                    }));
                }
            }
        }
    }

    /// Waits up to `timeout` for the channel to have data (or to be closed).
    pub fn wait_readable(&self, timeout: Duration) -> Result<bool, ChannelError> {
        if let Stream::Tls(tls) = &self.stream
            && tls.has_buffered_plaintext()
        {
            return Ok(true);
        }
        poll_readable(self.fd, timeout).map_err(ChannelError::Io)
    }

    /// Sends all segments in order with as few system calls as possible.
    ///
    /// # Safety
    /// Every segment must point to `len` readable bytes for the duration of
    /// the call. The bytes may be written concurrently by others (guest
    /// memory); the kernel then sends some mix of old and new bytes, which
    /// the dirty log makes harmless.
    pub unsafe fn send_vectored(&mut self, segments: &[Segment]) -> Result<(), ChannelError> {
        if let Stream::Tls(tls) = &mut self.stream {
            // SAFETY: the caller's contract, passed on.
            return unsafe { tls.send_segments(segments, self.message_timeout) };
        }
        let mut iovecs = to_iovecs(segments);
        let mut first = 0;
        let mut clock = TransferClock::new(self.fd, libc::SO_SNDTIMEO, self.message_timeout);
        while first < iovecs.len() {
            clock.before_call()?;
            let batch = &mut iovecs[first..];
            let count = batch.len().min(libc::UIO_MAXIOV as usize);
            // SAFETY: an all-zero msghdr is a valid empty message.
            let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
            header.msg_iov = batch.as_mut_ptr();
            header.msg_iovlen = count;
            // SAFETY: the iovecs point to readable memory (caller's
            // contract) and live until the call returns; `header` points to
            // them. MSG_NOSIGNAL turns a closed peer into EPIPE instead of a
            // signal.
            let sent = unsafe { libc::sendmsg(self.fd, &header, libc::MSG_NOSIGNAL) };
            if sent < 0 {
                let error = io::Error::last_os_error();
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(clock.failed(error));
            }
            first = advance(&mut iovecs, first, crate::numeric::syscall_count(sent));
        }
        Ok(())
    }

    /// Reads exactly the sum of the segments' lengths, scattering the bytes
    /// into them in order.
    ///
    /// # Safety
    /// Every segment must point to `len` writable bytes that nothing else
    /// accesses during the call, and that lie inside memory the caller has
    /// bounds-checked (guest pages or a scratch buffer).
    pub unsafe fn read_scattered(&mut self, segments: &[Segment]) -> Result<(), ChannelError> {
        let mut clock = self.read_clock()?;
        if let Stream::Tls(tls) = &mut self.stream {
            // SAFETY: the caller's contract, passed on.
            return unsafe { tls.read_segments(segments, clock) };
        }
        let mut iovecs = to_iovecs(segments);
        let mut first = 0;
        while first < iovecs.len() {
            clock.before_call()?;
            let batch = &mut iovecs[first..];
            let count = libc::c_int::try_from(batch.len())
                .map_or(libc::UIO_MAXIOV, |len| len.min(libc::UIO_MAXIOV));
            // SAFETY: the iovecs describe writable memory (caller's contract)
            // and live until the call returns.
            let read = unsafe { libc::readv(self.fd, batch.as_ptr(), count) };
            if read < 0 {
                let error = io::Error::last_os_error();
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(clock.failed(error));
            }
            if read == 0 {
                return Err(ChannelError::Closed);
            }
            first = advance(&mut iovecs, first, crate::numeric::syscall_count(read));
        }
        Ok(())
    }
}

/// The deadline of one transfer that may take several system calls. The
/// socket's own timeout bounds each call; after the first, the clock
/// narrows it to what is left of the transfer's deadline, so partial
/// progress never restarts the wait, and puts it back when the transfer
/// ends.
struct TransferClock {
    fd: RawFd,
    option: libc::c_int,
    timeout: Option<Duration>,
    started: Option<Instant>,
    narrowed: bool,
    /// The socket's timeout outside this transfer.
    restore: Option<Duration>,
}

impl TransferClock {
    const OUTLASTED: ChannelError =
        ChannelError::Timeout("the peer (a transfer outlasted the I/O timeout)");

    /// The error for a failed call: a timeout after partial progress is the
    /// transfer's deadline, not a silent peer.
    fn failed(&self, error: io::Error) -> ChannelError {
        match map_io(error) {
            ChannelError::Timeout(_) if self.narrowed => Self::OUTLASTED,
            other => other,
        }
    }

    fn new(fd: RawFd, option: libc::c_int, timeout: Option<Duration>) -> Self {
        Self {
            fd,
            option,
            timeout,
            started: None,
            narrowed: false,
            restore: timeout,
        }
    }

    /// A clock of `left` whose first call is narrowed too: what is left of
    /// a transfer that began earlier. The socket's timeout goes back to
    /// `restore` when the clock ends.
    fn narrowed_from_start(
        fd: RawFd,
        option: libc::c_int,
        left: Duration,
        restore: Option<Duration>,
    ) -> Self {
        Self {
            fd,
            option,
            timeout: Some(left),
            started: Some(Instant::now()),
            narrowed: false,
            restore,
        }
    }

    /// Called before every system call of the transfer.
    fn before_call(&mut self) -> Result<(), ChannelError> {
        let Some(timeout) = self.timeout else {
            return Ok(());
        };
        let Some(started) = self.started else {
            self.started = Some(Instant::now());
            return Ok(());
        };
        let left = timeout.saturating_sub(started.elapsed());
        if left.is_zero() {
            return Err(Self::OUTLASTED);
        }
        // A zero socket timeout would mean "wait forever".
        set_socket_timeout(self.fd, self.option, left.max(Duration::from_millis(1)))
            .map_err(ChannelError::Io)?;
        self.narrowed = true;
        Ok(())
    }
}

impl Drop for TransferClock {
    fn drop(&mut self) {
        if self.narrowed {
            // Best effort: a socket whose option cannot be set is broken,
            // and its next transfer says so. A zero timeout is "none".
            let timeout = self.restore.unwrap_or(Duration::ZERO);
            let _ = set_socket_timeout(self.fd, self.option, timeout);
        }
    }
}

/// Sets `SO_RCVTIMEO` or `SO_SNDTIMEO`.
fn set_socket_timeout(fd: RawFd, option: libc::c_int, timeout: Duration) -> io::Result<()> {
    let value = libc::timeval {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_usec: libc::suseconds_t::from(timeout.subsec_micros()),
    };
    // SAFETY: `value` is a valid timeval that outlives the call, and its
    // size is passed with it.
    let result = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            option,
            (&raw const value).cast(),
            crate::numeric::socklen_of::<libc::timeval>(),
        )
    };
    if result == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn to_iovecs(segments: &[Segment]) -> Vec<libc::iovec> {
    segments.iter().filter_map(Segment::iovec).collect()
}

/// Consumes `done` bytes from `iovecs[first..]` after a partial transfer and
/// returns the index of the first iovec with bytes left. Shared by every
/// sender and receiver that loops on short `sendmsg`/`readv` results.
pub(crate) fn advance(iovecs: &mut [libc::iovec], mut first: usize, mut done: usize) -> usize {
    while done > 0 {
        let iov = &mut iovecs[first];
        if done >= iov.iov_len {
            done -= iov.iov_len;
            first += 1;
        } else {
            // `done` is below the iovec's length, so the new base stays
            // inside the same buffer.
            iov.iov_base = iov.iov_base.cast::<u8>().wrapping_add(done).cast();
            iov.iov_len -= done;
            done = 0;
        }
    }
    first
}

fn connect_tcp(host_port: &str, timeout: Duration) -> io::Result<TcpStream> {
    let mut last_error = io::Error::new(io::ErrorKind::NotFound, "no address resolved");
    let host_port = match host_port.strip_prefix(':') {
        Some(port) => format!("localhost:{port}"),
        None => host_port.to_string(),
    };
    for address in host_port.to_socket_addrs()? {
        match TcpStream::connect_timeout(&address, timeout) {
            Ok(stream) => return Ok(stream),
            Err(error) => last_error = error,
        }
    }
    Err(last_error)
}

/// Waits at most `timeout` until one of `fds` is readable; which are.
pub(crate) fn poll_readable_any<const N: usize>(
    fds: [RawFd; N],
    timeout: Duration,
) -> io::Result<[bool; N]> {
    let mut poll_fds = fds.map(|fd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    });
    let millis = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    let count = libc::nfds_t::try_from(N).unwrap_or(libc::nfds_t::MAX);
    loop {
        // SAFETY: `poll_fds` is an array of `N` valid pollfds that lives
        // for the duration of the call, and `count` is `N`.
        let ready = unsafe { libc::poll(poll_fds.as_mut_ptr(), count, millis) };
        if ready >= 0 {
            return Ok(poll_fds.map(|polled| polled.revents != 0));
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// Waits at most `timeout` until `fd` is readable; whether it is.
pub(crate) fn poll_readable(fd: RawFd, timeout: Duration) -> io::Result<bool> {
    poll_readable_any([fd], timeout).map(|[readable]| readable)
}

pub(crate) fn map_io(error: io::Error) -> ChannelError {
    match error.kind() {
        io::ErrorKind::UnexpectedEof => ChannelError::Closed,
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            ChannelError::Timeout("the peer (I/O timed out)")
        }
        _ => ChannelError::Io(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_addresses() {
        assert_eq!(
            "127.0.0.1:4444".parse::<Address>(),
            Ok(Address::Tcp("127.0.0.1:4444".into()))
        );
        assert_eq!(
            "tcp:[::1]:80".parse::<Address>(),
            Ok(Address::Tcp("[::1]:80".into()))
        );
        assert_eq!(
            "unix:/tmp/x.sock".parse::<Address>(),
            Ok(Address::Unix("/tmp/x.sock".into()))
        );
        assert_eq!(
            "tcp::4444".parse::<Address>(),
            Ok(Address::Tcp(":4444".into()))
        );
        assert_eq!(
            "tcp::4444".parse::<Address>().unwrap().to_string(),
            "tcp::4444"
        );
        assert!(":4444".parse::<Address>().is_err());
        assert!("nonsense".parse::<Address>().is_err());
        assert!("host:99999".parse::<Address>().is_err());
        assert!("unix:".parse::<Address>().is_err());
    }

    #[test]
    fn empty_host_listens_everywhere_and_connects_here() {
        let listener = Listener::bind(&"tcp::0".parse().unwrap()).unwrap();
        let Ok(Address::Tcp(bound)) = listener.local_address() else {
            panic!("not a TCP listener")
        };
        let port = bound.rsplit_once(':').unwrap().1;
        let address: Address = format!("tcp::{port}").parse().unwrap();
        Channel::connect(&address, Duration::from_secs(30)).unwrap();
        listener.accept_timeout(Duration::from_secs(30)).unwrap();
    }

    #[test]
    fn a_reader_refuses_an_unexpected_kind_at_its_header() {
        let dir = tempfile::tempdir().unwrap();
        let address = Address::Unix(dir.path().join("s"));
        let listener = Listener::bind(&address).unwrap();
        let mut client = Channel::connect(&address, Duration::from_secs(5)).unwrap();
        let mut server = listener.accept_timeout(Duration::from_secs(5)).unwrap();
        client
            .send_message(&Message::Welcome(tern_wire::Welcome {
                session_id: 1,
                channel_index: 0,
            }))
            .unwrap();
        let sync = Message::Sync(tern_wire::Sync {
            iteration: 7,
            last: false,
            dictionaries: 0,
        });
        client.send_message(&sync).unwrap();
        assert!(matches!(
            server.read_expected(Expected::WELCOME),
            Ok(Message::Welcome(_))
        ));
        match server.read_expected(Expected::WELCOME) {
            Err(ChannelError::Protocol(tern_wire::WireError::Unexpected { got, expected })) => {
                assert_eq!((got, expected), (tern_wire::FrameKind::Sync, "a welcome"));
            }
            other => panic!("expected the sync refused, got {other:?}"),
        }
        // Refused at the header: its body is still unread, byte for byte.
        let mut body = [0u8; 8];
        server.read_exact(&mut body).unwrap();
        assert_eq!(&body[..], &sync.to_bytes()[FRAME_HEADER_LEN..]);
        // And the channel reads no frame after a refused one.
        client.send_message(&sync).unwrap();
        assert!(server.read_message().is_err());
    }

    #[test]
    fn vectored_send_and_scattered_read() {
        let dir = tempfile::tempdir().unwrap();
        let address = Address::Unix(dir.path().join("s"));
        let listener = Listener::bind(&address).unwrap();
        let mut client = Channel::connect(&address, Duration::from_secs(1)).unwrap();
        let mut server = listener.accept_timeout(Duration::from_secs(1)).unwrap();
        let a = vec![1u8; 100_000];
        let b = [2u8; 3];
        let sender = std::thread::spawn(move || {
            let segments = [
                Segment {
                    ptr: a.as_ptr(),
                    len: a.len(),
                },
                Segment {
                    ptr: b.as_ptr(),
                    len: b.len(),
                },
            ];
            // SAFETY: the vectors live until the call returns.
            unsafe { client.send_vectored(&segments) }.unwrap();
        });
        let mut first = vec![0u8; 50_001];
        let mut second = vec![0u8; 50_002];
        let segments = [
            Segment {
                ptr: first.as_mut_ptr(),
                len: first.len(),
            },
            Segment {
                ptr: second.as_mut_ptr(),
                len: second.len(),
            },
        ];
        // SAFETY: both buffers are owned here and outlive the call.
        unsafe { server.read_scattered(&segments) }.unwrap();
        tern_test_skip::wait::join_within(sender, "the vectored send");
        assert!(first.iter().all(|&x| x == 1));
        assert_eq!(&second[second.len() - 3..], &[2, 2, 2]);
        assert!(matches!(server.read_message(), Err(ChannelError::Closed)));
    }
}
