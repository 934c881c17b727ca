//! Eager restore: every page read into a fresh guest, checked, then resumed.

use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use serde::Serialize;
use tern_wire::snapshot::CHUNK_PAGES;
use xxhash_rust::xxh3::Xxh3;

use crate::digest::{add_region, page_hash, zero_page_hash};
use crate::guest::{DestinationGuest, MemoryRegion, PAGE_SIZE};
use crate::snapshot::file::{PageAt, slot_runs};
use crate::snapshot::{SnapshotError, SnapshotFile, check_shape, sections};

/// How to restore.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct RestoreConfig {
    /// Reader threads for an eager restore, loader threads for a lazy one.
    pub threads: usize,
    /// Lazy: prefetch the file's recorded working set (or
    /// [`RestoreConfig::working_set`]) before the rest.
    pub prefetch_working_set: bool,
    /// Lazy: a working set recorded by an earlier restore, used instead of
    /// the file's.
    pub working_set: Option<Vec<(u32, u32)>>,
    /// Lazy: load in the background at all (off: faults only).
    pub background: bool,
    /// Eager: resume the guest once restored (off: it stays paused, for a
    /// caller that checks it first, like QEMU's `-S`).
    pub resume: bool,
    /// When the snapshot is a diff: the files under it, oldest first (a
    /// full snapshot, then any diffs between it and the snapshot).
    pub bases: Vec<std::path::PathBuf>,
}

impl Default for RestoreConfig {
    fn default() -> Self {
        Self {
            threads: 2,
            prefetch_working_set: true,
            working_set: None,
            background: true,
            resume: true,
            bases: Vec::new(),
        }
    }
}

/// What an eager restore did.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct RestoreStats {
    /// From opening the file to the guest running.
    pub total_time_ms: f64,
    /// Pages read from the file.
    pub pages_read: u64,
    /// Zero pages (holes), not touched.
    pub zero_pages: u64,
    /// The digest, equal in the file and in memory.
    pub digest: String,
}

/// A restored guest, running unless [`RestoreConfig::resume`] was off.
#[derive(Debug)]
#[non_exhaustive]
pub struct Restored<G> {
    /// The guest.
    pub guest: G,
    /// What the restore did.
    pub stats: RestoreStats,
}

/// Restores the snapshot at `path` into the guest `make_guest` builds
/// from the snapshot's region lengths (fresh, zeroed memory), compares the
/// memory digest, restores the device state and resumes the guest. On any
/// error the guest is dropped without having run.
pub fn restore<G: DestinationGuest>(
    path: &Path,
    config: &RestoreConfig,
    make_guest: impl FnOnce(&[u64]) -> crate::guest::GuestResult<G>,
) -> Result<Restored<G>, SnapshotError> {
    let started = Instant::now();
    let file = SnapshotFile::open_layers(&config.bases, path)?;
    let mut guest = make_guest(&file.region_lens())?;
    check_shape(&file, guest.regions(), guest.guest_kind())?;
    let (digest, pages_read, zero_pages) = read_all(&file, guest.regions(), config.threads)?;
    let expected = file.metadata().header.digest;
    if digest != expected {
        return Err(SnapshotError::DigestMismatch {
            expected,
            actual: digest,
        });
    }
    guest.restore_state(&sections(&file))?;
    if config.resume {
        guest.resume()?;
    }
    Ok(Restored {
        guest,
        stats: RestoreStats {
            total_time_ms: started.elapsed().as_secs_f64() * 1000.0,
            pages_read,
            zero_pages,
            digest: format!("{digest:032x}"),
        },
    })
}

/// Reads every present page into `regions` with `threads` readers, one
/// chunk at a time, checking each chunk's hash. Returns the digest of
/// memory and the pages read and skipped.
fn read_all(
    file: &SnapshotFile,
    regions: &[MemoryRegion],
    threads: usize,
) -> Result<(u128, u64, u64), SnapshotError> {
    let metadata = file.metadata();
    let chunks: Vec<(usize, u64)> = metadata
        .regions
        .iter()
        .enumerate()
        .flat_map(|(index, region)| (0..region.chunks()).map(move |chunk| (index, chunk)))
        .collect();
    let mut hashes: Vec<Vec<u64>> = metadata
        .regions
        .iter()
        .map(|region| vec![0; crate::numeric::saturating_usize(region.pages())])
        .collect();
    let slots: Vec<Mutex<&mut [u64]>> = hashes
        .iter_mut()
        .flat_map(|region| region.chunks_mut(crate::numeric::saturating_usize(CHUNK_PAGES)))
        .map(Mutex::new)
        .collect();
    let next = AtomicUsize::new(0);
    let failure: Mutex<Option<SnapshotError>> = Mutex::new(None);
    let counts = Mutex::new((0u64, 0u64));
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1) {
            scope.spawn(|| {
                let (mut read, mut zero) = (0, 0);
                while let Some(index) =
                    Some(next.fetch_add(1, Ordering::Relaxed)).filter(|&index| index < chunks.len())
                {
                    if failure.lock().is_ok_and(|failure| failure.is_some()) {
                        break;
                    }
                    let (region, chunk) = chunks[index];
                    let Ok(mut out) = slots[index].lock() else {
                        break;
                    };
                    match read_chunk(file, &regions[region], region, chunk, &mut out) {
                        Ok((r, z)) => {
                            read += r;
                            zero += z;
                        }
                        Err(error) => {
                            if let Ok(mut failure) = failure.lock() {
                                failure.get_or_insert(error);
                            }
                            break;
                        }
                    }
                }
                if let Ok(mut counts) = counts.lock() {
                    counts.0 += read;
                    counts.1 += zero;
                }
            });
        }
    });
    if let Some(error) = failure.into_inner().ok().flatten() {
        return Err(error);
    }
    drop(slots);
    let mut hasher = Xxh3::new();
    for (region, page_hashes) in metadata.regions.iter().zip(hashes) {
        add_region(&mut hasher, region.id, page_hashes);
    }
    let (read, zero) = counts.into_inner().unwrap_or_default();
    Ok((hasher.digest128(), read, zero))
}

/// Reads one chunk's present pages straight into guest memory (one
/// `pread` per run of slots in one file) and checks the chunk's hash from
/// what memory holds.
fn read_chunk(
    file: &SnapshotFile,
    memory: &MemoryRegion,
    region: usize,
    chunk: u64,
    hashes: &mut [u64],
) -> Result<(u64, u64), SnapshotError> {
    let first = chunk * CHUNK_PAGES;
    let places: Vec<PageAt> = (first..first + hashes.len() as u64)
        .map(|page| file.locate(region, page))
        .collect();
    let outside = || SnapshotError::Shape("a page outside the guest".into());
    for (start, end, layer, offset) in slot_runs(&places) {
        let ptr = memory.page_ptr(first + start as u64).ok_or_else(outside)?;
        memory
            .page_ptr(first + end as u64 - 1)
            .ok_or_else(outside)?;
        pread_exact(file, layer, ptr, (end - start) * PAGE_SIZE, offset)?;
    }
    let (mut read, mut zero) = (0, 0);
    for (index, place) in places.iter().enumerate() {
        if *place == PageAt::Zero {
            hashes[index] = zero_page_hash();
            zero += 1;
            continue;
        }
        let at = memory.page_ptr(first + index as u64).ok_or_else(outside)?;
        // SAFETY: a bounds-checked page of a guest that does not run.
        hashes[index] = unsafe { page_hash(at) };
        read += 1;
    }
    file.check_chunk(region, chunk, hashes)?;
    Ok((read, zero))
}

/// Reads `len` bytes at `offset` of layer `layer`'s file to `ptr` (guest
/// memory).
fn pread_exact(
    file: &SnapshotFile,
    layer: usize,
    ptr: *mut u8,
    len: usize,
    offset: u64,
) -> Result<(), SnapshotError> {
    let mut done = 0;
    while done < len {
        let at = crate::numeric::file_offset(offset + done as u64).map_err(|source| {
            SnapshotError::Read {
                path: file.path().to_owned(),
                source,
            }
        })?;
        // SAFETY: `ptr..ptr + len` are pages of the guest's region (bounds
        // checked by the caller), which does not run during a restore.
        let got = unsafe {
            libc::pread(
                file.layer_file(layer).as_raw_fd(),
                ptr.add(done).cast(),
                len - done,
                at,
            )
        };
        let error = || SnapshotError::Read {
            path: file.layer_path(layer).to_owned(),
            source: std::io::Error::last_os_error(),
        };
        match got {
            got if got > 0 => done += crate::numeric::syscall_count(got),
            0 => {
                return Err(SnapshotError::Read {
                    path: file.layer_path(layer).to_owned(),
                    source: std::io::ErrorKind::UnexpectedEof.into(),
                });
            }
            _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
            _ => return Err(error()),
        }
    }
    Ok(())
}
