//! `tern bench codec`'s zstd rows beyond one page: per page with a trained
//! dictionary, and packet frames, on a corpus cut into packets as the
//! pipeline cuts guest memory.

use std::time::Instant;

use tern_wire::MAX_PAGES_PER_PACKET;

use super::batch::{CompressedBatch, PageOutcome};
use super::compressor::PageCompressor;
use super::decompressor::PageDecompressor;
use super::dictionary::CodecDictionary;
use super::error::CodecError;
use super::id::CodecId;
use super::training::train_dictionary;
use crate::PAGE_SIZE;

/// One zstd variant on one corpus.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ZstdVariantRow {
    /// Corpus name (`mixed`, or the image's file name).
    pub corpus: String,
    /// `per-page`, `per-page+dict`, `packet` or `packet+dict`.
    pub variant: &'static str,
    /// zstd level.
    pub level: i32,
    /// Dictionary size in bytes, for the variants with one.
    pub dictionary_bytes: Option<usize>,
    /// Wall-clock time to train the dictionary, in milliseconds.
    pub training_ms: Option<f64>,
    /// Guest MB/s (10^6 bytes) compressed on one thread, median of rounds.
    pub compress_mb_s: f64,
    /// Guest MB/s decoded on one thread (compressed pages only), median.
    pub decompress_mb_s: Option<f64>,
    /// Guest bytes / wire bytes over the corpus's data pages (raw pages
    /// count 4096).
    pub ratio: f64,
    /// Data pages measured.
    pub pages: usize,
}

/// The pages to measure, in packets, and the pages to train on (others).
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct PacketCorpus {
    /// Corpus name.
    pub name: String,
    /// Data pages (no zero pages: the pipeline sends those as zero pages
    /// before any codec runs), one vector per packet.
    pub packets: Vec<Vec<[u8; PAGE_SIZE]>>,
    /// Pages sampled elsewhere in the corpus for training.
    pub training: Vec<[u8; PAGE_SIZE]>,
}

impl PacketCorpus {
    /// Cuts `image` (a guest memory image) into windows of
    /// [`MAX_PAGES_PER_PACKET`] pages as the pipeline does, keeps the data
    /// pages of windows spread over the image until about `pages` are
    /// measured, and samples `training_pages` pages from other windows.
    pub fn from_image(name: &str, image: &[u8], pages: usize, training_pages: usize) -> Self {
        let window_bytes = MAX_PAGES_PER_PACKET * PAGE_SIZE;
        let windows = image.len() / window_bytes;
        let data_pages = |window: usize| {
            image[window * window_bytes..(window + 1) * window_bytes]
                .chunks_exact(PAGE_SIZE)
                .filter(|page| page.iter().any(|&byte| byte != 0))
                .map(|page| <[u8; PAGE_SIZE]>::try_from(page).expect("a page"))
                .collect::<Vec<_>>()
        };
        // Measured windows are the even ones of a stride, training pages
        // come from the odd ones: never the same pages.
        let wanted = (pages / (MAX_PAGES_PER_PACKET / 2)).clamp(1, windows.max(1));
        let stride = (windows / wanted).max(2);
        let mut corpus = Self {
            name: name.to_string(),
            ..Self::default()
        };
        let mut measured = 0;
        for window in (0..windows).step_by(stride) {
            if measured >= pages {
                break;
            }
            let packet = data_pages(window);
            measured += packet.len();
            if !packet.is_empty() {
                corpus.packets.push(packet);
            }
        }
        let per_window = (training_pages / (windows / stride).max(1)).max(1);
        for window in (stride / 2..windows).step_by(stride) {
            corpus
                .training
                .extend(data_pages(window).into_iter().take(per_window));
            if corpus.training.len() >= training_pages {
                break;
            }
        }
        corpus
    }

    /// A synthetic corpus of `pages` pages of `kinds` in turn, in packets
    /// of [`MAX_PAGES_PER_PACKET`], with as many other pages to train on as
    /// a migration samples ([`super::DICTIONARY_SAMPLE_PAGES`]).
    pub fn synthetic(name: &str, kinds: &[&str], pages: usize) -> Self {
        let page = |i: usize| super::corpus_page(kinds[i % kinds.len()], i as u64 + 1);
        let all: Vec<_> = (0..pages).map(page).collect();
        Self {
            name: name.to_string(),
            packets: all
                .chunks(MAX_PAGES_PER_PACKET)
                .map(<[_]>::to_vec)
                .collect(),
            training: (pages..pages + super::DICTIONARY_SAMPLE_PAGES)
                .map(page)
                .collect(),
        }
    }

    fn pages(&self) -> usize {
        self.packets.iter().map(Vec::len).sum()
    }
}

/// Measures zstd at `level` on `corpus`: per page, per page with a
/// dictionary of `dictionary_len` bytes trained on the corpus's training
/// pages, packet frames, and packet frames with the dictionary. One
/// thread; median of `rounds`.
pub fn bench_zstd_variants(
    corpus: &PacketCorpus,
    level: i32,
    dictionary_len: usize,
    rounds: usize,
) -> Result<Vec<ZstdVariantRow>, CodecError> {
    let started = Instant::now();
    let bytes = train_dictionary(&corpus.training, dictionary_len)?;
    let training_ms = started.elapsed().as_secs_f64() * 1e3;
    let dictionary = CodecDictionary::new(1, CodecId::Zstd, bytes)?;
    let variants = [
        ("per-page", CodecId::Zstd, None),
        ("per-page+dict", CodecId::Zstd, Some(&dictionary)),
        ("packet", CodecId::ZstdPacket, None),
        ("packet+dict", CodecId::ZstdPacket, Some(&dictionary)),
    ];
    let mut rows = Vec::new();
    for (variant, codec, dictionary) in variants {
        let (compress_mb_s, decompress_mb_s, wire) =
            measure(corpus, codec, level, dictionary, rounds.max(1))?;
        rows.push(ZstdVariantRow {
            corpus: corpus.name.clone(),
            variant,
            level,
            dictionary_bytes: dictionary.map(|d| d.bytes().len()),
            training_ms: dictionary.map(|_| training_ms),
            compress_mb_s,
            decompress_mb_s,
            ratio: (corpus.pages() * PAGE_SIZE) as f64 / wire.max(1) as f64,
            pages: corpus.pages(),
        });
    }
    Ok(rows)
}

/// Compress and decompress rates (MB/s, medians) and the wire bytes.
fn measure(
    corpus: &PacketCorpus,
    codec: CodecId,
    level: i32,
    dictionary: Option<&CodecDictionary>,
    rounds: usize,
) -> Result<(f64, Option<f64>, usize), CodecError> {
    let mut compressor = PageCompressor::with_dictionary(codec, level, dictionary)?;
    let mut decoder = PageDecompressor::new(codec)?
        .with_dictionaries(dictionary.map(std::slice::from_ref).unwrap_or_default())?;
    let id = dictionary.map_or(0, CodecDictionary::id);
    let bytes = (corpus.pages() * PAGE_SIZE) as f64;
    let mut batches: Vec<CompressedBatch> = corpus
        .packets
        .iter()
        .map(|_| CompressedBatch::new())
        .collect();
    let (mut compress, mut decompress) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let t = Instant::now();
        for (packet, batch) in corpus.packets.iter().zip(&mut batches) {
            let pointers: Vec<*const u8> = packet.iter().map(|page| page.as_ptr()).collect();
            // SAFETY: every pointer is a whole page of the corpus, alive
            // and unchanged during the call.
            unsafe { compressor.compress_batch(&pointers, batch) };
        }
        compress.push(bytes / t.elapsed().as_secs_f64() / 1e6);
        let t = Instant::now();
        let decoded = decode_all(&mut decoder, &batches, id)?;
        if decoded > 0 {
            decompress.push(decoded as f64 / t.elapsed().as_secs_f64() / 1e6);
        }
    }
    let wire = batches
        .iter()
        .flat_map(|batch| &batch.outcomes)
        .map(|outcome| match outcome {
            PageOutcome::Compressed { len, .. } => *len,
            PageOutcome::Raw(_) => PAGE_SIZE,
        })
        .sum();
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    Ok((median(compress).unwrap_or(0.0), median(decompress), wire))
}

/// Decodes every compressed page of `batches`; returns the bytes decoded.
pub(super) fn decode_all(
    decoder: &mut PageDecompressor,
    batches: &[CompressedBatch],
    id: u8,
) -> Result<usize, CodecError> {
    let mut decoded = 0;
    let mut page = [0u8; PAGE_SIZE];
    for batch in batches {
        if matches!(decoder.codec(), CodecId::ZstdPacket | CodecId::ZstdStream) {
            let pages = batch
                .outcomes
                .iter()
                .filter(|outcome| matches!(outcome, PageOutcome::Compressed { .. }))
                .count();
            // A stream's packets say where it restarts, in the dictionary's byte.
            let byte = match decoder.codec() {
                CodecId::ZstdStream => u8::from(batch.stream_restart),
                _ => id,
            };
            if pages > 0 {
                decoded += decoder.decompress_packet(&batch.data, byte, pages)?.len();
            }
            continue;
        }
        for i in 0..batch.outcomes.len() {
            if let Some(input) = batch.compressed(i) {
                decoder.decompress_with(input, id, &mut page)?;
                decoded += PAGE_SIZE;
            }
        }
    }
    Ok(decoded)
}
