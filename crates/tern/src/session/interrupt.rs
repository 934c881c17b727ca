//! SIGINT and SIGTERM: recorded, and turned into a cancel from a thread of
//! their own.

/// The first SIGINT or SIGTERM received, once a handler is installed.
static INTERRUPTED_BY: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// The signal that interrupted the command, if one did.
pub(crate) fn interrupted_by() -> Option<i32> {
    match INTERRUPTED_BY.load(std::sync::atomic::Ordering::Relaxed) {
        0 => None,
        signal => Some(signal),
    }
}

/// Runs `on_interrupt` once on SIGINT or SIGTERM, from a thread of its own
/// (the handler itself only records the signal and writes to a pipe).
pub(crate) fn install_interrupt_handler(on_interrupt: impl FnOnce() + Send + 'static) {
    use std::io::Read;
    use std::os::fd::FromRawFd;
    static WRITE_FD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);
    extern "C" fn handler(signal: libc::c_int) {
        // Lock-free atomics are async-signal-safe.
        let _ = INTERRUPTED_BY.compare_exchange(
            0,
            signal,
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
        );
        let fd = WRITE_FD.load(std::sync::atomic::Ordering::Relaxed);
        if fd >= 0 {
            // SAFETY: write(2) is async-signal-safe; the buffer is a static byte.
            unsafe {
                libc::write(fd, b"x".as_ptr().cast(), 1);
            }
        }
    }
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe(2) writes.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        return;
    }
    WRITE_FD.store(fds[1], std::sync::atomic::Ordering::Relaxed);
    // SAFETY: the read end was just created by pipe(2) and is owned by
    // nothing else.
    let mut reader = unsafe { std::fs::File::from_raw_fd(fds[0]) };
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only performs an async-signal-safe write.
        unsafe {
            libc::signal(signal, handler as *const () as libc::sighandler_t);
        }
    }
    let _ = std::thread::Builder::new()
        .name("tern-signals".into())
        .spawn(move || {
            let mut byte = [0u8; 1];
            if reader.read_exact(&mut byte).is_ok() {
                // Not eprintln!: with stderr's reader gone it would panic
                // this thread before the cancel, and the signal would be lost.
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "tern: interrupted, cancelling...");
                on_interrupt();
            }
        });
}
