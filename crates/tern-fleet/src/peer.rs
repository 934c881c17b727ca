//! What the agent learns about a member from the kernel rather than from
//! the member: who it is (`SO_PEERCRED`) and what its process has written
//! (`/proc/PID/io`).

use std::os::fd::AsRawFd;
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
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
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

/// Bytes process `pid` has passed to write(2) and its kin (`wchar` of
/// `/proc/PID/io`): an upper bound of what it sent on its TCP channels,
/// which it writes with write(2). `None` when it cannot be read (the
/// process is gone, or belongs to another user).
pub fn written_bytes(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    text.lines()
        .find_map(|line| line.strip_prefix("wchar:"))
        .and_then(|value| value.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::{own_uid, peer, written_bytes};

    #[test]
    fn the_peer_of_a_pair_is_this_process() {
        let (left, _right) = std::os::unix::net::UnixStream::pair().unwrap();
        let peer = peer(&left).unwrap();
        assert_eq!(peer.pid, std::process::id());
        assert_eq!(peer.uid, own_uid());
    }

    #[test]
    fn this_process_has_written_something() {
        use std::io::Write;
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(&[0; 4096]).unwrap();
        assert!(written_bytes(std::process::id()).unwrap() >= 4096);
        assert_eq!(written_bytes(u32::MAX), None);
    }
}
