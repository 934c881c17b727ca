//! What the agent learns about a member from the kernel rather than from
//! the member: who it is (`SO_PEERCRED`) and what its process has written
//! (`/proc/PID/io`).

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

/// The peer's process and user.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    /// Process id.
    pub pid: u32,
    /// User id.
    pub uid: u32,
}

/// The credentials of the process at the other end of `stream`.
pub fn peer(stream: &UnixStream) -> std::io::Result<Peer> {
    let mut credentials = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    // A ucred is 12 bytes.
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::ucred>())
        .map_err(std::io::Error::other)?;
    // SAFETY: the buffer is a ucred and `len` its size, as SO_PEERCRED
    // requires; the descriptor is open for the stream's lifetime.
    let result = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut credentials).cast(),
            &mut len,
        )
    };
    if result != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(Peer {
        pid: u32::try_from(credentials.pid).unwrap_or(0),
        uid: credentials.uid,
    })
}

/// This process's effective user id.
pub fn own_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// Bytes each of `pids` has sent on its TCP sockets open now, as the
/// kernel counts them: acknowledged by the peer (`tcpi_bytes_acked`) plus
/// still in the send queue, read with one `sock_diag` dump (the netlink
/// interface `ss` uses). A process with no TCP socket counts 0; one whose
/// descriptors cannot be read (gone, another user's) is left out.
pub fn tcp_bytes_sent(pids: &[u32]) -> BTreeMap<u32, u64> {
    let mut sent = BTreeMap::new();
    if pids.is_empty() {
        return sent;
    }
    let by_inode = match tcp_sockets() {
        Ok(by_inode) => by_inode,
        Err(error) => {
            tracing::debug!("sock_diag: {error}");
            return sent;
        }
    };
    for &pid in pids {
        let Some(inodes) = socket_inodes(pid) else {
            continue;
        };
        let total = inodes
            .iter()
            .filter_map(|inode| by_inode.get(inode))
            .sum::<u64>();
        sent.insert(pid, total);
    }
    sent
}

/// The inodes of the sockets process `pid` holds open.
fn socket_inodes(pid: u32) -> Option<Vec<u32>> {
    let entries = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?;
    Some(
        entries
            .filter_map(Result::ok)
            .filter_map(|entry| std::fs::read_link(entry.path()).ok())
            .filter_map(|target| {
                let target = target.to_str()?;
                target
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .parse()
                    .ok()
            })
            .collect(),
    )
}

// The kernel's UAPI (linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h,
// linux/tcp.h), as far as this reads it.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLMSG_HEADER: usize = 16;
/// `struct inet_diag_req_v2`: family, protocol, extensions, pad, states,
/// then a 48-byte `inet_diag_sockid`.
const REQUEST_BODY: usize = 56;
/// `struct inet_diag_msg`: 4 bytes, the sockid, expires, rqueue, wqueue,
/// uid, inode.
const MESSAGE_BODY: usize = 72;
const WQUEUE_OFFSET: usize = 60;
const INODE_OFFSET: usize = 68;
const INET_DIAG_INFO: u16 = 2;
/// `tcpi_bytes_acked` in `struct tcp_info`.
const BYTES_ACKED_OFFSET: usize = 120;

/// Every TCP socket on the host: its inode and the bytes it sent.
fn tcp_sockets() -> std::io::Result<BTreeMap<u32, u64>> {
    // SAFETY: socket(2) with constant arguments; the descriptor is owned
    // by the OwnedFd at once.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and nothing else owns it.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut found = BTreeMap::new();
    for family in [libc::AF_INET, libc::AF_INET6] {
        dump(
            &socket,
            u8::try_from(family).map_err(std::io::Error::other)?,
            &mut found,
        )?;
    }
    Ok(found)
}

fn dump(socket: &OwnedFd, family: u8, found: &mut BTreeMap<u32, u64>) -> std::io::Result<()> {
    let mut request = [0u8; NLMSG_HEADER + REQUEST_BODY];
    let len = u32::try_from(request.len()).map_err(std::io::Error::other)?;
    request[0..4].copy_from_slice(&len.to_ne_bytes());
    request[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    let flags =
        u16::try_from(libc::NLM_F_REQUEST | libc::NLM_F_DUMP).map_err(std::io::Error::other)?;
    request[6..8].copy_from_slice(&flags.to_ne_bytes());
    let body = &mut request[NLMSG_HEADER..];
    body[0] = family;
    body[1] = u8::try_from(libc::IPPROTO_TCP).map_err(std::io::Error::other)?;
    body[2] = 1 << (INET_DIAG_INFO - 1);
    body[4..8].copy_from_slice(&u32::MAX.to_ne_bytes());
    // SAFETY: the buffer is valid for its length; the kernel is the
    // default destination of a netlink socket.
    let sent = unsafe {
        libc::send(
            socket.as_raw_fd(),
            request.as_ptr().cast(),
            request.len(),
            0,
        )
    };
    if sent < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut buffer = vec![0u8; 64 << 10];
    loop {
        // SAFETY: the buffer is valid for writes of its length.
        let received = unsafe {
            libc::recv(
                socket.as_raw_fd(),
                buffer.as_mut_ptr().cast(),
                buffer.len(),
                0,
            )
        };
        if received < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // Not negative: checked above.
        let received = received.unsigned_abs();
        if received == 0 || !parse_messages(&buffer[..received], found)? {
            return Ok(());
        }
    }
}

fn u32_at(bytes: &[u8], offset: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(
        bytes.get(offset..offset + 4)?.try_into().ok()?,
    ))
}

fn u16_at(bytes: &[u8], offset: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(
        bytes.get(offset..offset + 2)?.try_into().ok()?,
    ))
}

/// Reads one datagram's messages into `found`; false once the dump ended.
fn parse_messages(mut bytes: &[u8], found: &mut BTreeMap<u32, u64>) -> std::io::Result<bool> {
    while bytes.len() >= NLMSG_HEADER {
        let len = u32_at(bytes, 0).unwrap_or(0) as usize;
        let kind = u16_at(bytes, 4).unwrap_or(0);
        if len < NLMSG_HEADER || len > bytes.len() {
            return Err(std::io::Error::other("a truncated netlink message"));
        }
        match kind {
            NLMSG_DONE => return Ok(false),
            NLMSG_ERROR => return Err(std::io::Error::other("sock_diag refused the dump")),
            SOCK_DIAG_BY_FAMILY => {
                if let Some((inode, bytes_sent)) = parse_socket(&bytes[NLMSG_HEADER..len]) {
                    found.insert(inode, bytes_sent);
                }
            }
            _ => {}
        }
        bytes = &bytes[len.next_multiple_of(4).min(bytes.len())..];
    }
    Ok(true)
}

/// One socket's inode and bytes sent (acknowledged plus queued).
fn parse_socket(body: &[u8]) -> Option<(u32, u64)> {
    let wqueue = u32_at(body, WQUEUE_OFFSET)?;
    let inode = u32_at(body, INODE_OFFSET)?;
    let mut attributes = body.get(MESSAGE_BODY..)?;
    while attributes.len() >= 4 {
        let len = usize::from(u16_at(attributes, 0)?);
        let kind = u16_at(attributes, 2)?;
        if len < 4 || len > attributes.len() {
            return None;
        }
        if kind == INET_DIAG_INFO {
            let info = &attributes[4..len];
            let acked = info.get(BYTES_ACKED_OFFSET..BYTES_ACKED_OFFSET + 8)?;
            let acked = u64::from_ne_bytes(acked.try_into().ok()?);
            return Some((inode, acked + u64::from(wqueue)));
        }
        attributes = &attributes[len.next_multiple_of(4).min(attributes.len())..];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::{own_uid, peer, tcp_bytes_sent};

    #[test]
    fn the_peer_of_a_pair_is_this_process() {
        let (left, _right) = std::os::unix::net::UnixStream::pair().unwrap();
        let peer = peer(&left).unwrap();
        assert_eq!(peer.pid, std::process::id());
        assert_eq!(peer.uid, own_uid());
    }

    #[test]
    fn the_kernel_counts_what_this_process_sent_on_tcp() {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut sender = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut receiver, _) = listener.accept().unwrap();
        let pid = std::process::id();
        let before = tcp_bytes_sent(&[pid])[&pid];
        let reading = std::thread::spawn(move || {
            let mut sink = vec![0; 1 << 20];
            receiver.read_exact(&mut sink).unwrap();
        });
        sender.write_all(&vec![7; 1 << 20]).unwrap();
        tern_test_skip::wait::join_within(reading, "the reader of 1 MiB");
        let after = tcp_bytes_sent(&[pid])[&pid];
        assert!(after >= before + (1 << 20), "{before} then {after}");
        assert!(!tcp_bytes_sent(&[u32::MAX]).contains_key(&u32::MAX));
    }
}
