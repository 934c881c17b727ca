//! The completion thread: polls the status byte of each outstanding
//! slot's watched records (spinning with `spin_loop` for a few rounds,
//! then, when nothing progresses, UMONITOR/UMWAIT on the oldest pending
//! record where the CPU has WAITPKG, else `yield_now`; it parks when nothing
//! is outstanding), marks slots done or timed out, and unparks waiters.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tern_page::cpu_time::thread_cpu_ns;

use super::inner::Inner;
use super::slot::{DONE, Slot};
use crate::desc::CompletionRecord;

impl Inner {
    /// The first watched record of the slot not written yet, `None` when
    /// the slot is complete.
    fn first_pending(&self, slot: &Slot) -> Option<*const CompletionRecord> {
        // SAFETY: the slot is IN_FLIGHT and was received through `pending`
        // (which synchronises with the submitter's push): meta is read-only.
        let meta = unsafe { &*slot.meta.get() };
        meta.watch.iter().map(|&w| slot.watch_rec(w)).find(|&rec| {
            // SAFETY: a record of the slot's live memory.
            unsafe { CompletionRecord::load_status(rec) == 0 }
        })
    }

    fn mark_done(&self, slot: &Slot, timed_out: bool) {
        // SAFETY: as in first_pending.
        let meta = unsafe { &*slot.meta.get() };
        let q = &self.queues.entries[meta.queue];
        if timed_out {
            // The device may still hold these descriptors (or have dropped
            // them: nobody can tell), so the queue's occupancy is unknown:
            // keep the reservation and hand the queue nothing more.
            self.counters.slots_retired.fetch_add(1, Ordering::Relaxed);
            if !q.disabled.swap(true, Ordering::Relaxed) {
                self.counters
                    .queues_disabled
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    "DSA queue {} retired: a submission got no completion within {:?}",
                    q.queue.name(),
                    self.config.completion_timeout
                );
            }
        } else {
            q.in_flight.fetch_sub(meta.reserved, Ordering::AcqRel);
        }
        slot.timed_out.store(timed_out, Ordering::Release);
        slot.state.store(DONE, Ordering::Release);
        if let Some(t) = slot.waiter.lock().unwrap_or_else(|e| e.into_inner()).take() {
            t.unpark();
        }
    }
}

/// How often, at most, the completion thread asks the queues with
/// outstanding work whether the kernel has disabled them: well inside the
/// 100 ms a disabled queue may go unnoticed.
const HEALTH_INTERVAL: Duration = Duration::from_millis(10);

/// A submission outstanding this long makes its queue's state be read even
/// when the queue's fd does not poll ready.
const HEALTH_OVERDUE: Duration = Duration::from_millis(50);

/// Whether `fd` polls readable or in error right now (no waiting).
fn polls_ready(fd: std::os::fd::BorrowedFd<'_>) -> bool {
    let mut pfd = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(&fd),
        events: libc::POLLIN | libc::POLLPRI,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&raw mut pfd, 1, 0) };
    n > 0 && pfd.revents != 0
}

impl Inner {
    /// Retires every queue with outstanding work that the kernel has
    /// disabled (its fd polled ready, or a submission is overdue, and its
    /// state says so), finishing its slots as timed out: the device may
    /// still write their memory, so it is never reused.
    fn retire_disabled_queues(&self, active: &mut Vec<u32>, now: Instant) {
        let mut suspects: Vec<usize> = Vec::new();
        // Queues asked this round: a kernel without a poll handler reports
        // every fd ready, so each queue's state is read at most once.
        let mut asked: Vec<usize> = Vec::new();
        for &i in active.iter() {
            // SAFETY: as in first_pending.
            let meta = unsafe { &*self.slots[i as usize].meta.get() };
            let q = &self.queues.entries[meta.queue];
            if asked.contains(&meta.queue) || q.disabled.load(Ordering::Relaxed) {
                continue;
            }
            let overdue = now.saturating_duration_since(meta.submitted_at) > HEALTH_OVERDUE;
            let signalled = q.queue.event_fd().is_some_and(polls_ready);
            if overdue || signalled {
                asked.push(meta.queue);
                if q.queue.is_disabled() {
                    suspects.push(meta.queue);
                }
            }
        }
        for qi in suspects {
            let q = &self.queues.entries[qi];
            if !q.disabled.swap(true, Ordering::Relaxed) {
                self.counters
                    .queues_disabled
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    "DSA queue {} was disabled (by the kernel or accel-config): its outstanding \
                     pages are checked on the CPU and it is not used again",
                    q.queue.name()
                );
            }
            active.retain(|&i| {
                let slot = &self.slots[i as usize];
                // SAFETY: as in first_pending.
                let on_queue = unsafe { &*slot.meta.get() }.queue == qi;
                if on_queue {
                    self.mark_done(slot, true);
                }
                !on_queue
            });
        }
    }
}

/// Idle polling rounds spent spinning before the completion thread waits
/// more politely (UMWAIT or yield).
pub(super) const SPIN_ROUNDS: u32 = 64;

/// TSC cycles one UMWAIT may last (about 30-50 µs; the kernel's default
/// limit, `umwait_control/max_time`, is 100 000 as well).
const UMWAIT_CYCLES: u32 = 100_000;

/// What the completion thread does after a round in which nothing completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum IdleStep {
    /// `spin_loop` and poll again: completions are usually microseconds away.
    Spin,
    /// UMONITOR the oldest pending record, UMWAIT until it is written (or a
    /// short deadline): the core idles in C0.2 instead of burning cycles.
    Umwait,
    /// No WAITPKG: give the core away (to the device's software thread, or
    /// anyone) and poll again.
    Yield,
}

/// The idle step after `idle_rounds` rounds without progress.
pub(super) fn idle_step(idle_rounds: u32, umwait_available: bool) -> IdleStep {
    if idle_rounds < SPIN_ROUNDS {
        IdleStep::Spin
    } else if umwait_available {
        IdleStep::Umwait
    } else {
        IdleStep::Yield
    }
}

/// Polls outstanding slots until stopped (and drained, within a bound).
pub(super) fn completion_thread(inner: &Inner) {
    let mut active: Vec<u32> = Vec::with_capacity(inner.slots.len());
    let mut idle_rounds = 0u32;
    let mut stop_deadline: Option<Instant> = None;
    let publish_cpu = || {
        inner
            .counters
            .completion_cpu_ns
            .store(thread_cpu_ns(), Ordering::Relaxed);
    };
    let timeout = inner.config.completion_timeout;
    let mut last_health = Instant::now();
    loop {
        while let Some(i) = inner.pending.pop() {
            active.push(i);
        }
        if inner.stop.load(Ordering::Acquire) {
            let deadline = *stop_deadline
                .get_or_insert_with(|| Instant::now() + timeout.min(Duration::from_secs(2)));
            if active.is_empty() || Instant::now() > deadline {
                break;
            }
        }
        if active.is_empty() {
            publish_cpu();
            // Submitters unpark us after every push; the timeout is a
            // safety net only.
            std::thread::park_timeout(Duration::from_millis(100));
            continue;
        }
        let before = active.len();
        // One clock read per round: every outstanding submission is judged
        // by its own age, however many others complete meanwhile.
        let now = Instant::now();
        let mut oldest_pending: Option<*const CompletionRecord> = None;
        active.retain(|&i| {
            let slot = &inner.slots[i as usize];
            let Some(rec) = inner.first_pending(slot) else {
                inner.mark_done(slot, false);
                return false;
            };
            // SAFETY: as in first_pending.
            let meta = unsafe { &*slot.meta.get() };
            if now.saturating_duration_since(meta.submitted_at) > timeout {
                inner.mark_done(slot, true);
                return false;
            }
            oldest_pending.get_or_insert(rec);
            true
        });
        if active.len() == before && now.saturating_duration_since(last_health) >= HEALTH_INTERVAL {
            last_health = now;
            inner.retire_disabled_queues(&mut active, now);
        }
        if active.len() < before {
            idle_rounds = 0;
            publish_cpu();
            continue;
        }
        idle_rounds = idle_rounds.saturating_add(1);
        match (
            idle_step(idle_rounds, inner.umwait_available),
            oldest_pending,
        ) {
            (IdleStep::Umwait, Some(rec)) => {
                inner.counters.umwaits.fetch_add(1, Ordering::Relaxed);
                // SAFETY: umwait_available implies the CPU has WAITPKG
                // (CPUID); `rec` is a record of a live slot (slot memory is
                // freed only when the engine is dropped, after this thread).
                unsafe { waitpkg::wait_for_write(rec.cast(), UMWAIT_CYCLES) };
            }
            (IdleStep::Spin, _) => std::hint::spin_loop(),
            // Nothing moved for a while: let the device (or, with the
            // software device, its thread) have the core.
            _ => std::thread::yield_now(),
        }
    }
    publish_cpu();
}

#[cfg(target_arch = "x86_64")]
mod waitpkg {
    /// Arms UMONITOR on `addr`'s cache line and, unless the byte at `addr`
    /// is already non-zero, UMWAITs (C0.2) until the line is written, an
    /// interrupt arrives, or `cycles` TSC cycles pass.
    ///
    /// # Safety
    ///
    /// The CPU must have WAITPKG and `addr` must be readable.
    pub(super) unsafe fn wait_for_write(addr: *const u8, cycles: u32) {
        // SAFETY: caller guarantees WAITPKG and a readable address. The
        // status is re-read after arming the monitor so a write between the
        // caller's poll and UMONITOR is not slept through. UMWAIT takes the
        // TSC deadline in EDX:EAX and the C-state hint in its operand (0 =
        // C0.2); it only sets flags.
        unsafe {
            core::arch::asm!(
                "umonitor {addr}",
                "cmp byte ptr [{addr}], 0",
                "jne 2f",
                "rdtsc",
                "add eax, {cycles:e}",
                "adc edx, 0",
                "umwait {hint:e}",
                "2:",
                addr = in(reg) addr,
                cycles = in(reg) cycles,
                hint = in(reg) 0u32,
                out("eax") _,
                out("edx") _,
                options(nostack),
            );
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod waitpkg {
    /// Never called: WAITPKG is only detected on x86_64.
    pub(super) unsafe fn wait_for_write(_: *const u8, _: u32) {}
}
