//! Switch-over: everything has arrived; check it, compare digests, restore
//! the guest's state, say "ready", and resume the guest only once the
//! source has committed (docs/protocol.md, "Switch-over").

use crate::deadline::Deadline;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use tern_wire::{DigestAlgorithm, FrameDecoder, Message, Outcome, OutcomeStats, Ready};

use super::handshake::peer_aborted;
use super::live::Delivered;
use super::order::MainChannelState;
use super::postcopy;
use super::recover::Reconnected;
use super::shared::ReceiverShared;
use super::stream::{FrameSink, FrameSource, read_message_until};
use super::{Destination, POLL_INTERVAL, ReceivePhase};
use crate::error::{ChannelError, MigrationError};
use crate::guest::{DestinationGuest, StateSection};
use crate::postcopy::{PostcopyReport, StaleSet};
use crate::stats::{DigestComparison, thread_cpu_seconds};
use crate::transport::Channel;

impl Destination {
    /// Verifies what was delivered, restores `guest`'s state, and resumes it
    /// once the source commits. Returns the statistics sent to the source
    /// with the verdict.
    pub(super) fn switch_over<G: DestinationGuest>(
        &self,
        shared: &ReceiverShared<'_>,
        main: &mut (impl FrameSink + FrameSource),
        decoder: &mut FrameDecoder,
        guest: &mut G,
        delivered: Delivered,
        cpu_start: f64,
    ) -> Result<OutcomeStats, MigrationError> {
        let Delivered {
            sections,
            complete,
            final_iterations,
            postcopy,
        } = delivered;
        if postcopy.is_some() {
            let error = MigrationError::Protocol(
                "a postcopy switch on a session that cannot run postcopy (no socket)".into(),
            );
            refuse(main, 0, error.to_string());
            return Err(error);
        }
        check_complete(&final_iterations, sections.len(), &complete)?;
        tracing::debug!("all pages and state received");
        self.stats.set_phase(ReceivePhase::Verifying);
        self.stats.timeline.mark("digest-started");
        let digest_started = Instant::now();
        let digest = memory_digest(shared);
        let digest_time = digest_started.elapsed();
        self.stats.timeline.mark("digest-finished");
        if shared.setup.digest != DigestAlgorithm::None && digest != complete.digest {
            let error = MigrationError::DigestMismatch {
                source_digest: complete.digest,
                destination: digest,
            };
            refuse(main, digest, error.to_string());
            return Err(error);
        }
        if shared.setup.digest != DigestAlgorithm::None {
            self.stats.set_digest_comparison(DigestComparison {
                source: complete.digest,
                destination: digest,
            });
        }
        if let Err(error) = restore(guest, &sections) {
            refuse(main, digest, error.chain());
            return Err(error);
        }
        self.stats.timeline.mark("state-restored");
        self.commit_and_resume(main, decoder, guest, digest, digest_time, cpu_start)
    }

    /// The end both switch-overs (copy and hand-over) share, where "a
    /// guest never runs on two hosts" is kept: "ready" with `digest`, the
    /// source's commit awaited, only then the guest resumed (or kept
    /// paused), and the source told. Returns the figures sent with the
    /// outcome.
    pub(super) fn commit_and_resume<G: DestinationGuest>(
        &self,
        main: &mut (impl FrameSink + FrameSource),
        decoder: &mut FrameDecoder,
        guest: &mut G,
        digest: u128,
        digest_time: Duration,
        cpu_start: f64,
    ) -> Result<OutcomeStats, MigrationError> {
        main.send_message(&Message::Ready(Ready { digest }))
            .map_err(MigrationError::channel(0))?;
        self.stats.timeline.mark("ready-sent");
        self.await_commit(main, decoder)?;
        self.stats.timeline.mark("commit-read");
        if let Err(error) = self.resume_unless_kept_paused(guest) {
            refuse(main, digest, error.chain());
            return Err(error);
        }
        self.stats.timeline.mark("resumed");
        self.stats.record_main_cpu(thread_cpu_seconds() - cpu_start);
        let stats = self.stats.snapshot(digest_time);
        main.send_message(&Message::Outcome(Outcome {
            verified: true,
            digest,
            detail: String::new(),
            stats: stats.clone(),
        }))
        .inspect_err(|error| {
            // The guest runs here now whatever happens to this message; the
            // source, committed, keeps its copy paused and reports the
            // outcome as unknown.
            tracing::warn!(%error, "the guest was resumed, but the source could not be told");
        })
        .ok();
        self.stats.timeline.mark("outcome-sent");
        self.stats.set_phase(self.finished_phase());
        Ok(stats)
    }

    /// The phase a completed reception ends in: the guest runs here, or
    /// the embedder takes it over paused (`keep_paused`).
    fn finished_phase(&self) -> ReceivePhase {
        if self.config.keep_paused {
            ReceivePhase::Paused
        } else {
            ReceivePhase::Resumed
        }
    }

    /// Resumes the guest, unless the embedder takes it over paused
    /// (`keep_paused`): committed and verified, it is then the embedder's
    /// to resume.
    pub(super) fn resume_unless_kept_paused<G: DestinationGuest>(
        &self,
        guest: &mut G,
    ) -> Result<(), MigrationError> {
        if self.config.keep_paused {
            tracing::info!("switch-over verified and committed; the guest stays paused");
            return Ok(());
        }
        guest.resume().map_err(MigrationError::guest("resume"))
    }

    /// Waits, at most the switch-over timeout, for the source's commit. Any
    /// other answer, or none, means the guest must not run here.
    pub(super) fn await_commit(
        &self,
        main: &mut impl FrameSource,
        decoder: &mut FrameDecoder,
    ) -> Result<(), MigrationError> {
        let deadline = Deadline::after(self.config.switch_over_timeout, "the source's commit");
        loop {
            let slice = deadline.next_slice_unless(&self.cancel, 0, POLL_INTERVAL)?;
            if main
                .wait_readable(slice)
                .map_err(MigrationError::channel(0))?
            {
                break;
            }
        }
        // The commit must be whole by the deadline, however it trickles.
        let message = read_message_until(main, decoder, deadline.at()).map_err(|error| {
            // Cut off by the switch-over deadline: say so, not "I/O".
            MigrationError::channel(0)(match error {
                ChannelError::Timeout(_) if deadline.passed() => ChannelError::Timeout(
                    "the source's commit (whole, by the switch-over deadline)",
                ),
                other => other,
            })
        })?;
        MainChannelState::Ready
            .next(message.kind())
            .map_err(MigrationError::Protocol)?;
        match message {
            Message::Abort(abort) => Err(peer_aborted(abort)),
            _ => Ok(()),
        }
    }
}

/// Every channel must have ended at the source's final iteration, and every
/// state section the source counted must have arrived.
fn check_complete(
    final_iterations: &[u32],
    sections: usize,
    complete: &tern_wire::Complete,
) -> Result<(), MigrationError> {
    if final_iterations
        .iter()
        .any(|&iteration| iteration != complete.final_iteration)
    {
        return Err(MigrationError::Protocol(format!(
            "channels ended at iterations {final_iterations:?}, the source says {}",
            complete.final_iteration
        )));
    }
    if sections != complete.sections as usize {
        return Err(MigrationError::Protocol(format!(
            "received {sections} state sections, the source sent {}",
            complete.sections
        )));
    }
    Ok(())
}

/// The digest of the memory as it is now: the page hashes the receivers
/// recorded, with the pages the audit found changed since hashed again;
/// 0 when the session does not verify.
fn memory_digest(shared: &ReceiverShared<'_>) -> u128 {
    let Some(hashes) = &shared.page_hashes else {
        return 0;
    };
    // SAFETY: every receiver has ended, so nothing writes guest memory or
    // records hashes any more.
    let finished = unsafe { hashes.finish(crate::digest::digest_threads()) };
    finished.digest.value
}

/// Everything short of running the guest.
pub(super) fn restore<G: DestinationGuest>(
    guest: &mut G,
    sections: &[StateSection],
) -> Result<(), MigrationError> {
    guest
        .restore_state(sections)
        .map_err(MigrationError::guest("restore state"))?;
    // Auto-converge throttling belongs to the migration, not to the guest's
    // life on the destination.
    guest
        .set_throttle(0)
        .map_err(MigrationError::guest("throttle"))
}

/// Tells the source the guest will not run here. Best effort: the error
/// that caused it is what the caller reports.
pub(super) fn refuse(main: &mut impl FrameSink, digest: u128, detail: String) {
    let _ = main.send_message(&Message::Outcome(Outcome {
        verified: false,
        digest,
        detail,
        stats: OutcomeStats::default(),
    }));
}

/// The postcopy switch (docs/postcopy.md): the stale pages are discarded
/// and registered with the fault service before "ready"; after the commit
/// the guest resumes and the missing pages arrive while it runs.
impl Destination {
    // long: the postcopy switch's steps in order, each with its failure path.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn postcopy_switch_over<G: DestinationGuest>(
        &self,
        shared: &ReceiverShared<'_>,
        mut session: super::recover::Session<'_, '_>,
        main: &mut Channel,
        decoder: &mut FrameDecoder,
        guest: &mut G,
        delivered: Delivered,
        push_channels: Vec<Channel>,
        codecs: &[tern_page::codec::CodecId],
        cpu_start: f64,
    ) -> Result<PostcopyReport, MigrationError> {
        let Delivered {
            sections,
            complete,
            final_iterations,
            postcopy,
        } = delivered;
        let runs = postcopy.unwrap_or_default();
        let prepared = check_complete(&final_iterations, sections.len(), &complete)
            .and_then(|()| {
                if push_channels.len() != final_iterations.len() {
                    return Err(MigrationError::Protocol(
                        "postcopy needs second handles on the page channels, which this \
                         transport cannot give (user-space TLS)"
                            .into(),
                    ));
                }
                StaleSet::from_runs(shared.setup, &runs).map_err(MigrationError::Protocol)
            })
            .and_then(|stale| {
                // The digest of the pages held now, before the stale ones go;
                // each late page's hash replaces its stale one as it lands.
                memory_digest(shared);
                postcopy::discard(shared.regions, &runs, shared.setup)?;
                let delivery = Arc::new(postcopy::Delivery::new(
                    stale,
                    shared.setup,
                    self.config.postcopy_request_timeout,
                )?);
                let service = postcopy::start_faults(shared.regions, &delivery)?;
                restore(guest, &sections)?;
                Ok((delivery, service))
            });
        let (delivery, service) = match prepared {
            Ok(prepared) => prepared,
            Err(error) => {
                refuse(main, 0, error.chain());
                return Err(error);
            }
        };
        main.send_message(&Message::Ready(Ready { digest: 0 }))
            .map_err(MigrationError::channel(0))?;
        self.await_commit(main, decoder)?;
        if let Err(error) = self.resume_unless_kept_paused(guest) {
            refuse(main, 0, error.chain());
            return Err(error);
        }
        let resumed_at = Instant::now();
        self.stats.record_main_cpu(thread_cpu_seconds() - cpu_start);
        self.enter_postcopy_phase(ReceivePhase::PostcopyActive, None);
        main.send_message(&Message::Outcome(Outcome {
            verified: true,
            digest: 0,
            detail: "resumed in postcopy".into(),
            stats: self.stats.snapshot(Duration::ZERO),
        }))
        .map_err(MigrationError::channel(0))?;
        tracing::info!("the guest runs here; postcopy fetches its missing pages");
        let mut push_channels = push_channels;
        let mut recoveries = 0u64;
        let mut paused_for = Duration::ZERO;
        let delivered = loop {
            let stop = AtomicBool::new(false);
            let phase = postcopy::Phase {
                setup: shared.setup,
                delivery: &delivery,
                service: &service,
                hashes: shared.page_hashes.as_ref(),
                iteration: complete.final_iteration.saturating_add(1),
                io_timeout: shared.io_timeout(),
                stop: &stop,
                receiver: shared,
                codecs,
            };
            let cause = match postcopy::deliver_all(
                &phase,
                main,
                decoder,
                std::mem::take(&mut push_channels),
            ) {
                Err(error) if crate::postcopy::is_recoverable(&error) => error,
                other => break other,
            };
            // The source hears at once that this connection is over.
            main.shutdown();
            let paused_at = Instant::now();
            // Nothing is placed while paused (the round's threads have
            // ended): what is missing now is what the source must resend.
            let reconnected =
                self.await_reconnection(&mut session, &cause, &delivery.missing_runs());
            paused_for += paused_at.elapsed();
            match reconnected {
                Ok(Reconnected {
                    main: new_main,
                    decoder: new_decoder,
                    page_channels,
                }) => {
                    *main = new_main;
                    *decoder = new_decoder;
                    push_channels = page_channels;
                    recoveries += 1;
                    delivery.resume();
                    self.enter_postcopy_phase(ReceivePhase::PostcopyActive, None);
                    tracing::info!("postcopy recovered: the source sends what is missing");
                }
                Err(error) => {
                    delivery.fail();
                    break Err(error);
                }
            }
        };
        let delivered_after = resumed_at.elapsed();
        let faults = service.stop();
        if let Err(error) = delivered {
            // Memory the guest depends on will never arrive: stop it here.
            // The phase stays postcopy's, the one the failure names.
            let _ = guest.pause();
            return Err(MigrationError::PostcopyFailed {
                fate: "the guest is paused on the destination without all of its memory; \
                       it must not be resumed, and the source's copy stays paused",
                cause: Box::new(error),
            });
        }
        let digest = shared
            .page_hashes
            .as_ref()
            .map_or(0, |hashes| hashes.recorded_digest());
        let (message, mut report) = postcopy::completion(
            &delivery,
            &faults,
            digest,
            delivered_after,
            &faults.fault_latency_histogram_us,
        );
        report.postcopy_recoveries = recoveries;
        report.postcopy_paused_ms = paused_for.as_secs_f64() * 1000.0;
        main.send_message(&Message::PostcopyComplete(message))
            .map_err(MigrationError::channel(0))?;
        self.stats.set_phase(self.finished_phase());
        if shared.setup.digest != DigestAlgorithm::None {
            self.stats.set_digest_comparison(DigestComparison {
                source: complete.digest,
                destination: digest,
            });
            if digest != complete.digest {
                tracing::error!(
                    source = format!("{:032x}", complete.digest),
                    destination = format!("{digest:032x}"),
                    stale_pages = delivery_total(&report),
                    "MEMORY DIGEST MISMATCH AFTER POSTCOPY: the guest already runs here"
                );
            }
        }
        Ok(report)
    }
}

fn delivery_total(report: &PostcopyReport) -> u64 {
    report.stale_pages
}
