//! The switch-over: the guest pauses, the last pages and the device state
//! go, the destination verifies and answers.

use crate::deadline::Deadline;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tern_wire::{
    Complete, MAX_STALE_RUNS, Message, Outcome, PostcopySwitch, Ready, StateSectionMsg,
};

use super::live::LiveEnd;
use super::postcopy::{self, Frozen, Handover, ServeCounters};
use super::recover;
use super::{GuestChanges, Source};
use crate::bitmap::DirtyBitmap;
use crate::config::Verify;
use crate::error::{ChannelError, MigrationError};
use crate::guest::SourceGuest;
use crate::pipeline::Pipeline;
use crate::postcopy::{PostcopyReport, StaleSet};
use crate::stats::{DestinationStats, DigestComparison, MigrationStatus};
use crate::switch_over_timeline::StepMark;
use crate::transport::{Channel, Expected};

impl Source {
    /// The precopy switch-over, as the source sees it. Until the commit is
    /// sent, every failure resumes the guest here; after it, the guest may
    /// run on the destination, so only a definite "not resumed" (an
    /// outcome that is not verified, or an abort) resumes it here, and
    /// anything else leaves it paused with the outcome unknown.
    ///
    /// ```mermaid
    /// stateDiagram-v2
    ///     [*] --> Paused: pause, last dirty-log sync
    ///     Paused --> LastPages: pages dirtied since the last sync, Sync(last)
    ///     LastPages --> StateSent: state sections, Complete(digest)
    ///     StateSent --> Committed: Ready with our digest, Commit sent
    ///     StateSent --> ResumedHere: Outcome (refused), Abort, digest mismatch, timeout
    ///     Committed --> Done: Outcome verified
    ///     Committed --> ResumedHere: Outcome not verified, or Abort
    ///     Committed --> Unknown: silence, second Ready, channel error
    ///     Paused --> ResumedHere: any error
    ///     LastPages --> ResumedHere: any error
    ///     Done --> [*]: the guest runs on the destination
    ///     ResumedHere --> [*]: the guest runs here
    ///     Unknown --> [*]: the guest stays paused here
    /// ```
    pub(super) fn switch_over<G: SourceGuest>(
        &self,
        guest: &mut G,
        main: &mut Channel,
        changes: &mut GuestChanges,
        pipe: &mut Pipeline<'_>,
        live: LiveEnd,
    ) -> Result<DestinationStats, MigrationError> {
        let paused_at = Instant::now();
        self.stats.timeline.clear();
        self.stats.timeline.origin_at(
            "pause-requested",
            StepMark::now().with_queued(pipe.unacknowledged_bytes()),
        );
        let result = self.pause_and_switch(guest, main, changes, pipe, live, paused_at);
        if result.is_err() && changes.paused {
            // Failed or unknown: the guest was paused this long so far (it
            // resumes right after a failure, or stays paused when the
            // outcome is unknown); reported whatever the outcome.
            self.stats.set_downtime(paused_at.elapsed());
        }
        result
    }

    // long: the switch-over's steps in order, each with its failure path.
    fn pause_and_switch<G: SourceGuest>(
        &self,
        guest: &mut G,
        main: &mut Channel,
        changes: &mut GuestChanges,
        pipe: &mut Pipeline<'_>,
        live: LiveEnd,
        paused_at: Instant,
    ) -> Result<DestinationStats, MigrationError> {
        let LiveEnd {
            mut bitmaps,
            iteration,
            forced,
            ..
        } = live;
        self.stats.set_status(MigrationStatus::Device);
        guest.pause().map_err(MigrationError::guest("pause"))?;
        changes.paused = true;
        self.stats.timeline.mark("paused");
        guest
            .sync_dirty_log(&mut bitmaps)
            .map_err(MigrationError::guest("sync dirty log"))?;
        self.stats.timeline.mark("dirty-log-synced");
        self.stats.dirty_sync_count.fetch_add(1, Ordering::Relaxed);
        let digest = self.send_last_pages(pipe, &mut bitmaps, iteration)?;
        tracing::debug!(
            elapsed_ms = crate::numeric::saturating_u64(paused_at.elapsed().as_millis()),
            "final pages sent and memory hashed"
        );
        self.send_state(guest, main, iteration, digest)?;
        tracing::debug!(
            elapsed_ms = crate::numeric::saturating_u64(paused_at.elapsed().as_millis()),
            "state and digest sent"
        );
        // The destination waits for the commit no longer than its own
        // switch-over timeout after its ready, which follows this
        // completion: a ready read after ours has passed (this side stalled)
        // may be one the destination no longer honours.
        let outcome = self.commit(main, changes, digest)?;
        self.stats.set_downtime(paused_at.elapsed());
        self.stats.set_digest_verified_from_comparison();
        if forced {
            tracing::info!("switch-over was forced by a limit");
        }
        Ok(DestinationStats::from_wire(&outcome.stats))
    }

    /// Waits for the destination's ready, commits, and waits for its
    /// outcome: the end of every precopy switch-over and of a hand-over.
    /// Returns the outcome of a destination that resumed the guest.
    pub(super) fn commit(
        &self,
        main: &mut Channel,
        changes: &mut GuestChanges,
        digest: u128,
    ) -> Result<Outcome, MigrationError> {
        let answer_deadline = Deadline::after(
            self.config.switch_over_timeout,
            "the destination's switch-over answer",
        );
        self.await_ready(main, digest, &answer_deadline)?;
        self.stats.timeline.mark("ready-read");
        // From here on the destination may run the guest: never resume it
        // here, whatever happens next.
        changes.committed = true;
        let commit_deadline = Deadline::after(
            self.config.switch_over_timeout,
            "the destination's switch-over answer",
        );
        let answer = main
            .send_message(&Message::Commit)
            .map_err(MigrationError::channel(0))
            .and_then(|()| {
                self.stats.timeline.mark("commit-sent");
                self.await_answer(main, &commit_deadline)
            });
        self.stats.timeline.mark("answer-read");
        let outcome = match answer {
            Ok(Ok(outcome)) if outcome.verified => outcome,
            // A definite "not resumed": the guest runs nowhere, so it
            // resumes here.
            Ok(Ok(outcome)) => {
                changes.committed = false;
                return Err(MigrationError::Protocol(format!(
                    "the destination could not resume the guest: {}",
                    outcome.detail
                )));
            }
            Ok(Err(ready)) => {
                return Err(MigrationError::OutcomeUnknown(Box::new(
                    MigrationError::Protocol(format!(
                        "a second ready ({:032x}) instead of the acknowledgement",
                        ready.digest
                    )),
                )));
            }
            // The destination sends an abort only while the guest has not
            // resumed there (after resuming it answers with its outcome),
            // so, like a "not resumed" outcome, it means the guest runs
            // nowhere: it resumes here. (With a key, both are sealed: nobody
            // on the path can forge them.)
            Err(error @ MigrationError::PeerAborted { .. }) => {
                changes.committed = false;
                return Err(MigrationError::Protocol(format!(
                    "the destination did not resume the guest: {}",
                    error.chain()
                )));
            }
            Err(error) => return Err(MigrationError::OutcomeUnknown(Box::new(error))),
        };
        Ok(outcome)
    }

    /// Sends the pages dirtied since the last sync (the workers hash them as
    /// they go) and, with verification, finishes the incremental digest:
    /// the guest is paused, so stale pages are hashed from final memory.
    /// Returns the digest (0 without verification).
    fn send_last_pages(
        &self,
        pipe: &mut Pipeline<'_>,
        bitmaps: &mut [DirtyBitmap],
        iteration: u32,
    ) -> Result<u128, MigrationError> {
        if let Some(hashes) = pipe.page_hashes() {
            hashes.stop_audit();
            if self.config.verify == Verify::Strict {
                // Paused: the last pages are recorded as they go, from
                // final memory; every other page is hashed again by
                // `finish`, whatever the dirty log said.
                hashes.mark_all_stale();
            }
        }
        let sending = Instant::now();
        pipe.send_iteration(bitmaps, iteration, true, None)?;
        self.stats.set_final_pages_time(sending.elapsed());
        self.stats.timeline.record(
            "last-pages-sent",
            StepMark::now().with_queued(pipe.unacknowledged_bytes()),
        );
        self.stats.remaining.store(0, Ordering::Relaxed);
        let Some(hashes) = pipe.page_hashes() else {
            return Ok(0);
        };
        // SAFETY: the guest is paused and the pipeline has sent (and
        // hashed) everything, so nothing writes memory or records hashes.
        let finished = unsafe { hashes.finish(self.config.digest_thread_count()) };
        self.stats.timeline.mark("digest-finished");
        self.stats.record_cpu("digest", finished.digest.cpu_seconds);
        self.stats.set_digest_time(finished.digest.elapsed);
        self.stats.record_digest_rehash(finished.rehashed_pages);
        Ok(finished.digest.value)
    }

    /// Sends the device state and the completion message with the digest.
    pub(super) fn send_state<G: SourceGuest>(
        &self,
        guest: &mut G,
        main: &mut Channel,
        iteration: u32,
        digest: u128,
    ) -> Result<(), MigrationError> {
        let started = Instant::now();
        let sections = guest
            .save_state()
            .map_err(MigrationError::guest("save state"))?;
        self.stats.timeline.mark("state-saved");
        let mut send_paused = |message: Message| {
            let sent = main
                .send_message_counted(&message)
                .map_err(MigrationError::channel(0))?;
            self.stats.add_sent(sent as u64, true, false);
            Ok::<_, MigrationError>(())
        };
        for section in &sections {
            send_paused(Message::StateSection(StateSectionMsg {
                name: section.name.clone(),
                version: section.version,
                data: section.data.clone(),
            }))?;
        }
        let sent = send_paused(Message::Complete(Complete {
            final_iteration: iteration,
            sections: u32::try_from(sections.len()).unwrap_or(u32::MAX),
            digest,
        }));
        self.stats.timeline.mark("complete-sent");
        self.stats.set_state_time(started.elapsed());
        sent
    }

    /// Waits for the destination's "ready": it checked everything and
    /// restored the state, and resumes the guest on our commit. A refusal,
    /// an abort, silence past the switch-over timeout: the migration fails
    /// and the guest resumes here, which is safe, since the destination
    /// never resumes without a commit.
    fn await_ready(
        &self,
        main: &mut Channel,
        digest: u128,
        deadline: &Deadline,
    ) -> Result<(), MigrationError> {
        let verify = self.config.verify.compares();
        let answer = self.await_answer(main, deadline)?;
        if deadline.passed() {
            // Read late (this side stalled): the destination may have given
            // up waiting for the commit, so none is sent.
            return Err(MigrationError::Channel {
                index: 0,
                source: ChannelError::Timeout(
                    "the destination's switch-over answer (read after the switch-over deadline)",
                ),
            });
        }
        if verify {
            let destination = match &answer {
                Ok(outcome) => outcome.digest,
                Err(ready) => ready.digest,
            };
            self.stats.set_digest_comparison(DigestComparison {
                source: digest,
                destination,
            });
        }
        match answer {
            Err(ready) if verify && ready.digest != digest => Err(MigrationError::DigestMismatch {
                source_digest: digest,
                destination: ready.digest,
            }),
            Err(_ready) => Ok(()),
            Ok(outcome) if verify && outcome.digest != digest => {
                Err(MigrationError::DigestMismatch {
                    source_digest: digest,
                    destination: outcome.digest,
                })
            }
            Ok(outcome) => Err(MigrationError::Protocol(format!(
                "the destination refused the guest: {}",
                outcome.detail
            ))),
        }
    }

    /// The destination's next answer on the main channel within the
    /// switch-over timeout: its outcome, or (as `Err`) its ready. Heartbeats
    /// it sent before it knew the live phase had ended are skipped.
    fn await_answer(
        &self,
        main: &mut Channel,
        deadline: &Deadline,
    ) -> Result<Result<Outcome, Ready>, MigrationError> {
        loop {
            let slice = deadline
                .next_slice(ANSWER_POLL)
                .map_err(MigrationError::channel(0))?;
            if !main
                .wait_readable(slice)
                .map_err(MigrationError::channel(0))?
            {
                continue;
            }
            // Whole by the deadline, however the bytes trickle in.
            let message = main
                .read_expected_until(Expected::SWITCH_OVER_ANSWER, Some(deadline.at()))
                .map_err(|error| {
                    // Cut off by the switch-over deadline: say so.
                    MigrationError::channel(0)(match error {
                        ChannelError::Timeout(_) if deadline.passed() => ChannelError::Timeout(
                            "the destination's switch-over answer (whole, by the deadline)",
                        ),
                        other => other,
                    })
                })?;
            match message {
                Message::Outcome(outcome) => return Ok(Ok(outcome)),
                Message::Ready(ready) => return Ok(Err(ready)),
                // Sent before the destination read the completion.
                Message::Heartbeat(_) | Message::PassApplied(_) => {}
                Message::Abort(abort) => {
                    return Err(MigrationError::from_peer_abort(abort));
                }
                other => {
                    return Err(MigrationError::Protocol(format!(
                        "expected the destination's answer, got {:?}",
                        other.kind()
                    )));
                }
            }
        }
    }
}

/// How long one wait for the destination's answer lasts before the
/// deadline is looked at again.
const ANSWER_POLL: Duration = Duration::from_millis(100);

/// The postcopy switch (docs/postcopy.md): the same ready and commit as a
/// precopy switch-over, but the dirty pages stay behind, named in the
/// switch frames, and are served after the commit.
impl Source {
    /// The switch to postcopy and the service after it, as the source sees
    /// it. The commit is the point of no return: before it any failure
    /// resumes the guest here, after it the guest runs on the destination
    /// and the source serves its stale pages until the destination says
    /// every one is placed.
    ///
    /// ```mermaid
    /// stateDiagram-v2
    ///     [*] --> Paused: decision postcopy; pause, last dirty-log sync
    ///     Paused --> Switched: empty last Sync on page channels; PostcopySwitch (stale runs), state, Complete
    ///     Switched --> ResumedHere: Outcome (refused), Abort, digest mismatch, timeout
    ///     Switched --> Serving: Ready, Commit sent (point of no return)
    ///     Serving --> Serving: PageRequest answered with UrgentPages; push on page channels
    ///     Serving --> Completed: PostcopyComplete, digests equal
    ///     Serving --> DigestMismatch: PostcopyComplete, digests differ
    ///     Serving --> Failed: channel broken, destination silent, Abort
    ///     ResumedHere --> [*]: the guest runs here
    ///     Completed --> [*]
    ///     DigestMismatch --> [*]
    ///     Failed --> [*]: the guest runs on the destination, pages missing
    /// ```
    pub(super) fn switch_over_postcopy<G: SourceGuest>(
        &self,
        guest: &mut G,
        main: &mut Channel,
        changes: &mut GuestChanges,
        pipe: &mut Pipeline<'_>,
        live: LiveEnd,
        handover: Handover<'_>,
    ) -> Result<DestinationStats, MigrationError> {
        let paused_at = Instant::now();
        let result =
            self.pause_and_hand_over(guest, main, changes, pipe, live, handover, paused_at);
        if result.is_err() && changes.paused && !changes.postcopy_resumed {
            self.stats.set_downtime(paused_at.elapsed());
        }
        result
    }

    // long: the postcopy switch's steps in order, each with its failure path.
    #[allow(clippy::too_many_arguments)]
    fn pause_and_hand_over<G: SourceGuest>(
        &self,
        guest: &mut G,
        main: &mut Channel,
        changes: &mut GuestChanges,
        pipe: &mut Pipeline<'_>,
        live: LiveEnd,
        handover: Handover<'_>,
        paused_at: Instant,
    ) -> Result<DestinationStats, MigrationError> {
        let LiveEnd {
            mut bitmaps,
            iteration,
            ..
        } = live;
        guest.pause().map_err(MigrationError::guest("pause"))?;
        changes.paused = true;
        // The live phase's last sync found pages it never sent; this one
        // adds what was written since.
        guest
            .sync_dirty_log(&mut bitmaps)
            .map_err(MigrationError::guest("sync dirty log"))?;
        self.stats.dirty_sync_count.fetch_add(1, Ordering::Relaxed);
        let stale = StaleSet::from_dirty(&bitmaps);
        let digest = self.end_precopy(pipe, &bitmaps, iteration)?;
        self.send_switch_frames(main, &stale, handover.setup)?;
        self.send_state(guest, main, iteration, digest)?;
        let answer_deadline = Deadline::after(
            self.config.switch_over_timeout,
            "the destination's switch-over answer",
        );
        match self.await_answer(main, &answer_deadline)? {
            Err(_ready) if !answer_deadline.passed() => {}
            Err(_ready) => {
                return Err(MigrationError::Channel {
                    index: 0,
                    source: ChannelError::Timeout(
                        "the destination's switch-over answer (read after the switch-over deadline)",
                    ),
                });
            }
            Ok(outcome) => {
                return Err(MigrationError::Protocol(format!(
                    "the destination refused the postcopy switch: {}",
                    outcome.detail
                )));
            }
        }
        // The point of no return: from the commit on, the guest may run on
        // the destination, and it never resumes here.
        changes.committed = true;
        let commit_deadline = Deadline::after(
            self.config.switch_over_timeout,
            "the destination's switch-over answer",
        );
        let answer = main
            .send_message(&Message::Commit)
            .map_err(MigrationError::channel(0))
            .and_then(|()| self.await_answer(main, &commit_deadline));
        let resumed = match answer {
            Ok(Ok(outcome)) if outcome.verified => outcome,
            Ok(Ok(outcome)) => {
                changes.committed = false;
                return Err(MigrationError::Protocol(format!(
                    "the destination could not resume the guest: {}",
                    outcome.detail
                )));
            }
            Err(error @ MigrationError::PeerAborted { .. }) => {
                changes.committed = false;
                return Err(MigrationError::Protocol(format!(
                    "the destination did not resume the guest: {}",
                    error.chain()
                )));
            }
            Ok(Err(_)) => {
                return Err(MigrationError::OutcomeUnknown(Box::new(
                    MigrationError::Protocol(
                        "a second ready instead of the acknowledgement".into(),
                    ),
                )));
            }
            Err(error) => return Err(MigrationError::OutcomeUnknown(Box::new(error))),
        };
        changes.postcopy_resumed = true;
        self.stats.set_downtime(paused_at.elapsed());
        self.stats.set_status(MigrationStatus::PostcopyActive);
        self.control
            .events
            .status(MigrationStatus::PostcopyActive, None);
        tracing::info!(
            stale_pages = stale.total(),
            "the guest runs on the destination; serving its missing pages"
        );
        let encoder = pipe.push_encoder();
        let frozen = Frozen {
            regions: handover.regions,
            stale: &stale,
            iteration: iteration.saturating_add(1),
            encoder: &encoder,
        };
        self.serve_postcopy(main, handover, &frozen, digest)?;
        Ok(DestinationStats::from_wire(&resumed.stats))
    }

    /// Serves the destination until it holds every page, then compares the
    /// digests: a mismatch now cannot be undone, and says so. A lost
    /// connection pauses postcopy and reconnects (`source/recover.rs`);
    /// only a misbehaving peer, a cancel or a destination that is gone for
    /// good ends it.
    fn serve_postcopy(
        &self,
        main: &mut Channel,
        handover: Handover<'_>,
        frozen: &Frozen<'_>,
        digest: u128,
    ) -> Result<(), MigrationError> {
        let counters = ServeCounters::default();
        let mut report = PostcopyReport {
            trigger: Some(handover.trigger),
            stale_pages: frozen.stale.total(),
            ..PostcopyReport::default()
        };
        let setup = handover.setup;
        let served = self.serve_with_recovery(main, handover, frozen, &counters, &mut report);
        report.postcopy_bytes = counters.bytes.load(Ordering::Relaxed);
        report.postcopy_requests = counters.requests.load(Ordering::Relaxed);
        report.requested_pages = counters.requested_pages.load(Ordering::Relaxed);
        report.pushed_pages = counters.pushed_pages.load(Ordering::Relaxed);
        report.push_skipped_pages = counters.push_skipped_pages.load(Ordering::Relaxed);
        report.answer_skipped_pages = counters.answer_skipped_pages.load(Ordering::Relaxed);
        report.resent_pages = counters.resent_pages.load(Ordering::Relaxed);
        let codec = frozen.encoder.codec();
        report.push_codec =
            (codec != tern_page::codec::CodecId::None).then(|| codec.name().to_owned());
        report.push_bytes = counters.push_bytes.load(Ordering::Relaxed);
        report.push_compressed_pages = counters.push_compressed_pages.load(Ordering::Relaxed);
        report.push_zero_pages = counters.push_zero_pages.load(Ordering::Relaxed);
        let complete = match served {
            Ok(complete) => complete,
            Err(error) => {
                self.stats.set_postcopy(report);
                // The destination's abort is its own word that it gave up:
                // nothing is left to recover.
                let fate = if matches!(error, MigrationError::PeerAborted { .. }) {
                    "the destination gave up and paused the guest without all of its memory: \
                     the guest is lost, and this source's copy, which is stale, stays paused"
                } else {
                    "the guest runs on the destination without all of its memory and cannot \
                     continue without this source, whose copy stays paused"
                };
                return Err(MigrationError::PostcopyFailed {
                    fate,
                    cause: Box::new(error),
                });
            }
        };
        report.add_destination(&complete);
        self.stats.set_postcopy(report);
        if self.config.verify.compares() {
            self.stats.set_digest_comparison(DigestComparison {
                source: digest,
                destination: complete.digest,
            });
            if complete.digest != digest {
                let pages = describe_runs(&frozen.stale.runs(setup));
                tracing::error!(
                    source = format!("{digest:032x}"),
                    destination = format!("{:032x}", complete.digest),
                    %pages,
                    "MEMORY DIGEST MISMATCH AFTER POSTCOPY: the guest already runs on the destination"
                );
                return Err(MigrationError::PostcopyDigestMismatch {
                    source_digest: digest,
                    destination: complete.digest,
                    pages,
                });
            }
        }
        self.stats.set_digest_verified_from_comparison();
        Ok(())
    }

    /// Runs postcopy's rounds: one per connection, a lost connection
    /// paused and mended in between (`source/recover.rs`); the missing
    /// pages the destination names after a recovery are the next round's
    /// stale set. Counts recoveries and paused time into `report`.
    fn serve_with_recovery(
        &self,
        main: &mut Channel,
        handover: Handover<'_>,
        frozen: &Frozen<'_>,
        counters: &ServeCounters,
        report: &mut PostcopyReport,
    ) -> Result<tern_wire::PostcopyComplete, MigrationError> {
        let session = recover::Session {
            config: &self.config,
            connector: handover.connector,
            session_id: handover.session_id,
            identity: main.security().peer_identity.clone(),
            setup: handover.setup,
            redirected: std::sync::Mutex::new(None),
        };
        let mut channels = handover.channels;
        let mut missing: Option<StaleSet> = None;
        let mut paused_for = Duration::ZERO;
        let served = loop {
            let round = Frozen {
                regions: frozen.regions,
                stale: missing.as_ref().unwrap_or(frozen.stale),
                iteration: frozen.iteration,
                encoder: frozen.encoder,
            };
            let result = postcopy::serve(
                main,
                std::mem::take(&mut channels),
                &round,
                self.config.io_timeout,
                &self.stats,
                counters,
            );
            let cause = match result {
                Err(error) if recover::is_recoverable(&error) => error,
                other => break other,
            };
            main.shutdown();
            let paused_at = Instant::now();
            let mended = session.recover(&self.control, &self.cancel, round.stale, &cause);
            paused_for += paused_at.elapsed();
            match mended {
                Ok(mended) => {
                    *main = mended.main;
                    channels = mended.page_channels;
                    missing = Some(mended.missing);
                    report.postcopy_recoveries += 1;
                    self.stats.set_status(MigrationStatus::PostcopyActive);
                    self.control
                        .events
                        .status(MigrationStatus::PostcopyActive, None);
                    tracing::info!(
                        missing = missing.as_ref().map_or(0, StaleSet::total),
                        "postcopy recovered; resending what the destination lacks"
                    );
                }
                Err(error) => break Err(error),
            }
        };
        report.postcopy_paused_ms = paused_for.as_secs_f64() * 1000.0;
        served
    }

    /// Ends precopy with the guest paused: a last sync on every page
    /// channel without the dirty pages (the destination's receivers end
    /// there), and the digest of frozen memory, the dirty pages hashed
    /// again. Returns the digest (0 without verification).
    fn end_precopy(
        &self,
        pipe: &mut Pipeline<'_>,
        dirty: &[DirtyBitmap],
        iteration: u32,
    ) -> Result<u128, MigrationError> {
        if let Some(hashes) = pipe.page_hashes() {
            hashes.stop_audit();
        }
        let mut nothing: Vec<DirtyBitmap> = dirty
            .iter()
            .map(|bitmap| DirtyBitmap::new(bitmap.pages()))
            .collect();
        pipe.send_iteration(&mut nothing, iteration, true, None)?;
        let Some(hashes) = pipe.page_hashes() else {
            return Ok(0);
        };
        if self.config.verify == Verify::Strict {
            hashes.mark_all_stale();
        } else {
            for (region, bitmap) in dirty.iter().enumerate() {
                for page in bitmap.iter_dirty() {
                    hashes.mark_stale(region, page);
                }
            }
        }
        // SAFETY: the guest is paused and the pipeline has sent everything,
        // so nothing writes memory or records hashes.
        let finished = unsafe { hashes.finish(self.config.digest_thread_count()) };
        self.stats.record_cpu("digest", finished.digest.cpu_seconds);
        self.stats.set_digest_time(finished.digest.elapsed);
        self.stats.record_digest_rehash(finished.rehashed_pages);
        Ok(finished.digest.value)
    }

    /// The stale pages, in as many switch frames as they take.
    fn send_switch_frames(
        &self,
        main: &mut Channel,
        stale: &StaleSet,
        setup: &tern_wire::SessionSetup,
    ) -> Result<(), MigrationError> {
        let runs = stale.runs(setup);
        let mut frames = runs.chunks(MAX_STALE_RUNS).peekable();
        if frames.peek().is_none() {
            let sent = main
                .send_message_counted(&Message::PostcopySwitch(PostcopySwitch {
                    more: false,
                    stale: Vec::new(),
                }))
                .map_err(MigrationError::channel(0))?;
            self.stats.add_sent(sent as u64, true, false);
        }
        while let Some(frame) = frames.next() {
            let sent = main
                .send_message_counted(&Message::PostcopySwitch(PostcopySwitch {
                    more: frames.peek().is_some(),
                    stale: frame.to_vec(),
                }))
                .map_err(MigrationError::channel(0))?;
            self.stats.add_sent(sent as u64, true, false);
        }
        Ok(())
    }
}

/// Runs as `region:first+count`, the first 16 and how many more.
fn describe_runs(runs: &[tern_wire::PageRun]) -> String {
    const SHOWN: usize = 16;
    let mut text: Vec<String> = runs
        .iter()
        .take(SHOWN)
        .map(|run| format!("{}:{}+{}", run.region_id, run.first_page, run.pages))
        .collect();
    if runs.len() > SHOWN {
        text.push(format!("and {} more runs", runs.len() - SHOWN));
    }
    if text.is_empty() {
        return "none were delivered after the switch".into();
    }
    text.join(" ")
}
