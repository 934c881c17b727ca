//! `tern serve-pages` against a stand-in for Firecracker that follows its
//! documented page-fault handler protocol step by step, written here from
//! the documentation (not from tern's handler code): create a
//! userfaultfd (`UFFDIO_API` asking for `UFFD_FEATURE_EVENT_REMOVE`), map
//! anonymous guest memory, register it for missing pages, connect to the
//! handler's socket, send the descriptor (`SCM_RIGHTS`) with the JSON
//! region list in one message, then touch memory. The stand-in is this
//! test process (or a child of it): a separate process from the handler,
//! as Firecracker is.

use crate::process;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};

use process::tern;
use tern_test_skip::wait::{exit_after_deadline, output_within, wait_for};

const PAGE: usize = 4096;

// <linux/userfaultfd.h>, generic _IOC encoding (x86-64, aarch64).
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
const UFFD_API: u64 = 0xaa;
const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;

/// Guest memory the stand-in mapped and registered.
struct StandIn {
    uffd: OwnedFd,
    base: *mut u8,
    len: usize,
}

impl StandIn {
    /// Steps 1-3: the userfaultfd, the memory, the registration. `None`
    /// where this process may not have a userfaultfd.
    fn new(len: usize) -> Option<Self> {
        // SAFETY: the system call takes flags only.
        let fd =
            unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if fd < 0 {
            return None;
        }
        // SAFETY: a new descriptor.
        let uffd = unsafe { OwnedFd::from_raw_fd(libc::c_int::try_from(fd).unwrap()) };
        let mut api = [UFFD_API, UFFD_FEATURE_EVENT_REMOVE, 0];
        // SAFETY: struct uffdio_api is three u64s.
        let result = unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_API, api.as_mut_ptr()) };
        assert_eq!(result, 0);
        // SAFETY: a new anonymous mapping.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        // struct uffdio_register: range (start, len), mode, ioctls.
        let mut register = [base as u64, len as u64, UFFDIO_REGISTER_MODE_MISSING, 0];
        // SAFETY: the structure UFFDIO_REGISTER reads and writes.
        let result =
            unsafe { libc::ioctl(uffd.as_raw_fd(), UFFDIO_REGISTER, register.as_mut_ptr()) };
        assert_eq!(result, 0, "{}", std::io::Error::last_os_error());
        Some(Self {
            uffd,
            base: base.cast(),
            len,
        })
    }

    /// Step 4: connect and send the descriptor and the regions, as one
    /// message. `regions` are (offset into guest memory, size, file offset).
    fn send(&self, socket: &Path, regions: &[(usize, usize, u64)]) -> UnixStream {
        let stream = connect(socket);
        let json = format!(
            "[{}]",
            regions
                .iter()
                .map(|&(at, size, offset)| format!(
                    r#"{{"base_host_virt_addr":{},"size":{size},"offset":{offset},"page_size":{PAGE}}}"#,
                    self.base as u64 + at as u64
                ))
                .collect::<Vec<_>>()
                .join(",")
        );
        send_with_fd(&stream, json.as_bytes(), self.uffd.as_raw_fd());
        stream
    }

    /// Byte `offset` of guest memory (faults through the handler).
    fn read(&self, offset: usize) -> u8 {
        assert!(offset < self.len);
        // SAFETY: inside the mapping.
        unsafe { self.base.add(offset).read_volatile() }
    }

    fn page(&self, page: usize) -> Vec<u8> {
        (0..PAGE)
            .map(|byte| self.read(page * PAGE + byte))
            .collect()
    }

    /// What a balloon does: the kernel sends `UFFD_EVENT_REMOVE`.
    fn remove(&self, page: usize, pages: usize) {
        // SAFETY: whole pages of the mapping.
        let result = unsafe {
            libc::madvise(
                self.base.add(page * PAGE).cast(),
                pages * PAGE,
                libc::MADV_DONTNEED,
            )
        };
        assert_eq!(result, 0);
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

fn connect(socket: &Path) -> UnixStream {
    wait_for(&format!("{} accepts connections", socket.display()), || {
        UnixStream::connect(socket).ok()
    })
}

fn send_with_fd(stream: &UnixStream, bytes: &[u8], fd: i32) {
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut _,
        iov_len: bytes.len(),
    };
    let mut control = [0u64; 4];
    // SAFETY: zeroed msghdr, filled below with live buffers.
    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
    header.msg_iov = &mut iov;
    header.msg_iovlen = 1;
    header.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE of one int.
    header.msg_controllen = unsafe { libc::CMSG_SPACE(4) } as usize;
    // SAFETY: the control buffer has room for one header and one int.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&header);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(4) as usize;
        libc::CMSG_DATA(cmsg).cast::<i32>().write_unaligned(fd);
    }
    // SAFETY: `header` describes live buffers.
    let sent = unsafe { libc::sendmsg(stream.as_raw_fd(), &header, 0) };
    assert_eq!(usize::try_from(sent), Ok(bytes.len()));
}

/// `tern serve-pages` on a fresh socket path.
fn serve(dir: &Path, source: &[&str]) -> (Child, PathBuf) {
    let socket = dir.join("uffd.sock");
    let child = tern()
        .arg("serve-pages")
        .arg("--socket")
        .arg(&socket)
        .args(source)
        .args(["--json", "--accept-timeout", "60"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    (child, socket)
}

/// Waits for the handler to exit, within the deadline (no hang).
fn finish(child: Child) -> (std::process::ExitStatus, String, String) {
    let output = output_within(child, "tern serve-pages");
    (
        output.status,
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

/// A memory file: pages hold their index, every fourth is zero.
fn memory_file(path: &Path, pages: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; pages * PAGE];
    for (index, page) in bytes.chunks_mut(PAGE).enumerate() {
        if index % 4 != 3 {
            page.fill(u8::try_from(index % 251).unwrap() + 1);
        }
    }
    std::fs::write(path, &bytes).unwrap();
    bytes
}

/// The stand-in's own role in a child process: hand over, touch a few
/// pages, then die without a word (`TERN_STANDIN_SOCKET` set).
#[test]
fn stand_in_child() {
    let Ok(socket) = std::env::var("TERN_STANDIN_SOCKET") else {
        return;
    };
    let standin = StandIn::new(64 * PAGE).expect("userfaultfd in the child");
    let _stream = standin.send(Path::new(&socket), &[(0, 64 * PAGE, 0)]);
    assert_eq!(standin.read(0), 1);
    // SAFETY: ends this process at once, as a crash would.
    unsafe { libc::_exit(0) };
}

#[test]
fn a_raw_memory_file_is_served_with_removes_and_statistics() {
    let Some(standin) = StandIn::new(2 * 64 * PAGE) else {
        tern_test_skip::skip(
            tern_test_skip::Need::Userfaultfd,
            "no userfaultfd for this process",
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("memory");
    let bytes = memory_file(&file, 128);
    let (handler, socket) = serve(
        dir.path(),
        &["--memory-file", file.to_str().unwrap(), "--loaders", "0"],
    );
    // Two regions, the second from the second half of the file.
    let _stream = standin.send(
        &socket,
        &[
            (0, 64 * PAGE, 0),
            (64 * PAGE, 64 * PAGE, (64 * PAGE) as u64),
        ],
    );
    exit_after_deadline("the handler serves the faulted pages", || {
        for page in [0, 5, 70, 127, 3] {
            assert_eq!(
                standin.page(page),
                bytes[page * PAGE..(page + 1) * PAGE],
                "page {page}"
            );
        }
        // The balloon takes pages 5-6 back: they fault again and come as
        // zeros.
        standin.remove(5, 2);
        assert!(standin.page(5).iter().all(|&byte| byte == 0));
        assert_eq!(standin.page(8), bytes[8 * PAGE..9 * PAGE]);
    });
    drop(standin);
    // The stand-in "exits": here it closes the socket and its descriptor,
    // which is what the handler can see of a VMM that ends; the handler
    // runs on until the VMM process exits, so stop it as an operator does.
    // SAFETY: signalling our own child.
    unsafe { libc::kill(libc::pid_t::try_from(handler.id()).unwrap(), libc::SIGTERM) };
    let (status, stdout, stderr) = finish(handler);
    assert!(status.success(), "{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    // Three chunks of 16 pages faulted in, and page 5 again after the
    // remove.
    assert_eq!(report["faults"].as_u64().unwrap(), 4, "{report}");
    assert!(report["removes"].as_u64().unwrap() >= 1, "{report}");
    assert!(report["zero-pages"].as_u64().unwrap() >= 1, "{report}");
    assert_eq!(report["regions"], 2);
}

#[test]
fn a_tern_snapshot_is_served_and_read_back_exactly() {
    let Some(standin) = StandIn::new(4 << 20) else {
        tern_test_skip::skip(
            tern_test_skip::Need::Userfaultfd,
            "no userfaultfd for this process",
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("guest.tern");
    let mut guest = tern_synthetic::SyntheticGuest::new(&tern_synthetic::SyntheticConfig {
        memory_bytes: 4 << 20,
        seed: 32,
        ..tern_synthetic::SyntheticConfig::default()
    })
    .unwrap();
    let config = {
        let mut config = tern_engine::SaveConfig::default();
        config.resume = false;
        config
    };
    tern_engine::save(&mut guest, &path, &config).unwrap();
    let expected = guest.region_bytes(0).unwrap();
    let (handler, socket) = serve(dir.path(), &["--snapshot", path.to_str().unwrap()]);
    let _stream = standin.send(&socket, &[(0, 4 << 20, 0)]);
    exit_after_deadline("the handler serves the snapshot's pages", || {
        for page in 0..(4 << 20) / PAGE {
            assert_eq!(
                standin.page(page),
                expected[page * PAGE..(page + 1) * PAGE],
                "page {page}"
            );
        }
    });
    // SAFETY: signalling our own child.
    unsafe { libc::kill(libc::pid_t::try_from(handler.id()).unwrap(), libc::SIGTERM) };
    let (status, stdout, stderr) = finish(handler);
    assert!(status.success(), "{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["memory-bytes"], 4 << 20);
}

#[test]
fn a_vmm_that_dies_after_the_handshake_ends_the_handler() {
    if StandIn::new(PAGE).is_none() {
        tern_test_skip::skip(
            tern_test_skip::Need::Userfaultfd,
            "no userfaultfd for this process",
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("memory");
    memory_file(&file, 64);
    let (handler, socket) = serve(dir.path(), &["--memory-file", file.to_str().unwrap()]);
    // The test's name in this binary: its module path without the crate.
    let stand_in = format!(
        "{}::stand_in_child",
        module_path!().split_once("::").unwrap().1
    );
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &stand_in, "--nocapture", "--test-threads", "1"])
        .env("TERN_STANDIN_SOCKET", &socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let child = output_within(child, "the stand-in child");
    // A filter that matches nothing also exits 0: the child must have run
    // the stand-in.
    let child_output = String::from_utf8_lossy(&child.stdout);
    assert!(
        child.status.success() && child_output.contains("running 1 test"),
        "the stand-in child did not run: {child_output}"
    );
    let (status, _, stderr) = finish(handler);
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("exited"), "{stderr}");
}

#[test]
fn a_vmm_that_closes_before_the_handshake_is_one_line_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("memory");
    memory_file(&file, 16);
    let (handler, socket) = serve(dir.path(), &["--memory-file", file.to_str().unwrap()]);
    drop(connect(&socket));
    let (status, _, stderr) = finish(handler);
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("closed the socket before sending"),
        "{stderr}"
    );
}

#[test]
fn regions_the_file_cannot_hold_are_refused() {
    let Some(standin) = StandIn::new(64 * PAGE) else {
        tern_test_skip::skip(
            tern_test_skip::Need::Userfaultfd,
            "no userfaultfd for this process",
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("memory");
    memory_file(&file, 16);
    let (handler, socket) = serve(dir.path(), &["--memory-file", file.to_str().unwrap()]);
    let _stream = standin.send(&socket, &[(0, 64 * PAGE, 0)]);
    let (status, _, stderr) = finish(handler);
    assert!(!status.success());
    assert!(stderr.contains("a region needs bytes up to"), "{stderr}");
}
