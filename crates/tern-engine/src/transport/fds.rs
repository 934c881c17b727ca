//! Descriptors passed with a control frame on a Unix socket (`SCM_RIGHTS`):
//! the memory hand-over's files (docs/protocol.md, "Memory hand-over").
//!
//! The descriptors ride on the first byte of the frame they belong to. A
//! reader gets them with the read that takes that byte, so the destination
//! reads the frame's first bytes with `recvmsg` (and the rest as usual);
//! the frame decoder reads exactly one structure at a time, so no earlier
//! read can take that byte and drop its descriptors.

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use tern_wire::Message;

use super::{Channel, Stream};
use crate::error::ChannelError;

/// What one `recvmsg` brought: bytes, descriptors, and whether the sender
/// attached more descriptors than the reader made room for (the kernel
/// closes those).
#[derive(Debug)]
pub(crate) struct Received {
    pub(crate) len: usize,
    pub(crate) files: Vec<OwnedFd>,
    pub(crate) truncated: bool,
}

impl Channel {
    /// Whether this channel is a plain Unix stream socket, the only kind
    /// that carries descriptors (not TLS, which would carry only bytes).
    pub(crate) fn carries_descriptors(&self) -> bool {
        if matches!(self.stream, Stream::Tls(_)) {
            return false;
        }
        let mut domain: libc::c_int = 0;
        let mut len = crate::numeric::socklen_of::<libc::c_int>();
        // SAFETY: `domain` and `len` are valid for writes of the sizes given.
        let status = unsafe {
            libc::getsockopt(
                self.fd,
                libc::SOL_SOCKET,
                libc::SO_DOMAIN,
                (&raw mut domain).cast(),
                &raw mut len,
            )
        };
        status == 0 && domain == libc::AF_UNIX
    }

    /// Sends `message` (sealed when the channel seals) with `files`
    /// attached to its first byte.
    pub(crate) fn send_message_with_files(
        &mut self,
        message: &Message,
        files: &[RawFd],
    ) -> Result<usize, ChannelError> {
        if !self.carries_descriptors() {
            return Err(ChannelError::Io(io::Error::other(
                "descriptors pass only over a plain Unix socket",
            )));
        }
        let mut bytes = message.to_bytes();
        if let Some(sealer) = &mut self.sealer {
            sealer.seal(&mut bytes);
        }
        let sent = send_with_rights(self.fd, &bytes, files).map_err(super::map_io)?;
        self.write_all(&bytes[sent..])?;
        Ok(bytes.len())
    }

    /// One `recvmsg` of at most `buf.len()` bytes, taking up to
    /// `max_files` descriptors, close-on-exec. Blocks within the socket's
    /// timeout; call it once the channel is readable.
    pub(crate) fn receive_with_files(
        &mut self,
        buf: &mut [u8],
        max_files: usize,
    ) -> Result<Received, ChannelError> {
        if !self.carries_descriptors() {
            return Err(ChannelError::Io(io::Error::other(
                "descriptors pass only over a plain Unix socket",
            )));
        }
        receive_with_rights(self.fd, buf, max_files).map_err(super::map_io)
    }
}

fn control_space(files: usize) -> usize {
    let bytes = u32::try_from(files * std::mem::size_of::<RawFd>()).unwrap_or(u32::MAX);
    // SAFETY: CMSG_SPACE is arithmetic on its argument.
    unsafe { libc::CMSG_SPACE(bytes) as usize }
}

/// `sendmsg` of `bytes` with `files` as `SCM_RIGHTS`; returns the bytes
/// sent (at least 1: the descriptors went with them).
fn send_with_rights(fd: RawFd, bytes: &[u8], files: &[RawFd]) -> io::Result<usize> {
    // u64 words keep the control buffer aligned for `cmsghdr`.
    let mut control = vec![0u64; control_space(files.len()).div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: an all-zero msghdr is valid (no name, no buffers).
    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
    header.msg_iov = &raw mut iov;
    header.msg_iovlen = 1;
    header.msg_control = control.as_mut_ptr().cast();
    header.msg_controllen = control_space(files.len());
    let data_len = u32::try_from(std::mem::size_of_val(files)).unwrap_or(u32::MAX);
    // SAFETY: the control buffer has room for one header with `files`
    // (CMSG_SPACE), so CMSG_FIRSTHDR is non-null and CMSG_DATA points to
    // `data_len` writable bytes inside it.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&header);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(data_len) as usize;
        std::ptr::copy_nonoverlapping(
            files.as_ptr().cast::<u8>(),
            libc::CMSG_DATA(cmsg),
            data_len as usize,
        );
    }
    loop {
        // SAFETY: the header points to `bytes` and `control`, both alive
        // for the call.
        let sent = unsafe { libc::sendmsg(fd, &header, libc::MSG_NOSIGNAL) };
        if sent >= 0 {
            return Ok(crate::numeric::syscall_count(sent));
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

fn receive_with_rights(fd: RawFd, buf: &mut [u8], max_files: usize) -> io::Result<Received> {
    let mut control = vec![0u64; control_space(max_files.max(1)).div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is valid (no name, no buffers).
    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
    header.msg_iov = &raw mut iov;
    header.msg_iovlen = 1;
    header.msg_control = control.as_mut_ptr().cast();
    header.msg_controllen = control_space(max_files.max(1));
    let len = loop {
        // SAFETY: the header points to `buf` and `control`, both writable
        // for their lengths during the call.
        let len = unsafe { libc::recvmsg(fd, &mut header, libc::MSG_CMSG_CLOEXEC) };
        if len >= 0 {
            break crate::numeric::syscall_count(len);
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    };
    let mut files = Vec::new();
    // SAFETY: the kernel filled `header.msg_control` with well-formed
    // control messages up to `msg_controllen`; CMSG_FIRSTHDR/NXTHDR walk
    // them within that length, and each SCM_RIGHTS payload holds
    // descriptors this process now owns (each taken exactly once here).
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&header);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let payload = (*cmsg).cmsg_len - libc::CMSG_LEN(0) as usize;
                for index in 0..payload / std::mem::size_of::<RawFd>() {
                    let raw = std::ptr::read_unaligned(
                        data.add(index * std::mem::size_of::<RawFd>())
                            .cast::<RawFd>(),
                    );
                    files.push(OwnedFd::from_raw_fd(raw));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&header, cmsg);
        }
    }
    Ok(Received {
        len,
        files,
        truncated: header.msg_flags & libc::MSG_CTRUNC != 0,
    })
}
