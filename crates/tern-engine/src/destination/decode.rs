//! The decode step (a packet whose payload has been read lands in guest
//! memory: pages decompressed, zero pages cleared, page hashes recorded)
//! and the pool of threads that runs it, so that decompression is not
//! bound to one receiver thread per channel.
//!
//! A receiver reads a packet's payload into a [`Landing`] (raw pages
//! straight into guest memory, compressed ones into the landing's buffer),
//! then either lands it itself (nothing to decode) or queues it on the
//! pool's shared ring. Any decoder thread, or a receiver that waits for a
//! free landing, takes it from there: work goes to whichever core is free,
//! whatever channel it came on. Each receiver owns a few landings, so the
//! data it has in flight is bounded; a landing goes back to its owner once
//! landed.
//!
//! The iteration barrier keeps its meaning: a receiver reaching a sync
//! first waits until every landing it queued has landed (helping decode
//! meanwhile), so when the barrier releases, everything sent before the
//! sync is in memory. The per-page path takes no lock: landings move
//! through lock-free rings, threads sleep on doorbells.
//!
//! New page kinds plug into [`land`]: one arm per kind, and
//! [`Landing::needs_decoding`] says which kinds are worth a hand-off.

use std::sync::OnceLock;
use std::sync::atomic::Ordering;
use std::time::Instant;

use tern_page::codec::{CodecId, PageDecompressor};
use tern_wire::{MAX_PAGES_PER_PACKET, PageEntry, PageKind, PagePacket, codec_id};

use super::landing_pool::{DecodePool, Landing};
use super::populate::{place_fresh_as_zeros, populate_runs};
use super::reuse::{WrittenHere, apply_delta, apply_duplicate};
use super::shared::ReceiverShared;
use crate::digest::{page_hash, zero_page_hash};
use crate::error::MigrationError;
use crate::guest::PAGE_SIZE;
use crate::ring::Doorbell;
use crate::stats::thread_cpu_seconds;
use crate::transport::Segment;

impl Landing {
    /// Finds each entry's page and the segment its payload goes to. The
    /// region's `page_ptr` is the one bounds check between a page index and
    /// guest memory.
    pub(super) fn place(
        &mut self,
        shared: &ReceiverShared<'_>,
        packet: &PagePacket,
        entries: &[PageEntry],
    ) -> Result<(), MigrationError> {
        let region = &shared.regions[packet.region_index];
        self.region_index = packet.region_index;
        self.region_id = packet.header.region_id;
        self.codec = packet.header.codec;
        self.dictionary = packet.header.dictionary;
        self.entries.clear();
        self.entries.extend_from_slice(entries);
        self.pages.clear();
        self.segments.clear();
        self.staged.clear();
        let stage_fresh = shared.userfault.is_some();
        if stage_fresh && self.staging.is_empty() {
            self.staging = vec![0; MAX_PAGES_PER_PACKET * PAGE_SIZE];
        }
        let populated = &shared.populated[packet.region_index];
        let mut compressed = &mut self.compressed[..];
        let mut staging = &mut self.staging[..];
        for entry in entries {
            let ptr = region
                .page_ptr(u64::from(entry.page_index))
                .ok_or_else(|| MigrationError::Protocol("page outside its region".into()))?;
            self.pages.push(ptr);
            match entry.kind {
                PageKind::Raw if stage_fresh && !populated.get(u64::from(entry.page_index)) => {
                    // At most MAX_PAGES_PER_PACKET pages, so they fit.
                    let (slot, rest) = std::mem::take(&mut staging).split_at_mut(PAGE_SIZE);
                    staging = rest;
                    self.segments.push(Segment {
                        ptr: slot.as_mut_ptr(),
                        len: PAGE_SIZE,
                    });
                    self.staged.push(ptr);
                }
                PageKind::Raw => self.segments.push(Segment {
                    ptr,
                    len: PAGE_SIZE,
                }),
                // A packet frame's later pages: their bytes are in its frame.
                PageKind::Compressed if entry.encoded_len == 0 => {}
                PageKind::Compressed | PageKind::Duplicate | PageKind::Delta => {
                    // Each such payload is shorter than a page and there
                    // are at most MAX_PAGES_PER_PACKET, so they fit.
                    let (slot, rest) =
                        std::mem::take(&mut compressed).split_at_mut(entry.encoded_len as usize);
                    compressed = rest;
                    self.segments.push(Segment {
                        ptr: slot.as_mut_ptr(),
                        len: slot.len(),
                    });
                }
                PageKind::Zero => {}
            }
        }
        Ok(())
    }

    /// Places the staged raw pages, read into the bounce buffer, in guest
    /// memory: one `UFFDIO_COPY` per run of contiguous pages.
    pub(super) fn place_staged(&self, shared: &ReceiverShared<'_>) -> Result<(), MigrationError> {
        let Some(userfault) = &shared.userfault else {
            return Ok(());
        };
        let mut first = 0;
        while first < self.staged.len() {
            let start = self.staged[first];
            let run = 1 + self.staged[first + 1..]
                .iter()
                .zip(&self.staged[first..])
                .take_while(|(next, previous)| **next == previous.wrapping_add(PAGE_SIZE))
                .count();
            let source = self.staging[first * PAGE_SIZE..][..run * PAGE_SIZE].as_ptr();
            // SAFETY: the staged pages are whole pages inside the region
            // (from `page_ptr`), `run` of them contiguous from `start`,
            // claimed by this packet for this iteration; `source` is this
            // landing's own buffer, holding their `run` pages in order.
            unsafe { userfault.place(start, source, run) }.map_err(|error| {
                MigrationError::Internal(format!("placing received pages: {error}"))
            })?;
            first += run;
        }
        Ok(())
    }

    /// Populates the runs of pages the `readv` is about to write (see
    /// `populate.rs`).
    pub(super) fn populate_raw_pages(&self, shared: &ReceiverShared<'_>) {
        populate_runs(
            shared,
            self.region_index,
            &self.entries,
            &self.pages,
            PageKind::Raw,
        );
    }
}

/// Per-page counts of one packet, added to the live statistics.
#[derive(Default)]
struct PageCounts {
    zero: u64,
    cleared: u64,
    normal: u64,
}

/// One decompressor per codec id the session announced, and how many of
/// the session's dictionaries they know.
pub(super) struct Decompressors {
    by_codec: [Option<PageDecompressor>; 8],
    dictionaries: u8,
}

impl Decompressors {
    /// Decompressors for `codecs`, knowing the session's dictionaries in
    /// force.
    pub(super) fn new(
        codecs: &[CodecId],
        shared: &ReceiverShared<'_>,
    ) -> Result<Self, MigrationError> {
        let mut by_codec: [Option<PageDecompressor>; 8] = Default::default();
        for &codec in codecs {
            by_codec[codec as usize] = Some(
                PageDecompressor::for_destination(codec, shared.qpl_path).map_err(|error| {
                    MigrationError::Incompatible(format!("cannot decode {}: {error}", codec.name()))
                })?,
            );
        }
        let mut decompressors = Self {
            by_codec,
            dictionaries: 0,
        };
        decompressors.learn_dictionaries(shared)?;
        Ok(decompressors)
    }

    /// Loads the dictionaries that came into force since the last call (a
    /// refresh, at an iteration barrier), before a packet that names one
    /// is decoded; a packet naming one not in force then finds no decoder
    /// and is refused.
    fn learn_dictionaries_for(
        &mut self,
        dictionary: u8,
        shared: &ReceiverShared<'_>,
    ) -> Result<(), MigrationError> {
        if dictionary <= self.dictionaries {
            return Ok(());
        }
        self.learn_dictionaries(shared)
    }

    fn learn_dictionaries(&mut self, shared: &ReceiverShared<'_>) -> Result<(), MigrationError> {
        let new = shared.dictionaries.in_force_after(self.dictionaries);
        if new.is_empty() {
            return Ok(());
        }
        for decompressor in self.by_codec.iter_mut().flatten() {
            decompressor
                .add_dictionaries(&new)
                .map_err(|error| MigrationError::Protocol(error.to_string()))?;
        }
        self.dictionaries += u8::try_from(new.len()).unwrap_or(u8::MAX);
        Ok(())
    }

    /// Says which inflate ran and how often the offload left a page to
    /// libdeflate (not in the statistics, whose wire message lacks a field).
    pub(super) fn log_offload(&self, thread: &str) {
        for decompressor in self.by_codec.iter().flatten() {
            if decompressor.implementation() == tern_page::codec::CodecImpl::Qpl {
                tracing::info!(
                    thread,
                    fallbacks = decompressor.offload_fallbacks(),
                    "deflate pages inflated on IAA through QPL"
                );
            }
        }
    }
}

/// The decode step: writes what the payload alone does not (decompresses
/// compressed pages into their page, clears zero pages that hold data),
/// records each page's hash and whether it holds data, and adds the
/// packet's counts to the statistics.
fn land(
    landing: &Landing,
    decompressors: &mut Decompressors,
    shared: &ReceiverShared<'_>,
    written: Option<&WrittenHere>,
) -> Result<(), MigrationError> {
    let region = landing.region_index;
    populate_runs(
        shared,
        region,
        &landing.entries,
        &landing.pages,
        PageKind::Compressed,
    );
    place_fresh_as_zeros(shared, region, &landing.entries, &landing.pages)?;
    let populated = &shared.populated[region];
    let hashes = shared.page_hashes.as_ref();
    let mut payloads = &landing.compressed[..];
    decompressors.learn_dictionaries_for(landing.named_dictionary(), shared)?;
    let mut compressed = CompressedInput::new(landing, decompressors);
    let mut counts = PageCounts::default();
    for (entry, &ptr) in landing.entries.iter().zip(&landing.pages) {
        let page = u64::from(entry.page_index);
        if entry.kind == PageKind::Zero {
            counts.zero += 1;
            if let Some(hashes) = hashes {
                hashes.record(region, page, zero_page_hash());
            }
            if populated.get(page) {
                // SAFETY: a whole page inside the region (from `page_ptr`),
                // claimed by this packet for this iteration.
                unsafe { std::ptr::write_bytes(ptr, 0, PAGE_SIZE) };
                populated.clear(page);
                counts.cleared += 1;
            }
            continue;
        }
        if entry.kind != PageKind::Raw {
            let (input, rest) = payloads.split_at(entry.encoded_len as usize);
            payloads = rest;
            // In every arm `ptr` is a whole page inside the region (from
            // `page_ptr`), claimed by this packet for this iteration; each
            // writes exactly one page or fails.
            let written_page = match entry.kind {
                // SAFETY: as above.
                PageKind::Compressed => unsafe { compressed.decode_next(input, ptr) },
                // SAFETY: as above.
                _ => unsafe { reuse_page(shared, written, (region, page), entry.kind, input, ptr) },
            };
            written_page.map_err(|error| {
                MigrationError::Protocol(format!(
                    "channel {}: page {page} of region {}: {error}",
                    landing.channel, landing.region_id
                ))
            })?;
        }
        populated.set(page);
        counts.normal += 1;
        if let Some(hashes) = hashes {
            // SAFETY: a whole page inside the region, written just now and
            // claimed by this packet for this iteration.
            let hash = unsafe { page_hash(ptr) };
            hashes.record(region, page, hash);
        }
    }
    let stats = shared.stats;
    stats.zero_pages.fetch_add(counts.zero, Ordering::Relaxed);
    stats
        .zero_pages_cleared
        .fetch_add(counts.cleared, Ordering::Relaxed);
    stats
        .normal_pages
        .fetch_add(counts.normal, Ordering::Relaxed);
    Ok(())
}

/// Copies the page a duplicate names (`written`: the owner's pages, given
/// when the owner lands the packet itself) or applies a delta.
///
/// # Safety
/// `ptr` is a whole page inside region `region`, claimed by this packet for
/// this iteration.
unsafe fn reuse_page(
    shared: &ReceiverShared<'_>,
    written: Option<&WrittenHere>,
    at: (usize, u64),
    kind: PageKind,
    input: &[u8],
    ptr: *mut u8,
) -> Result<(), String> {
    match (kind, written) {
        // SAFETY: the caller's contract.
        (PageKind::Duplicate, Some(written)) => unsafe {
            apply_duplicate(shared, written, at, ptr, input)
        },
        (PageKind::Duplicate, None) => {
            Err("a packet with duplicates was handed to the decoder pool".into())
        }
        // SAFETY: the caller's contract.
        (PageKind::Delta, _) => unsafe { apply_delta(shared, at, ptr, input) },
        _ => Err(format!("no payload to rebuild a {kind:?} page from")),
    }
}

/// Where a packet's compressed pages come from: each page's own bytes,
/// decoded alone (against the packet's dictionary, if it names one), or
/// the packet's one frame (codecs `zstd-packet` and `zstd-stream`),
/// decoded at its first compressed page into exactly the packet's
/// compressed pages.
struct CompressedInput<'d> {
    decompressor: Option<&'d mut PageDecompressor>,
    /// The header's dictionary byte (a stream's restart flag).
    dictionary: u8,
    /// For a packet frame: how many pages it holds, and once decoded,
    /// those not yet written.
    frame: Option<(usize, Option<&'d [u8]>)>,
}

impl<'d> CompressedInput<'d> {
    fn new(landing: &Landing, decompressors: &'d mut Decompressors) -> Self {
        Self::for_packet(
            landing.codec,
            landing.dictionary,
            &landing.entries,
            decompressors,
        )
    }

    /// The input of a packet with codec byte `codec`, dictionary
    /// `dictionary` and table `entries`.
    fn for_packet(
        codec: u8,
        dictionary: u8,
        entries: &[PageEntry],
        decompressors: &'d mut Decompressors,
    ) -> Self {
        let frame = codec_id::one_frame_per_packet(codec).then(|| {
            let pages = entries
                .iter()
                .filter(|entry| entry.kind == PageKind::Compressed)
                .count();
            (pages, None)
        });
        Self {
            decompressor: decompressors
                .by_codec
                .get_mut(usize::from(codec))
                .and_then(Option::as_mut),
            dictionary,
            frame,
        }
    }

    /// Writes the next compressed page (its own bytes `input`; a packet
    /// frame's later pages have none) into `page_out`.
    ///
    /// # Safety
    /// `page_out` points to `PAGE_SIZE` writable bytes nothing else
    /// accesses during the call.
    unsafe fn decode_next(&mut self, input: &[u8], page_out: *mut u8) -> Result<(), String> {
        // The decoder admits only announced codecs and every announced
        // codec has a decompressor: a miss means those two lists disagree.
        const UNANNOUNCED: &str = "the packet's codec was not announced";
        let Some((pages, decoded)) = &mut self.frame else {
            let decompressor = self.decompressor.as_deref_mut().ok_or(UNANNOUNCED)?;
            // SAFETY: forwarded caller contract; the decoder writes exactly
            // one page or fails.
            return unsafe { decompressor.decompress_page_with(input, self.dictionary, page_out) }
                .map_err(|error| error.to_string());
        };
        if decoded.is_none() {
            // The wire's table rules put the frame's bytes on the first
            // compressed entry.
            let decompressor = self.decompressor.take().ok_or(UNANNOUNCED)?;
            *decoded = Some(
                decompressor
                    .decompress_packet(input, self.dictionary, *pages)
                    .map_err(|error| error.to_string())?,
            );
        }
        let rest = decoded.as_mut().ok_or(UNANNOUNCED)?;
        let (page, after) = rest
            .split_first_chunk::<PAGE_SIZE>()
            .ok_or("the packet frame holds fewer pages than its table")?;
        *rest = after;
        // SAFETY: forwarded caller contract; `page` is in the decompressor's
        // own buffer, which cannot overlap guest memory.
        unsafe { std::ptr::copy_nonoverlapping(page.as_ptr(), page_out, PAGE_SIZE) };
        Ok(())
    }
}

/// A packet's compressed pages decoded one at a time into a buffer rather
/// than into guest memory: postcopy's push, whose pages are placed
/// atomically (`UFFDIO_COPY`) from that buffer once decoded, so that the
/// guest, which runs meanwhile, never sees a page half-written.
pub(super) struct PacketPages<'d>(CompressedInput<'d>);

impl Decompressors {
    /// The decoder of one packet's compressed pages (`packet`, `entries`),
    /// once the dictionaries in force are known.
    pub(super) fn packet<'d>(
        &'d mut self,
        shared: &ReceiverShared<'_>,
        packet: &PagePacket,
        entries: &[PageEntry],
    ) -> Result<PacketPages<'d>, MigrationError> {
        self.learn_dictionaries_for(packet.header.named_dictionary(), shared)?;
        Ok(PacketPages(CompressedInput::for_packet(
            packet.header.codec,
            packet.header.dictionary,
            entries,
            self,
        )))
    }
}

impl PacketPages<'_> {
    /// Decodes the packet's next compressed page (its own bytes `input`;
    /// a packet frame's later pages have none) into `page`. Bad input is
    /// an error and leaves nothing but `page` written.
    pub(super) fn decode_next(
        &mut self,
        input: &[u8],
        page: &mut [u8; PAGE_SIZE],
    ) -> Result<(), String> {
        // SAFETY: `page` is PAGE_SIZE bytes this call borrows exclusively.
        unsafe { self.0.decode_next(input, page.as_mut_ptr()) }
    }
}

impl DecodePool {
    /// Lands `landing` and gives it back to its owner.
    fn finish(
        &self,
        landing: Box<Landing>,
        decompressors: &mut Decompressors,
        shared: &ReceiverShared<'_>,
        written: Option<&WrittenHere>,
    ) -> Result<(), MigrationError> {
        let mut landed = land(&landing, decompressors, shared, written);
        let owner = landing.owner;
        // The owner's ring holds all its landings, so it has room.
        let _ = self.free[owner].push(landing);
        // A packet landed off its receiver's path (by a decoder, or by a
        // receiver helping): its failure is recorded before the owner's
        // count drops, or the owner could see the count reach zero, find
        // no failure and complete the sync without the page (measured:
        // 3 of 63 runs of the bad-input test under load returned Ok).
        if written.is_none()
            && let Err(error) = std::mem::replace(&mut landed, Ok(()))
        {
            shared.fail(error);
        }
        // Release: the page writes and hashes above happen before the
        // owner sees its count drop (and then enters the barrier).
        self.in_flight[owner].fetch_sub(1, Ordering::Release);
        if let Some(bell) = self.receiver_bells[owner].get() {
            bell.ring();
        }
        landed
    }

    /// Decodes one queued packet, if any; whether there was one. A
    /// failure is recorded in `shared`, which stops every thread.
    fn decode_one(&self, decompressors: &mut Decompressors, shared: &ReceiverShared<'_>) -> bool {
        let Some(landing) = self.queued.pop() else {
            return false;
        };
        // `finish` records a failure itself (`shared.fail`), before the
        // owner can see its packet landed.
        let _ = self.finish(landing, decompressors, shared, None);
        true
    }

    /// Runs decoder thread `index` until the pool closes or the migration
    /// fails.
    pub(super) fn run_decoder(
        &self,
        index: usize,
        shared: &ReceiverShared<'_>,
        codecs: &[CodecId],
    ) {
        let cpu_start = thread_cpu_seconds();
        let bell = self.decoder_bells[index].get_or_init(Doorbell::for_current_thread);
        match Decompressors::new(codecs, shared) {
            Ok(mut decompressors) => {
                loop {
                    if self.decode_one(&mut decompressors, shared) {
                        continue;
                    }
                    if self.closed.load(Ordering::Acquire) || shared.failed() {
                        break;
                    }
                    bell.wait_until(|| {
                        !self.queued.is_empty()
                            || self.closed.load(Ordering::Acquire)
                            || shared.failed()
                    });
                }
                decompressors.log_offload(&format!("decoder-{index}"));
            }
            Err(error) => shared.fail(error),
        }
        let seconds = thread_cpu_seconds() - cpu_start;
        self.cpu_nanos.fetch_add(
            crate::numeric::saturating_u64_from_f64(seconds * 1e9),
            Ordering::Relaxed,
        );
    }
}

/// A receiver's side of the pool: takes landings, hands them off, and
/// waits for its own to land before a sync.
pub(super) struct ReceiverLanding {
    owner: usize,
    decompressors: Decompressors,
}

impl ReceiverLanding {
    /// Receiver `owner`'s side; call on the receiver's thread.
    pub(super) fn new(
        shared: &ReceiverShared<'_>,
        owner: usize,
        decompressors: Decompressors,
    ) -> Self {
        shared.pool.receiver_bells[owner].get_or_init(Doorbell::for_current_thread);
        Self {
            owner,
            decompressors,
        }
    }

    /// A free landing; while there is none, decodes queued packets (of any
    /// receiver) or sleeps until a decoder gives one back.
    pub(super) fn take(
        &mut self,
        shared: &ReceiverShared<'_>,
    ) -> Result<Box<Landing>, MigrationError> {
        let pool = &shared.pool;
        let free = &pool.free[self.owner];
        self.wait_while_helping(shared, || !free.is_empty())?;
        free.pop()
            .ok_or_else(|| MigrationError::Internal("a free landing vanished".into()))
    }

    /// Lands `landing` here when it has nothing to decode or there is no
    /// pool, or queues it for the pool.
    ///
    /// A packet with duplicates lands here, after every packet this
    /// receiver handed off before it: a duplicate may copy a page one of
    /// them writes (`written` says which pages this receiver wrote).
    pub(super) fn hand_off(
        &mut self,
        shared: &ReceiverShared<'_>,
        landing: Box<Landing>,
        written: &WrittenHere,
    ) -> Result<(), MigrationError> {
        let pool = &shared.pool;
        let copies_pages = landing.copies_pages();
        if copies_pages {
            self.wait_landed(shared)?;
        }
        pool.in_flight[self.owner].fetch_add(1, Ordering::Relaxed);
        if pool.threads == 0
            || copies_pages
            || !landing.needs_decoding()
            || landing.continues_a_stream()
        {
            return pool.finish(landing, &mut self.decompressors, shared, Some(written));
        }
        if let Err(landing) = pool.queued.push(landing) {
            // The ring holds every landing of every receiver: never full.
            return pool.finish(landing, &mut self.decompressors, shared, Some(written));
        }
        for bell in pool.decoder_bells.iter().filter_map(OnceLock::get) {
            bell.ring();
        }
        Ok(())
    }

    /// Returns once every packet this receiver handed off has landed: what
    /// a sync promises.
    pub(super) fn wait_landed(
        &mut self,
        shared: &ReceiverShared<'_>,
    ) -> Result<(), MigrationError> {
        let in_flight = &shared.pool.in_flight[self.owner];
        // Acquire: pairs with `finish`'s release, so the pages written by
        // decoders are visible before this receiver enters the barrier.
        self.wait_while_helping(shared, || in_flight.load(Ordering::Acquire) == 0)?;
        shared.check_failed()
    }

    /// Waits until `ready()`, decoding queued packets meanwhile; fails
    /// when the migration does, or after the I/O timeout (decoding a
    /// queue of packets takes milliseconds, so that means a stuck decoder).
    fn wait_while_helping(
        &mut self,
        shared: &ReceiverShared<'_>,
        mut ready: impl FnMut() -> bool,
    ) -> Result<(), MigrationError> {
        let pool = &shared.pool;
        let bell = pool.receiver_bells[self.owner].get_or_init(Doorbell::for_current_thread);
        let started = Instant::now();
        loop {
            if ready() {
                return Ok(());
            }
            shared.check_failed()?;
            if pool.decode_one(&mut self.decompressors, shared) {
                continue;
            }
            if started.elapsed() > shared.io_timeout() {
                return Err(MigrationError::Internal(
                    "the decoders did not land this channel's packets in time".into(),
                ));
            }
            bell.wait_until(|| {
                ready()
                    || !pool.queued.is_empty()
                    || shared.failed()
                    || started.elapsed() > shared.io_timeout()
            });
        }
    }

    pub(super) fn log_offload(&self) {
        self.decompressors
            .log_offload(&format!("receiver-{}", self.owner));
    }
}
