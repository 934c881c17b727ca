//! An open snapshot file, checked before anything is restored from it,
//! and the [`PageSource`] a lazy restore faults pages in from.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use tern_wire::snapshot::{
    CHUNK_PAGES, SNAPSHOT_HEADER_LEN, SnapshotHeader, SnapshotMetadata, Trailer, chunk_hash,
};
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use crate::digest::{add_region, zero_page_hash};
use crate::fault::{PageSource, PageSourceError};
use crate::guest::PAGE_SIZE;
use crate::snapshot::SnapshotError;

const PAGE: u64 = PAGE_SIZE as u64;

/// A length the file's header declares, as `usize`, before it is
/// allocated; one past the address space (32-bit hosts) is refused.
fn declared_len(
    field: &'static str,
    len: u64,
) -> Result<usize, tern_wire::snapshot::SnapshotError> {
    usize::try_from(len).map_err(|_| tern_wire::snapshot::SnapshotError::Invalid {
        field,
        detail: format!("{len} bytes do not fit in this host's memory"),
    })
}

/// A snapshot file whose header, metadata and trailer passed every check.
#[derive(Debug)]
pub struct SnapshotFile {
    path: PathBuf,
    file: File,
    metadata: SnapshotMetadata,
    trailer: Trailer,
    /// Page hashes of the chunks fetched and verified so far (lazy
    /// restore), for the digest once everything is loaded.
    verified: Vec<Vec<AtomicU64>>,
}

impl SnapshotFile {
    /// Opens and checks `path`: magic, version, completeness, the metadata
    /// checksum and layout, that the file holds every byte the header
    /// claims, and the trailer's checksum. Pages are checked as they are
    /// read.
    pub fn open(path: &Path) -> Result<Self, SnapshotError> {
        let file = File::open(path).map_err(|source| SnapshotError::Open {
            path: path.to_owned(),
            source,
        })?;
        let read_error = |source| SnapshotError::Read {
            path: path.to_owned(),
            source,
        };
        let format = |source| SnapshotError::Format {
            path: path.to_owned(),
            source,
        };
        let actual = file.metadata().map_err(read_error)?.len();
        let mut head = vec![0u8; SNAPSHOT_HEADER_LEN];
        let got = read_up_to(&file, &mut head, 0).map_err(read_error)?;
        head.truncate(got);
        let header = SnapshotHeader::decode(&head).map_err(format)?;
        // The file's real length bounds every read below: a header that
        // claims more than the file holds is refused before allocating.
        header.check_file_len(actual).map_err(format)?;
        let mut block =
            vec![0u8; declared_len("metadata length", header.metadata_len).map_err(format)?];
        file.read_exact_at(&mut block, 0).map_err(read_error)?;
        let metadata = SnapshotMetadata::decode(&block).map_err(format)?;
        if metadata.header != header {
            return Err(format(tern_wire::snapshot::SnapshotError::MetadataChecksum));
        }
        let mut trailer =
            vec![0u8; declared_len("trailer length", header.trailer_len).map_err(format)?];
        file.read_exact_at(&mut trailer, header.data_end)
            .map_err(read_error)?;
        let trailer = Trailer::decode(&trailer, &header, &metadata.regions).map_err(format)?;
        let verified = metadata
            .regions
            .iter()
            .map(|region| (0..region.pages()).map(|_| AtomicU64::new(0)).collect())
            .collect();
        Ok(Self {
            path: path.to_owned(),
            file,
            metadata,
            trailer,
            verified,
        })
    }

    /// The path it was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The checked metadata (regions, present pages, hashes, digest).
    pub fn metadata(&self) -> &SnapshotMetadata {
        &self.metadata
    }

    /// The checked trailer (device state, working set, guest kind).
    pub fn trailer(&self) -> &Trailer {
        &self.trailer
    }

    /// The region lengths, for building a guest of the same shape.
    pub fn region_lens(&self) -> Vec<u64> {
        self.metadata
            .regions
            .iter()
            .map(|region| region.len)
            .collect()
    }

    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// Reads pages `first..first + zero.len()` of `region` into `buf`:
    /// present pages from their slots (contiguous ones in one read), absent
    /// ones marked zero. Returns each page's hash.
    pub(crate) fn read_pages(
        &self,
        region: usize,
        first: u64,
        buf: &mut [u8],
        zero: &mut [bool],
    ) -> std::io::Result<Vec<u64>> {
        let slots = self.metadata.regions[region];
        let count = zero.len();
        for (index, is_zero) in zero.iter_mut().enumerate() {
            *is_zero = !self.metadata.is_present(region, first + index as u64);
        }
        let mut start = 0;
        while start < count {
            if zero[start] {
                start += 1;
                continue;
            }
            let end = zero[start..]
                .iter()
                .position(|&is_zero| is_zero)
                .map_or(count, |run| start + run);
            let offset = slots.slots_offset + (first + start as u64) * PAGE;
            self.file
                .read_exact_at(&mut buf[start * PAGE_SIZE..end * PAGE_SIZE], offset)?;
            start = end;
        }
        Ok((0..count)
            .map(|index| {
                if zero[index] {
                    zero_page_hash()
                } else {
                    xxh3_64(&buf[index * PAGE_SIZE..(index + 1) * PAGE_SIZE])
                }
            })
            .collect())
    }

    /// Checks the hashes of chunk `chunk` of `region` against the file's.
    pub(crate) fn check_chunk(
        &self,
        region: usize,
        chunk: u64,
        page_hashes: &[u64],
    ) -> Result<(), SnapshotError> {
        let expected = self.metadata.chunk_hashes[region][crate::numeric::saturating_usize(chunk)];
        if chunk_hash(page_hashes) != expected {
            return Err(SnapshotError::Corrupted {
                path: self.path.clone(),
                region,
                chunk,
            });
        }
        Ok(())
    }

    /// The digest of the pages [`PageSource::fetch`] verified, when every
    /// page has been.
    pub(crate) fn verified_digest(&self) -> u128 {
        let mut hasher = Xxh3::new();
        for (region, hashes) in self.metadata.regions.iter().zip(&self.verified) {
            add_region(
                &mut hasher,
                region.id,
                hashes.iter().map(|hash| hash.load(Ordering::Acquire)),
            );
        }
        hasher.digest128()
    }
}

impl PageSource for SnapshotFile {
    fn fetch(
        &self,
        region: usize,
        first: u64,
        buf: &mut [u8],
        zero: &mut [bool],
    ) -> Result<(), PageSourceError> {
        let slots =
            self.metadata.regions.get(region).ok_or_else(|| {
                PageSourceError::new(format!("no region {region} in the snapshot"))
            })?;
        let chunk = first / CHUNK_PAGES;
        let whole = CHUNK_PAGES.min(slots.pages().saturating_sub(first));
        if !first.is_multiple_of(CHUNK_PAGES) || zero.len() as u64 != whole {
            return Err(PageSourceError::new(format!(
                "pages {first}+{} are not one chunk of the snapshot",
                zero.len()
            )));
        }
        let hashes = self.read_pages(region, first, buf, zero).map_err(|error| {
            PageSourceError::io(format!("cannot read {}", self.path.display()), error)
        })?;
        self.check_chunk(region, chunk, &hashes)
            .map_err(|error| PageSourceError::new(error.to_string()))?;
        for (index, hash) in hashes.into_iter().enumerate() {
            self.verified[region][crate::numeric::saturating_usize(first) + index]
                .store(hash, Ordering::Release);
        }
        Ok(())
    }
}

/// Reads as much of `buf` as the file holds from `offset`.
fn read_up_to(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(read) => done += read,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
    }
    Ok(done)
}
