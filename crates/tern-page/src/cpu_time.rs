//! CPU time of the calling thread or process, the one clock every tern
//! crate uses to report what a thread or a codec cost.

/// CPU time consumed by the calling thread, in nanoseconds (0 if the clock
/// cannot be read).
pub fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// CPU time consumed by the whole process, in nanoseconds (0 if the clock
/// cannot be read).
pub fn process_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; both CPU-time clocks exist
    // on every Linux this crate targets.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    if rc != 0 {
        return 0;
    }
    let secs = u64::try_from(ts.tv_sec).unwrap_or(0);
    let nanos = u64::try_from(ts.tv_nsec).unwrap_or(0);
    secs * 1_000_000_000 + nanos
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_and_process_clocks_move_with_work() {
        let thread_before = thread_cpu_ns();
        let process_before = process_cpu_ns();
        let mut x = 0u64;
        // Poll instead of guessing an amount of work: stop as soon as the
        // thread clock has ticked (its resolution is coarse on some kernels).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while thread_cpu_ns() == thread_before {
            assert!(
                std::time::Instant::now() < deadline,
                "thread CPU clock never moved"
            );
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        assert!(thread_cpu_ns() > thread_before);
        assert!(process_cpu_ns() > process_before);
    }
}
