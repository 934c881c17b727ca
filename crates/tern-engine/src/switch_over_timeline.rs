//! The switch-over's steps with their times, on either side (issue 31: a
//! destination's part of the downtime reached 780 ms where 10-47 were
//! expected, and nothing said which step took it).
//!
//! Each step records when it happened and, from the kernel's scheduler
//! statistics of the thread that recorded it (`/proc/thread-self/schedstat`),
//! how long that thread ran on a CPU and how long it waited for one since
//! its previous step: a gap that is neither was spent blocked (on a socket,
//! a lock, another thread). The report gives every step in milliseconds
//! after the side's origin (the source's pause, the destination's reading
//! of `Complete`), and the origin's `CLOCK_MONOTONIC` time, so that two
//! processes on one host can be laid side by side.

use std::sync::Mutex;
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// At most this many steps are kept: each side records a fixed handful per
/// switch-over (and a few per page channel); the bound only keeps a
/// repeated path from growing the list.
const MAX_STEPS: usize = 256;

/// One step of a switch-over, as the report gives it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct TimelineStep {
    /// What had just happened (e.g. `ready-sent`, `receiver-0-landed`).
    pub step: String,
    /// Milliseconds after the origin (negative: before it).
    pub at_ms: f64,
    /// The thread that recorded it.
    pub thread: String,
    /// Milliseconds that thread ran on a CPU since its previous step, when
    /// it recorded one and the kernel's scheduler statistics are readable.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub cpu_ms: Option<f64>,
    /// Milliseconds that thread waited, runnable, for a CPU since its
    /// previous step (the scheduler's run-queue delay): time lost to other
    /// work on the host, not to tern's own.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub run_queue_ms: Option<f64>,
    /// Bytes queued at that moment where the step says: on the source,
    /// written to the page channels and not yet acknowledged by the
    /// destination's kernel; on a destination receiver, arrived in its
    /// socket and not yet read.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub queued_bytes: Option<u64>,
}

/// A switch-over's steps, in the order they happened.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct SwitchOverTimeline {
    /// The origin's `CLOCK_MONOTONIC` time in nanoseconds: the same clock
    /// for every process of a host.
    pub origin_monotonic_ns: u64,
    /// The steps, ordered by time.
    pub steps: Vec<TimelineStep>,
}

/// A step taken, not yet named: when, by which thread, and that thread's
/// scheduler figures then.
#[derive(Debug, Clone)]
pub(crate) struct StepMark {
    at: Instant,
    queued_bytes: Option<u64>,
    thread: String,
    thread_id: libc::pid_t,
    sched: Option<SchedStat>,
}

impl StepMark {
    /// The same step, with the bytes queued then.
    pub(crate) fn with_queued(mut self, bytes: Option<u64>) -> Self {
        self.queued_bytes = bytes;
        self
    }

    /// Now, on this thread.
    pub(crate) fn now() -> Self {
        Self {
            sched: SchedStat::of_this_thread(),
            at: Instant::now(),
            queued_bytes: None,
            thread: thread_name(),
            thread_id: thread_id(),
        }
    }
}

/// The steps of one switch-over, recorded by any thread.
#[derive(Debug, Default)]
pub(crate) struct TimelineRecorder {
    steps: Mutex<Vec<(String, StepMark)>>,
    /// The origin: its instant and its `CLOCK_MONOTONIC` nanoseconds.
    origin: Mutex<Option<(Instant, u64)>>,
}

impl TimelineRecorder {
    /// Forgets every step: a new switch-over begins.
    pub(crate) fn clear(&self) {
        self.steps.lock().unwrap_or_else(|e| e.into_inner()).clear();
        *self.origin.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// Records `step` as happening now; the first step marked as the
    /// origin sets the time every other is given against.
    pub(crate) fn origin(&self, step: impl Into<String>) {
        self.origin_at(step, StepMark::now());
    }

    /// As [`Self::origin`], at `mark`.
    pub(crate) fn origin_at(&self, step: impl Into<String>, mark: StepMark) {
        let monotonic = monotonic_ns();
        self.origin
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert((mark.at, monotonic));
        self.record(step, mark);
    }

    /// Records `step` as happening now, on this thread.
    pub(crate) fn mark(&self, step: impl Into<String>) {
        self.record(step, StepMark::now());
    }

    /// Records `step` as having happened at `mark`.
    pub(crate) fn record(&self, step: impl Into<String>, mark: StepMark) {
        let mut steps = self.steps.lock().unwrap_or_else(|e| e.into_inner());
        if steps.len() < MAX_STEPS {
            steps.push((step.into(), mark));
        }
    }

    /// The timeline so far; `None` before the origin.
    pub(crate) fn report(&self) -> Option<SwitchOverTimeline> {
        let (origin, origin_monotonic_ns) =
            (*self.origin.lock().unwrap_or_else(|e| e.into_inner()))?;
        let steps = self.steps.lock().unwrap_or_else(|e| e.into_inner());
        let mut order: Vec<&(String, StepMark)> = steps.iter().collect();
        order.sort_by_key(|(_, mark)| mark.at);
        let mut reported = Vec::with_capacity(order.len());
        for (index, (step, recorded)) in order.iter().enumerate() {
            let previous = order[..index]
                .iter()
                .rev()
                .find(|(_, earlier)| {
                    earlier.thread_id == recorded.thread_id && earlier.sched.is_some()
                })
                .and_then(|(_, earlier)| earlier.sched);
            let since = match (previous, recorded.sched) {
                (Some(before), Some(now)) => Some(now.since(before)),
                _ => None,
            };
            reported.push(TimelineStep {
                step: step.clone(),
                at_ms: signed_ms(origin, recorded.at),
                thread: recorded.thread.clone(),
                cpu_ms: since.map(|(cpu, _)| cpu),
                run_queue_ms: since.map(|(_, wait)| wait),
                queued_bytes: recorded.queued_bytes,
            });
        }
        Some(SwitchOverTimeline {
            origin_monotonic_ns,
            steps: reported,
        })
    }
}

/// `at` in milliseconds after `origin`, negative before it, to 0.01 ms.
fn signed_ms(origin: Instant, at: Instant) -> f64 {
    let ms = match at.checked_duration_since(origin) {
        Some(after) => after.as_secs_f64() * 1000.0,
        None => -(origin.duration_since(at).as_secs_f64() * 1000.0),
    };
    (ms * 100.0).round() / 100.0
}

/// The kernel's scheduler figures of one thread: nanoseconds on a CPU and
/// nanoseconds waiting on a run queue, since the thread began.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct SchedStat {
    cpu_ns: u64,
    run_queue_ns: u64,
}

impl SchedStat {
    /// This thread's figures; `None` where the kernel does not give them.
    fn of_this_thread() -> Option<Self> {
        let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
        Self::parse(&text)
    }

    fn parse(text: &str) -> Option<Self> {
        let mut fields = text.split_whitespace().map(str::parse::<u64>);
        Some(Self {
            cpu_ns: fields.next()?.ok()?,
            run_queue_ns: fields.next()?.ok()?,
        })
    }

    /// Milliseconds on a CPU and on a run queue since `before`.
    fn since(self, before: Self) -> (f64, f64) {
        let ms = |now: u64, then: u64| (now.saturating_sub(then) as f64 / 1e4).round() / 100.0;
        (
            ms(self.cpu_ns, before.cpu_ns),
            ms(self.run_queue_ns, before.run_queue_ns),
        )
    }
}

fn thread_name() -> String {
    std::thread::current()
        .name()
        .unwrap_or("unnamed")
        .to_string()
}

fn thread_id() -> libc::pid_t {
    // SAFETY: gettid has no preconditions and cannot fail.
    unsafe { libc::gettid() }
}

/// Bytes a socket has received and not yet given to a read (`FIONREAD`),
/// or `None` when the kernel does not say.
pub(crate) fn socket_unread(fd: std::os::fd::RawFd) -> Option<u64> {
    socket_count(fd, libc::FIONREAD)
}

/// Bytes a socket holds that its peer has not acknowledged (`SIOCOUTQ`),
/// or `None` when the kernel does not say.
pub(crate) fn socket_unacknowledged(fd: std::os::fd::RawFd) -> Option<u64> {
    socket_count(fd, libc::TIOCOUTQ)
}

fn socket_count(fd: std::os::fd::RawFd, request: libc::Ioctl) -> Option<u64> {
    let mut count: libc::c_int = 0;
    // SAFETY: FIONREAD and SIOCOUTQ write one int through the pointer,
    // which points at a live local; a bad or closed descriptor only fails.
    let result = unsafe { libc::ioctl(fd, request, &mut count) };
    (result == 0).then(|| u64::try_from(count).unwrap_or(0))
}

/// `CLOCK_MONOTONIC` now, in nanoseconds (0 if it cannot be read).
fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec for the call to fill.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) } != 0 {
        return 0;
    }
    u64::try_from(now.tv_sec)
        .unwrap_or(0)
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::try_from(now.tv_nsec).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scheduler_figures_parse_and_subtract() {
        let before = SchedStat::parse("1000000 2000000 3\n").unwrap();
        let after = SchedStat::parse("4500000 2250000 9\n").unwrap();
        assert_eq!(after.since(before), (3.5, 0.25));
        assert_eq!(SchedStat::parse("x 1"), None);
        assert_eq!(SchedStat::parse(""), None);
    }

    #[test]
    fn steps_are_given_against_the_origin_in_order_with_this_threads_figures() {
        let recorder = TimelineRecorder::default();
        assert!(recorder.report().is_none());
        let early = StepMark::now();
        recorder.origin("complete-read");
        recorder.mark("ready-sent");
        recorder.record("receiver-0-began", early);
        let timeline = recorder.report().unwrap();
        let names: Vec<&str> = timeline.steps.iter().map(|s| s.step.as_str()).collect();
        assert_eq!(names, ["receiver-0-began", "complete-read", "ready-sent"]);
        assert!(timeline.steps[0].at_ms <= 0.0);
        assert_eq!(timeline.steps[1].at_ms, 0.0);
        assert!(timeline.steps[2].at_ms >= 0.0);
        assert!(timeline.origin_monotonic_ns > 0);
        // The first step of a thread has nothing to count from; the
        // others count from that thread's previous one.
        assert_eq!(timeline.steps[0].cpu_ms, None);
        if std::path::Path::new("/proc/thread-self/schedstat").exists() {
            assert!(timeline.steps[1].cpu_ms.is_some());
            assert!(timeline.steps[2].run_queue_ms.is_some());
        }
        recorder.clear();
        assert!(recorder.report().is_none());
    }
}
