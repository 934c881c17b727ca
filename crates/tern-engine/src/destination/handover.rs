//! The destination of a same-host hand-over: it receives the files that
//! back the source's guest memory on the main Unix channel, gives them to
//! the VMM to map, confirms, then takes the device state and switches over
//! as usual; no page moves (docs/protocol.md, "Memory hand-over").

use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use tern_wire::{
    FRAME_HEADER_LEN, FrameDecoder, MAX_HANDOVER_FILES, MemoryHandover, Message, SessionSetup,
};

use super::handshake::{Greeted, peer_aborted};
use super::live::keep_state_section;
use super::stream::{FrameSource, read_message, read_message_within};
use super::switch_over::{refuse, restore};
use super::{Destination, POLL_INTERVAL, ReceivePhase, Received};
use crate::config::ReceiveConfig;
use crate::deadline::Deadline;
use crate::error::{ChannelError, MigrationError};
use crate::guest::{DestinationGuest, GuestError, StateSection};
use crate::handover::{self as shared, HandedFile};
use crate::stats::{DigestComparison, MigrationStatus};
use crate::transport::{Channel, Listener, Segment};

impl Destination {
    /// Receives a same-host migration by memory hand-over
    /// ([`crate::MigrationConfig::memory_handover`] on the source) on a
    /// Unix `listener`. `make_guest` gets the session setup, the source
    /// VMM's configuration and the files backing the source's regions,
    /// checked (regular files, large enough, writable), one per region in
    /// the setup's order; it maps each `MAP_SHARED` at its region and
    /// returns the guest, paused. No page is copied: the guest's memory is
    /// the source's.
    pub fn receive_handover<G, F>(
        &self,
        listener: &Listener,
        make_guest: F,
    ) -> Result<Received<G>, MigrationError>
    where
        G: DestinationGuest,
        F: FnOnce(&SessionSetup, &[u8], Vec<HandedFile>) -> Result<G, GuestError>,
    {
        self.control.events.status(MigrationStatus::Setup, None);
        let result = self.receive_session(listener, |_, main, decoder, hello, cpu_start| {
            self.run_handover(main, decoder, hello, make_guest, cpu_start)
        });
        self.record_outcome(&result);
        result
    }

    // long: the hand-over's steps in order, each with its failure path.
    fn run_handover<G, F>(
        &self,
        main: &mut Channel,
        decoder: &mut FrameDecoder,
        hello: Message,
        make_guest: F,
        cpu_start: f64,
    ) -> Result<Received<G>, MigrationError>
    where
        G: DestinationGuest,
        F: FnOnce(&SessionSetup, &[u8], Vec<HandedFile>) -> Result<G, GuestError>,
    {
        if !main.carries_descriptors() {
            return Err(MigrationError::Incompatible(
                "a memory hand-over needs a plain Unix socket (no TLS) to pass the memory's \
                 file descriptors"
                    .into(),
            ));
        }
        let vmm_config =
            super::vmm_config::receive(main, decoder, &hello, self.config.max_vmm_config)?;
        let Message::Hello(hello_body) = &hello else {
            return Err(MigrationError::Internal(
                "the first message is not a hello".into(),
            ));
        };
        let (handover, files) = receive_files(main, decoder, &hello_body.setup, &self.config)?;
        let Greeted {
            setup,
            mut guest,
            regions,
            ..
        } = self.greet(main, hello, |setup| make_guest(setup, &vmm_config, files))?;
        main.send_message(&Message::MemoryHandover(handover.clone()))
            .map_err(MigrationError::channel(0))?;
        self.control.events.status(MigrationStatus::Device, None);
        let (sections, complete) = receive_state(main, decoder)?;
        self.stats.set_phase(ReceivePhase::Verifying);
        let started = Instant::now();
        let verifies = setup.digest != tern_wire::DigestAlgorithm::None;
        let digest = if verifies {
            // SAFETY: the guest is paused here and on the source (which
            // sent its completion), so nothing writes the shared pages.
            unsafe { shared::digest(&regions, handover.coverage) }
        } else {
            0
        };
        let digest_time = started.elapsed();
        if verifies {
            self.stats.set_digest_comparison(DigestComparison {
                source: complete.digest,
                destination: digest,
            });
            if digest != complete.digest {
                let error = MigrationError::DigestMismatch {
                    source_digest: complete.digest,
                    destination: digest,
                };
                refuse(main, digest, error.to_string());
                return Err(error);
            }
        }
        if sections.len() != complete.sections as usize {
            let error = MigrationError::Protocol(format!(
                "received {} state sections, the source sent {}",
                sections.len(),
                complete.sections
            ));
            refuse(main, digest, error.to_string());
            return Err(error);
        }
        if let Err(error) = restore(&mut guest, &sections) {
            refuse(main, digest, error.chain());
            return Err(error);
        }
        let stats =
            self.commit_and_resume(main, decoder, &mut guest, digest, digest_time, cpu_start)?;
        Ok(Received {
            resumed: !self.config.keep_paused,
            guest,
            stats: self.local_stats(&stats),
            setup,
            security: crate::stats::SessionSecurity::default(),
            digest_comparison: self.stats.digest_comparison(),
        })
    }
}

/// Reads the hand-over frame and its descriptors, within the handshake
/// timeout, and checks them against the hello's regions: one file per
/// region, each a regular file large enough and writable.
fn receive_files(
    main: &mut Channel,
    decoder: &mut FrameDecoder,
    setup: &SessionSetup,
    config: &ReceiveConfig,
) -> Result<(MemoryHandover, Vec<HandedFile>), MigrationError> {
    let deadline = Deadline::after(config.handshake_timeout, "the source's memory hand-over");
    while !main
        .wait_readable(
            deadline
                .next_slice(POLL_INTERVAL)
                .map_err(MigrationError::channel(0))?,
        )
        .map_err(MigrationError::channel(0))?
    {}
    let mut catcher = FileCatcher {
        channel: main,
        files: Vec::new(),
        truncated: false,
        first: true,
    };
    let max_frame = FRAME_HEADER_LEN + MemoryHandover::MAX_BODY;
    let message = read_message_within(&mut catcher, decoder, max_frame);
    let (files, truncated) = (std::mem::take(&mut catcher.files), catcher.truncated);
    let handover = match message.map_err(MigrationError::channel(0))? {
        Message::MemoryHandover(handover) => handover,
        Message::Abort(abort) => return Err(peer_aborted(abort)),
        other => {
            return Err(MigrationError::Incompatible(format!(
                "this destination receives memory by hand-over, but the source sent {:?} \
                 instead (is it migrating with memory_handover?)",
                other.kind()
            )));
        }
    };
    if truncated || files.len() != handover.regions.len() {
        return Err(MigrationError::Protocol(format!(
            "the memory hand-over names {} files but {}{} descriptors came with it",
            handover.regions.len(),
            files.len(),
            if truncated { " or more" } else { "" }
        )));
    }
    check_files(setup, handover, files)
}

/// One file per region of the setup, in its order, each able to back it.
fn check_files(
    setup: &SessionSetup,
    handover: MemoryHandover,
    files: Vec<OwnedFd>,
) -> Result<(MemoryHandover, Vec<HandedFile>), MigrationError> {
    if handover.regions.len() != setup.regions.len() {
        return Err(MigrationError::Protocol(format!(
            "the memory hand-over names {} regions, the hello {}",
            handover.regions.len(),
            setup.regions.len()
        )));
    }
    let mut handed = Vec::with_capacity(files.len());
    for ((entry, file), region) in handover.regions.iter().zip(files).zip(&setup.regions) {
        if entry.region_id != region.id || entry.len != region.len {
            return Err(MigrationError::Protocol(format!(
                "the memory hand-over gives region {} of {} bytes where the hello has region {} \
                 of {} bytes",
                entry.region_id, entry.len, region.id, region.len
            )));
        }
        if let Some(problem) = shared::file_problem(file.as_fd(), entry.offset, entry.len) {
            return Err(MigrationError::Protocol(format!(
                "the file handed over for region {} cannot back it: {problem}",
                region.id
            )));
        }
        handed.push(HandedFile {
            region_id: region.id,
            guest_addr: region.guest_addr,
            len: region.len,
            offset: entry.offset,
            file,
        });
    }
    debug_assert!(handed.len() <= MAX_HANDOVER_FILES);
    Ok((handover, handed))
}

/// The state sections and the completion, bounded like a copy's.
fn receive_state(
    main: &mut Channel,
    decoder: &mut FrameDecoder,
) -> Result<(Vec<StateSection>, tern_wire::Complete), MigrationError> {
    let mut sections: Vec<StateSection> = Vec::new();
    let mut state_bytes = 0usize;
    loop {
        match read_message(main, decoder).map_err(MigrationError::channel(0))? {
            Message::StateSection(section) => {
                keep_state_section(&mut sections, &mut state_bytes, section)?;
            }
            Message::Complete(complete) => return Ok((sections, complete)),
            Message::Abort(abort) => return Err(peer_aborted(abort)),
            other => {
                return Err(MigrationError::Protocol(format!(
                    "expected the source's state after the memory hand-over, got {:?}",
                    other.kind()
                )));
            }
        }
    }
}

/// The main channel, read with `recvmsg` until the first bytes of the
/// hand-over frame have come: the descriptors ride on its first byte.
struct FileCatcher<'a> {
    channel: &'a mut Channel,
    files: Vec<OwnedFd>,
    truncated: bool,
    first: bool,
}

impl FrameSource for FileCatcher<'_> {
    fn wait_readable(&self, timeout: Duration) -> Result<bool, ChannelError> {
        self.channel.wait_readable(timeout)
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), ChannelError> {
        if !std::mem::take(&mut self.first) || buf.is_empty() {
            return self.channel.read_exact(buf);
        }
        let received = self.channel.receive_with_files(buf, MAX_HANDOVER_FILES)?;
        self.files = received.files;
        self.truncated = received.truncated;
        if received.len == 0 {
            return Err(ChannelError::Closed);
        }
        self.channel.read_exact(&mut buf[received.len..])
    }

    unsafe fn read_scattered(&mut self, segments: &[Segment]) -> Result<(), ChannelError> {
        // SAFETY: the caller upholds the same contract.
        unsafe { self.channel.read_scattered(segments) }
    }

    fn begin_transfer(&mut self, limit: Option<Instant>) {
        self.channel.begin_transfer(limit);
    }

    fn end_transfer(&mut self) {
        self.channel.end_transfer();
    }
}
