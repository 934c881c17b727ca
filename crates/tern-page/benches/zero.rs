//! Zero-page detection throughput over a DRAM-resident buffer.
//!
//! The buffer (256 MiB) is far larger than any cache, so the zero-page case
//! measures how close each backend gets to the memory system's read
//! bandwidth, which the `read-bandwidth` entry measures directly. The
//! non-zero cases measure how cheaply each backend rejects a page.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use tern_page::{
    PAGE_SIZE, ZeroCheckBackend, ZeroChecker, is_zero_page_qemu_style, read_bandwidth_probe,
};

const BUF_SIZE: usize = 256 << 20;

/// A page-aligned buffer of zero pages, every page actually backed by its own
/// physical memory.
struct Pages {
    storage: Vec<u8>,
    start: usize,
}

impl Pages {
    /// `mark`: byte offset within each page to set to 1, or `None` for all-zero.
    fn new(mark: Option<usize>) -> Self {
        // Every page must be written so it is faulted in as a private page:
        // an untouched zeroed allocation maps the kernel's single shared zero
        // page everywhere, which reads from L1 at ~90 GiB/s and measures
        // nothing. Fill with non-zero first and hide that store behind
        // black_box, otherwise LLVM folds "malloc + memset(0xa5) + memset(0)"
        // into calloc and we are back to the shared zero page.
        let mut storage = vec![0xa5u8; BUF_SIZE + PAGE_SIZE];
        black_box(&mut storage);
        storage.fill(0);
        let start = storage.as_ptr().align_offset(PAGE_SIZE);
        let mut p = Pages { storage, start };
        if let Some(off) = mark {
            for page in p.bytes_mut().chunks_exact_mut(PAGE_SIZE) {
                page[off] = 1;
            }
        }
        p
    }

    fn bytes(&self) -> &[u8] {
        &self.storage[self.start..self.start + BUF_SIZE]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + BUF_SIZE]
    }
}

/// Runs `check` over every page; returns how many were zero so the work
/// cannot be optimised away.
fn count_zero(buf: &[u8], check: impl Fn(*const u8) -> bool) -> usize {
    buf.chunks_exact(PAGE_SIZE)
        .filter(|page| check(page.as_ptr()))
        .count()
}

fn bench_zero(c: &mut Criterion) {
    let cases: [(&str, Option<usize>); 4] = [
        ("zero", None),
        ("first-byte", Some(0)),
        ("last-byte", Some(PAGE_SIZE - 1)),
        // Not on a sampled word: the full scan has to find it.
        ("byte-3000", Some(3000)),
    ];
    let mut group = c.benchmark_group("zero-page");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(1500))
        .throughput(Throughput::Bytes(BUF_SIZE as u64));

    for (case, mark) in cases {
        let pages = Pages::new(mark);
        let buf = pages.bytes();
        let expected_zero = if mark.is_none() {
            BUF_SIZE / PAGE_SIZE
        } else {
            0
        };

        if mark.is_none() {
            group.bench_function(BenchmarkId::new("read-bandwidth", case), |b| {
                b.iter(|| black_box(read_bandwidth_probe(black_box(buf))))
            });
        }
        for backend in ZeroCheckBackend::all_available() {
            let checker = ZeroChecker::with_backend(backend).expect("available");
            // SAFETY: count_zero passes pointers to whole pages of `buf`.
            let check = |p| unsafe { checker.is_zero_page(p) };
            assert_eq!(count_zero(buf, check), expected_zero, "{backend} {case}");
            group.bench_function(BenchmarkId::new(backend.name(), case), |b| {
                b.iter(|| black_box(count_zero(black_box(buf), check)))
            });
        }
        // SAFETY: count_zero passes pointers to whole pages of `buf`.
        let qemu = |p| unsafe { is_zero_page_qemu_style(p) };
        assert_eq!(count_zero(buf, qemu), expected_zero, "qemu-style {case}");
        group.bench_function(BenchmarkId::new("qemu-style", case), |b| {
            b.iter(|| black_box(count_zero(black_box(buf), qemu)))
        });
    }
    group.finish();
}

criterion_group!(benches, bench_zero);
criterion_main!(benches);
