//! Intel QPL (IAA offload), loaded at run time.
//!
//! QPL is not packaged in the registries this project builds from, so
//! nothing links it: `libqpl.so` (or the file named by `TERN_QPL_LIB`) is
//! opened with `libloading` the first time QPL is asked for, and a missing
//! library is a clear [`CodecError::QplUnavailable`], never a build failure.
//!
//! # Format
//!
//! Jobs use `qpl_op_compress` with `FIRST | LAST | DYNAMIC_HUFFMAN |
//! OMIT_VERIFY` and neither the gzip nor the zlib flag: the output is a raw
//! deflate stream of one 4 KiB page, the same format as
//! [`CodecId::Deflate`](super::CodecId::Deflate), so the destination decodes
//! it with libdeflate whether or not it has IAA, and a page QPL cannot take
//! is compressed by libdeflate instead with no change on the wire.
//!
//! # Asynchronous batches
//!
//! [`QplCompressor::compress_batch`] submits one job per page
//! (`qpl_submit_job`), then waits for each (`qpl_wait_job`), so IAA works on
//! all of a packet's pages concurrently. A submission that finds the work
//! queues full (`QPL_STS_QUEUES_ARE_BUSY_ERR`) is retried
//! [`BUSY_RETRIES`] times with a yield in between; after that, or on any
//! other error, that page is compressed by libdeflate on the CPU (counted as
//! an offload fallback). On `QplPath::Software` the batch goes page by page
//! through one job instead: that path runs each job inside `qpl_submit_job`,
//! so more jobs would only cost memory.
//!
//! # Job layout
//!
//! `qpl_job` is allocated by the caller (`qpl_get_job_size` bytes, 64-byte
//! aligned) and its public fields are set directly. The offsets, enum,
//! flag and status values in `abi` are those of QPL 1.9.0's public headers
//! (`include/qpl/c_api/job.h`, `defs.h`, `status.h`), read with `offsetof`
//! and `sizeof` from the headers Debian ships in `libqpl-dev` 1.9.0-1
//! (`bench/qpl/job_layout.c` prints them): the struct starts `next_in_ptr`
//! (pointer), `available_in`, `total_in` (u32), `next_out_ptr`,
//! `available_out`, `total_out`, `op`, `flags`, `crc`, `xor_checksum`,
//! `last_bit_offset`, `level` (enums are C `int`), and the whole public
//! `qpl_job` is 240 bytes.
//!
//! Run against libqpl 1.9.0 on its software path (2026-11-23, a 2-core VM
//! without IAA; `bench/install-qpl.sh` installs it): compression and
//! decompression jobs round-trip through libdeflate, and the tests that
//! need libqpl check that the fields QPL writes back (`total_in`,
//! `total_out`) are where this layout says. **IAA hardware: not yet run.**
//! The software path's job is 740,864 bytes (the hardware path's 188,736),
//! and a batch holds one job per page.
//!
//! If the library reports a major version other than 1
//! (`qpl_get_library_version`), loading fails with
//! [`CodecError::QplUnsupported`] ("this build knows the qpl_job layout of
//! QPL 1.x only") rather than writing fields at guessed offsets; a job size
//! smaller than the public struct is refused the same way.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::PAGE_SIZE;
use crate::codec::backend::{Backend, PageDecoder, PageEncoder};
use crate::codec::batch::MAX_COMPRESSED;
use crate::codec::batch::{CompressedBatch, PageOutcome, RawReason};
use crate::codec::deflate::{deflate_page, inflate, new_deflate};
use crate::codec::error::CodecError;
use crate::codec::id::CodecImpl;
use crate::codec::qpl_path::QplPath;
use crate::codec::sample::looks_incompressible_bytes;
use crate::codec::stats::CodecCounters;

/// QPL: deflate's format, compressed through libqpl (IAA when present);
/// its decoder is the destination's IAA inflate, with libdeflate behind it.
pub(super) const BACKENDS: &[Backend] = &[Backend {
    implementation: CodecImpl::Qpl,
    encoder: |level, _, path| Ok(Box::new(QplCompressor::new(path, level)?)),
    decoder: || Ok(Box::new(QplInflater::open()?)),
    available: Some(qpl_available),
    trainer: None,
}];

/// `qpl_path_t`'s value for a path.
fn raw_path(path: QplPath) -> u32 {
    match path {
        QplPath::Auto => 0,
        QplPath::Hardware => 1,
        QplPath::Software => 2,
    }
}

// The page and output sizes as QPL's `u32` job fields.
#[expect(clippy::cast_possible_truncation, reason = "4096 fits in u32")]
const PAGE_SIZE_U32: u32 = PAGE_SIZE as u32;
#[expect(clippy::cast_possible_truncation, reason = "4095 fits in u32")]
const MAX_COMPRESSED_U32: u32 = MAX_COMPRESSED as u32;

/// Submissions tried against a busy queue before the CPU takes the page.
pub(super) const BUSY_RETRIES: u32 = 8;

/// How long a batch's jobs may run before they are given up. IAA finishes
/// a 4 KiB job in microseconds and the pages it reads and writes are the
/// compressor's own resident buffers, so a job still running after a second
/// is a stuck, disabled or reset device: its jobs are retired (see
/// [`RetiredJobs`]) and the compressor stops offering work to QPL.
pub(super) const JOB_DEADLINE: Duration = Duration::from_secs(1);

/// Status polls spun before the waiting thread starts to sleep between
/// them: a hardware job normally completes within these.
const SPIN_POLLS: u32 = 256;

/// The pause between status polls once spinning did not see the job end.
const POLL_PAUSE: Duration = Duration::from_micros(20);

/// Offsets and constants of QPL 1.x's public C API, as QPL 1.9.0's headers
/// give them (see module docs).
mod abi {
    pub(super) const OFF_NEXT_IN: usize = 0;
    pub(super) const OFF_AVAILABLE_IN: usize = 8;
    pub(super) const OFF_TOTAL_IN: usize = 12;
    pub(super) const OFF_NEXT_OUT: usize = 16;
    pub(super) const OFF_AVAILABLE_OUT: usize = 24;
    pub(super) const OFF_TOTAL_OUT: usize = 28;
    pub(super) const OFF_OP: usize = 32;
    pub(super) const OFF_FLAGS: usize = 36;
    pub(super) const OFF_LEVEL: usize = 52;
    /// Bytes of the prefix this build writes or reads.
    pub(super) const KNOWN_PREFIX: usize = 56;
    /// `sizeof(qpl_job)` in QPL 1.9.0's job.h; `qpl_get_job_size` adds the
    /// library's private state after it, so a smaller size is not QPL 1.x.
    pub(super) const PUBLIC_JOB_SIZE: usize = 240;
    // The job-size check in `Job::new` covers every field written.
    const _: () = assert!(KNOWN_PREFIX <= PUBLIC_JOB_SIZE);

    pub(super) const OP_DECOMPRESS: u32 = 0x00;
    pub(super) const OP_COMPRESS: u32 = 0x01;
    pub(super) const FLAG_FIRST: u32 = 0x0001;
    pub(super) const FLAG_LAST: u32 = 0x0002;
    pub(super) const FLAG_DYNAMIC_HUFFMAN: u32 = 0x2000;
    pub(super) const FLAG_OMIT_VERIFY: u32 = 0x4000;

    pub(super) const STS_OK: u32 = 0;
    pub(super) const STS_BEING_PROCESSED: u32 = 1;
    pub(super) const STS_MORE_OUTPUT_NEEDED: u32 = 2;
    pub(super) const STS_QUEUES_ARE_BUSY: u32 = 5;
    pub(super) const STS_DST_IS_SHORT: u32 = 225;
    pub(super) const STS_INTL_OUTPUT_OVERFLOW: u32 = 311;
    pub(super) const STS_INIT_HW_NOT_SUPPORTED: u32 = 500;
    pub(super) const STS_INIT_LIBACCEL_NOT_FOUND: u32 = 501;
    pub(super) const STS_INIT_LIBACCEL_ERROR: u32 = 502;
    pub(super) const STS_INIT_WORK_QUEUES_NOT_AVAILABLE: u32 = 503;
}

type GetJobSizeFn = unsafe extern "C" fn(u32, *mut u32) -> u32;
type InitJobFn = unsafe extern "C" fn(u32, *mut u8) -> u32;
type JobFn = unsafe extern "C" fn(*mut u8) -> u32;

/// The resolved QPL entry points; the library stays open as long as this
/// lives.
struct QplLib {
    get_job_size: GetJobSizeFn,
    init_job: InitJobFn,
    submit_job: JobFn,
    // Resolved so that a library lacking it is refused early; jobs are
    // waited for by polling `check_job` against a deadline instead, since
    // `qpl_wait_job` has none.
    #[allow(dead_code)]
    wait_job: JobFn,
    check_job: JobFn,
    fini_job: JobFn,
    _lib: libloading::Library,
}

#[derive(Clone, Debug)]
enum LoadFailure {
    Missing(String),
    Unsupported(String),
}

impl From<LoadFailure> for CodecError {
    fn from(f: LoadFailure) -> Self {
        match f {
            LoadFailure::Missing(m) => CodecError::QplUnavailable(m),
            LoadFailure::Unsupported(m) => CodecError::QplUnsupported(m),
        }
    }
}

fn load_from(candidates: &[&str]) -> Result<QplLib, LoadFailure> {
    let mut last = String::new();
    let lib = candidates.iter().find_map(|name| {
        // SAFETY: opening a shared library runs its initialisers. libqpl is a
        // system library the operator installed on purpose, trusted like
        // any library we would link.
        match unsafe { libloading::Library::new(name) } {
            Ok(l) => Some(l),
            Err(e) => {
                last = e.to_string();
                None
            }
        }
    });
    let Some(lib) = lib else {
        return Err(LoadFailure::Missing(format!(
            "libqpl.so not found: install Intel QPL (libqpl.so.1; tern's bench/install-qpl.sh) \
             or set TERN_QPL_LIB to its path ({last})"
        )));
    };
    macro_rules! sym {
        ($name:literal, $ty:ty) => {{
            // SAFETY: the symbol is QPL's public C function of this name,
            // whose signature in QPL 1.x is $ty; the pointer is only used
            // while `lib` is alive (it is stored next to it).
            let s: libloading::Symbol<'_, $ty> = unsafe { lib.get($name) }.map_err(|e| {
                LoadFailure::Unsupported(format!("libqpl lacks {}: {e}", stringify!($name)))
            })?;
            *s
        }};
    }
    let get_job_size = sym!(b"qpl_get_job_size\0", GetJobSizeFn);
    let init_job = sym!(b"qpl_init_job\0", InitJobFn);
    let submit_job = sym!(b"qpl_submit_job\0", JobFn);
    let wait_job = sym!(b"qpl_wait_job\0", JobFn);
    let check_job = sym!(b"qpl_check_job\0", JobFn);
    let fini_job = sym!(b"qpl_fini_job\0", JobFn);
    type VersionFn = unsafe extern "C" fn() -> *const std::ffi::c_char;
    // SAFETY: optional symbol; QPL declares it `const char *(void)`.
    if let Ok(version) = unsafe { lib.get::<VersionFn>(b"qpl_get_library_version\0") } {
        // SAFETY: the function takes no arguments and returns a static
        // NUL-terminated string (or NULL, checked).
        let p = unsafe { version() };
        if !p.is_null() {
            // SAFETY: non-null, NUL-terminated static string per QPL's API.
            let v = unsafe { std::ffi::CStr::from_ptr(p) }
                .to_string_lossy()
                .into_owned();
            let major = v.trim_start_matches(|c: char| !c.is_ascii_digit());
            if !major.starts_with("1.") {
                return Err(LoadFailure::Unsupported(format!(
                    "libqpl {v} found but this build knows the qpl_job layout of QPL 1.x only"
                )));
            }
        }
    }
    Ok(QplLib {
        get_job_size,
        init_job,
        submit_job,
        wait_job,
        check_job,
        fini_job,
        _lib: lib,
    })
}

fn library() -> Result<Arc<QplLib>, CodecError> {
    static LIB: OnceLock<Result<Arc<QplLib>, LoadFailure>> = OnceLock::new();
    LIB.get_or_init(|| {
        let env = std::env::var("TERN_QPL_LIB").ok();
        let names: Vec<&str> = match env.as_deref() {
            Some(p) => vec![p],
            None => vec!["libqpl.so", "libqpl.so.1"],
        };
        load_from(&names).map(Arc::new)
    })
    .clone()
    .map_err(CodecError::from)
}

/// Whether libqpl can be loaded; the error says why not.
fn qpl_available() -> Result<(), CodecError> {
    library().map(|_| ())
}

/// Why `qpl_init_job` failed. QPL's init statuses (`QPL_INIT_ERROR`, 500
/// and up) are how the hardware path says there is no usable IAA: seen
/// with libqpl 1.9.0 on a machine without IAA, status 501.
fn init_failure(path: QplPath, status: u32) -> CodecError {
    let why = match status {
        abi::STS_INIT_HW_NOT_SUPPORTED => "hardware path not supported on this CPU",
        abi::STS_INIT_LIBACCEL_NOT_FOUND => "libaccel-config not found",
        abi::STS_INIT_LIBACCEL_ERROR => "libaccel-config error",
        abi::STS_INIT_WORK_QUEUES_NOT_AVAILABLE => "no enabled IAA work queue (or no access)",
        _ => {
            return CodecError::Qpl {
                call: "qpl_init_job",
                status,
            };
        }
    };
    CodecError::QplUnavailable(format!(
        "no IAA work queue usable by libqpl on the {path} path: {why} \
         (qpl_init_job status {status}); --qpl-path software runs QPL on the CPU"
    ))
}

/// One `qpl_job`, caller-allocated and initialised.
struct Job {
    ptr: *mut u8,
    layout: Layout,
    lib: Arc<QplLib>,
}

// SAFETY: the job memory is owned exclusively by this value; QPL jobs are
// plain memory not tied to the thread that initialised them.
unsafe impl Send for Job {}

impl Job {
    fn new(lib: &Arc<QplLib>, path: QplPath) -> Result<Self, CodecError> {
        let mut size = 0u32;
        // SAFETY: `size` is a valid u32 out-pointer.
        let st = unsafe { (lib.get_job_size)(raw_path(path), &mut size) };
        if st != abi::STS_OK {
            return Err(CodecError::Qpl {
                call: "qpl_get_job_size",
                status: st,
            });
        }
        let size = size as usize;
        if size < abi::PUBLIC_JOB_SIZE {
            return Err(CodecError::QplUnsupported(format!(
                "libqpl found but its job is {size} bytes, smaller than the {} bytes of \
                 QPL 1.x's public qpl_job: cannot use its layout",
                abi::PUBLIC_JOB_SIZE
            )));
        }
        let layout = Layout::from_size_align(size, 64).map_err(|e| CodecError::Init {
            codec: "qpl",
            detail: e.to_string(),
        })?;
        // SAFETY: layout has non-zero size (>= PUBLIC_JOB_SIZE).
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        // SAFETY: `ptr` is qpl_get_job_size bytes, 64-byte aligned, as
        // qpl_init_job requires.
        let st = unsafe { (lib.init_job)(raw_path(path), ptr) };
        if st != abi::STS_OK {
            // SAFETY: allocated above with this layout, not initialised.
            unsafe { dealloc(ptr, layout) };
            return Err(init_failure(path, st));
        }
        Ok(Self {
            ptr,
            layout,
            lib: lib.clone(),
        })
    }

    /// Sets up a one-shot raw-deflate compression of `input` into `out`.
    ///
    /// # Safety
    ///
    /// `input` and `out` must stay valid and unmoved until the job is waited
    /// for.
    unsafe fn prepare(
        &mut self,
        input: &[u8; PAGE_SIZE],
        out: &mut [u8; MAX_COMPRESSED],
        level: u32,
    ) {
        let flags =
            abi::FLAG_FIRST | abi::FLAG_LAST | abi::FLAG_DYNAMIC_HUFFMAN | abi::FLAG_OMIT_VERIFY;
        // SAFETY: the caller's contract.
        unsafe {
            self.fill(
                abi::OP_COMPRESS,
                flags,
                (input.as_ptr(), PAGE_SIZE_U32),
                (out.as_mut_ptr(), MAX_COMPRESSED_U32),
            );
        }
        // SAFETY: within the checked prefix (see `fill`).
        unsafe {
            self.ptr
                .add(abi::OFF_LEVEL)
                .cast::<u32>()
                .write_unaligned(level)
        };
    }

    /// Sets up a one-shot inflate of the raw deflate stream `input` into
    /// `out`, whose length bounds every write.
    ///
    /// # Safety
    ///
    /// `input` and `out` must stay valid and unmoved until the job is waited
    /// for.
    unsafe fn prepare_decompress(&mut self, input: &[u8], out: &mut [u8; PAGE_SIZE]) {
        // The caller checked 1..=MAX_COMPRESSED bytes. The level field is
        // ignored by inflate.
        let input_len = u32::try_from(input.len()).unwrap_or(0);
        // SAFETY: the caller's contract.
        unsafe {
            self.fill(
                abi::OP_DECOMPRESS,
                abi::FLAG_FIRST | abi::FLAG_LAST,
                (input.as_ptr(), input_len),
                (out.as_mut_ptr(), PAGE_SIZE_U32),
            );
        }
    }

    /// Writes the job's operation, flags, input and output (pointer and
    /// length each) and zeroes its totals.
    ///
    /// # Safety
    ///
    /// The buffers must stay valid and unmoved until the job is waited for.
    unsafe fn fill(&mut self, op: u32, flags: u32, input: (*const u8, u32), out: (*mut u8, u32)) {
        // SAFETY: every offset + field size is within KNOWN_PREFIX <
        // PUBLIC_JOB_SIZE <= the job size (checked in `new`); fields are
        // written unaligned-safe. QPL's input field is `uint8_t *`; jobs
        // only read through it.
        unsafe {
            let j = self.ptr;
            j.add(abi::OFF_NEXT_IN)
                .cast::<*const u8>()
                .write_unaligned(input.0);
            j.add(abi::OFF_AVAILABLE_IN)
                .cast::<u32>()
                .write_unaligned(input.1);
            j.add(abi::OFF_TOTAL_IN).cast::<u32>().write_unaligned(0);
            j.add(abi::OFF_NEXT_OUT)
                .cast::<*mut u8>()
                .write_unaligned(out.0);
            j.add(abi::OFF_AVAILABLE_OUT)
                .cast::<u32>()
                .write_unaligned(out.1);
            j.add(abi::OFF_TOTAL_OUT).cast::<u32>().write_unaligned(0);
            j.add(abi::OFF_OP).cast::<u32>().write_unaligned(op);
            j.add(abi::OFF_FLAGS).cast::<u32>().write_unaligned(flags);
        }
    }

    fn total_out(&self) -> usize {
        // SAFETY: within the checked prefix.
        unsafe {
            self.ptr
                .add(abi::OFF_TOTAL_OUT)
                .cast::<u32>()
                .read_unaligned() as usize
        }
    }

    /// The input bytes QPL reports it consumed (tests check the layout with
    /// it).
    #[cfg(test)]
    fn total_in(&self) -> usize {
        // SAFETY: within the checked prefix.
        unsafe {
            self.ptr
                .add(abi::OFF_TOTAL_IN)
                .cast::<u32>()
                .read_unaligned() as usize
        }
    }

    /// Submits, retrying a busy queue; returns the final submit status (on
    /// QPL's software path, the job's own status: it runs synchronously).
    fn submit(&mut self) -> u32 {
        let mut st = abi::STS_QUEUES_ARE_BUSY;
        for _ in 0..=BUSY_RETRIES {
            // SAFETY: the job was initialised and prepared.
            st = unsafe { (self.lib.submit_job)(self.ptr) };
            if st != abi::STS_QUEUES_ARE_BUSY {
                break;
            }
            std::thread::yield_now();
        }
        st
    }

    /// The job's status now: `STS_BEING_PROCESSED` while it runs.
    fn status(&self) -> u32 {
        // SAFETY: the job was initialised; `qpl_check_job` reads its state
        // (and the completion record of a submitted job) without blocking.
        unsafe { (self.lib.check_job)(self.ptr) }
    }

    /// Waits for a submitted job until `deadline`: its final status, or
    /// `None` when it is still running then (the caller retires it).
    fn wait_until(&self, deadline: Instant) -> Option<u32> {
        let mut polls = 0u32;
        loop {
            let status = self.status();
            if status != abi::STS_BEING_PROCESSED {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            polls = polls.saturating_add(1);
            if polls < SPIN_POLLS {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(POLL_PAUSE);
            }
        }
    }
}

/// A job with the buffers it reads and writes. QPL, and IAA behind it,
/// hold the buffers' addresses until the job completes, so the job and its
/// buffers are one unit: a job given up at its deadline takes its buffers
/// into [`RetiredJobs`], and the slot gets fresh ones. Every buffer is
/// boxed, so its address stays put when the slot moves.
struct JobSlot {
    /// `None` once the compressor stopped using QPL.
    job: Option<Job>,
    input: Box<[u8; PAGE_SIZE]>,
    out: Box<[u8; PAGE_SIZE]>,
}

impl JobSlot {
    fn new(lib: &Arc<QplLib>, path: QplPath) -> Result<Self, CodecError> {
        Ok(Self {
            job: Some(Job::new(lib, path)?),
            input: Box::new([0; PAGE_SIZE]),
            out: Box::new([0; PAGE_SIZE]),
        })
    }

    /// The first `MAX_COMPRESSED` bytes of the output buffer, where a
    /// compression job writes.
    fn compressed_out(&mut self) -> &mut [u8; MAX_COMPRESSED] {
        self.out
            .first_chunk_mut::<MAX_COMPRESSED>()
            .unwrap_or_else(|| unreachable!("MAX_COMPRESSED < PAGE_SIZE"))
    }

    /// Prepares and submits a compression of `input` into `out`; the
    /// submit status (`STS_OK`: in flight), or `None` without a job.
    fn submit_compress(&mut self, level: u32) -> Option<u32> {
        let Self { job, input, out } = self;
        let job = job.as_mut()?;
        let out = out
            .first_chunk_mut::<MAX_COMPRESSED>()
            .unwrap_or_else(|| unreachable!("MAX_COMPRESSED < PAGE_SIZE"));
        // SAFETY: `input` and `out` are this slot's boxed buffers, which go
        // wherever the job goes until it completes (retired together).
        unsafe { job.prepare(input, out, level) };
        Some(job.submit())
    }

    /// Prepares and submits an inflate of `input[..len]` into `out`.
    fn submit_decompress(&mut self, len: usize) -> Option<u32> {
        let Self { job, input, out } = self;
        let job = job.as_mut()?;
        // SAFETY: as in `submit_compress`.
        unsafe { job.prepare_decompress(&input[..len], out) };
        Some(job.submit())
    }

    /// Waits for the submitted job until `deadline` (see
    /// [`Job::wait_until`]); `None` also when the slot has no job.
    fn wait_until(&self, deadline: Instant) -> Option<u32> {
        self.job.as_ref()?.wait_until(deadline)
    }

    fn total_out(&self) -> usize {
        self.job.as_ref().map_or(0, Job::total_out)
    }

    /// Gives up the job in flight: it moves into `retired` together with the buffers it may still read or write, and
    /// this slot keeps fresh buffers (the input copied, so the CPU can
    /// take the page) and no job.
    fn retire_job(&mut self, retired: &mut RetiredJobs) {
        let Some(job) = self.job.take() else {
            return;
        };
        let copy = self.input.clone();
        let input = std::mem::replace(&mut self.input, copy);
        let out = std::mem::replace(&mut self.out, Box::new([0; PAGE_SIZE]));
        retired.slots.push(JobSlot {
            job: Some(job),
            input,
            out,
        });
    }
}

/// Jobs given up at their deadline, kept with their buffers until QPL says
/// they ended: freeing memory a device may still write would be a write
/// outside anything we own. Ended jobs are freed at the next
/// [`reap`](Self::reap); jobs still running when this is dropped are
/// leaked on purpose (a few hundred KiB each, after a device failure).
#[derive(Default)]
struct RetiredJobs {
    slots: Vec<JobSlot>,
}

impl RetiredJobs {
    /// Frees the retired jobs that have ended.
    fn reap(&mut self) {
        self.slots.retain(|slot| {
            slot.job
                .as_ref()
                .is_some_and(|job| job.status() == abi::STS_BEING_PROCESSED)
        });
    }

    fn len(&self) -> usize {
        self.slots.len()
    }
}

impl Drop for RetiredJobs {
    fn drop(&mut self) {
        self.reap();
        for slot in self.slots.drain(..) {
            // The device may still write these buffers: never free them.
            std::mem::forget(slot);
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // SAFETY: initialised in `new` and never in flight here (every
        // submitted job is waited for in the same call that submitted it);
        // then freed with the layout it was allocated with.
        unsafe {
            (self.lib.fini_job)(self.ptr);
            dealloc(self.ptr, self.layout);
        }
    }
}

/// Counts from one batch.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct BatchCounts {
    pub compressed: u64,
    pub did_not_shrink: u64,
    pub sampled: u64,
    pub software: u64,
}

/// Deflate through QPL, one job per page, with libdeflate as the fallback.
pub struct QplCompressor {
    lib: Arc<QplLib>,
    path: QplPath,
    level: i32,
    /// One job with its buffers per page of the largest batch so far.
    slots: Vec<JobSlot>,
    retired: RetiredJobs,
    /// How long a batch's jobs may run ([`JOB_DEADLINE`]).
    job_deadline: Duration,
    /// Set when a job missed its deadline: every page goes to libdeflate
    /// from then on (counted as offload fallbacks).
    gave_up: bool,
    software: libdeflater::Compressor,
}

impl fmt::Debug for QplCompressor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QplCompressor")
            .field("path", &self.path)
            .field("level", &self.level)
            .field("jobs", &self.slots.len())
            .field("retired", &self.retired.len())
            .field("gave_up", &self.gave_up)
            .finish()
    }
}

/// Whether QPL runs jobs of `level` on `path` on the CPU although the path
/// may use IAA: IAA compresses at level 1 only, so `auto` at level 3 always
/// takes QPL's software path. Such pages are counted as offload fallbacks
/// (`offload_fallbacks`), so the report shows that IAA did not take them.
pub(crate) fn level_runs_on_the_cpu(path: QplPath, level: i32) -> bool {
    path == QplPath::Auto && level >= 3
}

/// What became of one page of a batch.
enum Slot {
    Sampled,
    Submitted,
    Done(Option<usize>),
}

impl QplCompressor {
    /// Loads libqpl (once per process) and initialises one job. Levels: QPL
    /// has 1 (default, the only one IAA hardware runs) and 3 (high,
    /// software path); requests are clamped to those, and to 1 on the
    /// hardware path.
    pub fn new(path: QplPath, level: i32) -> Result<Self, CodecError> {
        Self::with_library(library()?, path, level)
    }

    fn with_library(lib: Arc<QplLib>, path: QplPath, level: i32) -> Result<Self, CodecError> {
        let level = if path == QplPath::Hardware || level < 3 {
            1
        } else {
            3
        };
        let first = JobSlot::new(&lib, path)?;
        Ok(Self {
            lib,
            path,
            level,
            slots: vec![first],
            retired: RetiredJobs::default(),
            job_deadline: JOB_DEADLINE,
            gave_up: false,
            software: new_deflate(level),
        })
    }

    /// The QPL level in force (1 or 3).
    pub fn level(&self) -> i32 {
        self.level
    }

    /// The level as the job's `u32` field.
    fn level_u32(&self) -> u32 {
        // `new` sets 1 or 3.
        self.level.unsigned_abs()
    }

    /// The execution path.
    pub fn path(&self) -> QplPath {
        self.path
    }

    fn ensure(&mut self, n: usize) -> Result<(), CodecError> {
        while self.slots.len() < n {
            self.slots.push(JobSlot::new(&self.lib, self.path)?);
        }
        Ok(())
    }

    /// A job's final status: `Ok(Some(len))` compressed, `Ok(None)` did not
    /// fit in `MAX_COMPRESSED`, `Err` failed (the CPU takes the page). QPL's
    /// software path runs the job inside `qpl_submit_job`, so a page that
    /// does not fit shows as submit's status (`MORE_OUTPUT_NEEDED`, seen
    /// with libqpl 1.9.0), not as a failure to submit.
    fn finish(status: u32, total_out: usize) -> Result<Option<usize>, ()> {
        match status {
            abi::STS_OK if (1..=MAX_COMPRESSED).contains(&total_out) => Ok(Some(total_out)),
            abi::STS_OK
            | abi::STS_MORE_OUTPUT_NEEDED
            | abi::STS_DST_IS_SHORT
            | abi::STS_INTL_OUTPUT_OVERFLOW => Ok(None),
            _ => Err(()),
        }
    }

    /// Stops offering work to QPL after a job missed its deadline.
    fn give_up(&mut self, index: usize) {
        self.slots[index].retire_job(&mut self.retired);
        self.gave_up = true;
    }

    /// Compresses slot `index`'s input on the CPU into its output.
    fn on_the_cpu(&mut self, index: usize) -> Option<usize> {
        let JobSlot { input, out, .. } = &mut self.slots[index];
        let out = out
            .first_chunk_mut::<MAX_COMPRESSED>()
            .unwrap_or_else(|| unreachable!("MAX_COMPRESSED < PAGE_SIZE"));
        deflate_page(&mut self.software, input, out)
    }

    /// Compresses the first slot's input synchronously into its output;
    /// the bool says whether the software fallback did it.
    fn compress_first_slot(&mut self) -> (Option<usize>, bool) {
        self.retired.reap();
        let level = self.level_u32();
        let result = match self.slots[0].submit_compress(level) {
            None => Err(()),
            Some(abi::STS_OK) => {
                let deadline = Instant::now() + self.job_deadline;
                match self.slots[0].wait_until(deadline) {
                    Some(status) => Self::finish(status, self.slots[0].total_out()),
                    None => {
                        self.give_up(0);
                        Err(())
                    }
                }
            }
            Some(refused) => Self::finish(refused, 0),
        };
        match result {
            Ok(n) => (n, level_runs_on_the_cpu(self.path, self.level)),
            Err(()) => (self.on_the_cpu(0), true),
        }
    }

    /// Compresses one page synchronously; the bool says whether the
    /// software fallback did it.
    pub(crate) fn compress_one(
        &mut self,
        page: &[u8; PAGE_SIZE],
        out: &mut [u8; MAX_COMPRESSED],
    ) -> (Option<usize>, bool) {
        *self.slots[0].input = *page;
        let (n, software) = self.compress_first_slot();
        if let Some(n) = n {
            out[..n].copy_from_slice(&self.slots[0].out[..n]);
        }
        (n, software)
    }

    /// Compresses a packet's pages: copies each to a private buffer,
    /// samples it, submits a job per page, then waits for all until one
    /// deadline. Results are appended to `batch` in page order.
    ///
    /// # Safety
    ///
    /// Every pointer must point to [`PAGE_SIZE`] readable bytes (concurrent
    /// writes tolerated: each page is copied before QPL sees it).
    pub(crate) unsafe fn compress_batch(
        &mut self,
        pages: &[*const u8],
        batch: &mut CompressedBatch,
        sampling: bool,
    ) -> BatchCounts {
        if self.path == QplPath::Software || self.gave_up {
            // SAFETY: the caller's contract, passed on.
            return unsafe { self.compress_page_by_page(pages, batch, sampling) };
        }
        if self.ensure(pages.len()).is_err() {
            // Could not get enough jobs: the whole batch goes page by page
            // through the first (a job per page buys only concurrency).
            // SAFETY: the caller's contract, passed on.
            return unsafe { self.compress_page_by_page(pages, batch, sampling) };
        }
        self.retired.reap();
        let mut counts = BatchCounts::default();
        // SAFETY: the caller's contract, passed on.
        let mut slots = unsafe { self.submit_all(pages, sampling, &mut counts) };
        self.wait_all(&mut slots, &mut counts);
        for (i, slot) in slots.into_iter().enumerate() {
            match slot {
                Slot::Sampled => {
                    counts.sampled += 1;
                    batch.outcomes.push(PageOutcome::Raw(RawReason::Sampled));
                }
                Slot::Done(n) => Self::push(batch, &mut counts, n, self.slots[i].compressed_out()),
                Slot::Submitted => unreachable!("every submitted job was waited for"),
            }
        }
        if level_runs_on_the_cpu(self.path, self.level) {
            // QPL took them, but on the CPU: say so.
            counts.software = (pages.len() as u64).saturating_sub(counts.sampled);
        }
        counts
    }

    /// Copies each page into its slot, samples it, and submits a job for
    /// each page worth compressing; a page QPL refuses goes to the CPU.
    ///
    /// # Safety
    ///
    /// As [`compress_batch`](Self::compress_batch); `ensure(pages.len())`
    /// succeeded.
    unsafe fn submit_all(
        &mut self,
        pages: &[*const u8],
        sampling: bool,
        counts: &mut BatchCounts,
    ) -> Vec<Slot> {
        let level = self.level_u32();
        let mut slots = Vec::with_capacity(pages.len());
        for (i, &p) in pages.iter().enumerate() {
            // SAFETY: caller contract; the slot's input is private memory
            // with no job in flight on it.
            unsafe {
                core::ptr::copy_nonoverlapping(p, self.slots[i].input.as_mut_ptr(), PAGE_SIZE)
            };
            if sampling && looks_incompressible_bytes(&self.slots[i].input) {
                slots.push(Slot::Sampled);
                continue;
            }
            let slot = match self.slots[i].submit_compress(level) {
                Some(abi::STS_OK) => Slot::Submitted,
                refused => match refused.map_or(Err(()), |st| Self::finish(st, 0)) {
                    Ok(n) => Slot::Done(n),
                    Err(()) => {
                        counts.software += 1;
                        Slot::Done(self.on_the_cpu(i))
                    }
                },
            };
            slots.push(slot);
        }
        slots
    }

    /// Waits for every submitted job until one deadline for the batch; a
    /// job still running then is retired and its page goes to the CPU.
    fn wait_all(&mut self, slots: &mut [Slot], counts: &mut BatchCounts) {
        let deadline = Instant::now() + self.job_deadline;
        for (i, slot) in slots.iter_mut().enumerate() {
            if !matches!(slot, Slot::Submitted) {
                continue;
            }
            let result = match self.slots[i].wait_until(deadline) {
                Some(status) => Self::finish(status, self.slots[i].total_out()),
                None => {
                    self.give_up(i);
                    Err(())
                }
            };
            *slot = match result {
                Ok(n) => Slot::Done(n),
                Err(()) => {
                    counts.software += 1;
                    Slot::Done(self.on_the_cpu(i))
                }
            };
        }
    }

    /// QPL's software path runs each job inside `qpl_submit_job`, so a job
    /// per page buys no concurrency there, and each costs 740,864 bytes
    /// (libqpl 1.9.0): the software path uses its one job, page by page.
    /// So does a compressor that gave up on QPL (the CPU takes each page).
    ///
    /// # Safety
    ///
    /// As [`compress_batch`](Self::compress_batch).
    unsafe fn compress_page_by_page(
        &mut self,
        pages: &[*const u8],
        batch: &mut CompressedBatch,
        sampling: bool,
    ) -> BatchCounts {
        let mut counts = BatchCounts::default();
        for &p in pages {
            // SAFETY: caller contract; the first slot's input is private
            // memory with no job in flight on it.
            unsafe {
                core::ptr::copy_nonoverlapping(p, self.slots[0].input.as_mut_ptr(), PAGE_SIZE)
            };
            if sampling && looks_incompressible_bytes(&self.slots[0].input) {
                counts.sampled += 1;
                batch.outcomes.push(PageOutcome::Raw(RawReason::Sampled));
                continue;
            }
            let (n, software) = self.compress_first_slot();
            counts.software += u64::from(software);
            Self::push(batch, &mut counts, n, self.slots[0].compressed_out());
        }
        counts
    }

    fn push(
        batch: &mut CompressedBatch,
        counts: &mut BatchCounts,
        n: Option<usize>,
        out: &[u8; MAX_COMPRESSED],
    ) {
        match n {
            Some(n) => {
                counts.compressed += 1;
                batch.push_compressed(&out[..n]);
            }
            None => {
                counts.did_not_shrink += 1;
                batch
                    .outcomes
                    .push(PageOutcome::Raw(RawReason::DidNotShrink));
            }
        }
    }
}

/// Inflate through QPL (on the destination, IAA's decompressor), one page
/// per job, synchronously, into the job's own buffers (so a job given up
/// at its deadline can never write the caller's page).
pub struct QplDecompressor {
    path: QplPath,
    slot: JobSlot,
    retired: RetiredJobs,
    job_deadline: Duration,
}

impl fmt::Debug for QplDecompressor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QplDecompressor")
            .field("path", &self.path)
            .field("retired", &self.retired.len())
            .finish()
    }
}

impl QplDecompressor {
    /// Loads libqpl (once per process) and initialises a job on `path`;
    /// on the hardware path QPL's `qpl_init_job` fails when no IAA work
    /// queue can be opened, which is how IAA's absence shows here.
    pub fn new(path: QplPath) -> Result<Self, CodecError> {
        Self::with_library(&library()?, path)
    }

    fn with_library(lib: &Arc<QplLib>, path: QplPath) -> Result<Self, CodecError> {
        Ok(Self {
            path,
            slot: JobSlot::new(lib, path)?,
            retired: RetiredJobs::default(),
            job_deadline: JOB_DEADLINE,
        })
    }

    /// The execution path.
    pub fn path(&self) -> QplPath {
        self.path
    }

    /// Inflates `input` into `out`: the bytes written, or `None` when QPL
    /// could not (busy queues, a device error, a job past its deadline, or
    /// a stream it rejects); the caller then decodes with libdeflate, which
    /// has the last word on whether the stream is valid. After a job missed
    /// its deadline, QPL is not used again.
    pub(crate) fn decompress(&mut self, input: &[u8], out: &mut [u8; PAGE_SIZE]) -> Option<usize> {
        self.retired.reap();
        if input.is_empty() || input.len() > PAGE_SIZE {
            return None;
        }
        self.slot.input[..input.len()].copy_from_slice(input);
        if self.slot.submit_decompress(input.len())? != abi::STS_OK {
            return None;
        }
        let Some(status) = self.slot.wait_until(Instant::now() + self.job_deadline) else {
            self.slot.retire_job(&mut self.retired);
            return None;
        };
        let n = self.slot.total_out().min(PAGE_SIZE);
        (status == abi::STS_OK).then(|| {
            out[..n].copy_from_slice(&self.slot.out[..n]);
            n
        })
    }
}

impl BatchCounts {
    /// The counters of a batch of `pages` pages whose compressed bytes are
    /// `compressed_bytes`.
    fn counters(self, pages: usize, compressed_bytes: usize) -> CodecCounters {
        let raw = self.did_not_shrink + self.sampled;
        CodecCounters {
            pages: pages as u64,
            bytes_in: (pages * PAGE_SIZE) as u64,
            compressed: self.compressed,
            raw_fallbacks: self.did_not_shrink,
            skipped_by_sampling: self.sampled,
            offload_fallbacks: self.software,
            bytes_out: compressed_bytes as u64 + raw * PAGE_SIZE as u64,
            ..CodecCounters::default()
        }
    }
}

impl PageEncoder for QplCompressor {
    fn level(&self) -> i32 {
        self.level
    }

    fn compress(
        &mut self,
        page: &[u8; PAGE_SIZE],
        out: &mut [u8; MAX_COMPRESSED],
        counters: &mut CodecCounters,
    ) -> Option<usize> {
        let (n, software) = self.compress_one(page, out);
        counters.offload_fallbacks += u64::from(software);
        n
    }

    unsafe fn compress_batch(
        &mut self,
        pages: &[*const u8],
        batch: &mut CompressedBatch,
        sampling: bool,
    ) -> Option<CodecCounters> {
        // SAFETY: forwarded caller contract.
        let counts = unsafe { QplCompressor::compress_batch(self, pages, batch, sampling) };
        Some(counts.counters(pages.len(), batch.data.len()))
    }
}

/// The destination's deflate decoder on IAA: QPL's inflate, with libdeflate
/// for what it does not decode (libdeflate has the last word on whether a
/// stream is valid).
struct QplInflater {
    qpl: QplDecompressor,
    software: libdeflater::Decompressor,
    fallbacks: u64,
}

impl QplInflater {
    /// Opens QPL's hardware path: an error when IAA cannot be had.
    fn open() -> Result<Self, CodecError> {
        Ok(Self {
            qpl: QplDecompressor::new(QplPath::Hardware)?,
            software: libdeflater::Decompressor::new(),
            fallbacks: 0,
        })
    }
}

impl PageDecoder for QplInflater {
    fn decompress(
        &mut self,
        input: &[u8],
        dictionary: u8,
        out: &mut [u8; PAGE_SIZE],
    ) -> Result<usize, CodecError> {
        let _ = dictionary;
        match self.qpl.decompress(input, out) {
            Some(PAGE_SIZE) => Ok(PAGE_SIZE),
            _ => {
                self.fallbacks += 1;
                inflate(&mut self.software, input, out)
            }
        }
    }

    fn offload_fallbacks(&self) -> u64 {
        self.fallbacks
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{CodecChoice, PageCompressor};

    /// Loads QPL from explicit candidate file names.
    fn probe_library(candidates: &[&str]) -> Result<(), CodecError> {
        load_from(candidates).map(|_| ()).map_err(CodecError::from)
    }

    /// QPL 1.9.0's header values, from `offsetof`/`sizeof` on Debian's
    /// libqpl-dev 1.9.0-1 headers (`bench/qpl/job_layout.c` prints them):
    /// an edit of `abi` that drifts from the header fails here, and the
    /// tests below check against the real library where it is installed.
    #[test]
    fn abi_matches_the_qpl_1_9_headers() {
        let fields = [
            ("next_in_ptr", abi::OFF_NEXT_IN, 0, 8),
            ("available_in", abi::OFF_AVAILABLE_IN, 8, 4),
            ("total_in", abi::OFF_TOTAL_IN, 12, 4),
            ("next_out_ptr", abi::OFF_NEXT_OUT, 16, 8),
            ("available_out", abi::OFF_AVAILABLE_OUT, 24, 4),
            ("total_out", abi::OFF_TOTAL_OUT, 28, 4),
            ("op", abi::OFF_OP, 32, 4),
            ("flags", abi::OFF_FLAGS, 36, 4),
            ("level", abi::OFF_LEVEL, 52, 4),
        ];
        for (name, ours, header, size) in fields {
            assert_eq!(ours, header, "{name}");
            assert!(ours + size <= abi::KNOWN_PREFIX, "{name}");
        }
        assert_eq!(abi::PUBLIC_JOB_SIZE, 240);
        // defs.h: qpl_operation, QPL_FLAG_*; status.h: qpl_status.
        assert_eq!((abi::OP_DECOMPRESS, abi::OP_COMPRESS), (0x00, 0x01));
        assert_eq!(
            [
                abi::FLAG_FIRST,
                abi::FLAG_LAST,
                abi::FLAG_DYNAMIC_HUFFMAN,
                abi::FLAG_OMIT_VERIFY
            ],
            [0x0001, 0x0002, 0x2000, 0x4000]
        );
        assert_eq!(
            [
                abi::STS_OK,
                abi::STS_MORE_OUTPUT_NEEDED,
                abi::STS_QUEUES_ARE_BUSY,
                abi::STS_DST_IS_SHORT,
                abi::STS_INTL_OUTPUT_OVERFLOW,
                abi::STS_INIT_HW_NOT_SUPPORTED,
                abi::STS_INIT_LIBACCEL_NOT_FOUND,
                abi::STS_INIT_LIBACCEL_ERROR,
                abi::STS_INIT_WORK_QUEUES_NOT_AVAILABLE,
            ],
            [0, 2, 5, 225, 311, 500, 501, 502, 503]
        );
        assert_eq!(
            [
                raw_path(QplPath::Auto),
                raw_path(QplPath::Hardware),
                raw_path(QplPath::Software)
            ],
            [0, 1, 2]
        );
    }

    fn libqpl_or_skip() -> bool {
        match qpl_available() {
            Ok(()) => true,
            Err(e) => {
                tern_test_skip::skip(
                    tern_test_skip::Need::Qpl,
                    format!("needs libqpl (bench/install-qpl.sh, then TERN_QPL_LIB): {e}"),
                );
                false
            }
        }
    }

    fn inflate(compressed: &[u8]) -> [u8; PAGE_SIZE] {
        let mut page = [0u8; PAGE_SIZE];
        let n = libdeflater::Decompressor::new()
            .deflate_decompress(compressed, &mut page)
            .expect("QPL wrote a raw deflate stream libdeflate decodes");
        assert_eq!(n, PAGE_SIZE);
        page
    }

    #[test]
    fn auto_at_level_three_is_counted_on_the_cpu() {
        assert!(super::level_runs_on_the_cpu(QplPath::Auto, 3));
        assert!(!super::level_runs_on_the_cpu(QplPath::Auto, 1));
        // Hardware is clamped to level 1; software is the CPU by name.
        assert!(!super::level_runs_on_the_cpu(QplPath::Hardware, 1));
        assert!(!super::level_runs_on_the_cpu(QplPath::Software, 3));
    }

    #[test]
    fn with_libqpl_software_jobs_compress_where_the_layout_says() {
        if !libqpl_or_skip() {
            return;
        }
        for level in [1, 3] {
            let mut qpl = QplCompressor::new(QplPath::Software, level).unwrap();
            assert_eq!(qpl.level(), level);
            for kind in ["text", "binary", "random"] {
                let page = crate::codec::corpus_page(kind, 7);
                let mut out = [0u8; MAX_COMPRESSED];
                let (n, software) = qpl.compress_one(&page, &mut out);
                assert!(!software, "{kind}: QPL itself must take the page");
                match n {
                    Some(n) => {
                        assert_eq!(
                            qpl.slots[0].job.as_ref().unwrap().total_in(),
                            PAGE_SIZE,
                            "{kind}: total_in"
                        );
                        assert_eq!(inflate(&out[..n]), page, "{kind}");
                    }
                    // A page that does not fit is "did not shrink", not a
                    // failure handed to the CPU (`software` is false).
                    None => assert_eq!(kind, "random", "only random pages do not shrink"),
                }
            }
        }
    }

    #[test]
    fn with_libqpl_a_software_batch_matches_its_pages() {
        if !libqpl_or_skip() {
            return;
        }
        let pages: Vec<[u8; PAGE_SIZE]> = (0..6)
            .map(|i| crate::codec::corpus_page(["text", "binary", "random"][i % 3], i as u64))
            .collect();
        let pointers: Vec<*const u8> = pages.iter().map(|p| p.as_ptr()).collect();
        // Software: one job, page by page; auto: a job per page, all
        // submitted before the first wait (QPL picks its software path here
        // when there is no IAA).
        for (path, jobs) in [(QplPath::Software, 1), (QplPath::Auto, pages.len())] {
            let mut qpl = QplCompressor::new(path, 1).unwrap();
            for sampling in [false, true] {
                let mut batch = CompressedBatch::default();
                // SAFETY: every pointer is a live PAGE_SIZE array in `pages`.
                let counts = unsafe { qpl.compress_batch(&pointers, &mut batch, sampling) };
                assert_eq!(counts.software, 0, "{path}");
                assert_eq!(counts.compressed, 4, "{path}: text and binary shrink");
                if sampling {
                    assert_eq!(counts.sampled, 2, "{path}: random pages are sampled out");
                } else {
                    assert_eq!(counts.did_not_shrink, 2, "{path}: random pages do not fit");
                }
                for (page, outcome) in pages.iter().zip(&batch.outcomes) {
                    if let PageOutcome::Compressed { offset, len } = *outcome {
                        assert_eq!(inflate(&batch.data[offset..offset + len]), *page);
                    }
                }
            }
            assert_eq!(qpl.slots.len(), jobs, "{path}");
        }
    }

    #[test]
    fn with_libqpl_the_hardware_path_without_iaa_says_so() {
        if !libqpl_or_skip() {
            return;
        }
        if std::path::Path::new("/dev/iax").exists() {
            tern_test_skip::skip(
                tern_test_skip::Need::NoAccelerator,
                "this machine has IAA devices",
            );
            return;
        }
        let error = QplDecompressor::new(QplPath::Hardware).unwrap_err();
        assert!(matches!(error, CodecError::QplUnavailable(_)), "{error}");
        assert!(error.to_string().contains("no IAA work queue"), "{error}");
        let error = QplCompressor::new(QplPath::Hardware, 1).unwrap_err();
        assert!(error.to_string().contains("--qpl-path software"), "{error}");
    }

    #[test]
    fn with_libqpl_software_inflate_reads_libdeflate_streams() {
        if !libqpl_or_skip() {
            return;
        }
        let mut deflate = new_deflate(1);
        let mut inflater = QplDecompressor::new(QplPath::Software).unwrap();
        for kind in ["text", "binary"] {
            let page = crate::codec::corpus_page(kind, 3);
            let mut compressed = [0u8; MAX_COMPRESSED];
            let n = deflate_page(&mut deflate, &page, &mut compressed).expect("shrinks");
            let mut out = [0u8; PAGE_SIZE];
            assert_eq!(
                inflater.decompress(&compressed[..n], &mut out),
                Some(PAGE_SIZE)
            );
            assert_eq!(
                inflater.slot.job.as_ref().unwrap().total_in(),
                n,
                "{kind}: total_in"
            );
            assert_eq!(out, page, "{kind}");
            // A stream cut short is refused, not half-written as a page.
            assert_ne!(
                inflater.decompress(&compressed[..n / 2], &mut out),
                Some(PAGE_SIZE)
            );
        }
    }

    /// The stuck stand-in library (`qpl_stuck.c`) built with the system C
    /// compiler, with its controls; `None` (skipped visibly) without one.
    struct StuckLibrary {
        lib: Arc<QplLib>,
        controls: libloading::Library,
        _dir: tempfile::TempDir,
    }

    impl StuckLibrary {
        fn build() -> Option<Self> {
            let dir = tempfile::tempdir().unwrap();
            let source = dir.path().join("qpl_stuck.c");
            let object = dir.path().join("libqpl_stuck.so");
            std::fs::write(&source, include_str!("qpl_stuck.c")).unwrap();
            let built = std::process::Command::new("cc")
                .args(["-shared", "-fPIC", "-O1", "-o"])
                .arg(&object)
                .arg(&source)
                .status();
            if !built.is_ok_and(|status| status.success()) {
                tern_test_skip::skip(
                    tern_test_skip::Need::Host,
                    "needs a C compiler (`cc`) to build the stuck libqpl stand-in",
                );
                return None;
            }
            let path = object.to_str().unwrap();
            let lib = Arc::new(load_from(&[path]).expect("the stand-in loads as QPL 1.x"));
            // SAFETY: the stand-in built above; its initialisers are empty.
            let controls = unsafe { libloading::Library::new(path) }.unwrap();
            Some(Self {
                lib,
                controls,
                _dir: dir,
            })
        }

        fn call(&self, name: &[u8]) -> u32 {
            // SAFETY: the stand-in's controls are `uint32_t f(void)` or
            // `void f(void)` (the return register is then ignored).
            unsafe {
                let f = self
                    .controls
                    .get::<unsafe extern "C" fn() -> u32>(name)
                    .unwrap();
                f()
            }
        }

        fn submits(&self) -> u32 {
            self.call(b"stuck_submits\0")
        }

        fn finis(&self) -> u32 {
            self.call(b"stuck_finis\0")
        }

        fn release_all(&self) {
            self.call(b"stuck_release_all\0");
        }
    }

    /// A device that stops answering costs one deadline, never a hang (the
    /// stand-in aborts if `qpl_wait_job` is called): the batch's pages are
    /// compressed on the CPU, its jobs retired with their buffers, and QPL
    /// is not offered work again; retired jobs are freed once they end.
    #[test]
    fn a_stuck_device_costs_one_deadline_and_the_cpu_takes_over() {
        let Some(stuck) = StuckLibrary::build() else {
            return;
        };
        let mut qpl = QplCompressor::with_library(stuck.lib.clone(), QplPath::Hardware, 1).unwrap();
        qpl.job_deadline = Duration::from_millis(20);
        let pages: Vec<[u8; PAGE_SIZE]> = (0..4)
            .map(|i| crate::codec::corpus_page("text", i))
            .collect();
        let pointers: Vec<*const u8> = pages.iter().map(|p| p.as_ptr()).collect();
        for round in 0..2 {
            let mut batch = CompressedBatch::default();
            // SAFETY: every pointer is a live PAGE_SIZE array in `pages`.
            let counts = unsafe { qpl.compress_batch(&pointers, &mut batch, false) };
            assert_eq!(counts.software, 4, "round {round}: the CPU took every page");
            assert_eq!(counts.compressed, 4, "round {round}");
            for (page, outcome) in pages.iter().zip(&batch.outcomes) {
                let PageOutcome::Compressed { offset, len } = *outcome else {
                    panic!("round {round}: text pages compress");
                };
                assert_eq!(inflate(&batch.data[offset..offset + len]), *page);
            }
            assert!(qpl.gave_up, "round {round}");
            assert_eq!(
                stuck.submits(),
                4,
                "round {round}: nothing offered after giving up"
            );
            assert_eq!(qpl.retired.len(), 4, "round {round}: retired, not freed");
        }
        let mut out = [0u8; MAX_COMPRESSED];
        let (n, software) = qpl.compress_one(&pages[0], &mut out);
        assert!(software);
        assert_eq!(inflate(&out[..n.unwrap()]), pages[0]);
        assert_eq!(
            stuck.finis(),
            0,
            "no job freed while the device may write it"
        );
        stuck.release_all();
        qpl.compress_one(&pages[1], &mut out);
        assert_eq!(qpl.retired.len(), 0, "ended jobs are reaped");
        assert_eq!(stuck.finis(), 4);
    }

    /// The destination's inflate through a stuck device: `None` after the
    /// deadline (the caller decodes with libdeflate), the caller's page never
    /// handed to the device, and no job freed while it may still run, even
    /// when the decompressor is dropped.
    #[test]
    fn a_stuck_device_gives_inflate_back_to_libdeflate() {
        let Some(stuck) = StuckLibrary::build() else {
            return;
        };
        let mut inflater = QplDecompressor::with_library(&stuck.lib, QplPath::Hardware).unwrap();
        inflater.job_deadline = Duration::from_millis(20);
        let page = crate::codec::corpus_page("text", 9);
        let mut compressed = [0u8; MAX_COMPRESSED];
        let n = deflate_page(&mut new_deflate(1), &page, &mut compressed).expect("shrinks");
        let mut out = [7u8; PAGE_SIZE];
        assert_eq!(inflater.decompress(&compressed[..n], &mut out), None);
        assert_eq!(out, [7u8; PAGE_SIZE], "the caller's page is untouched");
        assert_eq!(inflater.retired.len(), 1);
        assert_eq!(
            inflater.decompress(&compressed[..n], &mut out),
            None,
            "no job left"
        );
        assert_eq!(stuck.submits(), 1);
        drop(inflater);
        assert_eq!(stuck.finis(), 0, "a job still running is leaked, not freed");
    }

    #[test]
    fn qpl_missing_is_a_clear_error() {
        let e = probe_library(&["/nonexistent/libqpl.so"]).unwrap_err();
        assert!(matches!(e, CodecError::QplUnavailable(_)), "{e}");
        assert!(e.to_string().contains("libqpl.so not found"), "{e}");
        if let Err(e) = qpl_available() {
            let r = PageCompressor::for_choice(CodecChoice::Qpl, 1, QplPath::Auto);
            assert_eq!(r.unwrap_err().to_string(), e.to_string());
        }
        assert!(matches!(
            PageCompressor::for_choice(CodecChoice::Auto, 1, QplPath::Auto),
            Err(CodecError::AutoUnresolved)
        ));
    }
}
