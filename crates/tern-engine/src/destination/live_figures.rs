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

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

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
        LiveFigures {
            placed_pages_per_sec: placed_rate(busy, pages, self.receivers),
            finish_micros: finish_estimate(lateness),
        }
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
    let finish = FINISH_FLOOR + lateness * FINISH_WAKE_UPS;
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
