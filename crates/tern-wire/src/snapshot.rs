//! The snapshot file format: a guest's memory at fixed offsets, its device
//! state and the hashes that prove both (docs/snapshot-format.md).
//!
//! Like QEMU's mapped-ram, every page of every region has a *slot* at a
//! fixed offset, so parallel writers `pwritev` without coordinating and a
//! live save overwrites a re-dirtied page in place: the file never grows
//! past memory plus metadata. Zero pages are holes, recorded as absent in a
//! per-region bitmap. The layout is a pure function of the regions
//! ([`plan_layout`]), and the parser recomputes it rather than trusting
//! the offsets written in the file.
//!
//! ```text
//! 0              metadata block: header (128 B), region table (32 B each),
//!                per region: present bitmap (u64 words), chunk hashes (u64)
//! aligned 1 MiB  region 0's page slots, region 1's, ... (each aligned)
//! data_end       trailer: device state sections, recorded working set
//! ```
//!
//! Sans-I/O: this module reads and writes byte slices only. The engine
//! reads the fixed header first ([`SnapshotHeader::decode`]), which bounds
//! the metadata block it may then read; the metadata bounds the trailer.
//! Nothing here allocates more than the bytes it was given.

use xxhash_rust::xxh3::xxh3_64;

use crate::{
    MAX_NAME_LEN, MAX_REGION_BYTES, MAX_REGIONS, MAX_SECTION_BYTES, PAGE_SIZE, Reader, Writer,
};

/// First bytes of a snapshot file.
pub const SNAPSHOT_MAGIC: [u8; 8] = *b"TERNSNAP";
/// First bytes of a working-set file ([`WorkingSet::encode_file`]).
pub const WORKING_SET_MAGIC: [u8; 8] = *b"TERNWSET";
/// The snapshot format version this build reads and writes.
pub const SNAPSHOT_VERSION: u16 = 1;
/// Length of the fixed header at offset 0.
pub const SNAPSHOT_HEADER_LEN: usize = HEADER_LEN_U16 as usize;
const HEADER_LEN_U16: u16 = 128;
/// Length of one region-table entry.
pub const REGION_ENTRY_LEN: usize = 32;
/// Page slots of each region start at a multiple of this (1 MiB, as QEMU's
/// mapped-ram): aligned for `O_DIRECT` on any device, and for huge pages.
pub const SLOT_ALIGN: u64 = 1 << 20;
/// Pages per chunk hash: the unit a lazy restore fetches and verifies.
pub const CHUNK_PAGES: u64 = CHUNK_PAGES_U32 as u64;
const CHUNK_PAGES_U32: u32 = 16;
/// Largest metadata block accepted (bitmaps and chunk hashes of a 4 TiB
/// guest fit; a header claiming more is refused before anything is read).
pub const MAX_METADATA_BYTES: u64 = 1 << 30;
/// Largest trailer accepted: every section at its limit is not a real VM.
pub const MAX_TRAILER_BYTES: u64 = 256 << 20;
/// Most state sections in a trailer.
pub const MAX_SECTIONS: usize = 4096;
/// Byte offset of the metadata hash inside the header (zeroed while hashing).
const METADATA_HASH_AT: usize = 80;
/// Header flag: a diff snapshot, holding only what changed since a base
/// snapshot named by its memory digest.
pub const FLAG_DIFF: u64 = 1;

const PAGE: u64 = PAGE_SIZE as u64;

/// Why a snapshot file was refused. Each message is one line naming what
/// is wrong with the file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// Not a tern snapshot at all.
    #[error("not a tern snapshot (bad magic)")]
    BadMagic,
    /// Written by another format version.
    #[error(
        "snapshot format version {0} is not supported (this build reads version {SNAPSHOT_VERSION})"
    )]
    Version(u16),
    /// The save never finished (crash, full disk): the file is unusable.
    #[error("the snapshot is incomplete: its save did not finish")]
    Incomplete,
    /// A field holds a value the format does not allow.
    #[error("invalid snapshot {field}: {detail}")]
    Invalid {
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        detail: String,
    },
    /// The metadata block does not hash to the value in the header.
    #[error("the snapshot's metadata is corrupted (checksum mismatch)")]
    MetadataChecksum,
    /// The trailer does not hash to the value in the header.
    #[error("the snapshot's device state is corrupted (checksum mismatch)")]
    TrailerChecksum,
    /// The file is shorter than its header says.
    #[error("the snapshot is truncated: the header needs {needed} bytes, the file holds {actual}")]
    Truncated {
        /// Bytes the metadata describes.
        needed: u64,
        /// Bytes the file holds.
        actual: u64,
    },
    /// A structure ended early or had bytes left over.
    #[error("malformed snapshot: {0}")]
    Malformed(#[from] crate::WireError),
}

/// A length or index as `usize`; values that do not fit (32-bit hosts)
/// become `usize::MAX`, which every bounds check then refuses.
fn to_usize(value: u64) -> usize {
    usize::try_from(value).unwrap_or(usize::MAX)
}

fn invalid(field: &'static str, detail: impl Into<String>) -> SnapshotError {
    SnapshotError::Invalid {
        field,
        detail: detail.into(),
    }
}

/// Whether the save that wrote a file finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SnapshotState {
    /// Written first, before any page: the file is being (or failed being)
    /// written.
    Incomplete,
    /// Written last, after every page, the trailer and an fsync.
    Complete,
}

impl SnapshotState {
    fn code(self) -> u32 {
        match self {
            Self::Incomplete => 0,
            Self::Complete => 1,
        }
    }
}

/// One region of guest memory in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotRegion {
    /// The VMM's id of the region.
    pub id: u32,
    /// Guest-physical address of its first byte.
    pub guest_addr: u64,
    /// Length in bytes, a multiple of the page size.
    pub len: u64,
    /// File offset of page 0's slot (page `n` is at `slots_offset + n * 4096`).
    pub slots_offset: u64,
}

impl SnapshotRegion {
    /// Pages in the region.
    pub fn pages(&self) -> u64 {
        self.len / PAGE
    }

    /// Chunks in the region (the last may be short).
    pub fn chunks(&self) -> u64 {
        self.pages().div_ceil(CHUNK_PAGES)
    }

    /// File offset of page `page`'s slot, if the page is in the region.
    pub fn slot_offset(&self, page: u64) -> Option<u64> {
        (page < self.pages()).then(|| self.slots_offset + page * PAGE)
    }

    fn bitmap_words(&self) -> u64 {
        self.pages().div_ceil(64)
    }
}

/// Where everything goes in a file for a set of regions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The regions with their slot offsets.
    pub regions: Vec<SnapshotRegion>,
    /// Length of the metadata block at offset 0.
    pub metadata_len: u64,
    /// End of the last region's slots: where the trailer starts.
    pub data_end: u64,
    /// A diff snapshot's layout: each region also has a changed bitmap.
    pub diff: bool,
}

/// Places `regions` (id, guest address, length) in a file: the metadata
/// block first, then each region's slots at the next [`SLOT_ALIGN`]
/// boundary. Both the writer and the parser call this, so offsets in a
/// file are checked against it, never trusted.
pub fn plan_layout(regions: &[(u32, u64, u64)]) -> Result<Layout, SnapshotError> {
    plan(regions, false)
}

/// [`plan_layout`] for a diff snapshot: the metadata block also holds a
/// changed bitmap per region (the pages the diff defines).
pub fn plan_diff_layout(regions: &[(u32, u64, u64)]) -> Result<Layout, SnapshotError> {
    plan(regions, true)
}

fn plan(regions: &[(u32, u64, u64)], diff: bool) -> Result<Layout, SnapshotError> {
    if regions.is_empty() || regions.len() > MAX_REGIONS {
        return Err(invalid(
            "region count",
            format!("{} (1 to {MAX_REGIONS} allowed)", regions.len()),
        ));
    }
    let mut metadata_len = (SNAPSHOT_HEADER_LEN + REGION_ENTRY_LEN * regions.len()) as u64;
    for (index, &(id, _, len)) in regions.iter().enumerate() {
        if len == 0 || len % PAGE != 0 || len > MAX_REGION_BYTES {
            return Err(invalid(
                "region length",
                format!(
                    "region {index} (id {id}) is {len} bytes: not a non-zero multiple of {PAGE} up to {MAX_REGION_BYTES}"
                ),
            ));
        }
        if regions[..index].iter().any(|&(other, _, _)| other == id) {
            return Err(invalid("region id", format!("{id} appears twice")));
        }
        let pages = len / PAGE;
        let bitmaps = if diff { 2 } else { 1 };
        metadata_len += 8 * (bitmaps * pages.div_ceil(64) + pages.div_ceil(CHUNK_PAGES));
    }
    if metadata_len > MAX_METADATA_BYTES {
        return Err(invalid(
            "metadata length",
            format!("{metadata_len} bytes (at most {MAX_METADATA_BYTES})"),
        ));
    }
    let mut offset = metadata_len.next_multiple_of(SLOT_ALIGN);
    let mut planned = Vec::with_capacity(regions.len());
    for &(id, guest_addr, len) in regions {
        planned.push(SnapshotRegion {
            id,
            guest_addr,
            len,
            slots_offset: offset,
        });
        // Cannot overflow: at most 1024 regions of at most 2^44 bytes.
        offset = (offset + len).next_multiple_of(SLOT_ALIGN);
    }
    let data_end = planned
        .last()
        .map_or(offset, |last| last.slots_offset + last.len);
    Ok(Layout {
        regions: planned,
        metadata_len,
        data_end,
        diff,
    })
}

/// The fixed header at offset 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotHeader {
    /// Whether the save finished.
    pub state: SnapshotState,
    /// Regions in the region table.
    pub region_count: u32,
    /// Length of the metadata block (header included).
    pub metadata_len: u64,
    /// Where the trailer starts.
    pub data_end: u64,
    /// Length of the trailer.
    pub trailer_len: u64,
    /// XXH3-64 of the trailer.
    pub trailer_hash: u64,
    /// The memory digest (tern's XXH3-128 over region ids and page hashes).
    pub digest: u128,
    /// XXH3-64 of the metadata block with this field zeroed.
    pub metadata_hash: u64,
    /// A diff snapshot: the memory digest of its base (any snapshot whose
    /// memory has this digest). `None`: a full snapshot.
    pub base_digest: Option<u128>,
}

impl SnapshotHeader {
    /// Decodes and checks the fixed header: the first
    /// [`SNAPSHOT_HEADER_LEN`] bytes of a file. An incomplete file is
    /// refused here, before its metadata is read.
    pub fn decode(bytes: &[u8]) -> Result<Self, SnapshotError> {
        let head = bytes
            .get(..SNAPSHOT_HEADER_LEN)
            .ok_or(crate::WireError::Truncated("snapshot header"))?;
        let mut reader = Reader::new(head, "snapshot header");
        if reader.array::<8>()? != SNAPSHOT_MAGIC {
            return Err(SnapshotError::BadMagic);
        }
        let version = reader.u16()?;
        if version != SNAPSHOT_VERSION {
            return Err(SnapshotError::Version(version));
        }
        let header_len = reader.u16()?;
        if usize::from(header_len) != SNAPSHOT_HEADER_LEN {
            return Err(invalid("header length", header_len.to_string()));
        }
        let page_size = reader.u32()?;
        if page_size != PAGE_SIZE {
            return Err(invalid(
                "page size",
                format!("{page_size} (only {PAGE_SIZE} is supported)"),
            ));
        }
        let state = match reader.u32()? {
            0 => return Err(SnapshotError::Incomplete),
            1 => SnapshotState::Complete,
            other => return Err(invalid("state", other.to_string())),
        };
        let region_count = reader.u32()?;
        let chunk_pages = reader.u32()?;
        let align_log2 = reader.u32()?;
        if u64::from(chunk_pages) != CHUNK_PAGES || align_log2 != SLOT_ALIGN.trailing_zeros() {
            return Err(invalid(
                "chunk or alignment",
                format!("{chunk_pages} pages per chunk, 2^{align_log2} alignment"),
            ));
        }
        let mut header = Self {
            state,
            region_count,
            metadata_len: reader.u64()?,
            data_end: reader.u64()?,
            trailer_len: reader.u64()?,
            trailer_hash: reader.u64()?,
            digest: reader.u128()?,
            metadata_hash: reader.u64()?,
            base_digest: None,
        };
        let flags = reader.u64()?;
        if flags & !FLAG_DIFF != 0 {
            return Err(invalid("flags", format!("unknown flags set ({flags:#x})")));
        }
        if flags & FLAG_DIFF != 0 {
            header.base_digest = Some(reader.u128()?);
            reader.reserved(16)?;
        } else {
            reader.reserved(32)?;
        }
        header.check_bounds()?;
        Ok(header)
    }

    fn check_bounds(&self) -> Result<(), SnapshotError> {
        let smallest = (SNAPSHOT_HEADER_LEN + REGION_ENTRY_LEN) as u64;
        if self.region_count == 0 || self.region_count as usize > MAX_REGIONS {
            return Err(invalid("region count", self.region_count.to_string()));
        }
        if self.metadata_len < smallest || self.metadata_len > MAX_METADATA_BYTES {
            return Err(invalid("metadata length", self.metadata_len.to_string()));
        }
        if self.trailer_len > MAX_TRAILER_BYTES {
            return Err(invalid("trailer length", self.trailer_len.to_string()));
        }
        Ok(())
    }

    /// Bytes the file must hold: the metadata, every slot and the trailer.
    pub fn file_len(&self) -> u64 {
        self.data_end.saturating_add(self.trailer_len)
    }

    /// Refuses a file shorter than the header says (`actual` is its length).
    pub fn check_file_len(&self, actual: u64) -> Result<(), SnapshotError> {
        let needed = self.file_len().max(self.metadata_len);
        if actual < needed {
            return Err(SnapshotError::Truncated { needed, actual });
        }
        Ok(())
    }

    fn encode(&self, out: &mut Vec<u8>) {
        let mut writer = Writer::new(out);
        writer
            .bytes(&SNAPSHOT_MAGIC)
            .u16(SNAPSHOT_VERSION)
            .u16(HEADER_LEN_U16)
            .u32(PAGE_SIZE)
            .u32(self.state.code())
            .u32(self.region_count)
            .u32(CHUNK_PAGES_U32)
            .u32(SLOT_ALIGN.trailing_zeros())
            .u64(self.metadata_len)
            .u64(self.data_end)
            .u64(self.trailer_len)
            .u64(self.trailer_hash)
            .u128(self.digest)
            .u64(self.metadata_hash);
        match self.base_digest {
            Some(base) => writer.u64(FLAG_DIFF).u128(base).zeros(16),
            None => writer.u64(0).zeros(32),
        };
    }
}

/// Everything in the metadata block: the header, the regions, which pages
/// are present (not holes) and the chunk hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotMetadata {
    /// The fixed header.
    pub header: SnapshotHeader,
    /// The regions, in the VMM's order.
    pub regions: Vec<SnapshotRegion>,
    /// Per region, one bit per page (bit `n % 64` of word `n / 64`): set
    /// when the page's slot holds data, clear for a zero page (a hole).
    pub present: Vec<Vec<u64>>,
    /// A diff snapshot's pages it defines, per region, bit by bit as
    /// `present`: a page not changed is its base's. Empty for a full
    /// snapshot, which defines every page.
    pub changed: Vec<Vec<u64>>,
    /// Per region, one [`chunk_hash`] per [`CHUNK_PAGES`] pages.
    pub chunk_hashes: Vec<Vec<u64>>,
}

impl SnapshotMetadata {
    /// An empty metadata block for `layout`: no page present, hashes zero,
    /// state incomplete.
    pub fn new(layout: &Layout) -> Self {
        Self {
            header: SnapshotHeader {
                state: SnapshotState::Incomplete,
                region_count: u32::try_from(layout.regions.len()).unwrap_or(u32::MAX),
                metadata_len: layout.metadata_len,
                data_end: layout.data_end,
                trailer_len: 0,
                trailer_hash: 0,
                digest: 0,
                metadata_hash: 0,
                base_digest: layout.diff.then_some(0),
            },
            regions: layout.regions.clone(),
            present: layout
                .regions
                .iter()
                .map(|region| vec![0; to_usize(region.bitmap_words())])
                .collect(),
            changed: layout
                .regions
                .iter()
                .map(|region| {
                    let words = if layout.diff {
                        region.bitmap_words()
                    } else {
                        0
                    };
                    vec![0; to_usize(words)]
                })
                .collect(),
            chunk_hashes: layout
                .regions
                .iter()
                .map(|region| vec![0; to_usize(region.chunks())])
                .collect(),
        }
    }

    /// Whether page `page` of region `region` (an index) has data in its slot.
    pub fn is_present(&self, region: usize, page: u64) -> bool {
        self.present
            .get(region)
            .and_then(|words| words.get(to_usize(page / 64)))
            .is_some_and(|word| word & (1 << (page % 64)) != 0)
    }

    /// Whether this file defines page `page` of region `region`: always
    /// for a full snapshot; for a diff, when the page changed since the
    /// base (otherwise the base's page is the page).
    pub fn is_changed(&self, region: usize, page: u64) -> bool {
        if !self.is_diff() {
            return true;
        }
        self.changed
            .get(region)
            .and_then(|words| words.get(to_usize(page / 64)))
            .is_some_and(|word| word & (1 << (page % 64)) != 0)
    }

    /// Whether this is a diff snapshot.
    pub fn is_diff(&self) -> bool {
        self.header.base_digest.is_some()
    }

    /// The whole metadata block, its hash computed and written in.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(to_usize(self.header.metadata_len));
        self.header.encode(&mut out);
        let mut writer = Writer::new(&mut out);
        for region in &self.regions {
            writer
                .u32(region.id)
                .u32(0)
                .u64(region.guest_addr)
                .u64(region.len)
                .u64(region.slots_offset);
        }
        for ((present, changed), hashes) in self
            .present
            .iter()
            .zip(&self.changed)
            .zip(&self.chunk_hashes)
        {
            for &word in present.iter().chain(changed).chain(hashes) {
                writer.u64(word);
            }
        }
        let hash = xxh3_64(&out).to_le_bytes();
        out[METADATA_HASH_AT..METADATA_HASH_AT + 8].copy_from_slice(&hash);
        out
    }

    /// Decodes and checks a whole metadata block (`bytes` holds exactly
    /// the header's `metadata_len` bytes): checksum, a region table that
    /// matches [`plan_layout`], no bit set past a region's end.
    pub fn decode(bytes: &[u8]) -> Result<Self, SnapshotError> {
        let header = SnapshotHeader::decode(bytes)?;
        if bytes.len() as u64 != header.metadata_len {
            return Err(SnapshotError::Truncated {
                needed: header.metadata_len,
                actual: bytes.len() as u64,
            });
        }
        let mut zeroed = bytes.to_vec();
        zeroed[METADATA_HASH_AT..METADATA_HASH_AT + 8].fill(0);
        if xxh3_64(&zeroed) != header.metadata_hash {
            return Err(SnapshotError::MetadataChecksum);
        }
        let mut reader = Reader::new(&bytes[SNAPSHOT_HEADER_LEN..], "snapshot metadata");
        let mut table = Vec::with_capacity(header.region_count as usize);
        for _ in 0..header.region_count {
            let id = reader.u32()?;
            reader.reserved(4)?;
            let guest_addr = reader.u64()?;
            let len = reader.u64()?;
            let slots_offset = reader.u64()?;
            table.push(((id, guest_addr, len), slots_offset));
        }
        let planned: Vec<_> = table.iter().map(|&(region, _)| region).collect();
        let layout = plan(&planned, header.base_digest.is_some())?;
        if layout.metadata_len != header.metadata_len || layout.data_end != header.data_end {
            return Err(invalid("layout", "lengths do not match the region table"));
        }
        for (region, &(_, offset)) in layout.regions.iter().zip(&table) {
            if region.slots_offset != offset {
                return Err(invalid(
                    "slot offset",
                    format!(
                        "region {} at {offset}, expected {}",
                        region.id, region.slots_offset
                    ),
                ));
            }
        }
        let mut metadata = Self::new(&layout);
        metadata.header = header;
        for (index, region) in layout.regions.iter().enumerate() {
            for word in metadata.present[index].iter_mut() {
                *word = reader.u64()?;
            }
            for word in metadata.changed[index].iter_mut() {
                *word = reader.u64()?;
            }
            check_bitmaps(
                region,
                &metadata.present[index],
                layout.diff.then_some(&metadata.changed[index][..]),
            )?;
            for hash in metadata.chunk_hashes[index].iter_mut() {
                *hash = reader.u64()?;
            }
        }
        reader.finish()?;
        Ok(metadata)
    }

    /// Marks the file complete, with its digest and trailer.
    pub fn complete(&mut self, digest: u128, trailer: &[u8]) {
        self.header.state = SnapshotState::Complete;
        self.header.digest = digest;
        self.header.trailer_len = trailer.len() as u64;
        self.header.trailer_hash = xxh3_64(trailer);
    }
}

/// Refuses bits set past a region's last page, and in a diff, a page
/// present (data in its slot) that the diff does not define.
fn check_bitmaps(
    region: &SnapshotRegion,
    present: &[u64],
    changed: Option<&[u64]>,
) -> Result<(), SnapshotError> {
    let tail = region.pages() % 64;
    let past_end = |words: &[u64]| tail != 0 && words.last().is_some_and(|w| w >> tail != 0);
    if past_end(present) || changed.is_some_and(past_end) {
        return Err(invalid(
            "bitmap",
            format!("bits set past the end of region {}", region.id),
        ));
    }
    if let Some(changed) = changed
        && present.iter().zip(changed).any(|(p, c)| p & !c != 0)
    {
        return Err(invalid(
            "bitmap",
            format!(
                "region {} has pages with data that the diff does not define",
                region.id
            ),
        ));
    }
    Ok(())
}

/// XXH3-64 of one chunk: over the little-endian XXH3-64 hashes of its
/// pages (a hole's is the zero page's). Built from page hashes so that a
/// reader verifies a chunk and the memory digest from the same hashes.
pub fn chunk_hash(page_hashes: &[u64]) -> u64 {
    let bytes: Vec<u8> = page_hashes.iter().flat_map(|h| h.to_le_bytes()).collect();
    xxh3_64(&bytes)
}

/// One device or vCPU state section in the trailer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotSection {
    /// Unique name.
    pub name: String,
    /// Layout version of `data`.
    pub version: u32,
    /// The state.
    pub data: Vec<u8>,
}

/// Pages worth loading first on a lazy restore, in order: recorded at save
/// time or from an earlier restore's faults. Each entry is (region index,
/// page).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkingSet {
    /// The pages, most wanted first.
    pub pages: Vec<(u32, u32)>,
}

impl WorkingSet {
    fn encode_into(&self, writer: &mut Writer<'_>) {
        writer.u64(self.pages.len() as u64);
        for &(region, page) in &self.pages {
            writer.u32(region).u32(page);
        }
    }

    fn decode_from(reader: &mut Reader<'_>) -> Result<Self, SnapshotError> {
        let count = reader.u64()?;
        // Eight bytes per entry must be there: the count alone decides nothing.
        if count > (reader.remaining() / 8) as u64 {
            return Err(crate::WireError::Truncated("working set").into());
        }
        let pages = (0..count)
            .map(|_| Ok((reader.u32()?, reader.u32()?)))
            .collect::<Result<_, crate::WireError>>()?;
        Ok(Self { pages })
    }

    /// A standalone working-set file: magic, then the list.
    pub fn encode_file(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + 8 * self.pages.len());
        let mut writer = Writer::new(&mut out);
        writer.bytes(&WORKING_SET_MAGIC);
        self.encode_into(&mut writer);
        out
    }

    /// Decodes [`WorkingSet::encode_file`]'s output.
    pub fn decode_file(bytes: &[u8]) -> Result<Self, SnapshotError> {
        let mut reader = Reader::new(bytes, "working set");
        if reader.array::<8>()? != WORKING_SET_MAGIC {
            return Err(invalid(
                "working set",
                "not a tern working-set file (bad magic)",
            ));
        }
        let set = Self::decode_from(&mut reader)?;
        reader.finish()?;
        Ok(set)
    }

    /// Refuses entries outside `regions`.
    pub fn check(&self, regions: &[SnapshotRegion]) -> Result<(), SnapshotError> {
        for &(region, page) in &self.pages {
            let fits = regions
                .get(region as usize)
                .is_some_and(|r| u64::from(page) < r.pages());
            if !fits {
                return Err(invalid(
                    "working set",
                    format!("page {page} of region {region} is outside the guest"),
                ));
            }
        }
        Ok(())
    }
}

/// What follows the page slots: device state and a working set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trailer {
    /// The VMM's kind of guest (`DeviceState::guest_kind` in the engine):
    /// a restore into a guest of another kind is refused. Empty: unknown.
    pub guest_kind: String,
    /// The guest's state sections.
    pub sections: Vec<SnapshotSection>,
    /// Pages to prefetch first on a lazy restore.
    pub working_set: WorkingSet,
}

impl Trailer {
    /// The trailer's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let mut writer = Writer::new(&mut out);
        writer.bytes_u32(self.guest_kind.as_bytes());
        writer.u32(u32::try_from(self.sections.len()).unwrap_or(u32::MAX));
        for section in &self.sections {
            writer
                .bytes_u32(section.name.as_bytes())
                .u32(section.version)
                .bytes_u32(&section.data);
        }
        self.working_set.encode_into(&mut writer);
        out
    }

    /// Decodes a trailer read from the file, checking it against the
    /// header's hash and the regions.
    pub fn decode(
        bytes: &[u8],
        header: &SnapshotHeader,
        regions: &[SnapshotRegion],
    ) -> Result<Self, SnapshotError> {
        if bytes.len() as u64 != header.trailer_len {
            return Err(SnapshotError::Truncated {
                needed: header.trailer_len,
                actual: bytes.len() as u64,
            });
        }
        if xxh3_64(bytes) != header.trailer_hash {
            return Err(SnapshotError::TrailerChecksum);
        }
        let mut reader = Reader::new(bytes, "snapshot trailer");
        let guest_kind = reader.peer_text(crate::MAX_GUEST_KIND_LEN, "guest kind")?;
        let count = reader.u32()? as usize;
        if count > MAX_SECTIONS {
            return Err(invalid("section count", count.to_string()));
        }
        let mut sections: Vec<SnapshotSection> = Vec::new();
        for _ in 0..count {
            let name = reader.string(MAX_NAME_LEN, "section name")?;
            if sections.iter().any(|section| section.name == name) {
                return Err(invalid("section name", format!("{name:?} appears twice")));
            }
            let version = reader.u32()?;
            let data = reader
                .bytes_u32(MAX_SECTION_BYTES, "section data")?
                .to_vec();
            sections.push(SnapshotSection {
                name,
                version,
                data,
            });
        }
        let working_set = WorkingSet::decode_from(&mut reader)?;
        working_set.check(regions)?;
        reader.finish()?;
        Ok(Self {
            guest_kind,
            sections,
            working_set,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{
        CHUNK_PAGES, SLOT_ALIGN, SNAPSHOT_HEADER_LEN, SnapshotError, SnapshotHeader,
        SnapshotMetadata, SnapshotSection, Trailer, WorkingSet, plan_diff_layout, plan_layout,
    };

    /// A diff of two regions on the base with digest 0xba5e: pages 0 and 1
    /// of region 0 changed (page 1 to zeros), page 2 of region 1 changed.
    fn diff_sample() -> SnapshotMetadata {
        let layout = plan_diff_layout(&[(0, 0, 64 << 12), (7, 1 << 32, 3 << 12)]).unwrap();
        let mut metadata = SnapshotMetadata::new(&layout);
        metadata.header.base_digest = Some(0xba5e);
        metadata.changed[0][0] = 0b11;
        metadata.present[0][0] = 0b01;
        metadata.changed[1][0] = 0b100;
        metadata.present[1][0] = 0b100;
        metadata.complete(0xd1ff, &Trailer::default().encode());
        metadata
    }

    #[test]
    fn a_diff_round_trips_with_its_base_and_changed_pages() {
        let metadata = diff_sample();
        let bytes = metadata.encode();
        let full = plan_layout(&[(0, 0, 64 << 12), (7, 1 << 32, 3 << 12)]).unwrap();
        // One more bitmap word per region.
        assert_eq!(bytes.len() as u64, full.metadata_len + 2 * 8);
        let decoded = SnapshotMetadata::decode(&bytes).unwrap();
        assert_eq!(decoded.header.base_digest, Some(0xba5e));
        assert!(decoded.is_diff());
        assert!(decoded.is_changed(0, 1) && !decoded.is_present(0, 1));
        assert!(!decoded.is_changed(0, 2) && decoded.is_changed(1, 2));
        for at in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[at] ^= 0x40;
            assert!(SnapshotMetadata::decode(&bad).is_err(), "byte {at}");
        }
        // A full snapshot defines every page.
        let (full, _) = sample();
        assert!(!full.is_diff() && full.is_changed(0, 5));
    }

    #[test]
    fn a_diff_with_data_for_a_page_it_does_not_define_is_refused() {
        let mut metadata = diff_sample();
        metadata.present[0][0] = 0b101;
        let error = SnapshotMetadata::decode(&metadata.encode()).unwrap_err();
        assert!(error.to_string().contains("does not define"), "{error}");
        let mut metadata = diff_sample();
        metadata.changed[1][0] = 0b1100;
        let error = SnapshotMetadata::decode(&metadata.encode()).unwrap_err();
        assert!(error.to_string().contains("past the end"), "{error}");
    }

    #[test]
    fn unknown_flags_are_refused() {
        let mut bytes = diff_sample().encode();
        bytes[88] |= 2;
        let error = SnapshotHeader::decode(&bytes).unwrap_err();
        assert!(error.to_string().contains("unknown flags"), "{error}");
    }

    fn sample() -> (SnapshotMetadata, Vec<u8>) {
        let layout = plan_layout(&[(0, 0, 64 << 12), (7, 1 << 32, 3 << 12)]).unwrap();
        let mut metadata = SnapshotMetadata::new(&layout);
        metadata.present[0][0] = 0b1011;
        metadata.present[1][0] = 0b101;
        metadata.chunk_hashes[0][2] = 42;
        let trailer = Trailer {
            guest_kind: "synthetic".into(),
            sections: vec![SnapshotSection {
                name: "vcpu0".into(),
                version: 3,
                data: vec![1, 2, 3],
            }],
            working_set: WorkingSet {
                pages: vec![(1, 2), (0, 63)],
            },
        }
        .encode();
        metadata.complete(0xfeed, &trailer);
        (metadata, trailer)
    }

    #[test]
    fn layout_aligns_every_region_and_counts_metadata() {
        let layout = plan_layout(&[(0, 0, 64 << 12), (7, 1 << 32, 3 << 12)]).unwrap();
        assert_eq!(
            layout.metadata_len,
            (SNAPSHOT_HEADER_LEN + 64) as u64 + 8 * (1 + 4) + 8 * (1 + 1)
        );
        assert_eq!(layout.regions[0].slots_offset, SLOT_ALIGN);
        assert_eq!(layout.regions[1].slots_offset, 2 * SLOT_ALIGN);
        assert_eq!(layout.data_end, 2 * SLOT_ALIGN + (3 << 12));
        assert_eq!(layout.regions[0].chunks(), 64 / CHUNK_PAGES);
    }

    #[test]
    fn metadata_and_trailer_round_trip() {
        let (metadata, trailer) = sample();
        let bytes = metadata.encode();
        let decoded = SnapshotMetadata::decode(&bytes).unwrap();
        let mut expected = metadata.clone();
        expected.header.metadata_hash = decoded.header.metadata_hash;
        assert_eq!(decoded, expected);
        assert!(decoded.is_present(0, 3) && !decoded.is_present(0, 2) && !decoded.is_present(1, 1));
        let parsed = Trailer::decode(&trailer, &decoded.header, &decoded.regions).unwrap();
        assert_eq!(parsed.sections[0].name, "vcpu0");
        assert_eq!(parsed.working_set.pages, [(1, 2), (0, 63)]);
    }

    #[test]
    fn every_flipped_metadata_byte_is_refused() {
        let (metadata, _) = sample();
        let bytes = metadata.encode();
        for at in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[at] ^= 0x40;
            assert!(SnapshotMetadata::decode(&bad).is_err(), "byte {at}");
        }
    }

    #[test]
    fn incomplete_foreign_and_short_files_are_refused_with_their_reason() {
        let (mut metadata, trailer) = sample();
        metadata.header.state = super::SnapshotState::Incomplete;
        assert_eq!(
            SnapshotHeader::decode(&metadata.encode()),
            Err(SnapshotError::Incomplete)
        );
        assert_eq!(
            SnapshotHeader::decode(&[0x7f; 200]),
            Err(SnapshotError::BadMagic)
        );
        let (metadata, _) = sample();
        let header = SnapshotHeader::decode(&metadata.encode()).unwrap();
        let full = header.file_len();
        assert_eq!(full, metadata.header.data_end + trailer.len() as u64);
        assert!(header.check_file_len(full).is_ok());
        assert!(matches!(
            header.check_file_len(full - 1),
            Err(SnapshotError::Truncated { .. })
        ));
        let mut changed = trailer.clone();
        changed[5] ^= 1;
        assert_eq!(
            Trailer::decode(&changed, &header, &metadata.regions),
            Err(SnapshotError::TrailerChecksum)
        );
    }

    #[test]
    fn a_working_set_outside_the_guest_is_refused() {
        let (metadata, _) = sample();
        let set = WorkingSet {
            pages: vec![(1, 3)],
        };
        assert!(set.check(&metadata.regions).is_err());
        let file = WorkingSet {
            pages: vec![(0, 1)],
        }
        .encode_file();
        assert_eq!(WorkingSet::decode_file(&file).unwrap().pages, [(0, 1)]);
        assert!(WorkingSet::decode_file(&file[..file.len() - 1]).is_err());
    }

    #[test]
    fn regions_that_do_not_fit_the_format_are_refused() {
        assert!(plan_layout(&[]).is_err());
        assert!(plan_layout(&[(0, 0, 4097)]).is_err());
        assert!(plan_layout(&[(1, 0, 4096), (1, 8192, 4096)]).is_err());
    }
}
