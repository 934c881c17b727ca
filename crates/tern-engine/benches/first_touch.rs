//! What the first write to a destination page costs, and what populating
//! the page beforehand saves: the measurement behind the destination's
//! `MADV_POPULATE_WRITE` per run of pages (issue 13 item 6).
//!
//! `cargo bench -p tern-engine --bench first_touch [-- --mib 64 --rounds 9]`
//!
//! Every case copies the same 4 KiB pages into a fresh anonymous mapping
//! (private, `MADV_NOHUGEPAGE`: 4 KiB faults, as the destination VMM's
//! memory and QEMU with THP disabled), one mapping per case and round, the
//! cases interleaved round by round; the figure is the median over rounds
//! of the time per page. Cases:
//!
//! * `touch+copy`: the copy's first write to each page faults it in (what a
//!   receiver's `readv` or decompression does without help);
//! * `populate run=N + copy`: one `MADV_POPULATE_WRITE` per run of N
//!   contiguous pages, then the copy (N = 1 is a data page between zero
//!   pages; 128 a whole packet of data pages);
//! * `copy into populated`: the memory was populated before the clock
//!   started (the cost left once the faults are paid elsewhere);
//! * `populate only`: `MADV_POPULATE_WRITE` over the whole mapping at once
//!   (prefaulting at setup);
//! * `THP touch+copy`: `MADV_HUGEPAGE` instead, when THP allows it.
//!
//! No assertion: a benchmark prints what it measured, on whatever machine.

use std::time::Instant;

const PAGE: usize = 4096;

/// One fresh anonymous mapping, unmapped on drop.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    fn new(len: usize, advice: libc::c_int) -> Self {
        // SAFETY: a new private anonymous mapping; no existing memory is
        // affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED, "mmap of {len} bytes failed");
        // SAFETY: the range is the mapping just made. Advice is a hint;
        // its failure leaves default pages, which the table then shows.
        unsafe { libc::madvise(ptr, len, advice) };
        Self {
            ptr: ptr.cast(),
            len,
        }
    }

    fn page(&self, index: usize) -> *mut u8 {
        debug_assert!(index * PAGE < self.len);
        self.ptr.wrapping_add(index * PAGE)
    }

    /// `MADV_POPULATE_WRITE` over `pages` pages from `first`; false when
    /// the kernel refuses (before 5.14).
    fn populate(&self, first: usize, pages: usize) -> bool {
        // SAFETY: the range lies inside this mapping.
        let result = unsafe {
            libc::madvise(
                self.page(first).cast(),
                pages * PAGE,
                libc::MADV_POPULATE_WRITE,
            )
        };
        result == 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer used.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Copies `source` (a whole number of pages, reused cyclically) into every
/// page of `mapping`.
fn copy_pages(mapping: &Mapping, pages: usize, source: &[u8]) {
    let source_pages = source.len() / PAGE;
    for index in 0..pages {
        let from = &source[(index % source_pages) * PAGE..][..PAGE];
        // SAFETY: a whole page inside the mapping, which nothing else
        // uses; `from` is a different allocation.
        unsafe { std::ptr::copy_nonoverlapping(from.as_ptr(), mapping.page(index), PAGE) };
    }
}

#[derive(Clone, Copy)]
enum Case {
    TouchCopy,
    PopulateRunCopy(usize),
    CopyIntoPopulated,
    PopulateOnly,
    HugeTouchCopy,
}

impl Case {
    fn name(self) -> String {
        match self {
            Self::TouchCopy => "touch+copy".into(),
            Self::PopulateRunCopy(run) => format!("populate run={run} + copy"),
            Self::CopyIntoPopulated => "copy into populated".into(),
            Self::PopulateOnly => "populate only".into(),
            Self::HugeTouchCopy => "THP touch+copy".into(),
        }
    }

    /// Nanoseconds per page for one round.
    fn run(self, pages: usize, source: &[u8]) -> f64 {
        let advice = match self {
            Self::HugeTouchCopy => libc::MADV_HUGEPAGE,
            _ => libc::MADV_NOHUGEPAGE,
        };
        let mapping = Mapping::new(pages * PAGE, advice);
        if let Self::CopyIntoPopulated = self {
            assert!(mapping.populate(0, pages), "MADV_POPULATE_WRITE refused");
        }
        let started = Instant::now();
        match self {
            Self::TouchCopy | Self::CopyIntoPopulated | Self::HugeTouchCopy => {
                copy_pages(&mapping, pages, source)
            }
            Self::PopulateRunCopy(run) => {
                for first in (0..pages).step_by(run) {
                    assert!(
                        mapping.populate(first, run.min(pages - first)),
                        "MADV_POPULATE_WRITE refused"
                    );
                }
                copy_pages(&mapping, pages, source);
            }
            Self::PopulateOnly => {
                assert!(mapping.populate(0, pages), "MADV_POPULATE_WRITE refused")
            }
        }
        started.elapsed().as_nanos() as f64 / pages as f64
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// `--name value` from the command line, or `default`.
fn option(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|arg| arg == name)
        .and_then(|at| args.get(at + 1))
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let mib = option("--mib", 64);
    let rounds = option("--rounds", 9).max(1);
    let pages = mib * (1 << 20) / PAGE;
    // Deterministic, incompressible-looking content: the copy's source
    // stays in cache (128 pages, one packet), as a receiver's buffer does.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let source: Vec<u8> = (0..128 * PAGE)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    let cases = [
        Case::TouchCopy,
        Case::PopulateRunCopy(1),
        Case::PopulateRunCopy(2),
        Case::PopulateRunCopy(8),
        Case::PopulateRunCopy(32),
        Case::PopulateRunCopy(128),
        Case::CopyIntoPopulated,
        Case::PopulateOnly,
        Case::HugeTouchCopy,
    ];
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); cases.len()];
    for _ in 0..rounds {
        for (case, samples) in cases.iter().zip(&mut samples) {
            samples.push(case.run(pages, &source));
        }
    }
    println!("first touch: {mib} MiB per case, {rounds} rounds interleaved, median per 4 KiB page");
    println!(
        "{:<24} {:>10} {:>10} {:>10}",
        "case", "median", "min", "max"
    );
    for (case, samples) in cases.iter().zip(&mut samples) {
        let min = samples.iter().copied().fold(f64::INFINITY, f64::min);
        let max = samples.iter().copied().fold(0.0, f64::max);
        let median = median(samples);
        println!(
            "{:<24} {:>8.2}µs {:>8.2}µs {:>8.2}µs",
            case.name(),
            median / 1e3,
            min / 1e3,
            max / 1e3
        );
    }
}
