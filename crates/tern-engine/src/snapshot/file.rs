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

/// One snapshot file whose header, metadata and trailer passed every
/// check: a full snapshot, or a diff on another.
#[derive(Debug)]
pub(crate) struct Layer {
    path: PathBuf,
    file: File,
    metadata: SnapshotMetadata,
    trailer: Trailer,
}

impl Layer {
    /// Opens and checks `path`: magic, version, completeness, the metadata
    /// checksum and layout, that the file holds every byte the header
    /// claims, and the trailer's checksum. Pages are checked as they are
    /// read.
    pub(crate) fn open(path: &Path) -> Result<Self, SnapshotError> {
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
        // One read for the header and, for guests up to about 1.5 GiB, the
        // metadata block after it: on a cold page cache each read is a
        // trip to the disk before the guest can run. Bounded by a constant
        // and by the file's real length, not by anything the file says.
        let first = FIRST_READ.min(usize::try_from(actual).unwrap_or(FIRST_READ));
        let mut head = vec![0u8; first.max(SNAPSHOT_HEADER_LEN)];
        let got = read_up_to(&file, &mut head, 0).map_err(read_error)?;
        head.truncate(got);
        let header = SnapshotHeader::decode(&head).map_err(format)?;
        // The file's real length bounds every read below: a header that
        // claims more than the file holds is refused before allocating.
        header.check_file_len(actual).map_err(format)?;
        // The trailer (device state) is read last: its disk read starts
        // now, while the metadata is read and checked.
        advise_will_need(&file, header.data_end, header.trailer_len);
        let metadata_len = declared_len("metadata length", header.metadata_len).map_err(format)?;
        let block = if metadata_len <= head.len() {
            head.truncate(metadata_len);
            head
        } else {
            let mut block = vec![0u8; metadata_len];
            file.read_exact_at(&mut block, 0).map_err(read_error)?;
            block
        };
        let metadata = SnapshotMetadata::decode(&block).map_err(format)?;
        if metadata.header != header {
            return Err(format(tern_wire::snapshot::SnapshotError::MetadataChecksum));
        }
        let mut trailer =
            vec![0u8; declared_len("trailer length", header.trailer_len).map_err(format)?];
        file.read_exact_at(&mut trailer, header.data_end)
            .map_err(read_error)?;
        let trailer = Trailer::decode(&trailer, &header, &metadata.regions).map_err(format)?;
        Ok(Self {
            path: path.to_owned(),
            file,
            metadata,
            trailer,
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn metadata(&self) -> &SnapshotMetadata {
        &self.metadata
    }

    pub(crate) fn trailer(&self) -> &Trailer {
        &self.trailer
    }

    fn digest(&self) -> u128 {
        self.metadata.header.digest
    }
}

/// A snapshot ready to restore from: one full snapshot, or a full one
/// with diffs layered on it, each diff checked to be taken on the memory
/// of the layer below. Pages come from the topmost layer that defines
/// them; the top layer's chunk hashes, digest and device state describe
/// the whole.
#[derive(Debug)]
pub struct SnapshotFile {
    /// Oldest (the full snapshot) first.
    layers: Vec<Layer>,
    /// Page hashes of the chunks fetched and verified so far (lazy
    /// restore), for the digest once everything is loaded.
    verified: Vec<Vec<AtomicU64>>,
}

/// Where one page's bytes are: a layer's slot, or nowhere (a zero page).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PageAt {
    /// In layer `layer` (an index, oldest first), at `offset`.
    Slot { layer: usize, offset: u64 },
    /// A zero page.
    Zero,
}

impl SnapshotFile {
    /// Opens and checks one full snapshot (see [`SnapshotFile::open_layers`]
    /// for a diff).
    pub fn open(path: &Path) -> Result<Self, SnapshotError> {
        Self::open_layers(&[], path)
    }

    /// Opens `top` on `bases` (oldest first: a full snapshot, then the
    /// diffs between it and `top`). Each layer is checked alone (header,
    /// metadata, trailer, as [`SnapshotFile::open`] does), then as a chain: every layer but the first is a
    /// diff taken on the memory digest of the layer below, the first is
    /// full, and all have the same regions.
    pub fn open_layers(bases: &[PathBuf], top: &Path) -> Result<Self, SnapshotError> {
        let mut layers = Vec::with_capacity(bases.len() + 1);
        for path in bases.iter().map(PathBuf::as_path).chain([top]) {
            layers.push(Layer::open(path)?);
        }
        check_chain(&layers)?;
        let verified = layers[layers.len() - 1]
            .metadata
            .regions
            .iter()
            .map(|region| (0..region.pages()).map(|_| AtomicU64::new(0)).collect())
            .collect();
        Ok(Self { layers, verified })
    }

    fn top(&self) -> &Layer {
        // Never empty: `open_layers` opens at least `top`.
        &self.layers[self.layers.len() - 1]
    }

    /// The path of the top layer (the file named last).
    pub fn path(&self) -> &Path {
        self.top().path()
    }

    /// The top layer's checked metadata (regions, hashes and digest of
    /// the whole memory; for a diff, its own present and changed pages).
    pub fn metadata(&self) -> &SnapshotMetadata {
        self.top().metadata()
    }

    /// The top layer's checked trailer (device state, working set, guest
    /// kind).
    pub fn trailer(&self) -> &Trailer {
        self.top().trailer()
    }

    /// How many files the snapshot is made of (1 for a full snapshot).
    pub fn layer_count(&self) -> usize {
        self.layers.len()
    }

    /// The region lengths, for building a guest of the same shape.
    pub fn region_lens(&self) -> Vec<u64> {
        self.metadata()
            .regions
            .iter()
            .map(|region| region.len)
            .collect()
    }

    /// The file of layer `layer`.
    pub(crate) fn layer_file(&self, layer: usize) -> &File {
        &self.layers[layer].file
    }

    /// The path of layer `layer`.
    pub(crate) fn layer_path(&self, layer: usize) -> &Path {
        &self.layers[layer].path
    }

    /// Where page `page` of region `region` is: the slot of the topmost
    /// layer that defines it, or a zero page.
    pub(crate) fn locate(&self, region: usize, page: u64) -> PageAt {
        for (index, layer) in self.layers.iter().enumerate().rev() {
            let metadata = &layer.metadata;
            if !metadata.is_changed(region, page) {
                continue;
            }
            return match metadata.regions.get(region) {
                Some(slots) if metadata.is_present(region, page) => PageAt::Slot {
                    layer: index,
                    offset: slots.slots_offset + page * PAGE,
                },
                _ => PageAt::Zero,
            };
        }
        // The bottom layer is full: it defines every page.
        PageAt::Zero
    }

    /// Reads pages `first..first + zero.len()` of `region` into `buf`:
    /// present pages from their layer's slots (contiguous ones in one
    /// read), absent ones marked zero. Returns each page's hash.
    pub(crate) fn read_pages(
        &self,
        region: usize,
        first: u64,
        buf: &mut [u8],
        zero: &mut [bool],
    ) -> std::io::Result<Vec<u64>> {
        let count = zero.len();
        let places: Vec<PageAt> = (0..count)
            .map(|index| self.locate(region, first + index as u64))
            .collect();
        for (is_zero, place) in zero.iter_mut().zip(&places) {
            *is_zero = *place == PageAt::Zero;
        }
        for (start, end, layer, offset) in slot_runs(&places) {
            let layer = &self.layers[layer];
            layer
                .file
                .read_exact_at(&mut buf[start * PAGE_SIZE..end * PAGE_SIZE], offset)
                .map_err(|error| {
                    std::io::Error::new(error.kind(), format!("{}: {error}", layer.path.display()))
                })?;
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
        let expected =
            self.metadata().chunk_hashes[region][crate::numeric::saturating_usize(chunk)];
        if chunk_hash(page_hashes) != expected {
            return Err(SnapshotError::Corrupted {
                path: self.path().to_owned(),
                bases: self.layers.len() - 1,
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
        for (region, hashes) in self.metadata().regions.iter().zip(&self.verified) {
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
            self.metadata().regions.get(region).ok_or_else(|| {
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
        let hashes = self
            .read_pages(region, first, buf, zero)
            .map_err(|error| PageSourceError::io("cannot read the snapshot", error))?;
        self.check_chunk(region, chunk, &hashes)
            .map_err(|error| PageSourceError::new(error.to_string()))?;
        for (index, hash) in hashes.into_iter().enumerate() {
            self.verified[region][crate::numeric::saturating_usize(first) + index]
                .store(hash, Ordering::Release);
        }
        Ok(())
    }
}

/// The runs of `places` in slots: (first index, end index, layer, file
/// offset of the first), each run contiguous in one layer's file.
pub(crate) fn slot_runs(places: &[PageAt]) -> Vec<(usize, usize, usize, u64)> {
    let mut runs: Vec<(usize, usize, usize, u64)> = Vec::new();
    for (index, place) in places.iter().enumerate() {
        let PageAt::Slot { layer, offset } = *place else {
            continue;
        };
        match runs.last_mut() {
            Some((start, end, run_layer, run_offset))
                if *end == index
                    && *run_layer == layer
                    && *run_offset + ((index - *start) as u64) * PAGE == offset =>
            {
                *end = index + 1;
            }
            _ => runs.push((index, index + 1, layer, offset)),
        }
    }
    runs
}

/// Refuses layers that are not one full snapshot under diffs, each taken
/// on the memory of the one below, all of one shape and guest kind.
fn check_chain(layers: &[Layer]) -> Result<(), SnapshotError> {
    let chain = |detail: String| SnapshotError::Chain(detail);
    let bottom = &layers[0];
    if let Some(base) = bottom.metadata.header.base_digest {
        return Err(chain(format!(
            "{} is a diff snapshot on the memory with digest {base:032x}: name its base first",
            bottom.path.display()
        )));
    }
    for pair in layers.windows(2) {
        let (below, above) = (&pair[0], &pair[1]);
        let Some(base) = above.metadata.header.base_digest else {
            return Err(chain(format!(
                "{} is a full snapshot: only the first file named can be one",
                above.path.display()
            )));
        };
        if base != below.digest() {
            return Err(chain(format!(
                "{} is a diff on the memory with digest {base:032x}, but {} holds digest {:032x}: not its base",
                above.path.display(),
                below.path.display(),
                below.digest()
            )));
        }
        let shape = |layer: &Layer| -> Vec<(u32, u64, u64)> {
            layer
                .metadata
                .regions
                .iter()
                .map(|region| (region.id, region.guest_addr, region.len))
                .collect()
        };
        if shape(below) != shape(above) {
            return Err(chain(format!(
                "{} and {} hold guests of different regions",
                below.path.display(),
                above.path.display()
            )));
        }
        if below.trailer.guest_kind != above.trailer.guest_kind {
            return Err(chain(format!(
                "{} holds a {:?} guest, {} a {:?} one",
                below.path.display(),
                below.trailer.guest_kind,
                above.path.display(),
                above.trailer.guest_kind
            )));
        }
    }
    Ok(())
}

/// The first read of a snapshot: its header and, when it fits, its
/// metadata block (164 000 bytes for a 1 GiB guest).
const FIRST_READ: usize = 256 * 1024;

/// Asks the kernel to start reading `len` bytes at `offset` into the page
/// cache. Only a hint: an error (or a length past the file) changes
/// nothing but the speed.
fn advise_will_need(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let (Ok(offset), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return;
    };
    // SAFETY: posix_fadvise reads nothing from memory; the descriptor is
    // open for the call.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), offset, len, libc::POSIX_FADV_WILLNEED) };
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
