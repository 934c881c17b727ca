//! vsock and inherited sockets: addresses, listening, connecting, and
//! taking ownership of descriptors a parent process passed in.

use std::collections::HashSet;
use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Mutex;
use std::time::Duration;

use socket2::{Domain, SockAddr, Socket, Type};

use super::{Accept, Address, Channel, Listener};
use crate::error::ChannelError;

/// Parses the `CID:PORT` of a `vsock:` address.
pub(super) fn parse_vsock(text: &str) -> Result<(u32, u32), String> {
    let parsed = text
        .split_once(':')
        .and_then(|(cid, port)| Some((cid.parse().ok()?, port.parse().ok()?)));
    parsed.ok_or_else(|| format!("'vsock:{text}' is not a vsock address: use vsock:CID:PORT"))
}

/// Parses the `N` or `N,M,...` of an `fd:` address.
pub(super) fn parse_fds(text: &str) -> Result<Vec<RawFd>, String> {
    let fds: Option<Vec<RawFd>> = text
        .split(',')
        .map(|fd| fd.parse().ok().filter(|fd: &RawFd| *fd >= 0))
        .collect();
    match fds {
        Some(fds) if !fds.is_empty() => Ok(fds),
        _ => Err(format!(
            "'fd:{text}' is not a descriptor list: use fd:N or fd:N,M,... (inherited sockets)"
        )),
    }
}

/// A vsock socket listening on `port` of every context id.
pub(super) fn listen_vsock(port: u32) -> io::Result<Socket> {
    let socket = Socket::new(Domain::VSOCK, Type::STREAM, None)?;
    socket.bind(&SockAddr::vsock(libc::VMADDR_CID_ANY, port))?;
    socket.listen(128)?;
    Ok(socket)
}

/// Connects to a vsock address within `timeout`.
pub(super) fn connect_vsock(cid: u32, port: u32, timeout: Duration) -> io::Result<Socket> {
    let socket = Socket::new(Domain::VSOCK, Type::STREAM, None)?;
    socket.connect_timeout(&SockAddr::vsock(cid, port), timeout)?;
    Ok(socket)
}

/// The address a listening socket is reachable at, as far as it can be
/// told: a vsock port, or the descriptor itself.
pub(super) fn local_address(socket: &Socket) -> io::Result<Address> {
    let address = socket.local_addr()?;
    if let Some((cid, port)) = address.as_vsock_address() {
        return Ok(Address::Vsock { cid, port });
    }
    if let Some(inet) = address.as_socket() {
        return Ok(Address::Tcp(inet.to_string()));
    }
    Ok(Address::Fd(vec![socket.as_raw_fd()]))
}

/// Descriptors already taken by this process: taking one twice would
/// close it twice.
static TAKEN: Mutex<Option<HashSet<RawFd>>> = Mutex::new(None);

/// Takes ownership of inherited descriptors, each an open stream socket.
///
/// The numbers come from the operator (`fd:N`), as with QEMU's `fd:`: the
/// process that started this one passed them for this use, and nothing
/// else in this process uses them. A number already taken is refused, so
/// an address cannot hand out the same descriptor twice.
pub(crate) fn take_fds(fds: &[RawFd]) -> Result<Vec<OwnedFd>, ChannelError> {
    let mut taken = TAKEN.lock().unwrap_or_else(|e| e.into_inner());
    let taken = taken.get_or_insert_with(HashSet::new);
    let mut owned = Vec::with_capacity(fds.len());
    for &fd in fds {
        let refuse = |why: &str| {
            ChannelError::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("fd:{fd}: {why}"),
            ))
        };
        // SAFETY: F_GETFD only reads the descriptor's flags.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
            return Err(refuse("not an open descriptor"));
        }
        if !taken.insert(fd) {
            return Err(refuse("already taken by this process"));
        }
        // SAFETY: the descriptor is open (checked above), was passed to this
        // process for this use (the operator's word, as for QEMU's fd:), and
        // is taken once (the set above), so one OwnedFd owns it.
        owned.push(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    Ok(owned)
}

/// A stream socket from an owned descriptor; anything else is refused.
pub(crate) fn stream_socket(fd: OwnedFd) -> Result<Socket, ChannelError> {
    let socket = Socket::from(fd);
    match socket.r#type() {
        Ok(kind) if kind == Type::STREAM => Ok(socket),
        Ok(_) => Err(ChannelError::Io(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the descriptor is not a stream socket",
        ))),
        Err(error) => Err(ChannelError::Io(error)),
    }
}

/// A listener over inherited descriptors: one listening socket, or
/// connected sockets handed out as if accepted.
pub(super) fn listener_from_fds(fds: &[RawFd]) -> io::Result<Listener> {
    let owned = take_fds(fds).map_err(io::Error::other)?;
    let sockets: Vec<Socket> = owned
        .into_iter()
        .map(stream_socket)
        .collect::<Result<_, _>>()
        .map_err(io::Error::other)?;
    let listening = sockets
        .iter()
        .map(|socket| socket.is_listener())
        .collect::<io::Result<Vec<bool>>>()?;
    match (&sockets[..], &listening[..]) {
        ([_], [true]) => Ok(Listener::Socket(sockets.into_iter().next().expect("one"))),
        (_, flags) if flags.iter().all(|listening| !listening) => {
            let channels = sockets
                .into_iter()
                .map(|socket| Channel::from_socket(socket.into()))
                .collect::<Result<VecDeque<_>, _>>()
                .map_err(io::Error::other)?;
            Ok(Listener::Custom(Box::new(Preconnected::new(
                Address::Fd(fds.to_vec()),
                channels,
            ))))
        }
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "fd: takes one listening socket or only connected ones",
        )),
    }
}

/// Connected channels handed out one per accept, in order.
#[derive(Debug)]
pub struct Preconnected {
    address: Address,
    channels: Mutex<VecDeque<Channel>>,
}

impl Preconnected {
    /// Channels an embedder connected (or accepted) itself; `address` is
    /// what reports call them.
    pub fn new(address: Address, channels: VecDeque<Channel>) -> Self {
        Self {
            address,
            channels: Mutex::new(channels),
        }
    }
}

impl Accept for Preconnected {
    fn accept_timeout(&self, timeout: Duration) -> Result<Channel, ChannelError> {
        let next = self
            .channels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front();
        match next {
            Some(channel) => Ok(channel),
            None => {
                // Nothing more will come; waiting out the timeout keeps the
                // accept loop's rhythm instead of spinning.
                std::thread::sleep(timeout);
                Err(ChannelError::Timeout("a connection"))
            }
        }
    }

    fn address(&self) -> Address {
        self.address.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vsock_and_fd_addresses() {
        assert_eq!(
            "vsock:2:1234".parse::<Address>(),
            Ok(Address::Vsock { cid: 2, port: 1234 })
        );
        assert_eq!(
            "vsock:2:1234".parse::<Address>().unwrap().to_string(),
            "vsock:2:1234"
        );
        assert!("vsock:2".parse::<Address>().is_err());
        assert!("vsock:x:1".parse::<Address>().is_err());
        assert_eq!("fd:3".parse::<Address>(), Ok(Address::Fd(vec![3])));
        assert_eq!(
            "fd:3,4,5".parse::<Address>().unwrap().to_string(),
            "fd:3,4,5"
        );
        assert!("fd:".parse::<Address>().is_err());
        assert!("fd:-1".parse::<Address>().is_err());
        assert!("fd:3,,4".parse::<Address>().is_err());
    }

    #[test]
    fn a_descriptor_is_taken_once_and_must_be_open() {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let fd = OwnedFd::from(a);
        let raw = fd.as_raw_fd();
        // Hand the number over as an inherited descriptor would be.
        std::mem::forget(fd);
        let owned = take_fds(&[raw]).unwrap();
        assert!(take_fds(&[raw]).is_err(), "taken twice");
        drop(owned);
        assert!(take_fds(&[1_000_000]).is_err(), "not open");
    }

    #[test]
    fn a_file_is_not_a_stream_socket() {
        let file = tempfile::tempfile().unwrap();
        assert!(stream_socket(OwnedFd::from(file)).is_err());
    }
}
