//! Merging a diff with its bases into one full snapshot.
//!
//! Every chunk is read from the layers as a restore reads it (each page
//! from the topmost layer that defines it), checked against the diff's
//! chunk hash, and written to the new file's slots; the memory digest is
//! recomputed from the pages and must be the diff's. The output follows
//! the save's order: incomplete header first, then pages, trailer, fsync,
//! and the complete header last, so a merge that fails leaves a file every
//! restore refuses.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use tern_wire::snapshot::{CHUNK_PAGES, SnapshotMetadata, plan_layout};
use xxhash_rust::xxh3::Xxh3;

use crate::digest::add_region;
use crate::guest::PAGE_SIZE;
use crate::snapshot::{SnapshotError, SnapshotFile};

const PAGE: u64 = PAGE_SIZE as u64;

/// What a merge did.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct MergeStats {
    /// Wall-clock time of the merge.
    pub total_time_ms: f64,
    /// Files merged (the bases and the diff).
    pub layers: usize,
    /// Pages written to the full snapshot.
    pub pages_written: u64,
    /// Zero pages, left as holes.
    pub zero_pages: u64,
    /// The new file's length (holes take no disk).
    pub file_bytes: u64,
    /// The memory digest: the diff's, checked against the pages merged.
    pub digest: String,
}

/// Writes the full snapshot of `top` on `bases` (oldest first, as for
/// [`crate::RestoreConfig::bases`]) to `output`, which must be none of them.
pub fn merge(bases: &[PathBuf], top: &Path, output: &Path) -> Result<MergeStats, SnapshotError> {
    let started = Instant::now();
    let source = SnapshotFile::open_layers(bases, top)?;
    for input in bases.iter().map(PathBuf::as_path).chain([top]) {
        if same_file(input, output) {
            return Err(SnapshotError::Config(format!(
                "the merge would replace its input {}",
                input.display()
            )));
        }
    }
    let write_error = |source| SnapshotError::Write {
        path: output.to_owned(),
        source,
    };
    let shape: Vec<_> = source
        .metadata()
        .regions
        .iter()
        .map(|region| (region.id, region.guest_addr, region.len))
        .collect();
    let layout = plan_layout(&shape).map_err(|source| SnapshotError::Format {
        path: output.to_owned(),
        source,
    })?;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(output)
        .map_err(|source| SnapshotError::Open {
            path: output.to_owned(),
            source,
        })?;
    file.set_len(layout.data_end).map_err(write_error)?;
    let mut metadata = SnapshotMetadata::new(&layout);
    file.write_all_at(&metadata.encode(), 0)
        .map_err(write_error)?;
    file.sync_data().map_err(write_error)?;
    let (digest, pages_written, zero_pages) = copy_pages(&source, &file, &mut metadata, output)?;
    let expected = source.metadata().header.digest;
    if digest != expected {
        return Err(SnapshotError::DigestMismatch {
            expected,
            actual: digest,
        });
    }
    metadata.chunk_hashes = source.metadata().chunk_hashes.clone();
    let trailer = source.trailer().encode();
    file.write_all_at(&trailer, layout.data_end)
        .map_err(write_error)?;
    let file_bytes = layout.data_end + trailer.len() as u64;
    file.set_len(file_bytes).map_err(write_error)?;
    file.sync_data().map_err(write_error)?;
    metadata.complete(digest, &trailer);
    file.write_all_at(&metadata.encode(), 0)
        .map_err(write_error)?;
    file.sync_data().map_err(write_error)?;
    Ok(MergeStats {
        total_time_ms: started.elapsed().as_secs_f64() * 1000.0,
        layers: source.layer_count(),
        pages_written,
        zero_pages,
        file_bytes,
        digest: format!("{digest:032x}"),
    })
}

/// Copies every chunk of `source`, checked, into `file`'s slots, marking
/// the pages written present in `metadata`. Returns the digest of the
/// pages copied and the pages written and left as holes.
fn copy_pages(
    source: &SnapshotFile,
    file: &File,
    metadata: &mut SnapshotMetadata,
    output: &Path,
) -> Result<(u128, u64, u64), SnapshotError> {
    let mut hasher = Xxh3::new();
    let (mut written, mut holes) = (0, 0);
    let mut buf = vec![0u8; crate::numeric::saturating_usize(CHUNK_PAGES) * PAGE_SIZE];
    let mut zero = vec![false; crate::numeric::saturating_usize(CHUNK_PAGES)];
    for (region, slots) in metadata.regions.clone().iter().enumerate() {
        let mut page_hashes = Vec::with_capacity(crate::numeric::saturating_usize(slots.pages()));
        for chunk in 0..slots.chunks() {
            let first = chunk * CHUNK_PAGES;
            let count = crate::numeric::saturating_usize(CHUNK_PAGES.min(slots.pages() - first));
            let hashes = source
                .read_pages(
                    region,
                    first,
                    &mut buf[..count * PAGE_SIZE],
                    &mut zero[..count],
                )
                .map_err(|source_error| SnapshotError::Read {
                    path: source.path().to_owned(),
                    source: source_error,
                })?;
            source.check_chunk(region, chunk, &hashes)?;
            let mut start = 0;
            while start < count {
                if zero[start] {
                    holes += 1;
                    start += 1;
                    continue;
                }
                let end = zero[start..count]
                    .iter()
                    .position(|&is_zero| is_zero)
                    .map_or(count, |run| start + run);
                file.write_all_at(
                    &buf[start * PAGE_SIZE..end * PAGE_SIZE],
                    slots.slots_offset + (first + start as u64) * PAGE,
                )
                .map_err(|source| SnapshotError::Write {
                    path: output.to_owned(),
                    source,
                })?;
                for page in first + start as u64..first + end as u64 {
                    metadata.present[region][(page / 64) as usize] |= 1 << (page % 64);
                }
                written += (end - start) as u64;
                start = end;
            }
            page_hashes.extend(hashes);
        }
        add_region(&mut hasher, slots.id, page_hashes);
    }
    Ok((hasher.digest128(), written, holes))
}

/// Whether `a` and `b` name the same existing file.
fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}
