//! How much of a CPU the workers get while they have work: the share of
//! their runnable time the kernel ran them (`/proc/self/task/TID/schedstat`:
//! time on a CPU, time waiting on a run queue). A codec's speed is measured
//! per CPU second; on a host busy with other work a worker gets a fraction
//! of a core, and the last pages take that much longer to compress (issue
//! 31: 407-467 ms for last pages expected to take 134-259 ms, the
//! migration's threads waiting on a run queue for most of the pass).

use std::sync::Mutex;
use std::sync::atomic::{AtomicI32, Ordering};

/// Less time than this on a CPU or waiting for one, since the last
/// sample, says nothing new: the previous share stands.
const ENOUGH_NANOS: u64 = 20_000_000;

/// The smallest share taken: a worker starved more than this still makes
/// some progress, and the estimate stays finite.
const MIN_SHARE: f64 = 0.05;

/// The workers' thread ids and their scheduler totals at the last sample.
#[derive(Debug)]
pub(super) struct WorkerCpuShare {
    threads: Box<[AtomicI32]>,
    state: Mutex<Sampled>,
}

#[derive(Debug, Clone, Copy)]
struct Sampled {
    cpu_ns: u64,
    run_queue_ns: u64,
    share: f64,
}

impl WorkerCpuShare {
    pub(super) fn new(workers: usize) -> Self {
        Self {
            threads: (0..workers).map(|_| AtomicI32::new(0)).collect(),
            state: Mutex::new(Sampled {
                cpu_ns: 0,
                run_queue_ns: 0,
                share: 1.0,
            }),
        }
    }

    /// Worker `index` names its thread; called on that thread.
    pub(super) fn register(&self, index: usize) {
        if let Some(slot) = self.threads.get(index) {
            // SAFETY: gettid has no preconditions and cannot fail.
            slot.store(unsafe { libc::gettid() }, Ordering::Relaxed);
        }
    }

    /// The workers' share of a CPU since the last call (the previous share
    /// when too little happened since, 1 where the kernel does not say).
    pub(super) fn sample(&self) -> f64 {
        let mut totals = (0u64, 0u64);
        for slot in &self.threads {
            let thread = slot.load(Ordering::Relaxed);
            if thread == 0 {
                continue;
            }
            let Some((cpu, waited)) = read_schedstat(thread) else {
                continue;
            };
            totals.0 += cpu;
            totals.1 += waited;
        }
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let cpu = totals.0.saturating_sub(state.cpu_ns);
        let waited = totals.1.saturating_sub(state.run_queue_ns);
        let share = share_of(cpu, waited, state.share);
        *state = Sampled {
            cpu_ns: totals.0,
            run_queue_ns: totals.1,
            share,
        };
        share
    }
}

/// The share of runnable time spent on a CPU: `cpu` over `cpu + waited`,
/// at least [`MIN_SHARE`]; `previous` when the two are too small to tell.
/// Pure.
pub(super) fn share_of(cpu_ns: u64, waited_ns: u64, previous: f64) -> f64 {
    let runnable = cpu_ns.saturating_add(waited_ns);
    if runnable < ENOUGH_NANOS {
        return previous;
    }
    (cpu_ns as f64 / runnable as f64).clamp(MIN_SHARE, 1.0)
}

/// A thread of this process: nanoseconds on a CPU and on a run queue.
fn read_schedstat(thread: libc::pid_t) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/self/task/{thread}/schedstat")).ok()?;
    let mut fields = text.split_whitespace().map(str::parse::<u64>);
    Some((fields.next()?.ok()?, fields.next()?.ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_share_is_cpu_over_runnable_time_and_needs_enough_of_it() {
        assert_eq!(share_of(30_000_000, 90_000_000, 1.0), 0.25);
        assert_eq!(share_of(100_000_000, 0, 0.5), 1.0);
        // Too little to tell: the previous share stands.
        assert_eq!(share_of(1_000_000, 2_000_000, 0.4), 0.4);
        // Starved: never below the floor.
        assert_eq!(share_of(1_000_000, 999_000_000, 1.0), MIN_SHARE);
    }

    #[test]
    fn a_registered_thread_is_sampled() {
        let share = WorkerCpuShare::new(1);
        assert_eq!(share.sample(), 1.0, "no thread yet: a full CPU");
        share.register(0);
        // Busy long enough to count: its share is its own, a real figure.
        let started = std::time::Instant::now();
        while started.elapsed() < std::time::Duration::from_millis(50) {
            std::hint::black_box(0u64);
        }
        let sampled = share.sample();
        assert!((MIN_SHARE..=1.0).contains(&sampled), "{sampled}");
    }
}
