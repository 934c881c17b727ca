//! Zero-page detection.
//!
//! Migration workers ask "is this 4 KiB page all zeroes?" for every page of
//! guest memory, so the check has to run at memory bandwidth: a freshly booted
//! guest is mostly zero pages, and sending a flag instead of 4 KiB for each of
//! them is the biggest single saving the migration gets.
//!
//! # Shape of every backend
//!
//! 1. **Sample** three 8-byte words (start, middle, end of the page). Most
//!    non-zero pages have data in at least one of them, so they are rejected
//!    after touching three cache lines instead of 64.
//! 2. **Scan** the whole page in blocks of 256–512 bytes, OR-ing words or
//!    vectors together and testing at least once per block, so a non-zero
//!    page stops early and the loop stays load-bound. The SIMD kernels test
//!    once per 64-byte line: on the Zen 4 machine measured, OR-ing 4–8 wide
//!    vectors before one test read DRAM-resident pages 10–15% slower.
//!
//! The backend is chosen once, by run-time CPU feature detection, and stored as
//! a function pointer in [`ZeroChecker`], so the hot path is one indirect call
//! with no feature test.
//!
//! # Concurrent writers
//!
//! Guest memory is written by the guest while we read it. That is why the page
//! API takes a raw pointer rather than a `&[u8]`: a shared slice would promise
//! the compiler that the bytes do not change, which is false. The answer is a
//! snapshot that can be stale the moment it is returned, and a read torn by a
//! concurrent write may report a page as zero that no longer is. That is fine
//! for migration: a page written during or after the check is marked dirty and
//! sent again in a later round, so the final round (with the guest paused)
//! is always exact.

use core::ptr::read_unaligned;
use std::fmt;
use std::str::FromStr;

/// Size of a guest page in bytes; the unit every page-level API works on.
/// The protocol defines it ([`tern_wire::PAGE_SIZE`]).
pub const PAGE_SIZE: usize = tern_wire::PAGE_SIZE as usize;

/// Byte offsets of the three 8-byte words sampled before the full scan.
///
/// Start and end catch headers and trailing data; the middle catches pages
/// whose data does not reach either edge.
const SAMPLE_OFFSETS: [usize; 3] = [0, PAGE_SIZE / 2, PAGE_SIZE - 8];

/// An implementation strategy for zero detection.
///
/// Exposed (rather than hidden behind [`ZeroChecker::best`]) so benchmarks and
/// the `tern bench zero` command can compare backends on the machine at hand,
/// and so a user can force a backend if a CPU's wide vectors turn out slower.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ZeroCheckBackend {
    /// Plain `u64` loads OR-ed together; the reference every other backend is
    /// tested against. (The compiler may still vectorise it.)
    Scalar,
    /// 256-bit AVX2 loads, two OR-ed per 64-byte line and tested with
    /// `vptest`, in 256-byte blocks.
    Avx2,
    /// 512-bit AVX-512 loads, four per 256-byte block, each tested with a
    /// mask compare (`vptestmq`). Requires `avx512f` and `avx512bw`.
    Avx512,
    /// Architecture-neutral code written so the compiler vectorises it with
    /// whatever the compile target offers (SSE2 on baseline x86_64, NEON on
    /// aarch64). The fallback on CPUs without AVX2.
    Portable,
}

impl ZeroCheckBackend {
    /// Every backend this crate knows, available or not.
    pub const ALL: [ZeroCheckBackend; 4] = [
        ZeroCheckBackend::Scalar,
        ZeroCheckBackend::Portable,
        ZeroCheckBackend::Avx2,
        ZeroCheckBackend::Avx512,
    ];

    /// Short lowercase name, stable for command lines and benchmark ids.
    pub fn name(self) -> &'static str {
        match self {
            ZeroCheckBackend::Scalar => "scalar",
            ZeroCheckBackend::Avx2 => "avx2",
            ZeroCheckBackend::Avx512 => "avx512",
            ZeroCheckBackend::Portable => "portable",
        }
    }

    /// Whether this backend can run on the current CPU (and was compiled for
    /// the current architecture). Detection is done at run time so one binary
    /// uses the best instructions of whichever host it lands on.
    pub fn is_available(self) -> bool {
        self.unavailable_reason().is_none()
    }

    /// Every backend that [`is_available`](Self::is_available), in
    /// [`ALL`](Self::ALL) order.
    pub fn all_available() -> Vec<Self> {
        Self::ALL.into_iter().filter(|b| b.is_available()).collect()
    }

    /// `None` if usable here, else a human-readable reason for the error.
    fn unavailable_reason(self) -> Option<&'static str> {
        match self {
            ZeroCheckBackend::Scalar | ZeroCheckBackend::Portable => None,
            #[cfg(target_arch = "x86_64")]
            ZeroCheckBackend::Avx2 => {
                (!std::arch::is_x86_feature_detected!("avx2")).then_some("this CPU lacks avx2")
            }
            #[cfg(target_arch = "x86_64")]
            ZeroCheckBackend::Avx512 => (!(std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")))
            .then_some("this CPU lacks avx512f and/or avx512bw"),
            #[cfg(not(target_arch = "x86_64"))]
            ZeroCheckBackend::Avx2 | ZeroCheckBackend::Avx512 => {
                Some("only compiled for x86_64 targets")
            }
        }
    }
}

impl fmt::Display for ZeroCheckBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ZeroCheckBackend {
    type Err = ZeroCheckError;

    /// Parses the names produced by [`ZeroCheckBackend::name`], so a CLI flag
    /// round-trips with what benchmarks print.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|b| b.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| ZeroCheckError::UnknownBackend(s.to_owned()))
    }
}

/// Why a [`ZeroChecker`] could not be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ZeroCheckError {
    /// The requested backend cannot run here; running it anyway would fault
    /// with an illegal instruction, so we refuse up front.
    #[error("zero-check backend `{backend}` is not available: {reason}")]
    Unavailable {
        /// The backend that was asked for.
        backend: ZeroCheckBackend,
        /// What is missing (CPU feature or target architecture).
        reason: &'static str,
    },
    /// A backend name that [`ZeroCheckBackend::from_str`] does not know.
    #[error("unknown zero-check backend `{0}` (expected scalar, portable, avx2 or avx512)")]
    UnknownBackend(String),
}

/// Checks whole pages: sample, then scan. `page` must be valid for
/// [`PAGE_SIZE`] bytes.
type PageFn = unsafe fn(*const u8) -> bool;
/// Checks `len` bytes without sampling. `ptr` must be valid for `len` bytes.
type RangeFn = unsafe fn(*const u8, usize) -> bool;

/// A zero-page detector bound to one backend.
///
/// The backend is resolved once at construction into function pointers, so a
/// worker builds one checker (it is `Copy`) and calls it for millions of pages
/// without repeating feature detection.
///
/// Invariant: a `ZeroChecker` only exists for a backend that is available on
/// this CPU; that is what makes [`is_zero`](Self::is_zero) safe.
#[derive(Clone, Copy)]
pub struct ZeroChecker {
    backend: ZeroCheckBackend,
    page_fn: PageFn,
    range_fn: RangeFn,
}

impl fmt::Debug for ZeroChecker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Function pointer addresses say nothing useful; the backend does.
        f.debug_struct("ZeroChecker")
            .field("backend", &self.backend)
            .finish_non_exhaustive()
    }
}

impl Default for ZeroChecker {
    /// Same as [`ZeroChecker::best`].
    fn default() -> Self {
        Self::best()
    }
}

impl ZeroChecker {
    /// The fastest backend this CPU supports: AVX-512 (avx512f + avx512bw),
    /// then AVX2, then Portable.
    ///
    /// Portable is preferred over Scalar as the fallback because it lets the
    /// compiler use the baseline vector unit of the target.
    pub fn best() -> Self {
        [ZeroCheckBackend::Avx512, ZeroCheckBackend::Avx2]
            .into_iter()
            .find_map(|b| Self::with_backend(b).ok())
            .unwrap_or_else(|| Self::from_kernels(ZeroCheckBackend::Portable))
    }

    /// A checker that uses exactly `backend`, for benchmarks and for forcing a
    /// backend from configuration.
    ///
    /// # Errors
    ///
    /// [`ZeroCheckError::Unavailable`] if the CPU lacks the instructions the
    /// backend needs (or the backend is not compiled for this architecture).
    pub fn with_backend(backend: ZeroCheckBackend) -> Result<Self, ZeroCheckError> {
        check_available(backend, backend.unavailable_reason())?;
        Ok(Self::from_kernels(backend))
    }

    /// Binds the kernels of `backend`. Callers must have checked availability.
    fn from_kernels(backend: ZeroCheckBackend) -> Self {
        let (page_fn, range_fn): (PageFn, RangeFn) = match backend {
            ZeroCheckBackend::Scalar => (scalar_page, scalar_range),
            ZeroCheckBackend::Portable => (portable_page, portable_range),
            #[cfg(target_arch = "x86_64")]
            ZeroCheckBackend::Avx2 => (x86::avx2_page, x86::avx2_range),
            #[cfg(target_arch = "x86_64")]
            ZeroCheckBackend::Avx512 => (x86::avx512_page, x86::avx512_range),
            // Never reached: with_backend rejects these off x86_64. Falling
            // back keeps this function total without a panic path.
            #[cfg(not(target_arch = "x86_64"))]
            ZeroCheckBackend::Avx2 | ZeroCheckBackend::Avx512 => (portable_page, portable_range),
        };
        ZeroChecker {
            backend,
            page_fn,
            range_fn,
        }
    }

    /// The backend this checker runs.
    pub fn backend(&self) -> ZeroCheckBackend {
        self.backend
    }

    /// Whether the [`PAGE_SIZE`] bytes at `page` are all zero.
    ///
    /// `page` needs no particular alignment. The result is a snapshot: see the
    /// module docs on concurrent writers.
    ///
    /// # Safety
    ///
    /// `page` must point to [`PAGE_SIZE`] bytes that are readable for the
    /// whole call (e.g. mapped guest memory). Other threads or the guest may
    /// write those bytes concurrently; a torn read is acceptable and only
    /// makes the answer stale.
    #[inline]
    pub unsafe fn is_zero_page(&self, page: *const u8) -> bool {
        // SAFETY: the caller guarantees PAGE_SIZE readable bytes at `page`;
        // the type invariant guarantees the backend's instructions exist on
        // this CPU.
        unsafe { (self.page_fn)(page) }
    }

    /// Whether the `len` bytes at `ptr` are all zero, without the page
    /// sampling step: for the part of a page an accelerator could not finish.
    ///
    /// # Safety
    ///
    /// `ptr` must point to `len` bytes readable for the whole call;
    /// concurrent writes are tolerated as for
    /// [`is_zero_page`](Self::is_zero_page).
    #[inline]
    pub unsafe fn is_zero_range(&self, ptr: *const u8, len: usize) -> bool {
        // SAFETY: forwarded from the caller; backend available (invariant).
        unsafe { (self.range_fn)(ptr, len) }
    }

    /// Whether every byte of `bytes` is zero; any length, including 0 (true)
    /// and lengths that are not a multiple of the vector width.
    ///
    /// For owned buffers (tests, received payloads); for guest memory use
    /// [`is_zero_page`](Self::is_zero_page). A page-sized slice goes through
    /// the sampling page path.
    pub fn is_zero(&self, bytes: &[u8]) -> bool {
        if bytes.len() == PAGE_SIZE {
            // SAFETY: the slice is valid for PAGE_SIZE bytes and cannot change
            // while borrowed; the backend is available (type invariant).
            unsafe { (self.page_fn)(bytes.as_ptr()) }
        } else {
            // SAFETY: the slice is valid for bytes.len() bytes; the backend is
            // available (type invariant).
            unsafe { (self.range_fn)(bytes.as_ptr(), bytes.len()) }
        }
    }
}

/// Turns an availability verdict into the public error. Separate from
/// [`ZeroChecker::with_backend`] so the error path is testable on a CPU that
/// has every backend.
fn check_available(
    backend: ZeroCheckBackend,
    unavailable: Option<&'static str>,
) -> Result<(), ZeroCheckError> {
    match unavailable {
        None => Ok(()),
        Some(reason) => Err(ZeroCheckError::Unavailable { backend, reason }),
    }
}

/// Reads the three sample words; `true` if all are zero.
///
/// # Safety
///
/// `page` must be readable for [`PAGE_SIZE`] bytes.
#[inline(always)]
unsafe fn sample_is_zero(page: *const u8) -> bool {
    let mut acc = 0u64;
    for off in SAMPLE_OFFSETS {
        // SAFETY: off + 8 <= PAGE_SIZE for every sample offset, so the read
        // stays inside the caller's readable range; read_unaligned has no
        // alignment requirement.
        acc |= unsafe { read_unaligned(page.add(off).cast::<u64>()) };
    }
    acc == 0
}

/// Checks the final `len` bytes that do not fill a vector block: whole words,
/// then single bytes. Shared by every backend so tails behave identically.
///
/// # Safety
///
/// `p` must be readable for `len` bytes.
#[inline]
unsafe fn tail_is_zero(p: *const u8, len: usize) -> bool {
    let mut acc = 0u64;
    let mut off = 0;
    while len - off >= 8 {
        // SAFETY: off + 8 <= len.
        acc |= unsafe { read_unaligned(p.add(off).cast::<u64>()) };
        off += 8;
    }
    while off < len {
        // SAFETY: off < len.
        acc |= u64::from(unsafe { p.add(off).read() });
        off += 1;
    }
    acc == 0
}

/// Scalar block size: four cache lines between early-exit tests.
const SCALAR_BLOCK: usize = 256;

/// Scalar scan of `len` bytes.
///
/// # Safety
///
/// `p` must be readable for `len` bytes.
#[inline]
unsafe fn scalar_range(p: *const u8, len: usize) -> bool {
    let mut off = 0;
    while len - off >= SCALAR_BLOCK {
        let mut acc = 0u64;
        let mut i = 0;
        while i < SCALAR_BLOCK {
            // SAFETY: off + i + 8 <= off + SCALAR_BLOCK <= len.
            acc |= unsafe { read_unaligned(p.add(off + i).cast::<u64>()) };
            i += 8;
        }
        if acc != 0 {
            return false;
        }
        off += SCALAR_BLOCK;
    }
    // SAFETY: off <= len, so the remaining len - off bytes are readable.
    unsafe { tail_is_zero(p.add(off), len - off) }
}

/// Scalar page check: sample, then scan.
///
/// # Safety
///
/// `page` must be readable for [`PAGE_SIZE`] bytes.
unsafe fn scalar_page(page: *const u8) -> bool {
    // SAFETY: forwarded from the caller.
    unsafe { sample_is_zero(page) && scalar_range(page, PAGE_SIZE) }
}

/// Independent `u64` accumulators in the portable backend: 64 bytes, one
/// cache line, per step, which the compiler maps onto its vector registers.
const PORTABLE_LANES: usize = 8;
/// Portable block size between early-exit tests.
const PORTABLE_BLOCK: usize = 512;

/// ORs the lanes together; written as a fixed-size loop so it reduces in
/// registers.
#[inline(always)]
fn or_lanes(acc: [u64; PORTABLE_LANES]) -> u64 {
    acc.into_iter().fold(0, |a, b| a | b)
}

/// Loads one 64-byte step into the lanes.
///
/// # Safety
///
/// `p` must be readable for 64 bytes.
#[inline(always)]
unsafe fn portable_step(acc: &mut [u64; PORTABLE_LANES], p: *const u8) {
    for (lane, a) in acc.iter_mut().enumerate() {
        // SAFETY: lane * 8 + 8 <= 64, inside the caller's readable range.
        *a |= unsafe { read_unaligned(p.add(lane * 8).cast::<u64>()) };
    }
}

/// Portable, autovectorised scan of `len` bytes.
///
/// # Safety
///
/// `p` must be readable for `len` bytes.
#[inline]
unsafe fn portable_range(p: *const u8, len: usize) -> bool {
    const STEP: usize = PORTABLE_LANES * 8;
    let mut off = 0;
    while len - off >= PORTABLE_BLOCK {
        let mut acc = [0u64; PORTABLE_LANES];
        let mut i = 0;
        while i < PORTABLE_BLOCK {
            // SAFETY: off + i + STEP <= off + PORTABLE_BLOCK <= len.
            unsafe { portable_step(&mut acc, p.add(off + i)) };
            i += STEP;
        }
        if or_lanes(acc) != 0 {
            return false;
        }
        off += PORTABLE_BLOCK;
    }
    let mut acc = [0u64; PORTABLE_LANES];
    while len - off >= STEP {
        // SAFETY: off + STEP <= len.
        unsafe { portable_step(&mut acc, p.add(off)) };
        off += STEP;
    }
    // SAFETY: off <= len, so the remaining len - off bytes are readable.
    or_lanes(acc) == 0 && unsafe { tail_is_zero(p.add(off), len - off) }
}

/// Portable page check: sample, then scan.
///
/// # Safety
///
/// `page` must be readable for [`PAGE_SIZE`] bytes.
unsafe fn portable_page(page: *const u8) -> bool {
    // SAFETY: forwarded from the caller.
    unsafe { sample_is_zero(page) && portable_range(page, PAGE_SIZE) }
}

/// The x86_64 SIMD kernels. Each is compiled with its target features
/// enabled, so it may only be called after run-time detection said yes.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{PAGE_SIZE, sample_is_zero, tail_is_zero};
    use core::arch::x86_64::{
        __m256i, __m512i, _mm256_loadu_si256, _mm256_or_si256, _mm256_testz_si256,
        _mm512_loadu_si512, _mm512_test_epi64_mask,
    };

    /// AVX2 block: four cache lines (eight 32-byte vectors) per iteration.
    const AVX2_BLOCK: usize = 256;
    /// AVX-512 block: four 64-byte vectors (four cache lines) per loop
    /// iteration, each tested separately (see `avx512_range`).
    const AVX512_BLOCK: usize = 256;

    /// AVX2 scan of `len` bytes.
    ///
    /// # Safety
    ///
    /// `p` must be readable for `len` bytes and the CPU must support AVX2.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) unsafe fn avx2_range(p: *const u8, len: usize) -> bool {
        const V: usize = 32;
        let mut off = 0;
        while len - off >= AVX2_BLOCK {
            // One test per 64-byte line (two ymm OR-ed), not one per block:
            // measured faster on DRAM-resident pages, see `avx512_range`.
            for line in 0..AVX2_BLOCK / 64 {
                let q = p.wrapping_add(off + line * 64).cast::<__m256i>();
                // SAFETY: both loads lie in off..off + AVX2_BLOCK <= len;
                // loadu has no alignment requirement.
                let v =
                    unsafe { _mm256_or_si256(_mm256_loadu_si256(q), _mm256_loadu_si256(q.add(1))) };
                // vptest: ZF is set iff (v AND v) == 0.
                if _mm256_testz_si256(v, v) == 0 {
                    return false;
                }
            }
            off += AVX2_BLOCK;
        }
        while len - off >= V {
            // SAFETY: off + V <= len.
            let v = unsafe { _mm256_loadu_si256(p.add(off).cast::<__m256i>()) };
            if _mm256_testz_si256(v, v) == 0 {
                return false;
            }
            off += V;
        }
        // SAFETY: off <= len, so the remaining len - off bytes are readable.
        unsafe { tail_is_zero(p.add(off), len - off) }
    }

    /// AVX2 page check: sample, then scan.
    ///
    /// # Safety
    ///
    /// `page` must be readable for [`PAGE_SIZE`] bytes and the CPU must
    /// support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn avx2_page(page: *const u8) -> bool {
        // SAFETY: forwarded from the caller (readability and AVX2 support).
        unsafe { sample_is_zero(page) && avx2_range(page, PAGE_SIZE) }
    }

    /// AVX-512 scan of `len` bytes.
    ///
    /// Only avx512f instructions are used, but avx512bw is required as well:
    /// it rules out the first AVX-512 parts (Xeon Phi), whose 512-bit loads
    /// are not a win for a load-bound loop like this one.
    ///
    /// # Safety
    ///
    /// `p` must be readable for `len` bytes and the CPU must support
    /// avx512f and avx512bw.
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    pub(super) unsafe fn avx512_range(p: *const u8, len: usize) -> bool {
        const V: usize = 64;
        let mut off = 0;
        while len - off >= AVX512_BLOCK {
            // Unlike the AVX2 kernel, each vector is tested on its own instead
            // of OR-ing the block first: on Zen 4 (the only AVX-512 machine
            // measured so far) an OR tree of 4 or 8 zmm loads per test read
            // DRAM-resident pages ~15% slower than one test per 64-byte line,
            // which runs at the plain read bandwidth.
            for i in 0..AVX512_BLOCK / V {
                // SAFETY: off + (i + 1) * V <= off + AVX512_BLOCK <= len;
                // loadu has no alignment requirement.
                let v = unsafe { _mm512_loadu_si512(p.add(off + i * V).cast::<__m512i>()) };
                // vptestmq: one mask bit per non-zero 64-bit lane.
                if _mm512_test_epi64_mask(v, v) != 0 {
                    return false;
                }
            }
            off += AVX512_BLOCK;
        }
        while len - off >= V {
            // SAFETY: off + V <= len.
            let v = unsafe { _mm512_loadu_si512(p.add(off).cast::<__m512i>()) };
            if _mm512_test_epi64_mask(v, v) != 0 {
                return false;
            }
            off += V;
        }
        // SAFETY: off <= len, so the remaining len - off bytes are readable.
        unsafe { tail_is_zero(p.add(off), len - off) }
    }

    /// AVX-512 page check: sample, then scan.
    ///
    /// # Safety
    ///
    /// `page` must be readable for [`PAGE_SIZE`] bytes and the CPU must
    /// support avx512f and avx512bw.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn avx512_page(page: *const u8) -> bool {
        // SAFETY: forwarded from the caller (readability and CPU support).
        unsafe { sample_is_zero(page) && avx512_range(page, PAGE_SIZE) }
    }

    /// Body of [`super::is_zero_page_qemu_style`] after its byte sample:
    /// 128-byte steps of four AVX2 vectors, one `vptest` per step.
    ///
    /// # Safety
    ///
    /// `page` must be readable for [`PAGE_SIZE`] bytes and the CPU must
    /// support AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn qemu_style_avx2(page: *const u8) -> bool {
        const STEP: usize = 128;
        let mut off = 0;
        while off < PAGE_SIZE {
            let q = page.wrapping_add(off).cast::<__m256i>();
            // SAFETY: the four loads cover off..off + STEP <= PAGE_SIZE
            // (PAGE_SIZE is a multiple of STEP); loadu is unaligned.
            let v = unsafe {
                _mm256_or_si256(
                    _mm256_or_si256(_mm256_loadu_si256(q), _mm256_loadu_si256(q.add(1))),
                    _mm256_or_si256(_mm256_loadu_si256(q.add(2)), _mm256_loadu_si256(q.add(3))),
                )
            };
            if _mm256_testz_si256(v, v) == 0 {
                return false;
            }
            off += STEP;
        }
        true
    }
}

/// Reference implementation in the style of QEMU's `buffer_is_zero`, for
/// benchmarks: sample three single bytes (first, middle, last), then scan the
/// page in 128-byte AVX2 steps with an early exit after each step. Falls back
/// to a scalar scan without AVX2. Written from that description only.
///
/// It exists so benchmarks can show the [`ZeroChecker`] backends are never
/// slower than the established approach; production code should use
/// [`ZeroChecker`], which avoids the per-call feature check.
///
/// # Safety
///
/// `page` must point to [`PAGE_SIZE`] readable bytes; concurrent writes are
/// tolerated as for [`ZeroChecker::is_zero_page`].
pub unsafe fn is_zero_page_qemu_style(page: *const u8) -> bool {
    // SAFETY: 0, PAGE_SIZE / 2 and PAGE_SIZE - 1 are inside the caller's
    // readable range.
    let sample = unsafe { *page | *page.add(PAGE_SIZE / 2) | *page.add(PAGE_SIZE - 1) };
    if sample != 0 {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was just detected; readability is the caller's.
        return unsafe { x86::qemu_style_avx2(page) };
    }
    // SAFETY: readability is the caller's.
    unsafe { scalar_range(page, PAGE_SIZE) }
}

/// Plain sequential read of `buf`, XOR-reducing every 64-bit word.
///
/// This is the yardstick for zero detection: a zero page has to be read in
/// full, so nothing can beat the time it takes just to read it. Returning the
/// XOR (which the caller should feed to `black_box`) keeps the compiler from
/// dropping the loads; eight independent lanes keep the loop load-bound rather
/// than limited by a dependency chain.
pub fn read_bandwidth_probe(buf: &[u8]) -> u64 {
    let (words, tail) = buf.as_chunks::<8>();
    let (lines, rest_words) = words.as_chunks::<PORTABLE_LANES>();
    let mut acc = [0u64; PORTABLE_LANES];
    for line in lines {
        for (a, w) in acc.iter_mut().zip(line) {
            *a ^= u64::from_ne_bytes(*w);
        }
    }
    let mut x = acc.into_iter().fold(0, |a, b| a ^ b);
    for w in rest_words {
        x ^= u64::from_ne_bytes(*w);
    }
    for &b in tail {
        x ^= u64::from(b);
    }
    x
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A buffer with room for a page at any offset 0..64 from a 64-byte
    /// aligned base, so tests control alignment exactly.
    struct Buf {
        storage: Vec<u8>,
        base: usize,
    }

    impl Buf {
        fn new() -> Self {
            let storage = vec![0u8; PAGE_SIZE + 128];
            let base = storage.as_ptr().align_offset(64);
            Buf { storage, base }
        }

        fn page_mut(&mut self, offset: usize) -> &mut [u8] {
            let start = self.base + offset;
            &mut self.storage[start..start + PAGE_SIZE]
        }
    }

    /// A page check under test, as a closure over a raw page pointer.
    type PageCheck = Box<dyn Fn(*const u8) -> bool>;

    /// Every page checker under test: the available backends plus the
    /// QEMU-style reference.
    fn checkers() -> Vec<(String, PageCheck)> {
        let mut v: Vec<(String, PageCheck)> = ZeroCheckBackend::all_available()
            .into_iter()
            .map(|b| {
                let c = ZeroChecker::with_backend(b).expect("listed as available");
                let f: PageCheck =
                    // SAFETY: tests only pass pointers to PAGE_SIZE bytes
                    // inside a live Buf.
                    Box::new(move |p| unsafe { c.is_zero_page(p) });
                (b.name().to_owned(), f)
            })
            .collect();
        v.push((
            "qemu-style".to_owned(),
            // SAFETY: as above.
            Box::new(|p| unsafe { is_zero_page_qemu_style(p) }),
        ));
        v
    }

    #[test]
    fn scalar_and_portable_always_available() {
        let all = ZeroCheckBackend::all_available();
        assert!(all.contains(&ZeroCheckBackend::Scalar));
        assert!(all.contains(&ZeroCheckBackend::Portable));
        eprintln!("available zero-check backends: {all:?}");
    }

    #[test]
    fn best_picks_widest_available() {
        let best = ZeroChecker::best().backend();
        let expected = if ZeroCheckBackend::Avx512.is_available() {
            ZeroCheckBackend::Avx512
        } else if ZeroCheckBackend::Avx2.is_available() {
            ZeroCheckBackend::Avx2
        } else {
            ZeroCheckBackend::Portable
        };
        assert_eq!(best, expected);
        assert_eq!(ZeroChecker::default().backend(), expected);
    }

    #[test]
    fn zero_page_is_zero() {
        let mut buf = Buf::new();
        for (name, check) in checkers() {
            assert!(check(buf.page_mut(0).as_ptr()), "{name}: zero page");
        }
    }

    #[test]
    fn single_nonzero_byte_anywhere_is_detected() {
        let mut buf = Buf::new();
        for (name, check) in checkers() {
            for pos in 0..PAGE_SIZE {
                let page = buf.page_mut(0);
                page[pos] = 0x80;
                assert!(!check(page.as_ptr()), "{name}: byte at {pos}");
                page[pos] = 0;
            }
            assert!(check(buf.page_mut(0).as_ptr()), "{name}: restored");
        }
    }

    #[test]
    fn first_middle_last() {
        let mut buf = Buf::new();
        for (name, check) in checkers() {
            for pos in [0, PAGE_SIZE / 2, PAGE_SIZE - 1] {
                let page = buf.page_mut(0);
                page[pos] = 1;
                assert!(!check(page.as_ptr()), "{name}: byte at {pos}");
                page[pos] = 0;
            }
        }
    }

    #[test]
    fn unaligned_pages() {
        // Positions around every block, vector and sample boundary, plus the
        // full sweep for a few offsets (the full sweep at all 63 offsets is
        // too slow in debug builds).
        let edges: Vec<usize> = [0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 127, 128]
            .into_iter()
            .chain([255, 256, 257, 511, 512, 513, 1024, 2047, 2048, 2055, 2056])
            .chain([3000, 3583, 3584, 4032, 4087, 4088, 4095])
            .collect();
        let mut buf = Buf::new();
        for (name, check) in checkers() {
            for offset in 1..64 {
                assert!(
                    check(buf.page_mut(offset).as_ptr()),
                    "{name}: zero @+{offset}"
                );
                let sweep: Vec<usize> = if matches!(offset, 1 | 8 | 33 | 63) {
                    (0..PAGE_SIZE).collect()
                } else {
                    edges.clone()
                };
                for &pos in &sweep {
                    let page = buf.page_mut(offset);
                    page[pos] = 0xff;
                    assert!(!check(page.as_ptr()), "{name}: byte {pos} @+{offset}");
                    page[pos] = 0;
                }
                // The bytes just outside the page must not be read.
                buf.storage[buf.base + offset - 1] = 1;
                buf.storage[buf.base + offset + PAGE_SIZE] = 1;
                assert!(
                    check(buf.page_mut(offset).as_ptr()),
                    "{name}: fenced @+{offset}"
                );
                buf.storage[buf.base + offset - 1] = 0;
                buf.storage[buf.base + offset + PAGE_SIZE] = 0;
            }
        }
    }

    #[test]
    fn is_zero_odd_lengths() {
        for b in ZeroCheckBackend::all_available() {
            let c = ZeroChecker::with_backend(b).unwrap();
            assert!(c.is_zero(&[]), "{b}: empty");
            for len in [1, 63, 64, 65, 4095, 4096, 4097] {
                let mut v = vec![0u8; len];
                assert!(c.is_zero(&v), "{b}: zero len {len}");
                v[len - 1] = 1;
                assert!(!c.is_zero(&v), "{b}: last byte, len {len}");
            }
        }
    }

    #[test]
    fn is_zero_every_position_short_lengths() {
        // Covers every split between block loop, vector loop and tail for
        // each backend, at a misaligned start.
        let mut storage = vec![0u8; 1100];
        for b in ZeroCheckBackend::all_available() {
            let c = ZeroChecker::with_backend(b).unwrap();
            for len in 0..=1030 {
                let s = &mut storage[3..3 + len];
                assert!(c.is_zero(s), "{b}: zero len {len}");
                for pos in (0..len).step_by(if len > 600 { 7 } else { 1 }) {
                    s[pos] = 4;
                    assert!(!c.is_zero(s), "{b}: len {len} pos {pos}");
                    s[pos] = 0;
                }
                if len > 0 {
                    s[len - 1] = 4;
                    assert!(!c.is_zero(s), "{b}: len {len} last");
                    s[len - 1] = 0;
                }
            }
        }
    }

    #[test]
    fn unavailable_backend_is_an_error() {
        let unavailable: Vec<_> = ZeroCheckBackend::ALL
            .into_iter()
            .filter(|b| !b.is_available())
            .collect();
        if unavailable.is_empty() {
            tern_test_skip::skip(
                tern_test_skip::Need::Host,
                "every zero-check backend is available on this CPU",
            );
        }
        for b in unavailable {
            let err = ZeroChecker::with_backend(b).unwrap_err();
            assert!(
                matches!(err, ZeroCheckError::Unavailable { backend, .. } if backend == b),
                "{err}"
            );
            println!("{err}");
        }
    }

    #[test]
    fn unavailable_error_path_and_message() {
        // Exercises the refusal even where the CPU has every backend.
        let err =
            check_available(ZeroCheckBackend::Avx512, Some("this CPU lacks avx512f")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "zero-check backend `avx512` is not available: this CPU lacks avx512f"
        );
        assert!(check_available(ZeroCheckBackend::Scalar, None).is_ok());
    }

    #[test]
    fn names_round_trip() {
        for b in ZeroCheckBackend::ALL {
            assert_eq!(b.name().parse::<ZeroCheckBackend>().unwrap(), b);
        }
        assert!(matches!(
            "sse9".parse::<ZeroCheckBackend>(),
            Err(ZeroCheckError::UnknownBackend(_))
        ));
    }

    #[test]
    fn read_bandwidth_probe_xors_words() {
        assert_eq!(read_bandwidth_probe(&[]), 0);
        let mut v = vec![0u8; 4096 + 13];
        assert_eq!(read_bandwidth_probe(&v), 0);
        v[0] = 1;
        v[4096 + 12] = 2;
        assert_eq!(read_bandwidth_probe(&v), 1 ^ 2);
        v[8] = 1; // same lane position in another word cancels v[0]
        assert_eq!(read_bandwidth_probe(&v), 2);
    }
}
