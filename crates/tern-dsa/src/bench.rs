//! Throughput of every zero-page backend, for `tern bench zero`.
//!
//! Measured over one DRAM-resident buffer (every page written first, so it is
//! backed by its own memory and not the kernel's shared zero page) in three
//! cases: all-zero pages (the full read), pages whose first byte is non-zero
//! (cheapest reject) and pages whose last byte is non-zero (full read, then
//! reject). A plain read-bandwidth loop over the same buffer is the ceiling.

use std::collections::VecDeque;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tern_page::zero::{
    PAGE_SIZE, ZeroCheckBackend, ZeroChecker, is_zero_page_qemu_style, read_bandwidth_probe,
};
use tern_page::{MAX_BATCH_PAGES, ZeroOffloadStats, ZeroPageOffload};

use crate::engine::{DsaConfig, open_dsa, software_dsa};
use crate::soft::SoftwareDsaConfig;

/// One measurement.
#[derive(Clone, Debug, PartialEq)]
pub struct ZeroBenchRow {
    /// Backend: a [`ZeroCheckBackend`] name, `qemu-style`, `read-bandwidth`,
    /// `soft-dsa` or `dsa`.
    pub backend: String,
    /// `zero`, `first-byte` or `last-byte`.
    pub case: &'static str,
    /// Bytes checked per round.
    pub bytes: u64,
    /// Median seconds per round.
    pub seconds: f64,
    /// Bytes per second / 1e9, from the median round.
    pub gb_per_s: f64,
    /// Offload rows: CPU time of the completion thread per GiB checked,
    /// over every round of the case (the price of polling for completions).
    pub completion_cpu_per_gib: Option<Duration>,
}

/// Submissions kept in flight by the offload measurements, so the device
/// works while the next batch is prepared.
const OFFLOAD_DEPTH: usize = 4;

/// Measures every backend on a `buffer_bytes` buffer (rounded down to whole
/// pages, at least one), `rounds` times each (at least one), and returns the
/// median of each. The hardware DSA is included when [`open_dsa`] with the
/// default configuration succeeds.
pub fn bench_zero(buffer_bytes: usize, rounds: usize) -> Vec<ZeroBenchRow> {
    bench_zero_report(buffer_bytes, rounds).rows
}

/// What the hardware DSA did during [`bench_zero_report`], or why it was
/// not measured.
#[derive(Clone, Debug, PartialEq)]
pub enum DsaBench {
    /// Measured: the engine's description (queues and submission method)
    /// and its counters over every round (device errors, page faults and
    /// CPU fallbacks say whether the device really did the work).
    Measured {
        /// E.g. `dsa [dsa0/wq0.0 (enqcmd)]`.
        describe: String,
        /// Counters after the last round.
        stats: ZeroOffloadStats,
    },
    /// Not measured: why the engine did not open.
    Missing(String),
}

/// The measurements of [`bench_zero`] and what became of the DSA row.
#[derive(Clone, Debug, PartialEq)]
pub struct ZeroBench {
    /// One row per backend and case.
    pub rows: Vec<ZeroBenchRow>,
    /// The hardware DSA's outcome.
    pub dsa: DsaBench,
}

/// [`bench_zero`], also saying what the hardware DSA did or why it is
/// missing.
pub fn bench_zero_report(buffer_bytes: usize, rounds: usize) -> ZeroBench {
    let pages = (buffer_bytes / PAGE_SIZE).max(1);
    let bytes = pages * PAGE_SIZE;
    let rounds = rounds.max(1);
    // Fill with non-zero behind black_box, then zero: otherwise the
    // allocation can become calloc and map the shared zero page.
    let mut storage = vec![0xa5u8; bytes + PAGE_SIZE];
    black_box(&mut storage);
    storage.fill(0);
    let start = storage.as_ptr().align_offset(PAGE_SIZE);
    let buf = &mut storage[start..start + bytes];

    let (offloads, dsa_missing) = bench_offloads();
    let mut rows = Vec::new();
    let cases: [(&'static str, Option<usize>); 3] = [
        ("zero", None),
        ("first-byte", Some(0)),
        ("last-byte", Some(PAGE_SIZE - 1)),
    ];
    for (case, mark) in cases {
        mark_pages(buf, mark);
        let expect_zero = mark.is_none();
        let buf: &[u8] = buf;
        let row = |backend: String, f: &mut dyn FnMut() -> usize| {
            let mut times: Vec<Duration> = (0..rounds)
                .map(|_| {
                    let t = Instant::now();
                    let zeros = black_box(f());
                    let el = t.elapsed();
                    debug_assert!(backend == "read-bandwidth" || (zeros == pages) == expect_zero);
                    el
                })
                .collect();
            times.sort();
            let secs = times[rounds / 2].as_secs_f64().max(1e-9);
            ZeroBenchRow {
                backend,
                case,
                bytes: bytes as u64,
                seconds: secs,
                gb_per_s: bytes as f64 / secs / 1e9,
                completion_cpu_per_gib: None,
            }
        };
        rows.push(row("read-bandwidth".to_owned(), &mut || {
            usize::try_from(read_bandwidth_probe(black_box(buf))).unwrap_or(usize::MAX)
        }));
        for b in ZeroCheckBackend::all_available() {
            let c = ZeroChecker::with_backend(b).expect("listed as available");
            rows.push(row(b.name().to_owned(), &mut || {
                buf.chunks_exact(PAGE_SIZE)
                    // SAFETY: each chunk is PAGE_SIZE bytes of `buf`.
                    .filter(|p| unsafe { c.is_zero_page(p.as_ptr()) })
                    .count()
            }));
        }
        rows.push(row("qemu-style".to_owned(), &mut || {
            buf.chunks_exact(PAGE_SIZE)
                // SAFETY: as above.
                .filter(|p| unsafe { is_zero_page_qemu_style(p.as_ptr()) })
                .count()
        }));
        for (name, off) in &offloads {
            let before = off.stats();
            let mut measured = row(name.clone(), &mut || count_with_offload(&**off, buf));
            measured.completion_cpu_per_gib = completion_cpu_per_gib(&before, &off.stats());
            rows.push(measured);
        }
    }
    let dsa = dsa_outcome(dsa_missing, &offloads);
    ZeroBench { rows, dsa }
}

/// Zeroes every page of `buf`, then sets the byte at `mark` in each.
fn mark_pages(buf: &mut [u8], mark: Option<usize>) {
    for page in buf.chunks_exact_mut(PAGE_SIZE) {
        page.fill(0);
        if let Some(off) = mark {
            page[off] = 1;
        }
    }
}

/// What the hardware DSA did, or why it is missing.
fn dsa_outcome(dsa_missing: Option<String>, offloads: &[NamedOffload]) -> DsaBench {
    match (dsa_missing, offloads.iter().find(|(name, _)| name == "dsa")) {
        (_, Some((_, dsa))) => DsaBench::Measured {
            describe: dsa.describe(),
            stats: dsa.stats(),
        },
        (Some(why), None) => DsaBench::Missing(why),
        (None, None) => DsaBench::Missing("not opened".to_owned()),
    }
}

/// An offload with its row name.
type NamedOffload = (String, Arc<dyn ZeroPageOffload>);

/// The offloads measured: the software device, and DSA when it opens
/// (else why it did not).
fn bench_offloads() -> (Vec<NamedOffload>, Option<String>) {
    let mut offloads: Vec<NamedOffload> = vec![(
        "soft-dsa".to_owned(),
        software_dsa(SoftwareDsaConfig {
            max_batch_size: MAX_BATCH_PAGES,
            ..Default::default()
        }),
    )];
    match open_dsa(&DsaConfig::default()) {
        Ok(dsa) => {
            offloads.push(("dsa".to_owned(), dsa));
            (offloads, None)
        }
        Err(error) => (offloads, Some(error.to_string())),
    }
}

/// Completion-thread CPU per GiB checked between two snapshots.
fn completion_cpu_per_gib(before: &ZeroOffloadStats, after: &ZeroOffloadStats) -> Option<Duration> {
    let pages = after.pages_checked() - before.pages_checked();
    let cpu = after
        .completion_thread_cpu
        .saturating_sub(before.completion_thread_cpu);
    (pages > 0).then(|| cpu.mul_f64((1u64 << 30) as f64 / (pages * PAGE_SIZE as u64) as f64))
}

/// Zero pages of `buf` through an offload, [`OFFLOAD_DEPTH`] submissions in
/// flight.
fn count_with_offload(off: &dyn ZeroPageOffload, buf: &[u8]) -> usize {
    let mut in_flight = VecDeque::new();
    let mut out = Vec::with_capacity(MAX_BATCH_PAGES);
    let mut ptrs: Vec<*const u8> = Vec::with_capacity(MAX_BATCH_PAGES);
    let mut zeros = 0;
    for batch in buf.chunks(PAGE_SIZE * MAX_BATCH_PAGES) {
        ptrs.clear();
        ptrs.extend(batch.chunks_exact(PAGE_SIZE).map(<[u8]>::as_ptr));
        if in_flight.len() == OFFLOAD_DEPTH {
            let t = in_flight.pop_front().expect("non-empty");
            off.wait(t, &mut out).expect("own ticket");
            zeros += out.iter().filter(|&&z| z).count();
        }
        // SAFETY: the pages are in `buf`, borrowed until every ticket is
        // waited below.
        in_flight.push_back(unsafe { off.submit(&ptrs) }.expect("<= 128 pages"));
    }
    for t in in_flight {
        off.wait(t, &mut out).expect("own ticket");
        zeros += out.iter().filter(|&&z| z).count();
    }
    zeros
}

#[cfg(test)]
mod tests {
    use tern_page::zero::ZeroCheckBackend;

    use super::bench_zero;

    #[test]
    fn bench_rows_for_every_backend() {
        let rows = bench_zero(4 << 20, 1);
        let mut backends: Vec<String> = ZeroCheckBackend::all_available()
            .into_iter()
            .map(|b| b.name().to_owned())
            .collect();
        backends.extend(["qemu-style", "read-bandwidth"].map(String::from));
        backends.push("soft-dsa".to_owned());
        for case in ["zero", "first-byte", "last-byte"] {
            for b in &backends {
                let r = rows
                    .iter()
                    .find(|r| r.case == case && &r.backend == b)
                    .unwrap_or_else(|| panic!("no row for {b} / {case}"));
                assert!(r.gb_per_s > 0.0 && r.gb_per_s.is_finite(), "{r:?}");
                assert_eq!(r.bytes, 4 << 20);
            }
        }
        for r in &rows {
            eprintln!(
                "{:>14} {:>10} {:8.2} GB/s {}",
                r.backend,
                r.case,
                r.gb_per_s,
                r.completion_cpu_per_gib
                    .map_or(String::new(), |c| format!("completion thread {c:?}/GiB"))
            );
        }
        let soft = rows.iter().find(|r| r.backend == "soft-dsa").expect("row");
        assert!(soft.completion_cpu_per_gib.is_some(), "{soft:?}");
    }

    /// The figure for docs/zero-page-detection.md: completion-thread CPU on
    /// the software device over a DRAM-sized buffer. Run with
    /// `cargo test -p tern-dsa --release completion_thread_cpu -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement (256 MiB x 5 rounds), not a check"]
    fn completion_thread_cpu_on_the_software_device() {
        for r in bench_zero(256 << 20, 5)
            .iter()
            .filter(|r| r.completion_cpu_per_gib.is_some())
        {
            let cpu = r.completion_cpu_per_gib.expect("filtered");
            eprintln!(
                "{} {}: {:.2} GB/s, completion thread {:.1} ms CPU per GiB ({:.1}% of one core at that rate)",
                r.backend,
                r.case,
                r.gb_per_s,
                cpu.as_secs_f64() * 1e3,
                cpu.as_secs_f64() * r.gb_per_s * 1e9 / (1u64 << 30) as f64 * 100.0
            );
        }
    }
}
