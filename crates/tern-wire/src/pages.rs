//! Page packets: a fixed header, a page table, then the payload.
//!
//! The payload is the concatenation of each page's encoded bytes in table
//! order: nothing for a zero page, `PAGE_SIZE` bytes for a raw page,
//! `encoded_len` bytes for a compressed one, a [`PageRef`] for a duplicate
//! and a DSA delta record for a delta page. A packet of codec
//! [`codec_id::ZSTD_PACKET`] carries all its compressed pages in one zstd
//! frame: the first compressed entry's length is the frame's, the other
//! compressed entries have none. A packet of [`codec_id::ZSTD_STREAM`]
//! has the same table, its bytes the channel stream's next.

use crate::codec::{Reader, Writer};
use crate::error::WireError;
use crate::message::SessionSetup;
use crate::{FRAME_HEADER_LEN, FrameHeader, FrameKind, MAX_PAGES_PER_PACKET, codec_id};

/// How one page is encoded in the payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PageKind {
    /// All bytes zero; no payload.
    Zero = 0,
    /// The page as it is; `PAGE_SIZE` payload bytes.
    Raw = 1,
    /// Compressed with the packet's codec; fewer than `PAGE_SIZE` bytes.
    Compressed = 2,
    /// The same bytes as another page the destination holds; the payload is
    /// a [`PageRef`] naming it.
    Duplicate = 3,
    /// A delta against the page's previous version, which the destination
    /// holds: a DSA delta record ([`DELTA_ENTRY_LEN`]-byte entries), shorter
    /// than a page.
    Delta = 4,
}

/// Bytes of one delta record entry: the 8-byte word's index in the page
/// (`u16`) and its new value (8 bytes), as Intel DSA's create-delta-record
/// operation writes them.
pub const DELTA_ENTRY_LEN: u32 = 10;

/// The page a duplicate entry copies: its region and page index. The
/// destination checks both before reading a byte of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageRef {
    /// Region id, as in the session setup.
    pub region_id: u32,
    /// Page index within that region.
    pub page_index: u32,
}

impl PageRef {
    /// Encoded size: region id, page index.
    pub const ENCODED_LEN: usize = 8;

    /// The payload bytes of a duplicate entry.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[..4].copy_from_slice(&self.region_id.to_le_bytes());
        out[4..].copy_from_slice(&self.page_index.to_le_bytes());
        out
    }

    /// Reads a duplicate entry's payload; the region and page still need to
    /// be checked against the session (the receiver does, with what it
    /// holds).
    pub fn decode(bytes: &[u8; Self::ENCODED_LEN]) -> Self {
        let [a, b, c, d, e, f, g, h] = *bytes;
        Self {
            region_id: u32::from_le_bytes([a, b, c, d]),
            page_index: u32::from_le_bytes([e, f, g, h]),
        }
    }
}

/// One page-table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageEntry {
    /// Page index within the packet's region.
    pub page_index: u32,
    /// Encoding.
    pub kind: PageKind,
    /// Payload bytes for this page.
    pub encoded_len: u32,
}

impl PageEntry {
    /// Encoded size: index, length, kind, three reserved bytes.
    pub const ENCODED_LEN: usize = 12;

    fn encode(&self, w: &mut Writer<'_>) {
        w.u32(self.page_index)
            .u32(self.encoded_len)
            .u8(self.kind as u8)
            .zeros(3);
    }
}

/// The fixed part of a page packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagesHeader {
    /// Region the pages belong to.
    pub region_id: u32,
    /// Dirty iteration the pages belong to.
    pub iteration: u32,
    /// Number of table entries, 1..=[`MAX_PAGES_PER_PACKET`].
    pub page_count: u16,
    /// Codec of the packet's compressed pages (0 when it has none); one the
    /// session announced.
    pub codec: u8,
    /// The dictionary the packet's compressed pages were made with: 0 for
    /// none, else one of the session's [`crate::Dictionary`] ids (only
    /// with a codec that takes one, [`codec_id::takes_dictionary`]). With
    /// [`codec_id::ZSTD_STREAM`], the stream's restart flag (0 or
    /// [`codec_id::STREAM_RESTART`]).
    pub dictionary: u8,
}

impl PagesHeader {
    /// The dictionary the packet names: 0 for none, and for a codec that
    /// takes none (whose byte means something else, or nothing).
    pub fn named_dictionary(&self) -> u8 {
        codec_id::named_dictionary(self.codec, self.dictionary)
    }

    /// Whether the packet's bytes begin a new channel stream
    /// ([`codec_id::ZSTD_STREAM`] with [`codec_id::STREAM_RESTART`]).
    pub fn restarts_stream(&self) -> bool {
        codec_id::restarts_stream(self.codec, self.dictionary)
    }

    /// Encoded size: region, iteration, count, codec, dictionary.
    pub const ENCODED_LEN: usize = 12;

    /// Bytes of the page table that follows this header.
    pub fn table_len(&self) -> usize {
        usize::from(self.page_count) * PageEntry::ENCODED_LEN
    }

    /// Decodes the header of a page frame whose body is `body_len` bytes,
    /// checking it against the session: the region exists, the page count is
    /// allowed, and the table fits in the body. Returns the header and the
    /// payload length.
    pub fn decode(
        bytes: &[u8; Self::ENCODED_LEN],
        body_len: usize,
        setup: &SessionSetup,
    ) -> Result<(Self, usize), WireError> {
        let mut r = Reader::new(bytes, "pages header");
        let region_id = r.u32()?;
        let iteration = r.u32()?;
        let page_count = r.u16()?;
        let codec = r.u8()?;
        let dictionary = r.u8()?;
        if codec != 0 && (codec > 7 || setup.codecs & (1 << codec) == 0) {
            return Err(WireError::InvalidField {
                field: "packet codec",
                detail: format!("codec {codec} was not announced in the session setup"),
            });
        }
        if dictionary != 0
            && !codec_id::restarts_stream(codec, dictionary)
            && (!codec_id::takes_dictionary(codec) || dictionary > setup.dictionaries)
        {
            return Err(WireError::InvalidField {
                field: "packet dictionary",
                detail: format!(
                    "dictionary {dictionary} with codec {codec}: the session has {} \
                     dictionaries, for zstd only",
                    setup.dictionaries
                ),
            });
        }
        if page_count == 0 || usize::from(page_count) > MAX_PAGES_PER_PACKET {
            return Err(WireError::InvalidField {
                field: "page count",
                detail: format!("{page_count} (must be 1..={MAX_PAGES_PER_PACKET})"),
            });
        }
        if setup.region(region_id).is_none() {
            return Err(WireError::UnknownRegion(region_id));
        }
        let header = Self {
            region_id,
            iteration,
            page_count,
            codec,
            dictionary,
        };
        let prefix = Self::ENCODED_LEN + header.table_len();
        let Some(payload_len) = body_len.checked_sub(prefix) else {
            return Err(WireError::Truncated("page table"));
        };
        Ok((header, payload_len))
    }
}

/// Decodes and validates a page table into `entries` (cleared first): every
/// page inside the region, every length consistent with its kind and the
/// packet's codec, and the lengths adding up to `payload_len`.
pub fn decode_page_table(
    header: &PagesHeader,
    table: &[u8],
    payload_len: usize,
    setup: &SessionSetup,
    entries: &mut Vec<PageEntry>,
) -> Result<(), WireError> {
    entries.clear();
    let region = setup
        .region(header.region_id)
        .ok_or(WireError::UnknownRegion(header.region_id))?;
    let region_pages = region.pages();
    let page_size = setup.page_size;
    let mut r = Reader::new(table, "page table");
    let mut expected = 0usize;
    let packet_frame = codec_id::one_frame_per_packet(header.codec);
    let mut frame_seen = false;
    for _ in 0..header.page_count {
        let page_index = r.u32()?;
        let encoded_len = r.u32()?;
        let kind = r.u8()?;
        r.reserved(3)?;
        if u64::from(page_index) >= region_pages {
            return Err(WireError::PageOutOfRange {
                region: header.region_id,
                page: page_index,
                pages: region_pages,
            });
        }
        let kind = match kind {
            0 if encoded_len == 0 => PageKind::Zero,
            1 if encoded_len == page_size => PageKind::Raw,
            // In a packet frame only the first compressed entry has bytes.
            2 if packet_frame && (encoded_len > 0) != frame_seen => {
                frame_seen = true;
                PageKind::Compressed
            }
            2 if !packet_frame
                && header.codec != 0
                && encoded_len > 0
                && encoded_len < page_size =>
            {
                PageKind::Compressed
            }
            3 if encoded_len as usize == PageRef::ENCODED_LEN => PageKind::Duplicate,
            4 if encoded_len > 0
                && encoded_len < page_size
                && encoded_len % DELTA_ENTRY_LEN == 0 =>
            {
                PageKind::Delta
            }
            _ => {
                return Err(WireError::InvalidField {
                    field: "page entry",
                    detail: format!(
                        "page {page_index}: kind {kind} with {encoded_len} bytes is not allowed"
                    ),
                });
            }
        };
        expected += encoded_len as usize;
        entries.push(PageEntry {
            page_index,
            kind,
            encoded_len,
        });
    }
    r.finish()?;
    if packet_frame {
        check_packet_frame(entries, page_size)?;
    }
    if expected != payload_len {
        return Err(WireError::PayloadMismatch {
            expected,
            actual: payload_len,
        });
    }
    Ok(())
}

/// A packet frame must shrink: fewer bytes than the pages it decodes to.
/// A packet of the codec may have no compressed page at all (every page
/// raw or zero), and then no frame.
fn check_packet_frame(entries: &[PageEntry], page_size: u32) -> Result<(), WireError> {
    let compressed = entries
        .iter()
        .filter(|entry| entry.kind == PageKind::Compressed);
    let pages = compressed.clone().count() as u64;
    let frame: u64 = compressed.map(|entry| u64::from(entry.encoded_len)).sum();
    if pages > 0 && frame >= pages * u64::from(page_size) {
        return Err(WireError::InvalidField {
            field: "packet frame",
            detail: format!("{frame} bytes for {pages} pages does not shrink"),
        });
    }
    Ok(())
}

/// Appends a page frame's header, pages header and page table to `out`;
/// the caller sends the payload after it. Entries beyond
/// [`MAX_PAGES_PER_PACKET`] are a caller bug and are rejected by the peer.
pub fn encode_pages_prefix(
    out: &mut Vec<u8>,
    region_id: u32,
    iteration: u32,
    codec: u8,
    entries: &[PageEntry],
) {
    let header = PagesHeader {
        region_id,
        iteration,
        page_count: u16::try_from(entries.len()).unwrap_or(u16::MAX),
        codec,
        dictionary: 0,
    };
    encode_packet_prefix(out, &header, entries);
}

/// As [`encode_pages_prefix`], with every field of the pages header given
/// (its page count is taken from `entries`).
pub fn encode_packet_prefix(out: &mut Vec<u8>, header: &PagesHeader, entries: &[PageEntry]) {
    let payload: usize = entries.iter().map(|entry| entry.encoded_len as usize).sum();
    let body_len = PagesHeader::ENCODED_LEN + entries.len() * PageEntry::ENCODED_LEN + payload;
    let frame = FrameHeader {
        kind: FrameKind::Pages,
        body_len: u32::try_from(body_len).unwrap_or(u32::MAX),
    };
    out.reserve(FRAME_HEADER_LEN + PagesHeader::ENCODED_LEN + entries.len() * 12);
    out.extend_from_slice(&frame.encode());
    let mut w = Writer::new(out);
    w.u32(header.region_id)
        .u32(header.iteration)
        .u16(u16::try_from(entries.len()).unwrap_or(u16::MAX))
        .u8(header.codec)
        .u8(header.dictionary);
    for entry in entries {
        entry.encode(&mut w);
    }
}
