//! Postcopy messages (protocol version 8): the switch with its list of
//! stale pages, page requests on the return path, urgent page deliveries,
//! and the destination's completion (docs/postcopy.md).
//!
//! All four travel on the main channel; the background push of the
//! remaining pages uses ordinary page packets on the page channels. Every
//! count and length is bounded here, before the engine sees a value: a
//! switch frame holds at most [`MAX_STALE_RUNS`] runs (a longer list takes
//! several frames), a request or an urgent delivery at most
//! [`MAX_REQUEST_PAGES`] pages. Whether a run or request lies inside guest
//! memory is the engine's check (it knows the regions).

use crate::codec::{Reader, Writer};
use crate::error::WireError;
use crate::{FrameKind, PAGE_SIZE};

/// Most stale-page runs one [`PostcopySwitch`] frame carries.
pub const MAX_STALE_RUNS: usize = 4096;
/// Most pages one [`PageRequest`] asks for, and one [`UrgentPages`]
/// carries (the width of its zero mask).
pub const MAX_REQUEST_PAGES: u32 = 32;

/// Contiguous pages of one region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageRun {
    /// The region's id.
    pub region_id: u32,
    /// First page index in the region.
    pub first_page: u32,
    /// Pages in the run, at least 1.
    pub pages: u32,
}

impl PageRun {
    /// Encoded size: region, first page, count, reserved.
    pub const ENCODED_LEN: usize = 16;

    /// One past the last page, as a 64-bit index (never overflows).
    pub fn end(&self) -> u64 {
        u64::from(self.first_page) + u64::from(self.pages)
    }

    fn encode(&self, w: &mut Writer<'_>) {
        w.u32(self.region_id)
            .u32(self.first_page)
            .u32(self.pages)
            .zeros(4);
    }

    fn decode(r: &mut Reader<'_>, field: &'static str) -> Result<Self, WireError> {
        let run = Self {
            region_id: r.u32()?,
            first_page: r.u32()?,
            pages: r.u32()?,
        };
        r.reserved(4)?;
        if run.pages == 0 {
            return Err(WireError::InvalidField {
                field,
                detail: "a run of 0 pages".into(),
            });
        }
        // Page indices are 32-bit: a run may end at 2^32, not past it.
        if run.end() > u64::from(u32::MAX) + 1 {
            return Err(WireError::InvalidField {
                field,
                detail: format!(
                    "pages {}+{} pass the largest page index",
                    run.first_page, run.pages
                ),
            });
        }
        Ok(run)
    }
}

/// The source switches to postcopy (source to destination, main channel,
/// with the guest paused, before the state sections): the pages the
/// destination holds that are now stale, which it discards and fetches on
/// demand. A long list takes several frames, each but the last with
/// `more` set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PostcopySwitch {
    /// More switch frames follow.
    pub more: bool,
    /// Stale pages, at most [`MAX_STALE_RUNS`] runs.
    pub stale: Vec<PageRun>,
}

impl PostcopySwitch {
    /// Bytes before the runs: flags, reserved, run count.
    pub const HEADER_LEN: usize = 8;
    /// Largest body.
    pub const MAX_BODY: usize = Self::HEADER_LEN + MAX_STALE_RUNS * PageRun::ENCODED_LEN;
}

/// The destination asks for pages a guest thread waits on (destination to
/// source, main channel, after the commit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageRequest {
    /// The pages, 1..=[`MAX_REQUEST_PAGES`] of them.
    pub run: PageRun,
}

impl PageRequest {
    /// Body length.
    pub const ENCODED_LEN: usize = PageRun::ENCODED_LEN;
}

/// Requested pages, sent ahead of the background push (source to
/// destination, main channel): `pages` pages from `first_page`, a zero
/// page carrying no bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UrgentPages {
    /// The region's id.
    pub region_id: u32,
    /// First page index.
    pub first_page: u32,
    /// Pages, 1..=[`MAX_REQUEST_PAGES`].
    pub pages: u16,
    /// Bit `i` set: page `first_page + i` is all zero and has no bytes in
    /// `data`. No bit at or above `pages`.
    pub zero_mask: u32,
    /// The data pages' bytes in order, [`PAGE_SIZE`] each.
    pub data: Vec<u8>,
}

impl UrgentPages {
    /// Bytes before the data: region, first page, count, reserved, mask.
    pub const HEADER_LEN: usize = 16;
    /// Largest body.
    pub const MAX_BODY: usize = Self::HEADER_LEN + MAX_REQUEST_PAGES as usize * PAGE_SIZE as usize;

    /// Whether page `index` (0-based in this delivery) is a zero page.
    pub fn is_zero(&self, index: usize) -> bool {
        index < 32 && self.zero_mask & (1 << index) != 0
    }

    /// The bytes of data page `index`, `None` for a zero page or an index
    /// past the delivery.
    pub fn page(&self, index: usize) -> Option<&[u8]> {
        if index >= usize::from(self.pages) || self.is_zero(index) {
            return None;
        }
        let before = (0..index).filter(|&i| !self.is_zero(i)).count();
        let page = PAGE_SIZE as usize;
        self.data.get(before * page..(before + 1) * page)
    }
}

/// A paused postcopy's source connects its main channel again (source to
/// destination, the first frame of a new connection after TLS and the
/// shared-key handshake, which bind the same session and channel 0): the
/// session it resumes. The destination welcomes it only while its
/// postcopy is paused and only for its own session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PostcopyResume {
    /// The session, and channel 0.
    pub handshake: crate::Handshake,
}

/// The stale pages a paused postcopy's destination still lacks (destination
/// to source, main channel, after welcoming a [`PostcopyResume`] and the
/// page channels): the complement of what it received, as runs (QEMU sends
/// a received bitmap). A long list takes several frames, each but the last
/// with `more` set. The source checks every run against its own stale
/// pages; it resends those and continues.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PostcopyMissing {
    /// More frames follow.
    pub more: bool,
    /// Missing pages, at most [`MAX_STALE_RUNS`] runs.
    pub missing: Vec<PageRun>,
}

/// Buckets of [`PostcopyComplete::latency_histogram`]: bucket `i` counts
/// faults answered in `[2^i, 2^(i+1))` microseconds (bucket 0 also below
/// 1 µs, the last one also everything longer).
pub const LATENCY_BUCKETS: usize = 24;

/// The destination holds every page (destination to source, main
/// channel): its digest of memory as delivered, to compare with the
/// source's, and what postcopy cost the guest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PostcopyComplete {
    /// Digest of memory as it stood at the switch, from the pages as they
    /// were placed (0 when the session does not verify).
    pub digest: u128,
    /// Pages the destination asked for.
    pub requested_pages: u64,
    /// Stale pages placed from the background push.
    pub pushed_pages: u64,
    /// Page faults the destination answered.
    pub faults: u64,
    /// Time guest threads spent waiting on faults, summed, in microseconds
    /// (QEMU's blocktime).
    pub blocktime_micros: u64,
    /// Microseconds from the resume until every page was placed.
    pub delivered_micros: u64,
    /// Fault latencies, a power-of-two histogram in microseconds: always
    /// [`LATENCY_BUCKETS`] entries on the wire (missing ones are sent as 0,
    /// extra ones are left out).
    pub latency_histogram: Vec<u64>,
}

impl PostcopyComplete {
    /// Body length.
    pub const ENCODED_LEN: usize = 16 + 5 * 8 + LATENCY_BUCKETS * 8;
}

/// Largest body of a postcopy kind, `None` for another kind.
pub(crate) const fn max_body(kind: FrameKind) -> Option<usize> {
    match kind {
        FrameKind::PostcopySwitch => Some(PostcopySwitch::MAX_BODY),
        FrameKind::PageRequest => Some(PageRequest::ENCODED_LEN),
        FrameKind::UrgentPages => Some(UrgentPages::MAX_BODY),
        FrameKind::PostcopyComplete => Some(PostcopyComplete::ENCODED_LEN),
        FrameKind::PostcopyResume => Some(crate::Handshake::ENCODED_LEN),
        FrameKind::PostcopyMissing => Some(PostcopySwitch::MAX_BODY),
        _ => None,
    }
}

pub(crate) fn encode_switch(switch: &PostcopySwitch, w: &mut Writer<'_>) {
    let count = switch.stale.len().min(MAX_STALE_RUNS);
    w.u8(u8::from(switch.more))
        .zeros(3)
        .u32(u32::try_from(count).unwrap_or(0));
    for run in &switch.stale[..count] {
        run.encode(w);
    }
}

pub(crate) fn decode_switch(r: &mut Reader<'_>) -> Result<PostcopySwitch, WireError> {
    let more = match r.u8()? {
        0 => false,
        1 => true,
        other => {
            return Err(WireError::InvalidField {
                field: "postcopy switch flags",
                detail: format!("{other:#x}"),
            });
        }
    };
    r.reserved(3)?;
    let count = r.u32()? as usize;
    if count > MAX_STALE_RUNS {
        return Err(WireError::FieldTooLong {
            field: "stale runs",
            len: count,
            max: MAX_STALE_RUNS,
        });
    }
    // The count is bounded, and each run needs its bytes in this body.
    let stale = (0..count)
        .map(|_| PageRun::decode(r, "stale run"))
        .collect::<Result<_, _>>()?;
    Ok(PostcopySwitch { more, stale })
}

pub(crate) fn encode_missing(missing: &PostcopyMissing, w: &mut Writer<'_>) {
    encode_switch(
        &PostcopySwitch {
            more: missing.more,
            stale: missing.missing.clone(),
        },
        w,
    );
}

/// The same layout as a switch frame: flags, reserved, bounded runs.
pub(crate) fn decode_missing(r: &mut Reader<'_>) -> Result<PostcopyMissing, WireError> {
    let PostcopySwitch { more, stale } = decode_switch(r)?;
    Ok(PostcopyMissing {
        more,
        missing: stale,
    })
}

pub(crate) fn encode_request(request: &PageRequest, w: &mut Writer<'_>) {
    request.run.encode(w);
}

pub(crate) fn decode_request(r: &mut Reader<'_>) -> Result<PageRequest, WireError> {
    let run = PageRun::decode(r, "page request")?;
    if run.pages > MAX_REQUEST_PAGES {
        return Err(WireError::FieldTooLong {
            field: "page request",
            len: run.pages as usize,
            max: MAX_REQUEST_PAGES as usize,
        });
    }
    Ok(PageRequest { run })
}

pub(crate) fn encode_urgent(urgent: &UrgentPages, w: &mut Writer<'_>) {
    w.u32(urgent.region_id)
        .u32(urgent.first_page)
        .u16(urgent.pages)
        .zeros(2)
        .u32(urgent.zero_mask)
        .bytes(&urgent.data);
}

pub(crate) fn decode_urgent(r: &mut Reader<'_>) -> Result<UrgentPages, WireError> {
    let region_id = r.u32()?;
    let first_page = r.u32()?;
    let pages = r.u16()?;
    r.reserved(2)?;
    let zero_mask = r.u32()?;
    if pages == 0 || u32::from(pages) > MAX_REQUEST_PAGES {
        return Err(WireError::InvalidField {
            field: "urgent pages",
            detail: format!("{pages} pages (must be 1..={MAX_REQUEST_PAGES})"),
        });
    }
    if u64::from(first_page) + u64::from(pages) > u64::from(u32::MAX) + 1 {
        return Err(WireError::InvalidField {
            field: "urgent pages",
            detail: format!("pages {first_page}+{pages} pass the largest page index"),
        });
    }
    let beyond = if u32::from(pages) >= 32 {
        0
    } else {
        u32::MAX << pages
    };
    if zero_mask & beyond != 0 {
        return Err(WireError::InvalidField {
            field: "urgent zero mask",
            detail: format!("{zero_mask:#x} marks pages past the {pages} delivered"),
        });
    }
    let data_pages = usize::from(pages) - zero_mask.count_ones() as usize;
    let len = data_pages * PAGE_SIZE as usize;
    if r.remaining() != len {
        return Err(WireError::PayloadMismatch {
            expected: len,
            actual: r.remaining(),
        });
    }
    let data = r.take(len)?.to_vec();
    Ok(UrgentPages {
        region_id,
        first_page,
        pages,
        zero_mask,
        data,
    })
}

pub(crate) fn encode_complete(complete: &PostcopyComplete, w: &mut Writer<'_>) {
    w.u128(complete.digest)
        .u64(complete.requested_pages)
        .u64(complete.pushed_pages)
        .u64(complete.faults)
        .u64(complete.blocktime_micros)
        .u64(complete.delivered_micros);
    for bucket in 0..LATENCY_BUCKETS {
        w.u64(complete.latency_histogram.get(bucket).copied().unwrap_or(0));
    }
}

pub(crate) fn decode_complete(r: &mut Reader<'_>) -> Result<PostcopyComplete, WireError> {
    let digest = r.u128()?;
    let requested_pages = r.u64()?;
    let pushed_pages = r.u64()?;
    let faults = r.u64()?;
    let blocktime_micros = r.u64()?;
    let delivered_micros = r.u64()?;
    let latency_histogram = (0..LATENCY_BUCKETS)
        .map(|_| r.u64())
        .collect::<Result<_, _>>()?;
    Ok(PostcopyComplete {
        digest,
        requested_pages,
        pushed_pages,
        faults,
        blocktime_micros,
        delivered_micros,
        latency_histogram,
    })
}

#[cfg(test)]
mod resume_tests {
    use crate::{Handshake, Message, PostcopyResume, WireError};

    #[test]
    fn a_resume_names_the_main_channel_only() {
        let resume = Message::PostcopyResume(PostcopyResume {
            handshake: Handshake {
                session_id: 1,
                channel_index: 2,
            },
        });
        let bytes = resume.to_bytes();
        let decoded = Message::decode(crate::FrameKind::PostcopyResume, &bytes[8..]);
        assert!(
            matches!(decoded, Err(WireError::InvalidField { .. })),
            "{decoded:?}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::{
        LATENCY_BUCKETS, MAX_REQUEST_PAGES, MAX_STALE_RUNS, PageRequest, PageRun, PostcopyComplete,
        PostcopyMissing, PostcopyResume, PostcopySwitch, UrgentPages,
    };
    use crate::{FRAME_HEADER_LEN, FrameHeader, FrameKind, Message, PAGE_SIZE, WireError};

    fn round_trip(message: &Message) -> Result<Message, WireError> {
        let bytes = message.to_bytes();
        let mut head = [0u8; FRAME_HEADER_LEN];
        head.copy_from_slice(&bytes[..FRAME_HEADER_LEN]);
        let header = FrameHeader::decode(&head)?;
        Message::decode(header.kind, &bytes[FRAME_HEADER_LEN..])
    }

    fn run(region_id: u32, first_page: u32, pages: u32) -> PageRun {
        PageRun {
            region_id,
            first_page,
            pages,
        }
    }

    #[test]
    fn every_postcopy_message_round_trips() {
        let page = PAGE_SIZE as usize;
        let messages = [
            Message::PostcopyResume(PostcopyResume {
                handshake: crate::Handshake {
                    session_id: 0xfeed,
                    channel_index: 0,
                },
            }),
            Message::PostcopyMissing(PostcopyMissing {
                more: true,
                missing: vec![run(3, 9, 2)],
            }),
            Message::PostcopyMissing(PostcopyMissing {
                more: false,
                missing: Vec::new(),
            }),
            Message::PostcopySwitch(PostcopySwitch {
                more: true,
                stale: vec![run(0, 1, 3), run(7, u32::MAX, 1)],
            }),
            Message::PostcopySwitch(PostcopySwitch {
                more: false,
                stale: vec![run(1, 0, 1); MAX_STALE_RUNS],
            }),
            Message::PageRequest(PageRequest {
                run: run(2, 9, MAX_REQUEST_PAGES),
            }),
            Message::UrgentPages(UrgentPages {
                region_id: 3,
                first_page: 10,
                pages: 3,
                zero_mask: 0b010,
                data: [vec![1u8; page], vec![3u8; page]].concat(),
            }),
            Message::UrgentPages(UrgentPages {
                region_id: 3,
                first_page: 0,
                pages: 32,
                zero_mask: u32::MAX,
                data: Vec::new(),
            }),
            Message::PostcopyComplete(PostcopyComplete {
                digest: 0x1234_5678_9abc_def0_0fed_cba9_8765_4321,
                requested_pages: 5,
                pushed_pages: 1 << 40,
                faults: 7,
                blocktime_micros: 900,
                delivered_micros: 12_000,
                latency_histogram: (0..LATENCY_BUCKETS as u64).collect(),
            }),
        ];
        for message in messages {
            assert_eq!(round_trip(&message).unwrap(), message);
        }
    }

    #[test]
    fn urgent_pages_name_their_pages() {
        let page = PAGE_SIZE as usize;
        let urgent = UrgentPages {
            region_id: 0,
            first_page: 0,
            pages: 3,
            zero_mask: 0b001,
            data: [vec![1u8; page], vec![2u8; page]].concat(),
        };
        assert_eq!(urgent.page(0), None);
        assert_eq!(urgent.page(1).unwrap()[0], 1);
        assert_eq!(urgent.page(2).unwrap()[0], 2);
        assert_eq!(urgent.page(3), None);
    }

    fn body_of(message: &Message) -> Vec<u8> {
        message.to_bytes()[FRAME_HEADER_LEN..].to_vec()
    }

    #[test]
    fn bad_counts_and_lengths_are_refused() {
        // A request for no pages, and for more than one delivery carries.
        for pages in [0, MAX_REQUEST_PAGES + 1] {
            let body = body_of(&Message::PageRequest(PageRequest {
                run: run(0, 0, pages),
            }));
            assert!(Message::decode(FrameKind::PageRequest, &body).is_err());
        }
        // A run past the last page index.
        let body = body_of(&Message::PageRequest(PageRequest {
            run: run(0, u32::MAX, 2),
        }));
        assert!(Message::decode(FrameKind::PageRequest, &body).is_err());
        // A switch frame announcing more runs than it may carry.
        let mut body = body_of(&Message::PostcopySwitch(PostcopySwitch {
            more: false,
            stale: vec![],
        }));
        body[4..8].copy_from_slice(&(u32::try_from(MAX_STALE_RUNS).unwrap() + 1).to_le_bytes());
        assert!(matches!(
            Message::decode(FrameKind::PostcopySwitch, &body),
            Err(WireError::FieldTooLong { .. })
        ));
        // More runs announced than the body holds.
        body[4..8].copy_from_slice(&2u32.to_le_bytes());
        assert!(Message::decode(FrameKind::PostcopySwitch, &body).is_err());
        // An unknown flag.
        body[0] = 2;
        assert!(Message::decode(FrameKind::PostcopySwitch, &body).is_err());
    }

    #[test]
    fn urgent_pages_must_carry_exactly_their_data() {
        let page = PAGE_SIZE as usize;
        let good = UrgentPages {
            region_id: 0,
            first_page: 0,
            pages: 2,
            zero_mask: 0b01,
            data: vec![4u8; page],
        };
        let body = body_of(&Message::UrgentPages(good.clone()));
        assert!(Message::decode(FrameKind::UrgentPages, &body).is_ok());
        // One byte short, one byte over.
        assert!(Message::decode(FrameKind::UrgentPages, &body[..body.len() - 1]).is_err());
        let mut long = body.clone();
        long.push(0);
        assert!(Message::decode(FrameKind::UrgentPages, &long).is_err());
        // A zero bit past the pages delivered.
        let mut masked = body.clone();
        masked[12..16].copy_from_slice(&0b101u32.to_le_bytes());
        assert!(Message::decode(FrameKind::UrgentPages, &masked).is_err());
        // No pages, and more than a mask can describe.
        for pages in [0u16, 33] {
            let mut counted = body.clone();
            counted[8..10].copy_from_slice(&pages.to_le_bytes());
            assert!(Message::decode(FrameKind::UrgentPages, &counted).is_err());
        }
    }

    #[test]
    fn the_frame_header_bounds_every_postcopy_body() {
        for kind in [
            FrameKind::PostcopySwitch,
            FrameKind::PageRequest,
            FrameKind::UrgentPages,
            FrameKind::PostcopyComplete,
        ] {
            let max = kind.max_body();
            let mut head = FrameHeader {
                kind,
                body_len: u32::try_from(max).unwrap(),
            }
            .encode();
            assert!(FrameHeader::decode(&head).is_ok());
            head[4..8].copy_from_slice(&u32::try_from(max + 1).unwrap().to_le_bytes());
            assert!(FrameHeader::decode(&head).is_err(), "{kind:?}");
        }
        assert!(FrameKind::UrgentPages.max_body() < 200 << 10);
        assert!(FrameKind::PostcopySwitch.max_body() <= 65 << 10);
    }
}
