//! The memory hand-over (same-host migration): the source passes its guest
//! memory's files (memfd, hugetlbfs, tmpfs) as descriptors on the main Unix
//! channel instead of copying pages (docs/protocol.md, "Memory hand-over").
//!
//! One [`MemoryHandover`] frame names, for each descriptor attached to it
//! (`SCM_RIGHTS`, in the same order), the region it backs and where in the
//! file the region starts. This file only checks the frame's own rules;
//! whether the regions are the hello's and whether each descriptor is a
//! file large enough is the engine's check (it holds the descriptors).

use crate::codec::{Reader, Writer};
use crate::error::WireError;
use crate::{FrameKind, MAX_REGION_BYTES, PAGE_SIZE};

/// Most descriptors one hand-over carries: Linux passes at most 253
/// (`SCM_MAX_FD`) in one message, so a guest with more regions than this
/// cannot be handed over.
pub const MAX_HANDOVER_FILES: usize = 253;

/// Layout of the hand-over body this implementation writes and reads.
pub const HANDOVER_FORMAT: u8 = 1;

/// One region's backing file, as the hand-over names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandedRegion {
    /// The region's id, as in the hello.
    pub region_id: u32,
    /// Where the region starts in its file; a multiple of the page size.
    pub offset: u64,
    /// The region's length, as in the hello.
    pub len: u64,
}

impl HandedRegion {
    /// Encoded size: region id, reserved, offset, length.
    pub const ENCODED_LEN: usize = 24;
}

/// Which pages the switch-over digest of a hand-over covers: both sides
/// hash the same pages of the same files, so the digest checks that the
/// destination mapped each file at its region, not a transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum HandoverCoverage {
    /// Up to [`HANDOVER_SAMPLE_PAGES`] pages per region, evenly spread,
    /// the first and last among them.
    Sampled = 0,
    /// Every page.
    All = 1,
}

/// Pages per region a [`HandoverCoverage::Sampled`] digest reads.
pub const HANDOVER_SAMPLE_PAGES: u64 = 1024;

/// The source's memory, handed over as files: one entry per descriptor
/// attached to the frame, in order. The destination, once it has mapped
/// them, sends the same frame back (without descriptors) after its welcome.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryHandover {
    /// Which pages the switch-over digest covers.
    pub coverage: HandoverCoverage,
    /// The regions, one per descriptor.
    pub regions: Vec<HandedRegion>,
}

impl MemoryHandover {
    /// Body bytes before the entries: format, reserved, count.
    pub const HEADER_LEN: usize = 8;
    /// Largest body.
    pub const MAX_BODY: usize = Self::HEADER_LEN + MAX_HANDOVER_FILES * HandedRegion::ENCODED_LEN;
}

pub(crate) const fn max_body(kind: FrameKind) -> Option<usize> {
    match kind {
        FrameKind::MemoryHandover => Some(MemoryHandover::MAX_BODY),
        _ => None,
    }
}

pub(crate) fn encode(handover: &MemoryHandover, w: &mut Writer<'_>) {
    let count = handover.regions.len().min(MAX_HANDOVER_FILES);
    w.u8(HANDOVER_FORMAT)
        .u8(handover.coverage as u8)
        .zeros(2)
        .u32(u32::try_from(count).unwrap_or(0));
    for region in &handover.regions[..count] {
        w.u32(region.region_id)
            .zeros(4)
            .u64(region.offset)
            .u64(region.len);
    }
}

pub(crate) fn decode(r: &mut Reader<'_>) -> Result<MemoryHandover, WireError> {
    let invalid = |field, detail: String| WireError::InvalidField { field, detail };
    let format = r.u8()?;
    if format != HANDOVER_FORMAT {
        return Err(invalid(
            "hand-over format",
            format!("{format} (this side reads format {HANDOVER_FORMAT})"),
        ));
    }
    let coverage = match r.u8()? {
        0 => HandoverCoverage::Sampled,
        1 => HandoverCoverage::All,
        other => {
            return Err(invalid(
                "hand-over coverage",
                format!("{other} (must be 0, sampled, or 1, every page)"),
            ));
        }
    };
    r.reserved(2)?;
    let count = r.u32()? as usize;
    if count == 0 || count > MAX_HANDOVER_FILES {
        return Err(invalid(
            "hand-over region count",
            format!("{count} (must be 1..={MAX_HANDOVER_FILES})"),
        ));
    }
    let mut regions = Vec::with_capacity(count);
    for _ in 0..count {
        let region_id = r.u32()?;
        r.reserved(4)?;
        let region = HandedRegion {
            region_id,
            offset: r.u64()?,
            len: r.u64()?,
        };
        check_region(&region)?;
        if regions
            .iter()
            .any(|seen: &HandedRegion| seen.region_id == region.region_id)
        {
            return Err(invalid(
                "hand-over region",
                format!("region {} is handed over twice", region.region_id),
            ));
        }
        regions.push(region);
    }
    Ok(MemoryHandover { coverage, regions })
}

fn check_region(region: &HandedRegion) -> Result<(), WireError> {
    let page = u64::from(PAGE_SIZE);
    let detail = if !region.offset.is_multiple_of(page) {
        format!(
            "region {} starts at file offset {}, not a multiple of {page}",
            region.region_id, region.offset
        )
    } else if region.len == 0 || !region.len.is_multiple_of(page) || region.len > MAX_REGION_BYTES {
        format!(
            "region {} has {} bytes (must be a non-zero multiple of {page}, at most {MAX_REGION_BYTES})",
            region.region_id, region.len
        )
    } else if region.offset.checked_add(region.len).is_none() {
        format!(
            "region {} ends past the largest file offset",
            region.region_id
        )
    } else {
        return Ok(());
    };
    Err(WireError::InvalidField {
        field: "hand-over region",
        detail,
    })
}

#[cfg(test)]
mod tests {
    use super::{HandedRegion, MAX_HANDOVER_FILES, MemoryHandover};
    use crate::{FRAME_HEADER_LEN, FrameHeader, FrameKind, Message, WireError};

    fn handover(regions: &[(u32, u64, u64)]) -> Message {
        Message::MemoryHandover(MemoryHandover {
            coverage: super::HandoverCoverage::Sampled,
            regions: regions
                .iter()
                .map(|&(region_id, offset, len)| HandedRegion {
                    region_id,
                    offset,
                    len,
                })
                .collect(),
        })
    }

    fn decode(bytes: &[u8]) -> Result<Message, WireError> {
        let head: [u8; FRAME_HEADER_LEN] = bytes[..FRAME_HEADER_LEN].try_into().unwrap();
        let header = FrameHeader::decode(&head)?;
        Message::decode(header.kind, &bytes[FRAME_HEADER_LEN..])
    }

    #[test]
    fn round_trips() {
        let message = handover(&[(0, 0, 1 << 20), (7, 1 << 20, 4096)]);
        let bytes = message.to_bytes();
        assert_eq!(bytes[0], FrameKind::MemoryHandover as u8);
        assert_eq!(decode(&bytes).unwrap(), message);
    }

    #[test]
    fn refuses_bad_entries() {
        for (regions, what) in [
            (vec![(0, 100, 4096)], "unaligned offset"),
            (vec![(0, 0, 4095)], "unaligned length"),
            (vec![(0, 0, 0)], "empty region"),
            (vec![(0, u64::MAX - 4095, 8192)], "offset overflow"),
            (vec![(1, 0, 4096), (1, 4096, 4096)], "region twice"),
            (vec![], "no region"),
        ] {
            let bytes = handover(&regions).to_bytes();
            assert!(decode(&bytes).is_err(), "{what} was accepted");
        }
    }

    #[test]
    fn refuses_an_unknown_format_and_too_many_files() {
        let mut bytes = handover(&[(0, 0, 4096)]).to_bytes();
        bytes[FRAME_HEADER_LEN] = 2;
        assert!(decode(&bytes).unwrap_err().to_string().contains("format"));
        let mut bytes = handover(&[(0, 0, 4096)]).to_bytes();
        bytes[FRAME_HEADER_LEN + 1] = 2;
        assert!(decode(&bytes).unwrap_err().to_string().contains("coverage"));
        let mut bytes = handover(&[(0, 0, 4096)]).to_bytes();
        bytes[FRAME_HEADER_LEN + 4..FRAME_HEADER_LEN + 8]
            .copy_from_slice(&(u32::try_from(MAX_HANDOVER_FILES).unwrap() + 1).to_le_bytes());
        assert!(decode(&bytes).unwrap_err().to_string().contains("count"));
    }
}
