//! `tern bench codec`: codec throughput and ratio on a synthetic corpus.

use std::time::Instant;

use super::compressor::PageCompressor;
use super::decompressor::PageDecompressor;
use super::error::CodecError;
use super::id::CodecId;
use crate::PAGE_SIZE;

/// One result line.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct CodecBenchRow {
    /// Corpus: `mixed`, `random`, `text` or `binary`.
    pub corpus: &'static str,
    /// Codec.
    pub codec: CodecId,
    /// Level in force.
    pub level: i32,
    /// Whether incompressible-page sampling was on.
    pub sampling: bool,
    /// Guest MB/s (10^6 bytes) compressed on one thread, median of rounds.
    pub compress_mb_s: f64,
    /// Guest MB/s decoded on one thread (compressed pages only), median;
    /// `None` when every page went raw, so nothing was decompressed.
    pub decompress_mb_s: Option<f64>,
    /// Guest bytes / wire bytes (raw pages count 4096).
    pub ratio: f64,
    /// Pages sent raw (sampled or did not shrink).
    pub raw_pages: usize,
    /// Pages in the corpus.
    pub pages: usize,
}

impl CodecBenchRow {
    /// One JSON object (no serde dependency in this crate).
    pub fn to_json(&self) -> String {
        format!(
            "{{\"corpus\":\"{}\",\"codec\":\"{}\",\"level\":{},\"sampling\":{},\
             \"compress_mb_s\":{:.1},\"decompress_mb_s\":{},\"ratio\":{:.3},\
             \"raw_pages\":{},\"pages\":{}}}",
            self.corpus,
            self.codec,
            self.level,
            self.sampling,
            self.compress_mb_s,
            self.decompress_mb_s
                .map_or_else(|| "null".to_string(), |rate| format!("{rate:.1}")),
            self.ratio,
            self.raw_pages,
            self.pages
        )
    }
}

/// zstd 1 and 3, deflate 1 and 6, lz4: those of them this build has.
pub fn default_bench_levels() -> Vec<(CodecId, i32)> {
    [
        (CodecId::Zstd, 1),
        (CodecId::Zstd, 3),
        (CodecId::Deflate, 1),
        (CodecId::Deflate, 6),
        (CodecId::Lz4, 1),
    ]
    .into_iter()
    .filter(|(codec, _)| codec.is_built())
    .collect()
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// An index into a slice of `len` elements.
    fn index(&mut self, len: usize) -> usize {
        // The remainder is below `len`, a usize.
        usize::try_from(self.below(len as u64)).expect("below len")
    }
    /// The low byte of the next number.
    fn byte(&mut self) -> u8 {
        self.next().to_le_bytes()[0]
    }
}

const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "memory",
    "page",
    "migration",
    "guest",
    "network",
    "kernel",
    "buffer",
    "request",
    "server",
    "value",
    "error",
    "return",
    "function",
    "process",
    "thread",
    "time",
];

/// Common x86-64 instruction byte sequences, to make code-like pages.
const CODE: &[&[u8]] = &[
    &[0x48, 0x89, 0xe5],
    &[0x55],
    &[0x5d, 0xc3],
    &[0x48, 0x83, 0xec, 0x20],
    &[0x48, 0x8b, 0x45, 0xf8],
    &[0xe8, 0x00, 0x00, 0x00, 0x00],
    &[0x0f, 0x1f, 0x44, 0x00, 0x00],
    &[0x31, 0xc0],
    &[0x85, 0xc0, 0x74, 0x08],
    &[0x48, 0x8d, 0x3d],
    &[0x89, 0x7d, 0xfc],
    &[0xc7, 0x45, 0xf4, 0x01, 0x00, 0x00, 0x00],
];

/// One corpus page: `kind` is `random`, `text` or `binary`; `seed` varies
/// the content. Deterministic.
pub fn corpus_page(kind: &str, seed: u64) -> [u8; PAGE_SIZE] {
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut p = [0u8; PAGE_SIZE];
    match kind {
        "text" => {
            let mut i = 0;
            while i < PAGE_SIZE {
                let w = WORDS[rng.index(WORDS.len())].as_bytes();
                let sep: &[u8] = if rng.below(12) == 0 { b".\n" } else { b" " };
                for &b in w.iter().chain(sep) {
                    if i < PAGE_SIZE {
                        p[i] = b;
                        i += 1;
                    }
                }
            }
        }
        "binary" => {
            // Runs of: small integers (u32), heap pointers (u64), code bytes.
            let base = 0x0000_7f3a_0000_0000u64 | (rng.below(1 << 20) << 12);
            let mut i = 0;
            while i < PAGE_SIZE {
                match rng.below(3) {
                    0 => {
                        for _ in 0..8 {
                            let v = u32::try_from(rng.below(300))
                                .expect("below 300")
                                .to_le_bytes();
                            for b in v {
                                if i < PAGE_SIZE {
                                    p[i] = b;
                                    i += 1;
                                }
                            }
                        }
                    }
                    1 => {
                        for _ in 0..4 {
                            let v = (base + rng.below(1 << 16) * 16).to_le_bytes();
                            for b in v {
                                if i < PAGE_SIZE {
                                    p[i] = b;
                                    i += 1;
                                }
                            }
                        }
                    }
                    _ => {
                        for _ in 0..8 {
                            let ins = CODE[rng.index(CODE.len())];
                            for &b in ins {
                                if i < PAGE_SIZE {
                                    p[i] = b;
                                    i += 1;
                                }
                            }
                            if i < PAGE_SIZE && rng.below(3) == 0 {
                                p[i] = rng.byte();
                                i += 1;
                            }
                        }
                    }
                }
            }
        }
        _ => {
            for c in p.chunks_exact_mut(8) {
                c.copy_from_slice(&rng.next().to_le_bytes());
            }
        }
    }
    p
}

fn corpus(kind: &'static str, pages: usize) -> Vec<[u8; PAGE_SIZE]> {
    (0..pages)
        .map(|i| {
            let k = if kind == "mixed" {
                ["random", "text", "binary"][i % 3]
            } else {
                kind
            };
            corpus_page(k, i as u64 + 1)
        })
        .collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

const ROUNDS: usize = 5;

/// Measures every `(codec, level)` on the mixed corpus of `corpus_pages`
/// pages (a third each random, text, binary) and on each class alone, with
/// sampling on. One thread; median of 5 rounds.
pub fn bench_codecs(
    corpus_pages: usize,
    levels: &[(CodecId, i32)],
) -> Result<Vec<CodecBenchRow>, CodecError> {
    let mut rows = Vec::new();
    for kind in ["mixed", "random", "text", "binary"] {
        for sampling in [true, false] {
            // Without sampling only the random class is interesting.
            if !sampling && kind != "random" {
                continue;
            }
            rows.extend(bench_corpus(kind, corpus_pages, levels, sampling)?);
        }
    }
    Ok(rows)
}

fn bench_corpus(
    kind: &'static str,
    corpus_pages: usize,
    levels: &[(CodecId, i32)],
    sampling: bool,
) -> Result<Vec<CodecBenchRow>, CodecError> {
    let pages = corpus(kind, corpus_pages.max(3));
    let bytes = (pages.len() * PAGE_SIZE) as f64;
    let mut rows = Vec::new();
    let mut outs = vec![[0u8; PAGE_SIZE - 1]; pages.len()];
    let mut lens = vec![None; pages.len()];
    for &(codec, level) in levels {
        let mut c = PageCompressor::new(codec, level)?;
        c.set_sampling(sampling);
        let mut d = PageDecompressor::new(codec)?;
        let mut ctimes = Vec::new();
        let mut dtimes = Vec::new();
        let mut page = [0u8; PAGE_SIZE];
        for _ in 0..ROUNDS {
            let t = Instant::now();
            for (i, p) in pages.iter().enumerate() {
                lens[i] = c.compress(p, &mut outs[i]);
            }
            ctimes.push(bytes / t.elapsed().as_secs_f64() / 1e6);
            let t = Instant::now();
            let mut decoded = 0usize;
            for (i, len) in lens.iter().enumerate() {
                if let Some(n) = *len {
                    d.decompress(&outs[i][..n], &mut page)?;
                    decoded += PAGE_SIZE;
                }
            }
            let secs = t.elapsed().as_secs_f64();
            if decoded > 0 {
                dtimes.push(decoded as f64 / secs / 1e6);
            }
        }
        let wire: usize = lens.iter().map(|l| l.unwrap_or(PAGE_SIZE)).sum();
        rows.push(CodecBenchRow {
            corpus: kind,
            codec,
            level: c.level(),
            sampling,
            compress_mb_s: median(ctimes),
            decompress_mb_s: (!dtimes.is_empty()).then(|| median(dtimes)),
            ratio: bytes / wire as f64,
            raw_pages: lens.iter().filter(|l| l.is_none()).count(),
            pages: pages.len(),
        });
    }
    Ok(rows)
}
