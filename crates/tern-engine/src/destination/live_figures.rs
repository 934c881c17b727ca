//! What the destination measures of its own speed during the live phase,
//! for the source's downtime estimate (protocol version 10: the
//! heartbeat's [`LiveFigures`]).
//!
//! Two figures. How fast the receivers place pages while busy: the time
//! each spends on a packet apart from waiting for its bytes, and at each
//! sync the wait for its decoders, over the pages it carried; the link's
//! speed is the source's to measure, so the socket reads are left out. And
//! how long the destination needs after the last page: it wakes its main
//! thread a few times on the way to resuming (the last pages, `Complete`,
//! the `Commit`, the outcome), so the latest delay of its own scheduled
//! wake-ups (the heartbeat's), times those wake-ups, plus a floor for the
//! work itself. Issue 31: a run under load 11 spent 272 ms on the
//! destination's side where the source expected none of it.
//!
//! The finish also counts the receivers' backlog: bytes the kernel has
//! received (and acknowledged, so the source counts them as sent) that the
//! receivers have not read yet, at the rate they read over the last
//! interval. A destination short of CPU falls behind the link, and its
//! sockets' buffers (up to 32 MiB each here) hold the rest of a pass: in
//! issue 31's runs the last pages waited up to 700 ms behind the previous
//! pass's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tern_wire::LiveFigures;

/// Wake-ups of the destination's main thread between the last page and the
/// resumed guest: the end of the page channels, `Complete`, `Commit`, and
/// the resume's own.
const FINISH_WAKE_UPS: u32 = 4;

/// The work of the finish on an idle machine (combining the page hashes,
/// restoring the state, resuming): the `destination` part of issue 31's
/// runs at load 9-12 was 3-33 ms in 8 of 10.
const FINISH_FLOOR: Duration = Duration::from_millis(10);

/// Fewer pages than this in a heartbeat interval are too few to tell a
/// rate: the figure since the start is sent instead.
const ENOUGH_PAGES: u64 = 1024;

/// The receivers' busy time and the pages it placed, counted by every
/// receiver and read by the main thread once per heartbeat.
#[derive(Debug, Default)]
pub(crate) struct PlacingMeter {
    busy_nanos: AtomicU64,
    pages: AtomicU64,
}

impl PlacingMeter {
    /// One receiver spent `busy` placing `pages` pages.
    pub(super) fn record(&self, busy: Duration, pages: u64) {
        let nanos = u64::try_from(busy.as_nanos()).unwrap_or(u64::MAX);
        self.busy_nanos.fetch_add(nanos, Ordering::Relaxed);
        self.pages.fetch_add(pages, Ordering::Relaxed);
    }

    fn totals(&self) -> (u64, u64) {
        (
            self.busy_nanos.load(Ordering::Relaxed),
            self.pages.load(Ordering::Relaxed),
        )
    }
}

/// Channels whose backlog is counted; a receiver beyond them is left out
/// (a destination has a handful).
const BACKLOG_CHANNELS: usize = 32;

/// Each receiver's unread bytes at its latest frame, and how far behind the
/// link it is in time, written by the receivers and read by the main thread
/// at each heartbeat.
///
/// The lag: a receiver that reads a frame and finds no more unread bytes
/// than the frame's own rest has read everything that had arrived, so it
/// is caught up at that moment. Until the next such moment, every byte it
/// has not read arrived after the last one: the time since is how long its
/// oldest unread byte has waited, and about the time the unread rest needs
/// at the pace the receiver kept. Bytes say nothing of that where a
/// destination short of CPU falls behind by whole passes of few bytes each:
/// issue 31's series F rep 5 broke the limit with 0.3-0.7 MB unread, two
/// small passes and 250-350 ms behind at the pause, and a figure of 11 ms.
#[derive(Debug)]
pub(crate) struct BacklogMeter {
    unread: [AtomicU64; BACKLOG_CHANNELS],
    /// Per receiver: 0 while caught up at its latest frame, else when it
    /// was last caught up (nanoseconds since `origin`, plus one).
    behind_since: [AtomicU64; BACKLOG_CHANNELS],
    /// Per receiver: when it was last caught up, as `behind_since`; 0
    /// before its first frame.
    caught_up_at: [AtomicU64; BACKLOG_CHANNELS],
    /// The longest lag a receiver showed at a frame since the main thread
    /// last took it, nanoseconds.
    worst_lag: AtomicU64,
    origin: Instant,
}

impl Default for BacklogMeter {
    fn default() -> Self {
        Self {
            unread: Default::default(),
            behind_since: Default::default(),
            caught_up_at: Default::default(),
            worst_lag: AtomicU64::new(0),
            origin: Instant::now(),
        }
    }
}

impl BacklogMeter {
    /// Receiver `index`'s socket held `unread` bytes not yet read after
    /// it read a frame's head at `at`, of which `rest` are the frame's own
    /// (a packet's payload; none for a sync).
    pub(super) fn record(&self, index: usize, unread: Option<u64>, rest: u64, at: Instant) {
        let (Some(slot), Some(unread)) = (self.unread.get(index), unread) else {
            return;
        };
        slot.store(unread, Ordering::Relaxed);
        let (Some(behind), Some(caught_up)) =
            (self.behind_since.get(index), self.caught_up_at.get(index))
        else {
            return;
        };
        let now = self.stamp(at);
        let last = caught_up.load(Ordering::Relaxed);
        // The first frame has no earlier moment to be behind since.
        if unread <= rest || last == 0 {
            caught_up.store(now, Ordering::Relaxed);
            behind.store(0, Ordering::Relaxed);
        } else {
            behind.store(last, Ordering::Relaxed);
            self.worst_lag
                .fetch_max(now.saturating_sub(last), Ordering::Relaxed);
        }
    }

    /// Unread bytes of every receiver, at each one's latest frame.
    pub(super) fn total(&self) -> u64 {
        self.unread
            .iter()
            .map(|slot| slot.load(Ordering::Relaxed))
            .sum()
    }

    /// The longest lag since the last call: the worst any receiver showed
    /// at a frame, or shows now if it was behind at its latest frame (a
    /// receiver waiting for its decoders or the others reads nothing).
    pub(super) fn take_lag(&self, now: Instant) -> Duration {
        let now = self.stamp(now);
        let current = self
            .behind_since
            .iter()
            .map(|slot| slot.load(Ordering::Relaxed))
            .filter(|&since| since != 0)
            .map(|since| now.saturating_sub(since))
            .max()
            .unwrap_or(0);
        let worst = self.worst_lag.swap(0, Ordering::Relaxed);
        Duration::from_nanos(worst.max(current))
    }

    /// `at` as nanoseconds since the meter's origin, plus one (so 0 is
    /// "never").
    fn stamp(&self, at: Instant) -> u64 {
        let since = at.saturating_duration_since(self.origin).as_nanos();
        u64::try_from(since).unwrap_or(u64::MAX - 1) + 1
    }
}

/// The main thread's side: the meter's totals at the last heartbeat, and
/// the figures each heartbeat carries.
#[derive(Debug)]
pub(super) struct FigureWindow {
    receivers: u32,
    last: (u64, u64),
    /// Bytes read from all channels at the last heartbeat, and when.
    last_received: Option<(u64, Instant)>,
    /// The receivers' lag the previous heartbeat counted: the figure sent
    /// is the larger of two, since the source may decide on it a second
    /// later.
    previous_lag: Duration,
}

impl FigureWindow {
    pub(super) fn new(receivers: usize) -> Self {
        Self {
            receivers: u32::try_from(receivers.max(1)).unwrap_or(u32::MAX),
            last: (0, 0),
            last_received: None,
            previous_lag: Duration::ZERO,
        }
    }

    /// The figures for a heartbeat sent `lateness` after it was due, with
    /// `backlog` bytes unread in the receivers' sockets, the receivers
    /// `lag` behind the link at worst since the last heartbeat, and
    /// `received` bytes read from all channels so far.
    pub(super) fn next(
        &mut self,
        meter: &PlacingMeter,
        lateness: Duration,
        backlog: u64,
        lag: Duration,
        received: u64,
    ) -> LiveFigures {
        let now_at = Instant::now();
        let drain = self.last_received.map_or(Duration::ZERO, |(before, at)| {
            drain_time(backlog, received.saturating_sub(before), now_at - at)
        });
        self.last_received = Some((received, now_at));
        let previous_lag = std::mem::replace(&mut self.previous_lag, lag);
        let now = meter.totals();
        let window = (
            now.0 - self.last.0.min(now.0),
            now.1 - self.last.1.min(now.1),
        );
        let (busy, pages) = if window.1 >= ENOUGH_PAGES {
            self.last = now;
            window
        } else {
            now
        };
        let figures = LiveFigures {
            placed_pages_per_sec: placed_rate(busy, pages, self.receivers),
            finish_micros: finish_estimate(lateness, drain.max(lag.max(previous_lag))),
        };
        tracing::debug!(
            lateness_ms = lateness.as_secs_f64() * 1e3,
            backlog,
            drain_ms = drain.as_secs_f64() * 1e3,
            lag_ms = lag.as_secs_f64() * 1e3,
            previous_lag_ms = previous_lag.as_secs_f64() * 1e3,
            finish_ms = f64::from(figures.finish_micros) / 1e3,
            placed_pages_per_sec = figures.placed_pages_per_sec,
            "heartbeat figures"
        );
        figures
    }
}

/// How long reading `backlog` bytes takes at the pace `read` bytes took
/// `over`: the whole interval again when nothing was read (it made no
/// progress at all), none without a backlog. Pure.
pub(super) fn drain_time(backlog: u64, read: u64, over: Duration) -> Duration {
    if backlog == 0 {
        return Duration::ZERO;
    }
    if read == 0 {
        return over;
    }
    over.mul_f64((backlog as f64 / read as f64).min(1e6))
}

/// Pages per second `receivers` working side by side place, from their
/// summed busy time; 0 when nothing was measured.
pub(super) fn placed_rate(busy_nanos: u64, pages: u64, receivers: u32) -> u32 {
    if busy_nanos == 0 || pages == 0 {
        return 0;
    }
    let per_receiver = busy_nanos as f64 / 1e9 / f64::from(receivers.max(1));
    let rate = pages as f64 / per_receiver;
    crate::numeric::saturating_u64_from_f64(rate)
        .min(u64::from(u32::MAX))
        .try_into()
        .unwrap_or(u32::MAX)
}

/// The finish's expected time from the latest delay of a scheduled
/// wake-up and the time to catch up with the link (the receivers' backlog
/// at their reading pace, or their lag, whichever is longer), in
/// microseconds.
pub(super) fn finish_estimate(lateness: Duration, drain: Duration) -> u32 {
    let finish = FINISH_FLOOR
        .saturating_add(lateness.saturating_mul(FINISH_WAKE_UPS))
        .saturating_add(drain);
    u32::try_from(finish.as_micros()).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_counts_receivers_side_by_side_and_nothing_is_zero() {
        // Two receivers busy 1 s in all placed 100 000 pages: each was busy
        // half a second, so together they place 200 000 a second.
        assert_eq!(placed_rate(1_000_000_000, 100_000, 2), 200_000);
        assert_eq!(placed_rate(1_000_000_000, 100_000, 1), 100_000);
        assert_eq!(placed_rate(0, 100, 2), 0);
        assert_eq!(placed_rate(100, 0, 2), 0);
        assert_eq!(placed_rate(1, u64::MAX, 1), u32::MAX);
    }

    #[test]
    fn a_late_heartbeat_lengthens_the_finish() {
        let none = Duration::ZERO;
        assert_eq!(finish_estimate(none, none), 10_000);
        assert_eq!(finish_estimate(Duration::from_millis(50), none), 210_000);
        assert_eq!(
            finish_estimate(Duration::from_secs(1 << 40), none),
            u32::MAX
        );
    }

    #[test]
    fn a_backlog_lengthens_the_finish_by_the_time_to_read_it() {
        let second = Duration::from_secs(1);
        // 12.5 MB unread at 50 MB read in the last second: 250 ms.
        let drain = drain_time(12_500_000, 50_000_000, second);
        assert_eq!(drain, Duration::from_millis(250));
        assert_eq!(
            finish_estimate(Duration::ZERO, drain),
            260_000,
            "the floor and the backlog's time"
        );
        assert_eq!(drain_time(0, 50_000_000, second), Duration::ZERO);
        // Nothing read at all: the interval again.
        assert_eq!(drain_time(1, 0, second), second);
        assert_eq!(finish_estimate(Duration::ZERO, Duration::MAX), u32::MAX);
    }

    #[test]
    fn the_backlog_sums_the_receivers_latest_figures() {
        let meter = BacklogMeter::default();
        let now = Instant::now();
        meter.record(0, Some(100), 0, now);
        meter.record(1, Some(50), 0, now);
        meter.record(0, Some(30), 0, now);
        meter.record(1, None, 0, now);
        meter.record(BACKLOG_CHANNELS, Some(1 << 40), 0, now);
        assert_eq!(meter.total(), 80);
    }

    /// Issue 31, series F rep 5: a destination two small passes behind
    /// with little unread was 250-350 ms late at the pause, and its figure
    /// said 11 ms. The lag is time, whatever the bytes.
    #[test]
    fn a_receiver_behind_the_link_shows_its_lag_until_it_catches_up() {
        let meter = BacklogMeter::default();
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        // The first frame has nothing to be behind since.
        meter.record(0, Some(5 << 20), 100, at(0));
        assert_eq!(meter.take_lag(at(0)), Duration::ZERO);
        // Caught up: no more unread than the packet's own payload.
        meter.record(0, Some(100), 100, at(10));
        meter.record(1, Some(0), 0, at(10));
        assert_eq!(meter.take_lag(at(500)), Duration::ZERO);
        // Behind by few bytes: a sync read with a packet's head after it.
        meter.record(0, Some(4096), 0, at(100));
        assert_eq!(meter.take_lag(at(400)), Duration::from_millis(390));
        // Stuck (in the barrier, say): the lag grows while it reads nothing.
        assert_eq!(meter.take_lag(at(600)), Duration::from_millis(590));
        // Still behind at its next frame, then caught up: the worst it
        // showed counts once, at the next look.
        meter.record(0, Some(8192), 0, at(700));
        meter.record(0, Some(0), 0, at(710));
        assert_eq!(meter.take_lag(at(800)), Duration::from_millis(690));
        assert_eq!(meter.take_lag(at(900)), Duration::ZERO);
        // Another receiver's lag counts too; a channel beyond the meter's
        // does not.
        meter.record(1, Some(1), 0, at(1000));
        meter.record(BACKLOG_CHANNELS, Some(1 << 40), 0, at(1000));
        assert_eq!(meter.take_lag(at(1010)), Duration::from_millis(1000));
    }

    #[test]
    fn the_lag_lengthens_the_finish_for_two_heartbeats() {
        let meter = PlacingMeter::default();
        let mut window = FigureWindow::new(1);
        let figure = |window: &mut FigureWindow, lag_ms| {
            window
                .next(&meter, Duration::ZERO, 0, Duration::from_millis(lag_ms), 0)
                .finish_micros
        };
        assert_eq!(figure(&mut window, 0), 10_000);
        assert_eq!(figure(&mut window, 200), 210_000);
        // The source may decide on a figure a second old: the next one
        // still counts the lag.
        assert_eq!(figure(&mut window, 0), 210_000);
        assert_eq!(figure(&mut window, 0), 10_000);
    }

    #[test]
    fn each_heartbeat_measures_its_own_interval_when_it_has_enough_pages() {
        let meter = PlacingMeter::default();
        let mut window = FigureWindow::new(1);
        assert_eq!(
            window
                .next(&meter, Duration::ZERO, 0, Duration::ZERO, 0)
                .placed_pages_per_sec,
            0
        );
        meter.record(Duration::from_millis(100), 10_000);
        assert_eq!(
            window
                .next(&meter, Duration::ZERO, 0, Duration::ZERO, 0)
                .placed_pages_per_sec,
            100_000
        );
        // A slower interval is seen as such, not averaged away.
        meter.record(Duration::from_millis(400), 10_000);
        assert_eq!(
            window
                .next(&meter, Duration::ZERO, 0, Duration::ZERO, 0)
                .placed_pages_per_sec,
            25_000
        );
        // Too few pages: the figure since the start.
        meter.record(Duration::from_millis(500), 10);
        assert_eq!(
            window
                .next(&meter, Duration::ZERO, 0, Duration::ZERO, 0)
                .placed_pages_per_sec,
            20_010
        );
    }
}
