//! A whole destination session run from bytes held in memory instead of
//! sockets: the same handshake checks, receivers, state machines, page
//! placement (userfaultfd where this process may use it), verification and
//! restore as [`Destination::receive`], with each channel a buffer. Tests
//! and the fuzz target drive the destination this way. Only the sockets'
//! own deadlines (a frame's transfer deadline, the accept timeout) are not
//! reached: a read from memory never waits.

use std::collections::HashSet;
use std::time::Duration;

use tern_wire::{
    Abort, FRAME_HEADER_LEN, FrameDecoder, FrameHeader, FrameKind, Message, SessionSetup,
};

use super::handshake::{Greeted, check_channel_hello, peer_aborted};
use super::live;
use super::shared::ReceiverShared;
use super::stream::{FrameSink, FrameSource, PageStream, read_message};
use super::{Destination, ReceivePhase, Received};
use crate::error::{ChannelError, MigrationError};
use crate::guest::{DestinationGuest, GuestError};
use crate::stats::{SessionSecurity, thread_cpu_seconds};
use crate::transport::Segment;

/// One channel's bytes from the source, and what the destination sends
/// back on it. A stream that ends is a channel the source closed.
pub(super) struct MemoryStream {
    input: Vec<u8>,
    read: usize,
    sent: Vec<u8>,
    /// The destination has said it is ready (see `wait_readable`).
    ready_sent: bool,
}

impl MemoryStream {
    pub(super) fn new(input: &[u8]) -> Self {
        Self {
            input: input.to_vec(),
            read: 0,
            sent: Vec::new(),
            ready_sent: false,
        }
    }

    /// Whether the next frame is a commit.
    fn commit_is_next(&self) -> bool {
        self.input
            .get(self.read..)
            .and_then(|rest| rest.get(..FRAME_HEADER_LEN))
            .and_then(|head| FrameHeader::decode(head.try_into().ok()?).ok())
            .is_some_and(|header| header.kind == FrameKind::Commit)
    }

    fn take(&mut self, len: usize) -> Result<&[u8], ChannelError> {
        let end = self.read.checked_add(len).ok_or(ChannelError::Closed)?;
        let bytes = self.input.get(self.read..end).ok_or(ChannelError::Closed)?;
        self.read = end;
        Ok(bytes)
    }
}

impl FrameSource for MemoryStream {
    fn wait_readable(&self, _: Duration) -> Result<bool, ChannelError> {
        // The rest of the stream, or its end, is there at once; except a
        // commit, which a source sends only in answer to the destination's
        // ready, so it is not there before that.
        Ok(self.ready_sent || !self.commit_is_next())
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), ChannelError> {
        buf.copy_from_slice(self.take(buf.len())?);
        Ok(())
    }

    unsafe fn read_scattered(&mut self, segments: &[Segment]) -> Result<(), ChannelError> {
        let total = segments.iter().map(|segment| segment.len).sum::<usize>();
        if self.input.len() - self.read < total {
            // As a socket would: the end of the stream before the whole
            // payload (the bytes that did arrive are of no use).
            return Err(ChannelError::Closed);
        }
        for segment in segments {
            let bytes = self.take(segment.len)?;
            // SAFETY: the caller's contract: `len` writable bytes that
            // nothing else accesses during the call; `bytes` is this
            // stream's own buffer, so the two do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), segment.ptr.cast_mut(), bytes.len())
            };
        }
        Ok(())
    }
}

impl FrameSink for MemoryStream {
    fn send_message(&mut self, message: &Message) -> Result<(), ChannelError> {
        self.ready_sent |= matches!(message, Message::Ready(_));
        self.sent.extend_from_slice(&message.to_bytes());
        Ok(())
    }
}

impl PageStream for MemoryStream {
    /// Nothing to interrupt: a read from memory never blocks.
    type Interrupt = ();

    fn interrupt_handle(&self) -> Result<(), ChannelError> {
        Ok(())
    }

    fn interrupt((): &()) {}
}

impl Destination {
    /// Runs one incoming migration from bytes held in memory: `main` is what
    /// the source sent on the main channel, `page_channels` what it sent on
    /// each page channel, each starting with its channel hello (in any
    /// order; one that fails its hello is dropped, as a stray connection
    /// is). Nothing touches a socket; everything else is
    /// [`receive`](Self::receive)'s own path. Returns the result and the
    /// bytes the destination sent on the main channel: its welcome, then its
    /// outcome or an abort. For tests and fuzzing.
    pub(crate) fn receive_from_memory<G, F>(
        &self,
        main: &[u8],
        page_channels: &[&[u8]],
        make_guest: F,
    ) -> (Result<Received<G>, MigrationError>, Vec<u8>)
    where
        G: DestinationGuest,
        F: FnOnce(&SessionSetup) -> Result<G, GuestError>,
    {
        let cpu_start = thread_cpu_seconds();
        let mut main = MemoryStream::new(main);
        let result = self.run_from_memory(&mut main, page_channels, make_guest, cpu_start);
        if let Err(error) = &result {
            self.stats.set_phase(ReceivePhase::Failed);
            if !matches!(error, MigrationError::PeerAborted { .. }) {
                let _ = main.send_message(&Message::Abort(Abort {
                    reason: error.abort_reason(),
                    message: error.chain(),
                }));
            }
        }
        (result, main.sent)
    }

    // long: `receive`'s steps in order, one call each, with the channel checks between
    fn run_from_memory<G, F>(
        &self,
        main: &mut MemoryStream,
        page_channels: &[&[u8]],
        make_guest: F,
        cpu_start: f64,
    ) -> Result<Received<G>, MigrationError>
    where
        G: DestinationGuest,
        F: FnOnce(&SessionSetup) -> Result<G, GuestError>,
    {
        let mut decoder = FrameDecoder::new();
        let hello = read_message(main, &mut decoder).map_err(MigrationError::channel(0))?;
        if let Message::Hello(hello) = &hello {
            self.check_resources(&hello.setup)
                .map_err(MigrationError::Incompatible)?;
        }
        let Greeted {
            setup,
            session_id,
            codecs,
            mut guest,
            regions,
        } = {
            super::vmm_config::receive(main, &mut decoder, &hello, self.config.max_vmm_config)?;
            self.greet(main, hello, make_guest)?
        };
        let dictionaries = super::dictionary::receive_dictionaries(main, &mut decoder, &setup)?;
        let count = setup.channel_count;
        let mut slots: Vec<Option<MemoryStream>> = (0..count).map(|_| None).collect();
        let mut seen = HashSet::new();
        for bytes in page_channels {
            let mut stream = MemoryStream::new(bytes);
            let verdict = match read_message(&mut stream, &mut FrameDecoder::new()) {
                Ok(Message::ChannelHello(hello)) => {
                    check_channel_hello(&hello, session_id, count, &mut seen)
                }
                Ok(Message::Abort(abort)) => return Err(peer_aborted(abort)),
                Ok(other) => Err(format!("expected a channel hello, got {:?}", other.kind())),
                Err(error) => Err(error.to_string()),
            };
            match verdict {
                Ok(index) => slots[usize::from(index) - 1] = Some(stream),
                Err(reason) => tracing::debug!("dropped a page channel: {reason}"),
            }
        }
        if let Some(missing) = slots.iter().position(Option::is_none) {
            return Err(MigrationError::Channel {
                index: missing + 1,
                source: ChannelError::Closed,
            });
        }
        let channels: Vec<MemoryStream> = slots.into_iter().flatten().collect();
        let shared = ReceiverShared::new(
            &setup,
            &regions,
            channels.len(),
            &self.stats,
            self.config.io_timeout,
            &self.cancel,
        )
        .with_qpl_path(self.config.qpl_path)
        .with_decode_threads(self.config.decode_threads())
        .with_dictionaries(dictionaries)
        // As `receive` does: fresh pages placed with UFFDIO_COPY where this
        // process may register the guest's memory, so fuzzing reaches the
        // placement and fault service too.
        .with_userfault();
        let delivered = live::receive_all(&shared, main, &mut decoder, channels, &codecs)?;
        let stats = self.switch_over(
            &shared,
            main,
            &mut decoder,
            &mut guest,
            delivered,
            cpu_start,
        )?;
        Ok(Received {
            resumed: !self.config.keep_paused,
            guest,
            stats: self.local_stats(&stats),
            setup,
            security: SessionSecurity {
                transport: "memory".into(),
                ..SessionSecurity::default()
            },
            digest_comparison: self.stats.digest_comparison(),
        })
    }
}

#[cfg(test)]
mod tests {
    use tern_wire::{
        ChannelHello, Complete, DigestAlgorithm, Handshake, Hello, PageEntry, PageKind, RegionInfo,
        Sync, encode_pages_prefix,
    };

    use super::*;
    use crate::config::ReceiveConfig;
    use crate::fuzzing::{MemoryGuest, sample_session};
    use crate::guest::PAGE_SIZE;

    const SESSION: u64 = 0xd0b1e;
    const REGION: u32 = 3;

    fn hello(channels: u16) -> Vec<u8> {
        Message::Hello(Hello {
            handshake: Handshake {
                session_id: SESSION,
                channel_index: 0,
            },
            setup: SessionSetup {
                page_size: tern_wire::PAGE_SIZE,
                channel_count: channels,
                codecs: 0,
                digest: DigestAlgorithm::None,
                regions: vec![RegionInfo {
                    id: REGION,
                    guest_addr: 0,
                    len: 16 * PAGE_SIZE as u64,
                }],
                guest_kind: String::new(),
                dictionaries: 0,
                vmm_config_len: 0,
            },
        })
        .to_bytes()
    }

    fn page_channel(index: u16) -> Vec<u8> {
        Message::ChannelHello(ChannelHello {
            handshake: Handshake {
                session_id: SESSION,
                channel_index: index,
            },
        })
        .to_bytes()
    }

    fn raw_pages(stream: &mut Vec<u8>, iteration: u32, pages: &[u32]) {
        let entries: Vec<PageEntry> = pages
            .iter()
            .map(|&page_index| PageEntry {
                page_index,
                kind: PageKind::Raw,
                encoded_len: tern_wire::PAGE_SIZE,
            })
            .collect();
        encode_pages_prefix(stream, REGION, iteration, 0, &entries);
        for &page in pages {
            stream.extend(std::iter::repeat_n(
                crate::numeric::low_byte(page.into()) + 1,
                PAGE_SIZE,
            ));
        }
    }

    fn sync(stream: &mut Vec<u8>, iteration: u32, last: bool) {
        stream.extend(
            Message::Sync(Sync {
                iteration,
                last,
                dictionaries: 0,
            })
            .to_bytes(),
        );
    }

    fn complete(main: &mut Vec<u8>, final_iteration: u32) {
        main.extend(
            Message::Complete(Complete {
                final_iteration,
                sections: 0,
                digest: 0,
            })
            .to_bytes(),
        );
        main.extend(Message::Commit.to_bytes());
    }

    fn run(
        main: &[u8],
        pages: &[Vec<u8>],
    ) -> (Result<Received<MemoryGuest>, MigrationError>, Vec<u8>) {
        let pages: Vec<&[u8]> = pages.iter().map(Vec::as_slice).collect();
        Destination::new(ReceiveConfig {
            allow_unverified: true,
            ..ReceiveConfig::default()
        })
        .receive_from_memory(main, &pages, MemoryGuest::for_setup)
    }

    /// The session fails with `needle` in its error, and tells the source.
    fn assert_refused(main: &[u8], pages: &[Vec<u8>], needle: &str) {
        let (result, sent) = run(main, pages);
        let error = result.expect_err("the session must fail").chain();
        assert!(error.contains(needle), "'{needle}' not in: {error}");
        let frames = tern_wire::decode_stream(&sent, None).expect("valid replies");
        match frames.last() {
            Some(tern_wire::Frame::Message(Message::Abort(abort))) => {
                assert!(abort.message.contains(needle), "{}", abort.message)
            }
            other => panic!("expected an abort, got {other:?}"),
        }
    }

    #[test]
    fn the_sample_session_is_received_and_verified() {
        let (main, pages) = sample_session();
        let (result, sent) = run(&main, &pages);
        let received = result.expect("the sample session is valid");
        assert!(received.guest.resumed);
        assert_eq!(received.guest.sections.len(), 1);
        let frames = tern_wire::decode_stream(&sent, None).unwrap();
        assert!(matches!(
            frames.last(),
            Some(tern_wire::Frame::Message(Message::Outcome(outcome))) if outcome.verified
        ));
    }

    #[test]
    fn the_same_page_on_two_channels_in_one_iteration_is_refused() {
        let mut main = hello(2);
        complete(&mut main, 0);
        let mut pages = vec![page_channel(1), page_channel(2)];
        for stream in &mut pages {
            raw_pages(stream, 0, &[5]);
            sync(stream, 0, true);
        }
        assert_refused(
            &main,
            &pages,
            "page 5 of region 3 arrived twice in iteration 0",
        );
    }

    #[test]
    fn the_same_page_twice_in_one_packet_is_refused() {
        let mut main = hello(1);
        complete(&mut main, 0);
        let mut stream = page_channel(1);
        raw_pages(&mut stream, 0, &[2, 7, 2]);
        sync(&mut stream, 0, true);
        assert_refused(
            &main,
            &[stream],
            "page 2 of region 3 arrived twice in iteration 0",
        );
    }

    #[test]
    fn the_same_page_in_two_iterations_is_accepted() {
        let mut main = hello(2);
        complete(&mut main, 1);
        let mut pages = vec![page_channel(1), page_channel(2)];
        raw_pages(&mut pages[0], 0, &[5]);
        for stream in &mut pages {
            sync(stream, 0, false);
        }
        raw_pages(&mut pages[1], 1, &[5]);
        for stream in &mut pages {
            sync(stream, 1, true);
        }
        let (result, _) = run(&main, &pages);
        let received = result.expect("a page may come again in a later iteration");
        assert!(
            received.guest.region_bytes(0)[5 * PAGE_SIZE..6 * PAGE_SIZE]
                .iter()
                .all(|&byte| byte == 6)
        );
    }

    #[test]
    fn channels_that_disagree_on_the_last_iteration_are_refused() {
        let mut main = hello(2);
        complete(&mut main, 0);
        let mut pages = vec![page_channel(1), page_channel(2)];
        sync(&mut pages[0], 0, true);
        sync(&mut pages[1], 0, false);
        // The barrier sees the disagreement, or the completion (which names
        // iteration 0 as the final one) reaches a receiver first.
        let (result, _) = run(&main, &pages);
        let error = result.expect_err("the session must fail").chain();
        assert!(
            error.contains("the page channels disagree on whether iteration 0 is the last")
                || error.contains("sync of iteration 0 is not the last"),
            "{error}"
        );
    }

    /// The completion counts a state section that never came: the guest
    /// would resume without part of its state.
    #[test]
    fn a_completion_counting_a_missing_state_section_is_refused() {
        let mut main = hello(1);
        main.extend(
            Message::Complete(Complete {
                final_iteration: 0,
                sections: 1,
                digest: 0,
            })
            .to_bytes(),
        );
        main.extend(Message::Commit.to_bytes());
        let mut stream = page_channel(1);
        sync(&mut stream, 0, true);
        let (result, _) = run(&main, &[stream]);
        let error = result.expect_err("the session must fail").chain();
        assert!(
            error.contains("received 0 state sections, the source sent 1"),
            "{error}"
        );
    }

    #[test]
    fn a_completion_naming_another_final_iteration_is_refused() {
        let mut main = hello(1);
        complete(&mut main, 0);
        let mut stream = page_channel(1);
        sync(&mut stream, 0, false);
        sync(&mut stream, 1, true);
        // Which check sees it first depends on timing: the receiver (sync
        // of iteration 0 not the last, or iteration 1 after the final one)
        // or the switch-over's comparison.
        let (result, _) = run(&main, &[stream]);
        let error = result.expect_err("the session must fail").chain();
        assert!(
            error.contains("the source named it the final one")
                || error.contains("after the source named 0")
                || error.contains("the source says 0"),
            "{error}"
        );
    }

    #[test]
    fn a_state_section_after_the_completion_is_refused_by_the_main_channel() {
        use super::super::order::MainChannelState;
        assert!(
            MainChannelState::Completed
                .next(tern_wire::FrameKind::StateSection)
                .is_err()
        );
    }

    #[test]
    fn a_missing_page_channel_is_a_closed_channel() {
        let main = hello(2);
        let (result, _) = run(&main, &[page_channel(2)]);
        assert!(matches!(
            result,
            Err(MigrationError::Channel {
                index: 1,
                source: ChannelError::Closed
            })
        ));
    }
}
