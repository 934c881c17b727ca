//! [`PageCompressor`]: one worker's compressor, whatever the codec.

use std::fmt;

use super::backend::PageEncoder;
use super::batch::{CompressedBatch, MAX_COMPRESSED, PageOutcome, RawReason};
use super::dictionary::CodecDictionary;
use super::error::CodecError;
use super::id::{CodecChoice, CodecId, CodecImpl};
use super::qpl_path::QplPath;
use super::registry;
use super::sample::looks_incompressible_bytes;
use super::stats::CodecStats;
use crate::PAGE_SIZE;
use crate::cpu_time::thread_cpu_ns;

/// Compresses pages one at a time, each independently. One per worker thread.
pub struct PageCompressor {
    codec: CodecId,
    which: CodecImpl,
    level: i32,
    sampling: bool,
    /// The codec's encoder; `None` for [`CodecId::None`].
    engine: Option<Box<dyn PageEncoder>>,
    page: Box<[u8; PAGE_SIZE]>,
    out: Box<[u8; MAX_COMPRESSED]>,
    stats: CodecStats,
    last_raw_reason: RawReason,
    /// The dictionary id packets name (0: none).
    dictionary: u8,
}

impl fmt::Debug for PageCompressor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PageCompressor")
            .field("codec", &self.codec)
            .field("implementation", &self.which)
            .field("level", &self.level)
            .field("sampling", &self.sampling)
            .field("dictionary", &self.dictionary)
            .finish_non_exhaustive()
    }
}

impl PageCompressor {
    /// A software compressor for `codec` at `level` (clamped: see
    /// [`level`](Self::level)). Sampling of incompressible pages is on.
    ///
    /// # Errors
    ///
    /// [`CodecError::NotBuilt`] for a codec whose feature is off;
    /// [`CodecError::Init`] if the codec library cannot start.
    pub fn new(codec: CodecId, level: i32) -> Result<Self, CodecError> {
        Self::with_dictionary(codec, level, None)
    }

    /// As [`new`](Self::new), compressing against `dictionary` (zstd
    /// only); packets then name its id ([`dictionary_id`](Self::dictionary_id)).
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new); [`CodecError::Dictionary`] for a dictionary
    /// with another codec than zstd.
    pub fn with_dictionary(
        codec: CodecId,
        level: i32,
        dictionary: Option<&CodecDictionary>,
    ) -> Result<Self, CodecError> {
        if dictionary.is_some() && !codec.is_zstd() {
            return Err(CodecError::Dictionary(format!(
                "{codec} takes no dictionary"
            )));
        }
        let which = CodecImpl::software(codec);
        let level = codec.clamp_level(level);
        let mut compressor =
            Self::with_encoder(codec, which, level, dictionary, QplPath::default())?;
        compressor.dictionary = dictionary.map_or(0, CodecDictionary::id);
        Ok(compressor)
    }

    /// A compressor for a command-line choice. `Qpl` uses the given path
    /// (and fails with [`CodecError::QplUnavailable`] without libqpl);
    /// `Auto` is an error: resolve it with [`AutoSelector`](super::AutoSelector) first.
    pub fn for_choice(
        choice: CodecChoice,
        level: i32,
        qpl_path: QplPath,
    ) -> Result<Self, CodecError> {
        match choice {
            CodecChoice::None => Self::new(CodecId::None, level),
            CodecChoice::Zstd => Self::new(CodecId::Zstd, level),
            CodecChoice::Deflate => Self::new(CodecId::Deflate, level),
            CodecChoice::Lz4 => Self::new(CodecId::Lz4, level),
            CodecChoice::Qpl => Self::with_qpl(qpl_path, level),
            CodecChoice::Auto => Err(CodecError::AutoUnresolved),
        }
    }

    /// A compressor that offloads to Intel QPL (IAA hardware, QPL's software
    /// path, or auto) and produces [`CodecId::Deflate`]'s wire format.
    ///
    /// # Errors
    ///
    /// [`CodecError::NotBuilt`] without the `qpl` feature;
    /// [`CodecError::QplUnavailable`] without libqpl, or why QPL's path
    /// cannot start.
    pub fn with_qpl(path: QplPath, level: i32) -> Result<Self, CodecError> {
        let level = CodecId::Deflate.clamp_level(level);
        Self::with_encoder(CodecId::Deflate, CodecImpl::Qpl, level, None, path)
    }

    /// A compressor of implementation `which` (of wire codec `codec`).
    fn with_encoder(
        codec: CodecId,
        which: CodecImpl,
        level: i32,
        dictionary: Option<&CodecDictionary>,
        qpl_path: QplPath,
    ) -> Result<Self, CodecError> {
        let engine = match which {
            CodecImpl::None => None,
            which => Some(registry::encoder(which, level, dictionary, qpl_path)?),
        };
        Ok(Self {
            codec,
            which,
            level: engine.as_ref().map_or(level, |engine| engine.level()),
            sampling: true,
            engine,
            page: Box::new([0; PAGE_SIZE]),
            out: Box::new([0; MAX_COMPRESSED]),
            stats: CodecStats::default(),
            last_raw_reason: RawReason::NoCodec,
            dictionary: 0,
        })
    }

    /// The dictionary id its packets name: 0 without a dictionary.
    pub fn dictionary_id(&self) -> u8 {
        self.dictionary
    }

    /// Turns the incompressible-page sampling on or off (on by default).
    pub fn set_sampling(&mut self, on: bool) {
        self.sampling = on;
    }

    /// The wire codec this compressor produces.
    pub fn codec(&self) -> CodecId {
        self.codec
    }

    /// The implementation (differs from the wire codec for QPL).
    pub fn implementation(&self) -> CodecImpl {
        self.which
    }

    /// The level in force, after clamping the requested one to the codec's
    /// range.
    pub fn level(&self) -> i32 {
        self.level
    }

    /// Takes `level` (clamped) in place, when the codec keeps state the
    /// receiver shares and so cannot be made anew (a channel stream, which
    /// restarts at its next packet): `true` if it did. Other codecs return
    /// `false` and are made anew for a new level.
    pub fn set_level(&mut self, level: i32) -> bool {
        let level = self.codec.clamp_level(level);
        let done = self
            .engine
            .as_mut()
            .is_some_and(|engine| engine.set_level(level));
        if done {
            self.level = level;
        }
        done
    }

    /// This worker's counters.
    pub fn stats(&self) -> &CodecStats {
        &self.stats
    }

    /// Returns this worker's counters and resets them (for per-iteration
    /// reporting).
    pub fn take_stats(&mut self) -> CodecStats {
        std::mem::take(&mut self.stats)
    }

    /// Compresses the page at `page` into `out`. Returns the compressed
    /// length (1..=`PAGE_SIZE - 1`), or `None` when the page should be sent
    /// raw (no codec, sampled as random, or did not shrink).
    ///
    /// # Safety
    ///
    /// `page` must point to [`PAGE_SIZE`] readable bytes for the duration of
    /// the call. The guest may write them concurrently: the page is copied to
    /// a private buffer first and the codec only sees that snapshot (a page
    /// written during the copy is dirty and sent again later).
    pub unsafe fn compress_page(
        &mut self,
        page: *const u8,
        out: &mut [u8; MAX_COMPRESSED],
    ) -> Option<usize> {
        // SAFETY: the caller guarantees PAGE_SIZE readable bytes at `page`;
        // `self.page` is a private PAGE_SIZE buffer that cannot overlap guest
        // memory.
        unsafe { core::ptr::copy_nonoverlapping(page, self.page.as_mut_ptr(), PAGE_SIZE) };
        let (result, reason) = self.compress_snapshot(out);
        self.count(result, reason);
        result
    }

    /// [`compress_page`](Self::compress_page) for an owned page.
    pub fn compress(
        &mut self,
        page: &[u8; PAGE_SIZE],
        out: &mut [u8; MAX_COMPRESSED],
    ) -> Option<usize> {
        // SAFETY: a &[u8; PAGE_SIZE] is PAGE_SIZE readable bytes.
        unsafe { self.compress_page(page.as_ptr(), out) }
    }

    /// Compresses a batch (e.g. one packet's pages) into `batch` (cleared
    /// first), measuring the thread's CPU time around the whole batch. With
    /// QPL, all pages are submitted before waiting for any.
    ///
    /// # Safety
    ///
    /// Every pointer in `pages` must satisfy [`compress_page`](Self::compress_page)'s
    /// contract.
    pub unsafe fn compress_batch(&mut self, pages: &[*const u8], batch: &mut CompressedBatch) {
        batch.clear();
        let t0 = thread_cpu_ns();
        if let Some(engine) = self.engine.as_mut() {
            // SAFETY: forwarded caller contract.
            if let Some(counters) = unsafe { engine.compress_batch(pages, batch, self.sampling) } {
                let c = self.stats.get_mut(self.which);
                c.add(&counters);
                c.cpu_ns += thread_cpu_ns().saturating_sub(t0);
                return;
            }
        }
        let mut out = std::mem::replace(&mut self.out, Box::new([0; MAX_COMPRESSED]));
        for &p in pages {
            // SAFETY: forwarded caller contract.
            match unsafe { self.compress_page(p, &mut out) } {
                Some(n) => batch.push_compressed(&out[..n]),
                None => batch.outcomes.push(PageOutcome::Raw(self.last_raw_reason)),
            }
        }
        self.out = out;
        self.stats.get_mut(self.which).cpu_ns += thread_cpu_ns().saturating_sub(t0);
    }

    fn compress_snapshot(&mut self, out: &mut [u8; MAX_COMPRESSED]) -> (Option<usize>, RawReason) {
        let Some(engine) = self.engine.as_mut() else {
            return (None, RawReason::NoCodec);
        };
        if self.sampling && looks_incompressible_bytes(&self.page) {
            return (None, RawReason::Sampled);
        }
        let counters = self.stats.get_mut(self.which);
        let n = engine.compress(&self.page, out, counters);
        (n, RawReason::DidNotShrink)
    }

    fn count(&mut self, result: Option<usize>, reason: RawReason) {
        let c = self.stats.get_mut(self.which);
        c.pages += 1;
        c.bytes_in += PAGE_SIZE as u64;
        match result {
            Some(n) => {
                c.compressed += 1;
                c.bytes_out += n as u64;
            }
            None => {
                c.bytes_out += PAGE_SIZE as u64;
                match reason {
                    RawReason::Sampled => c.skipped_by_sampling += 1,
                    RawReason::DidNotShrink => c.raw_fallbacks += 1,
                    RawReason::NoCodec => {}
                }
                self.last_raw_reason = reason;
            }
        }
    }
}
