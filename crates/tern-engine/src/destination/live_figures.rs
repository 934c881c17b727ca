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

/// Channels whose backlog is counted; a receiver beyond them is left out
/// (a destination has a handful).
const BACKLOG_CHANNELS: usize = 32;

/// Each receiver's unread bytes at its latest packet, written by the
/// receivers and summed by the main thread at each heartbeat.
#[derive(Debug, Default)]
pub(crate) struct BacklogMeter {
    unread: [AtomicU64; BACKLOG_CHANNELS],
}

impl BacklogMeter {
    /// Receiver `index`'s socket held `unread` bytes not yet read.
    pub(super) fn record(&self, index: usize, unread: Option<u64>) {
        if let (Some(slot), Some(unread)) = (self.unread.get(index), unread) {
            slot.store(unread, Ordering::Relaxed);
        }
    }

    /// Unread bytes of every receiver, at each one's latest packet.
    pub(super) fn total(&self) -> u64 {
        self.unread
            .iter()
            .map(|slot| slot.load(Ordering::Relaxed))
            .sum()
    }
}

/// The main thread's side: the meter's totals at the last heartbeat, and
/// the figures each heartbeat carries.
#[derive(Debug)]
pub(super) struct FigureWindow {
    receivers: u32,
    last: (u64, u64),
    /// Bytes read from all channels at the last heartbeat, and when.
    last_received: Option<(u64, std::time::Instant)>,
}

impl FigureWindow {
    pub(super) fn new(receivers: usize) -> Self {
        Self {
            receivers: u32::try_from(receivers.max(1)).unwrap_or(u32::MAX),
            last: (0, 0),
            last_received: None,
        }
    }

    /// The figures for a heartbeat sent `lateness` after it was due, with
    /// `backlog` bytes unread in the receivers' sockets and `received`
    /// bytes read from all channels so far.
    pub(super) fn next(
        &mut self,
        meter: &PlacingMeter,
        lateness: Duration,
        backlog: u64,
        received: u64,
    ) -> LiveFigures {
        let now_at = std::time::Instant::now();
        let drain = self.last_received.map_or(Duration::ZERO, |(before, at)| {
            drain_time(backlog, received.saturating_sub(before), now_at - at)
        });
        self.last_received = Some((received, now_at));
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
            finish_micros: finish_estimate(lateness, drain),
        }
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
/// wake-up and the time to read the receivers' backlog, in microseconds.
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
        meter.record(0, Some(100));
        meter.record(1, Some(50));
        meter.record(0, Some(30));
        meter.record(1, None);
        meter.record(BACKLOG_CHANNELS, Some(1 << 40));
        assert_eq!(meter.total(), 80);
    }

    #[test]
    fn each_heartbeat_measures_its_own_interval_when_it_has_enough_pages() {
        let meter = PlacingMeter::default();
        let mut window = FigureWindow::new(1);
        assert_eq!(
            window
                .next(&meter, Duration::ZERO, 0, 0)
                .placed_pages_per_sec,
            0
        );
        meter.record(Duration::from_millis(100), 10_000);
        assert_eq!(
            window
                .next(&meter, Duration::ZERO, 0, 0)
                .placed_pages_per_sec,
            100_000
        );
        // A slower interval is seen as such, not averaged away.
        meter.record(Duration::from_millis(400), 10_000);
        assert_eq!(
            window
                .next(&meter, Duration::ZERO, 0, 0)
                .placed_pages_per_sec,
            25_000
        );
        // Too few pages: the figure since the start.
        meter.record(Duration::from_millis(500), 10);
        assert_eq!(
            window
                .next(&meter, Duration::ZERO, 0, 0)
                .placed_pages_per_sec,
            20_010
        );
    }
}
