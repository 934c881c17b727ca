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
//! * `THP touch+copy`: `MADV_HUGEPAGE` instead, when THP allows it;
//! * `uffd copy run=N`: the mapping is registered with a userfaultfd
//!   (missing-page mode) and each run of N pages is placed with one
//!   `UFFDIO_COPY` from the cache-hot source: the kernel allocates each
//!   page and copies into it, without zeroing it first;
//! * `bounce+uffd run=N`: as the receive path would have to do it, the
//!   page is first copied into a cache-hot bounce buffer (where `readv`
//!   would put it), then placed with `UFFDIO_COPY`.
//!
//! The userfaultfd cases need `/dev/userfaultfd` (or the `userfaultfd`
//! system call allowed to this user); without it they print why and are
//! left out.
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

/// A userfaultfd with one mapping registered for missing pages; closing
/// it (on drop) unregisters the mapping.
struct Userfault {
    fd: libc::c_int,
}

/// `ioctl` numbers and structures of `linux/userfaultfd.h` (x86-64).
mod uffd {
    pub(super) const USERFAULTFD_IOC_NEW: libc::c_ulong = 0xaa00;
    pub(super) const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
    pub(super) const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
    pub(super) const UFFDIO_COPY: libc::c_ulong = 0xc028_aa03;
    pub(super) const UFFD_API: u64 = 0xaa;
    pub(super) const UFFDIO_REGISTER_MODE_MISSING: u64 = 1;

    #[repr(C)]
    pub(super) struct Api {
        pub(super) api: u64,
        pub(super) features: u64,
        pub(super) ioctls: u64,
    }

    #[repr(C)]
    pub(super) struct Register {
        pub(super) start: u64,
        pub(super) len: u64,
        pub(super) mode: u64,
        pub(super) ioctls: u64,
    }

    #[repr(C)]
    pub(super) struct Copy {
        pub(super) dst: u64,
        pub(super) src: u64,
        pub(super) len: u64,
        pub(super) mode: u64,
        pub(super) copy: i64,
    }
}

impl Userfault {
    /// Registers all of `mapping` for missing pages; `Err` says why not.
    fn register(mapping: &Mapping) -> Result<Self, String> {
        let fd = Self::open()?;
        let this = Self { fd };
        let mut api = uffd::Api {
            api: uffd::UFFD_API,
            features: 0,
            ioctls: 0,
        };
        // SAFETY: `api` is the structure this ioctl reads and writes.
        if unsafe { libc::ioctl(fd, uffd::UFFDIO_API, &mut api) } != 0 {
            return Err(format!("UFFDIO_API: {}", std::io::Error::last_os_error()));
        }
        let mut register = uffd::Register {
            start: mapping.ptr as u64,
            len: mapping.len as u64,
            mode: uffd::UFFDIO_REGISTER_MODE_MISSING,
            ioctls: 0,
        };
        // SAFETY: `register` is the structure this ioctl reads and writes;
        // the range is this process's own mapping.
        if unsafe { libc::ioctl(fd, uffd::UFFDIO_REGISTER, &mut register) } != 0 {
            return Err(format!(
                "UFFDIO_REGISTER: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(this)
    }

    /// A new userfaultfd: through `/dev/userfaultfd` (allowed to its
    /// owner whatever `vm.unprivileged_userfaultfd` says), else the
    /// system call.
    fn open() -> Result<libc::c_int, String> {
        // SAFETY: a NUL-terminated path; the descriptor is checked.
        let dev =
            unsafe { libc::open(c"/dev/userfaultfd".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if dev >= 0 {
            // SAFETY: the ioctl takes the new descriptor's flags.
            let fd = unsafe { libc::ioctl(dev, uffd::USERFAULTFD_IOC_NEW, libc::O_CLOEXEC) };
            let error = std::io::Error::last_os_error();
            // SAFETY: our own descriptor, no longer needed.
            unsafe { libc::close(dev) };
            return if fd >= 0 {
                Ok(fd)
            } else {
                Err(format!("USERFAULTFD_IOC_NEW: {error}"))
            };
        }
        // SAFETY: the system call takes flags only.
        let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) };
        if fd >= 0 {
            libc::c_int::try_from(fd)
                .map_err(|_| format!("userfaultfd: descriptor {fd} past an int"))
        } else {
            Err(format!("userfaultfd: {}", std::io::Error::last_os_error()))
        }
    }

    /// Places `pages` pages from `source` at `destination` with one
    /// `UFFDIO_COPY`.
    fn copy(&self, destination: *mut u8, source: *const u8, pages: usize) {
        let mut copy = uffd::Copy {
            dst: destination as u64,
            src: source as u64,
            len: (pages * PAGE) as u64,
            mode: 0,
            copy: 0,
        };
        // SAFETY: `copy` is the structure this ioctl reads and writes; the
        // destination lies in the registered mapping, the source in a
        // buffer of at least that length.
        let result = unsafe { libc::ioctl(self.fd, uffd::UFFDIO_COPY, &mut copy) };
        assert!(
            result == 0 && u64::try_from(copy.copy) == Ok(copy.len),
            "UFFDIO_COPY: {} (copied {})",
            std::io::Error::last_os_error(),
            copy.copy
        );
    }
}

impl Drop for Userfault {
    fn drop(&mut self) {
        // SAFETY: our own descriptor; closing it unregisters the mapping.
        unsafe { libc::close(self.fd) };
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
    UffdCopy(usize),
    BounceUffdCopy(usize),
}

impl Case {
    fn name(self) -> String {
        match self {
            Self::TouchCopy => "touch+copy".into(),
            Self::PopulateRunCopy(run) => format!("populate run={run} + copy"),
            Self::CopyIntoPopulated => "copy into populated".into(),
            Self::PopulateOnly => "populate only".into(),
            Self::HugeTouchCopy => "THP touch+copy".into(),
            Self::UffdCopy(run) => format!("uffd copy run={run}"),
            Self::BounceUffdCopy(run) => format!("bounce+uffd run={run}"),
        }
    }

    fn uses_userfaultfd(self) -> bool {
        matches!(self, Self::UffdCopy(_) | Self::BounceUffdCopy(_))
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
        let userfault = self
            .uses_userfaultfd()
            .then(|| Userfault::register(&mapping).expect("checked in main"));
        // Written once here, so its own first touch is not timed.
        let mut bounce = vec![1u8; 128 * PAGE];
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
            Self::UffdCopy(run) | Self::BounceUffdCopy(run) => {
                let userfault = userfault.as_ref().expect("registered above");
                uffd_copy_runs(&mapping, userfault, pages, run, source, &mut bounce, self);
            }
        }
        started.elapsed().as_nanos() as f64 / pages as f64
    }
}

/// Places every page of `mapping` with one `UFFDIO_COPY` per run of `run`
/// pages, from `source` or (`BounceUffdCopy`) through `bounce` first.
fn uffd_copy_runs(
    mapping: &Mapping,
    userfault: &Userfault,
    pages: usize,
    run: usize,
    source: &[u8],
    bounce: &mut [u8],
    case: Case,
) {
    let source_pages = source.len() / PAGE;
    for first in (0..pages).step_by(run) {
        let len = run.min(pages - first);
        // Runs wrap around the source, which holds a whole number of them.
        let offset = (first % source_pages) * PAGE;
        let from = &source[offset..offset + len * PAGE];
        let from = if let Case::BounceUffdCopy(_) = case {
            bounce[..from.len()].copy_from_slice(from);
            &bounce[..from.len()]
        } else {
            from
        };
        userfault.copy(mapping.page(first), from.as_ptr(), len);
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
            state.to_le_bytes()[0]
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
        Case::UffdCopy(1),
        Case::UffdCopy(8),
        Case::UffdCopy(128),
        Case::BounceUffdCopy(1),
        Case::BounceUffdCopy(8),
        Case::BounceUffdCopy(128),
    ];
    let probe = Mapping::new(PAGE, libc::MADV_NOHUGEPAGE);
    let cases: Vec<Case> = match Userfault::register(&probe) {
        Ok(_) => cases.to_vec(),
        Err(why) => {
            println!("userfaultfd cases skipped: {why}");
            cases
                .into_iter()
                .filter(|case| !case.uses_userfaultfd())
                .collect()
        }
    };
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
