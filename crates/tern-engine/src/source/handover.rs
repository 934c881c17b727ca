//! The source of a same-host hand-over: the memory's files go over the
//! main Unix channel while the guest runs, then the guest pauses, its
//! device state goes, and the usual ready and commit end it (docs/protocol.md,
//! "Memory hand-over").

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::time::Instant;

use tern_wire::{HandedRegion, HandoverCoverage, MAX_HANDOVER_FILES, MemoryHandover};

use super::{GuestChanges, Source, connect};
use crate::config::Verify;
use crate::error::MigrationError;
use crate::guest::{MemoryRegion, SourceGuest};
use crate::handover;
use crate::stats::{DestinationStats, MigrationStatus};
use crate::transport::{Channel, Connect};

impl Source {
    /// Hands the guest's memory over instead of copying it
    /// ([`crate::MigrationConfig::memory_handover`]).
    pub(super) fn run_handover<G: SourceGuest>(
        &self,
        guest: &mut G,
        connector: &dyn Connect,
        changes: &mut GuestChanges,
        main_slot: &mut Option<Channel>,
    ) -> Result<Option<DestinationStats>, MigrationError> {
        let config = &self.config;
        let address = connector.address();
        config.check_address(&address)?;
        let regions: Vec<MemoryRegion> = guest.regions().to_vec();
        let (handover, files) = handover_table(guest, &regions, config.verify)?;
        let setup =
            connect::session_setup(&regions, guest.guest_kind(), config, &self.compression)?;
        let total: u64 = regions.iter().map(MemoryRegion::len).sum();
        self.stats.total.store(total, Ordering::Relaxed);
        self.stats.remaining.store(0, Ordering::Relaxed);
        connect::connect_handover(
            config,
            &super::cancellable::CancellableConnect::new(connector, &self.cancel),
            &setup,
            connect::random_session_id(),
            main_slot,
            &handover,
            &files,
        )
        .map_err(|error| self.cancelled_or(error))?;
        let main = self.note_connected(main_slot, &address)?;
        tracing::info!(
            regions = regions.len(),
            bytes = total,
            "memory handed over to {address}"
        );
        self.enter_device_phase();
        let paused_at = Instant::now();
        let result = self.hand_over_state(guest, main, changes, &regions, handover.coverage);
        if result.is_err() && changes.paused {
            self.stats.set_downtime(paused_at.elapsed());
        }
        let outcome = result?;
        self.stats.set_downtime(paused_at.elapsed());
        self.stats.set_digest_verified_from_comparison();
        // The guest runs on the destination, on these very pages.
        handover::revoke(&regions);
        Ok(Some(DestinationStats::from_wire(&outcome.stats)))
    }

    /// Pauses the guest, sends its state with the hand-over's digest, and
    /// commits.
    fn hand_over_state<G: SourceGuest>(
        &self,
        guest: &mut G,
        main: &mut Channel,
        changes: &mut GuestChanges,
        regions: &[MemoryRegion],
        coverage: HandoverCoverage,
    ) -> Result<tern_wire::Outcome, MigrationError> {
        self.stats.set_status(MigrationStatus::Device);
        guest.pause().map_err(MigrationError::guest("pause"))?;
        changes.paused = true;
        let digest = if self.config.verify.compares() {
            let started = Instant::now();
            // SAFETY: the guest is paused and the regions stay mapped for
            // the whole migration.
            let digest = unsafe { handover::digest(regions, coverage) };
            self.stats.set_digest_time(started.elapsed());
            digest
        } else {
            0
        };
        self.send_state(guest, main, 0, digest)?;
        self.commit(main, changes, digest)
    }
}

/// The hand-over frame and its descriptors, one per region in the guest's
/// order, each file checked as the destination will check it: a guest
/// whose memory is not backed by files, or by files that cannot back it,
/// is refused before anything connects.
fn handover_table<G: SourceGuest>(
    guest: &G,
    regions: &[MemoryRegion],
    verify: Verify,
) -> Result<(MemoryHandover, Vec<RawFd>), MigrationError> {
    let refuse = |reason: String| MigrationError::InvalidConfig {
        field: "memory_handover",
        reason,
    };
    let files = guest.region_files().ok_or_else(|| {
        refuse(
            "the guest's memory is not backed by files this process can pass (its \
             GuestMemory::region_files gives none): only memfd, hugetlbfs or tmpfs \
             memory can be handed over"
                .into(),
        )
    })?;
    if regions.len() > MAX_HANDOVER_FILES {
        return Err(refuse(format!(
            "the guest has {} memory regions; a hand-over passes at most {MAX_HANDOVER_FILES} \
             files",
            regions.len()
        )));
    }
    let mut table = Vec::with_capacity(regions.len());
    let mut descriptors = Vec::with_capacity(regions.len());
    for region in regions {
        let mut matching = files.iter().filter(|file| file.region_id == region.id());
        let (Some(file), None) = (matching.next(), matching.next()) else {
            return Err(refuse(format!(
                "region {} needs exactly one backing file; the guest gives another count",
                region.id()
            )));
        };
        if let Some(problem) = handover::file_problem(file.file, file.offset, region.len()) {
            return Err(refuse(format!(
                "the file backing region {} cannot be handed over: {problem}",
                region.id()
            )));
        }
        table.push(HandedRegion {
            region_id: region.id(),
            offset: file.offset,
            len: region.len(),
        });
        descriptors.push(file.file.as_raw_fd());
    }
    if files.len() != regions.len() {
        return Err(refuse(format!(
            "the guest gives {} backing files for {} regions",
            files.len(),
            regions.len()
        )));
    }
    let coverage = if verify == Verify::Strict {
        HandoverCoverage::All
    } else {
        HandoverCoverage::Sampled
    };
    Ok((
        MemoryHandover {
            coverage,
            regions: table,
        },
        descriptors,
    ))
}
