//! The live phase: dirty iterations while the guest runs, until the
//! convergence rules say to switch over or stop.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::convergence::{Convergence, Decision, DestinationCost, SyncFacts};
use super::peer::PeerWatch;
use super::{GuestChanges, Source};
use crate::bitmap::DirtyBitmap;
use crate::config::Verify;
use crate::control::{EventBody, Pass, PassFigures, ThrottleChange};
use crate::error::MigrationError;
use crate::guest::{MemoryRegion, PAGE_SIZE, SourceGuest};
use crate::pipeline::{IterationTotals, Pipeline};
use crate::stats::{MigrationStatus, millis};
use crate::transport::Channel;

/// The most the source waits, in all, its guest running, for a destination
/// more than one pass behind before it pauses its guest anyway (and says
/// so in the report's `destination-catch-up`). The lags seen were 0.2-0.5 s
/// (issue 31); a destination slower than that for seconds is not catching
/// up, and holding the switch-over longer only prolongs the migration.
pub(crate) const CATCH_UP_BUDGET: Duration = Duration::from_secs(3);

/// Where the live phase ended: the pages still dirty and the iteration
/// that will carry them.
pub(super) struct LiveEnd {
    pub bitmaps: Vec<DirtyBitmap>,
    pub iteration: u32,
    pub forced: bool,
    /// Postcopy takes over, and why.
    pub postcopy: Option<crate::postcopy::PostcopyTrigger>,
}

impl Source {
    // long: one dirty iteration's steps in order, then the decisions.
    pub(super) fn live_phase<G: SourceGuest>(
        &self,
        guest: &mut G,
        main: &mut Channel,
        regions: &[MemoryRegion],
        changes: &mut GuestChanges,
        pipe: &mut Pipeline<'_>,
        dirty_log_started: Instant,
    ) -> Result<LiveEnd, MigrationError> {
        let mut bitmaps: Vec<DirtyBitmap> = regions
            .iter()
            .map(|region| DirtyBitmap::new(region.pages()))
            .collect();
        bitmaps.iter_mut().for_each(DirtyBitmap::set_all);
        self.stats.set_status(MigrationStatus::Active);
        self.control.events.status(MigrationStatus::Active, None);
        let live_start = Instant::now();
        let mut rules = Convergence::new(&self.config);
        let mut iteration: u32 = 0;
        let mut bandwidth: f64 = 0.0; // guest bytes of data pages per second
        let mut previous_sync = dirty_log_started;
        let mut peer = PeerWatch::new(self.config.io_timeout);
        let mut catch_up = CATCH_UP_BUDGET;
        loop {
            let started = Instant::now();
            let switches_before = pipe.codec_switches();
            let totals = pipe.send_iteration(&mut bitmaps, iteration, false, Some(main))?;
            let elapsed = started.elapsed().as_secs_f64().max(1e-6);
            if let Some(measured) = measured_bandwidth(&totals, elapsed, bandwidth == 0.0) {
                bandwidth = measured;
            }
            peer.check(main, iteration + 1)?;
            bitmaps.iter_mut().for_each(DirtyBitmap::clear);
            guest
                .sync_dirty_log(&mut bitmaps)
                .map_err(MigrationError::guest("sync dirty log"))?;
            let synced = Instant::now();
            let since_previous_sync = synced.duration_since(previous_sync);
            previous_sync = synced;
            iteration += 1;
            let facts = SyncFacts {
                iteration,
                dirty_pages: bitmaps.iter().map(DirtyBitmap::count).sum(),
                sent_pages: totals.pages,
                bandwidth,
                live_elapsed: live_start.elapsed(),
                cancelled: self.cancel.is_cancelled(),
                final_rehash: pipe.page_hashes().map_or(Duration::ZERO, |hashes| {
                    let threads = self.config.digest_thread_count();
                    if self.config.verify == Verify::Strict {
                        hashes.full_finish_estimate(threads)
                    } else {
                        hashes.finish_estimate(threads)
                    }
                }),
                state_bytes: guest.state_size_hint(),
                switch_over_requested: self.control.parameters.switch_over_requested(),
                codec: pipe.codec_cost(),
                destination: DestinationCost::from_figures(
                    peer.figures(),
                    peer.pass_lag(),
                    rules.downtime_limit(),
                ),
                codec_switched: pipe.codec_switches() != switches_before,
            };
            // What an operator changed since the last sync applies now.
            rules.apply(self.control.parameters.convergence());
            self.stats.set_downtime_limit(rules.downtime_limit());
            self.record_sync(&facts, since_previous_sync.as_secs_f64().max(1e-6));
            self.publish_pass(&facts);
            let decision = rules.decide(&facts);
            if let Some(trigger) = self.postcopy_instead(&facts, &decision) {
                tracing::info!(?trigger, "precopy hands over to postcopy");
                return Ok(LiveEnd {
                    bitmaps,
                    iteration,
                    forced: false,
                    postcopy: Some(trigger),
                });
            }
            let decision =
                self.hold_for_destination(decision, main, &mut peer, iteration, &mut catch_up)?;
            match decision {
                Decision::SwitchOver { forced } => {
                    if forced {
                        tracing::warn!("limit reached: forcing the switch-over");
                        self.stats.forced_switch_over.store(true, Ordering::Relaxed);
                    }
                    return Ok(LiveEnd {
                        bitmaps,
                        iteration,
                        forced,
                        postcopy: None,
                    });
                }
                Decision::Cancel => return Err(MigrationError::Cancelled),
                Decision::GiveUp(why) => return Err(MigrationError::LimitReached(why)),
                Decision::Iterate { throttle: None } => {}
                Decision::Iterate {
                    throttle: Some(percent),
                } => self.throttle(guest, changes, percent)?,
            }
        }
    }

    /// Holds a switch-over the rules chose (not a forced one) until the
    /// destination has applied every pass but the last of the
    /// `passes_sent`: paused earlier, its backlog would be downtime the
    /// estimate never saw (issue 31: every overrun left was a destination
    /// one or two passes behind, its receivers waiting for a CPU, with
    /// little unread). Waits, the guest running, for what is left of
    /// `budget`, then iterates again, since the guest dirtied pages
    /// meanwhile; once the budget is spent the switch-over goes ahead,
    /// recorded with how far behind the destination was.
    fn hold_for_destination(
        &self,
        decision: Decision,
        main: &mut Channel,
        peer: &mut PeerWatch,
        passes_sent: u32,
        budget: &mut Duration,
    ) -> Result<Decision, MigrationError> {
        let needed = passes_sent.saturating_sub(1);
        if decision != (Decision::SwitchOver { forced: false }) || peer.passes_applied() >= needed {
            return Ok(decision);
        }
        if budget.is_zero() {
            let behind = needed - peer.passes_applied();
            tracing::warn!(
                behind,
                budget_ms = millis(CATCH_UP_BUDGET),
                "the destination did not catch up within the budget: pausing with it behind"
            );
            self.stats.record_behind_at_pause(behind);
            return Ok(decision);
        }
        // Shown at once in the live query, not only once the wait is over:
        // an operator watching a switch-over that does not come sees why.
        self.stats.record_hold();
        tracing::info!(
            passes_applied = peer.passes_applied(),
            passes_sent,
            budget_left_ms = millis(*budget),
            "holding the switch-over: the destination is more than one pass behind"
        );
        let started = Instant::now();
        let caught_up = peer.wait_for_passes(main, needed, passes_sent, started + *budget)?;
        let waited = started.elapsed();
        *budget = budget.saturating_sub(waited);
        self.stats.record_catch_up(waited);
        tracing::info!(
            waited_ms = waited.as_secs_f64() * 1000.0,
            caught_up,
            passes_applied = peer.passes_applied(),
            passes_sent,
            "held the switch-over for the destination to apply the passes before the last"
        );
        Ok(Decision::Iterate { throttle: None })
    }

    /// Whether postcopy takes over from `decision` (the postcopy rules,
    /// `postcopy/decide.rs`).
    fn postcopy_instead(
        &self,
        facts: &SyncFacts,
        decision: &Decision,
    ) -> Option<crate::postcopy::PostcopyTrigger> {
        let config = &self.config;
        crate::postcopy::switch_to_postcopy(
            &crate::postcopy::PostcopyFacts {
                mode: config.postcopy,
                iteration: facts.iteration,
                live_elapsed: facts.live_elapsed,
                requested: self.control.postcopy_requested(),
                after: config.postcopy_after,
                max_throttle: config.postcopy_max_throttle,
            },
            decision,
        )
    }

    /// Sets the guest's throttle as auto-converge decided, and says so.
    fn throttle<G: SourceGuest>(
        &self,
        guest: &mut G,
        changes: &mut GuestChanges,
        percent: u8,
    ) -> Result<(), MigrationError> {
        guest
            .set_throttle(percent)
            .map_err(MigrationError::guest("throttle"))?;
        changes.throttled = true;
        self.stats
            .cpu_throttle_percentage
            .store(u64::from(percent), Ordering::Relaxed);
        self.control
            .events
            .publish(EventBody::MigrationThrottle(ThrottleChange {
                cpu_throttle_percentage: u64::from(percent),
            }));
        tracing::info!(throttle = percent, "auto-converge: throttling the guest");
        Ok(())
    }

    /// Tells subscribers what the iteration just ended measured.
    fn publish_pass(&self, facts: &SyncFacts) {
        let stats = &self.stats;
        let pass = Pass {
            pass: u64::from(facts.iteration),
            sent_pages: facts.sent_pages,
            dirty_pages: facts.dirty_pages,
            dirty_pages_rate: stats.dirty_pages_rate.load(Ordering::Relaxed),
            bandwidth: crate::numeric::saturating_u64_from_f64(facts.bandwidth),
            expected_downtime: millis(facts.expected_downtime()),
            downtime_limit: stats.downtime_limit_ms(),
        };
        self.control
            .events
            .publish(EventBody::MigrationPass(PassFigures::Source(pass)));
    }

    /// Publishes what a sync measured, before the decision.
    fn record_sync(&self, facts: &SyncFacts, seconds_since_previous_sync: f64) {
        let stats = &self.stats;
        let remaining = facts.dirty_pages * PAGE_SIZE as u64;
        stats.dirty_sync_count.fetch_add(1, Ordering::Relaxed);
        // The next iteration's size, before it starts.
        stats.start_iteration(remaining);
        let dirty_rate = facts.dirty_pages as f64 / seconds_since_previous_sync;
        stats.dirty_pages_rate.store(
            crate::numeric::saturating_u64_from_f64(dirty_rate),
            Ordering::Relaxed,
        );
        stats.bandwidth.store(
            crate::numeric::saturating_u64_from_f64(facts.bandwidth),
            Ordering::Relaxed,
        );
        stats
            .expected_downtime_ms
            .store(millis(facts.expected_downtime()), Ordering::Relaxed);
        let split = facts.expected_split();
        stats.set_expected_split(millis(split.source), millis(split.destination));
        stats
            .iteration
            .store(u64::from(facts.iteration), Ordering::Relaxed);
        tracing::debug!(
            iteration = facts.iteration,
            dirty_pages = facts.dirty_pages,
            bandwidth_mb_s = facts.bandwidth / 1e6,
            expected_source_ms = millis(split.source),
            expected_destination_ms = millis(split.destination),
            codec_switched = facts.codec_switched,
            "dirty iteration done"
        );
    }
}

/// Guest bytes of data pages an iteration moved per second, or `None` when
/// it was too small to tell (tiny iterations measure latency, not
/// bandwidth) and a `first` estimate is not needed. Zero pages are left
/// out: they cost the link almost nothing, while the pages a guest dirties,
/// which the switch-over sends, hold data; counting a mostly-zero first
/// iteration would promise a downtime the link cannot keep. An iteration
/// without enough data pages counts all its pages.
fn measured_bandwidth(totals: &IterationTotals, elapsed: f64, first: bool) -> Option<f64> {
    const ENOUGH_PAGES: u64 = 256;
    let pages = if totals.data_pages >= ENOUGH_PAGES {
        totals.data_pages
    } else if totals.pages >= ENOUGH_PAGES || first {
        totals.pages
    } else {
        return None;
    };
    Some(pages as f64 * PAGE_SIZE as f64 / elapsed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MigrationConfig;
    use tern_wire::{Message, PassApplied};

    /// A source, the main channel's two ends (the source's and the
    /// destination's), and the source's watch of it.
    fn watched() -> (Source, Channel, Channel, PeerWatch) {
        let (ours, theirs) = Channel::pair();
        let source = Source::new(MigrationConfig::default()).unwrap();
        (
            source,
            ours,
            theirs,
            PeerWatch::new(Duration::from_secs(60)),
        )
    }

    const SWITCH: Decision = Decision::SwitchOver { forced: false };
    const ITERATE: Decision = Decision::Iterate { throttle: None };

    fn applied(destination: &mut Channel, passes: u32) {
        applied_with_lag(destination, passes, 0);
    }

    fn applied_with_lag(destination: &mut Channel, passes: u32, lag_micros: u32) {
        destination
            .send_message(&Message::PassApplied(PassApplied { passes, lag_micros }))
            .unwrap();
    }

    /// Protocol 13: the lag the destination measured at its latest pass's
    /// end is what the source counts, not an older pass's.
    #[test]
    fn the_latest_pass_applied_gives_the_destinations_lag() {
        let (_source, mut main, mut destination, mut peer) = watched();
        assert_eq!(peer.pass_lag(), Duration::ZERO);
        applied_with_lag(&mut destination, 1, 250_000);
        applied_with_lag(&mut destination, 2, 4_000);
        peer.check(&mut main, 3).unwrap();
        assert_eq!(peer.passes_applied(), 2);
        assert_eq!(peer.pass_lag(), Duration::from_millis(4));
    }

    #[test]
    fn the_switch_over_waits_until_the_destination_applied_all_but_the_last_pass() {
        let (source, mut main, mut destination, mut peer) = watched();
        let mut budget = CATCH_UP_BUDGET;
        // Three passes sent, the destination has applied one: held. The
        // wait reads its word that it applied the second, and the source
        // iterates again (the guest dirtied pages while it waited).
        applied(&mut destination, 1);
        applied(&mut destination, 2);
        let held = source.hold_for_destination(SWITCH, &mut main, &mut peer, 3, &mut budget);
        assert_eq!(held.unwrap(), ITERATE);
        assert_eq!(peer.passes_applied(), 2);
        assert!(budget < CATCH_UP_BUDGET);
        let catch_up = source.stats.destination_catch_up().unwrap();
        assert_eq!(catch_up.behind_at_pause, 0);
        // Now within one pass: the switch-over goes ahead.
        let decided = source.hold_for_destination(SWITCH, &mut main, &mut peer, 3, &mut budget);
        assert_eq!(decided.unwrap(), SWITCH);
    }

    #[test]
    fn a_destination_that_never_catches_up_is_waited_for_once_then_reported() {
        let (source, mut main, _destination, mut peer) = watched();
        let mut budget = Duration::from_millis(20);
        let held = source.hold_for_destination(SWITCH, &mut main, &mut peer, 4, &mut budget);
        assert_eq!(held.unwrap(), ITERATE);
        assert!(budget.is_zero());
        let decided = source.hold_for_destination(SWITCH, &mut main, &mut peer, 5, &mut budget);
        assert_eq!(decided.unwrap(), SWITCH);
        let catch_up = source.stats.destination_catch_up().unwrap();
        assert_eq!(
            catch_up.behind_at_pause, 4,
            "4 passes before the last unapplied"
        );
        assert!(catch_up.waited_ms >= 20.0);
    }

    #[test]
    fn only_a_switch_over_the_rules_chose_is_held() {
        let (source, mut main, _destination, mut peer) = watched();
        let mut budget = CATCH_UP_BUDGET;
        for decision in [
            Decision::SwitchOver { forced: true },
            ITERATE,
            Decision::Cancel,
            Decision::GiveUp("a limit".into()),
        ] {
            let decided =
                source.hold_for_destination(decision.clone(), &mut main, &mut peer, 9, &mut budget);
            assert_eq!(decided.unwrap(), decision);
        }
        // The first pass needs nothing applied.
        let decided = source.hold_for_destination(SWITCH, &mut main, &mut peer, 1, &mut budget);
        assert_eq!(decided.unwrap(), SWITCH);
        assert_eq!(budget, CATCH_UP_BUDGET);
        assert!(source.stats.destination_catch_up().is_none());
    }

    #[test]
    fn a_count_of_passes_that_goes_back_or_past_what_was_sent_is_refused() {
        for (told, sent) in [(vec![3, 2], 9), (vec![4], 3)] {
            let (_source, mut main, mut destination, mut peer) = watched();
            for &passes in &told {
                applied(&mut destination, passes);
            }
            let refused = peer.check(&mut main, sent);
            assert!(
                matches!(&refused, Err(MigrationError::Protocol(text)) if text.contains("applied")),
                "{told:?} of {sent} sent: {refused:?}"
            );
        }
        let (_source, mut main, mut destination, mut peer) = watched();
        applied(&mut destination, 3);
        applied(&mut destination, 3);
        peer.check(&mut main, 3).unwrap();
        assert_eq!(
            peer.passes_applied(),
            3,
            "the same count twice, and all sent: fine"
        );
    }

    fn totals(pages: u64, data_pages: u64) -> IterationTotals {
        IterationTotals {
            pages,
            data_pages,
            wire_bytes: 0,
        }
    }

    #[test]
    fn zero_pages_do_not_count_as_bandwidth() {
        // A first iteration of 1000 pages, 300 of them data, in one second.
        let measured = measured_bandwidth(&totals(1000, 300), 1.0, true);
        assert_eq!(measured, Some(300.0 * PAGE_SIZE as f64));
        // Too few data pages: all pages count.
        let measured = measured_bandwidth(&totals(1000, 10), 1.0, false);
        assert_eq!(measured, Some(1000.0 * PAGE_SIZE as f64));
        // A tiny iteration measures nothing, unless nothing is known yet.
        assert_eq!(measured_bandwidth(&totals(10, 10), 1.0, false), None);
        assert_eq!(
            measured_bandwidth(&totals(10, 10), 1.0, true),
            Some(10.0 * PAGE_SIZE as f64)
        );
    }
}
