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
//! How far the destination is behind the link is not a heartbeat's: it is
//! measured per pass ([`PassLagMeter`]) and told with each pass applied
//! (protocol 13), since the source decides at its syncs, pass by pass.
//! Issue 31: the worst lag of the last two heartbeat intervals, which the
//! heartbeat carried before, was a second or two stale when the source
//! decided, and held 8 of 16 running migrations at the 270 ms clamp
//! (302 ms in one interval, 8-19 ms in the three before it).

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

/// Channels whose lag is measured; a receiver beyond them is left out
/// (a destination has a handful).
const LAG_CHANNELS: usize = 32;

/// When each receiver was last caught up with the link, and when the
/// current pass's sync reached it at the latest: written by the receivers,
/// taken once per pass by the last receiver to end it.
///
/// A receiver that reads a frame's head and finds no more unread bytes than
/// the frame's own rest has read everything that had arrived: it is caught
/// up at that moment. Its pass's sync, read later, arrived after the last
/// such moment; read caught up, it arrived about when read. So the pass's
/// lag, the time from its last byte's arrival to its pages all in memory,
/// is at most the time from the latest of those moments, over the
/// receivers, to the barrier's end: it counts the socket's backlog, the
/// decoders' and the barrier's waits, whatever the bytes (issue 31, series
/// F rep 5: a destination two small passes behind, 0.3-0.7 MB unread,
/// was 250-350 ms late at the pause).
#[derive(Debug)]
pub(crate) struct PassLagMeter {
    /// Per receiver: when it was last caught up (nanoseconds since
    /// `origin`, plus one); 0 before its first frame.
    caught_up_at: [AtomicU64; LAG_CHANNELS],
    /// Per receiver: the latest its current pass's sync can have arrived,
    /// as `caught_up_at`; 0 until it reads the sync.
    sync_arrived_by: [AtomicU64; LAG_CHANNELS],
    origin: Instant,
}

impl Default for PassLagMeter {
    fn default() -> Self {
        Self {
            caught_up_at: Default::default(),
            sync_arrived_by: Default::default(),
            origin: Instant::now(),
        }
    }
}

impl PassLagMeter {
    /// Receiver `index`'s socket held `unread` bytes not yet read after
    /// it read a frame's head at `at`, of which `rest` are the frame's own
    /// (a packet's payload; none for a sync). `None`: the transport cannot
    /// tell.
    pub(super) fn record(&self, index: usize, unread: Option<u64>, rest: u64, at: Instant) {
        let (Some(caught_up), Some(unread)) = (self.caught_up_at.get(index), unread) else {
            return;
        };
        // The first frame has no earlier moment to be behind since.
        if unread <= rest || caught_up.load(Ordering::Relaxed) == 0 {
            caught_up.store(self.stamp(at), Ordering::Relaxed);
        }
    }

    /// Receiver `index` read its pass's sync at `at` with `unread` bytes
    /// after it. A transport that cannot tell its unread bytes counts as
    /// caught up: the sync arrived when read.
    pub(super) fn record_sync(&self, index: usize, unread: Option<u64>, at: Instant) {
        self.record(index, unread, 0, at);
        let (Some(caught_up), Some(arrived_by)) = (
            self.caught_up_at.get(index),
            self.sync_arrived_by.get(index),
        ) else {
            return;
        };
        let by = match unread {
            Some(_) => caught_up.load(Ordering::Relaxed),
            None => self.stamp(at),
        };
        arrived_by.store(by, Ordering::Relaxed);
    }

    /// The pass's lag at `now`, when every receiver has ended it (so each
    /// recorded its sync, and none records the next pass's yet): the time
    /// since the latest moment any receiver's sync can have arrived. Clears
    /// the syncs for the next pass.
    pub(super) fn take_pass_lag(&self, now: Instant) -> Duration {
        let latest = self
            .sync_arrived_by
            .iter()
            .map(|slot| slot.swap(0, Ordering::Relaxed))
            .max()
            .unwrap_or(0);
        if latest == 0 {
            return Duration::ZERO;
        }
        Duration::from_nanos(self.stamp(now).saturating_sub(latest))
    }

    /// `at` as nanoseconds since the meter's origin, plus one (so 0 is
    /// "never").
    fn stamp(&self, at: Instant) -> u64 {
        let since = at.saturating_duration_since(self.origin).as_nanos();
        u64::try_from(since).unwrap_or(u64::MAX - 1) + 1
    }
}

/// A pass's lag in whole microseconds, as `PassApplied` carries it.
pub(super) fn lag_micros(lag: Duration) -> u32 {
    u32::try_from(lag.as_micros()).unwrap_or(u32::MAX)
}

/// The main thread's side: the meter's totals at the last heartbeat, and
/// the figures each heartbeat carries.
#[derive(Debug)]
pub(super) struct FigureWindow {
    receivers: u32,
    last: (u64, u64),
}

impl FigureWindow {
    pub(super) fn new(receivers: usize) -> Self {
        Self {
            receivers: u32::try_from(receivers.max(1)).unwrap_or(u32::MAX),
            last: (0, 0),
        }
    }

    /// The figures for a heartbeat sent `lateness` after it was due.
    pub(super) fn next(&mut self, meter: &PlacingMeter, lateness: Duration) -> LiveFigures {
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
            finish_micros: finish_estimate(lateness),
        };
        tracing::debug!(
            lateness_ms = lateness.as_secs_f64() * 1e3,
            finish_ms = f64::from(figures.finish_micros) / 1e3,
            placed_pages_per_sec = figures.placed_pages_per_sec,
            "heartbeat figures"
        );
        figures
    }
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
/// wake-up, in microseconds.
pub(super) fn finish_estimate(lateness: Duration) -> u32 {
    let finish = FINISH_FLOOR.saturating_add(lateness.saturating_mul(FINISH_WAKE_UPS));
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
        assert_eq!(finish_estimate(Duration::ZERO), 10_000);
        assert_eq!(finish_estimate(Duration::from_millis(50)), 210_000);
        assert_eq!(finish_estimate(Duration::from_secs(1 << 40)), u32::MAX);
    }

    /// Issue 31, series F rep 5: a destination two small passes behind
    /// with little unread was 250-350 ms late at the pause. The lag is
    /// time, whatever the bytes: from the latest its sync can have arrived
    /// to the pass's end.
    #[test]
    fn a_pass_lags_from_its_sync_latest_arrival_to_its_end() {
        let meter = PassLagMeter::default();
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        // The first frame has nothing to be behind since.
        meter.record(0, Some(5 << 20), 100, at(0));
        // Receiver 0 caught up at 10 ms (no more unread than the packet's
        // own payload), then behind at 40 and at its sync at 300: the
        // sync arrived after 10 ms, the pass ends at 320.
        meter.record(0, Some(100), 100, at(10));
        meter.record(0, Some(9000), 100, at(40));
        meter.record_sync(0, Some(4096), at(300));
        // Receiver 1 read its sync caught up at 100: it arrived then.
        meter.record_sync(1, Some(0), at(100));
        assert_eq!(meter.take_pass_lag(at(320)), Duration::from_millis(220));
        // Taken: the next pass starts from nothing.
        assert_eq!(meter.take_pass_lag(at(400)), Duration::ZERO);
        // Both caught up at their syncs: the lag is the barrier's wait
        // after the later one.
        meter.record_sync(0, Some(0), at(500));
        meter.record_sync(1, Some(0), at(505));
        assert_eq!(meter.take_pass_lag(at(507)), Duration::from_millis(2));
        // A transport that cannot count its unread bytes: arrived when
        // read. A channel beyond the meter's is left out.
        meter.record_sync(0, None, at(600));
        meter.record_sync(LAG_CHANNELS, Some(1 << 40), at(0));
        assert_eq!(meter.take_pass_lag(at(610)), Duration::from_millis(10));
        assert_eq!(lag_micros(Duration::from_millis(7)), 7000);
        assert_eq!(lag_micros(Duration::MAX), u32::MAX);
    }

    /// A sync read at the meter's very first instant is still a sync (its
    /// stamp is not the "never" of 0).
    #[test]
    fn a_sync_at_the_meters_origin_counts() {
        let meter = PassLagMeter::default();
        let origin = meter.origin;
        meter.record_sync(0, Some(0), origin);
        assert_eq!(
            meter.take_pass_lag(origin + Duration::from_millis(5)),
            Duration::from_millis(5)
        );
    }

    #[test]
    fn each_heartbeat_measures_its_own_interval_when_it_has_enough_pages() {
        let meter = PlacingMeter::default();
        let mut window = FigureWindow::new(1);
        assert_eq!(window.next(&meter, Duration::ZERO).placed_pages_per_sec, 0);
        meter.record(Duration::from_millis(100), 10_000);
        assert_eq!(
            window.next(&meter, Duration::ZERO).placed_pages_per_sec,
            100_000
        );
        // A slower interval is seen as such, not averaged away.
        meter.record(Duration::from_millis(400), 10_000);
        assert_eq!(
            window.next(&meter, Duration::ZERO).placed_pages_per_sec,
            25_000
        );
        // Too few pages: the figure since the start.
        meter.record(Duration::from_millis(500), 10);
        assert_eq!(
            window.next(&meter, Duration::ZERO).placed_pages_per_sec,
            20_010
        );
    }
}
