//! Filling guest memory with a deterministic content mix.

use std::sync::atomic::{AtomicU64, Ordering};

use tern_engine::PAGE_SIZE;

use crate::ContentMix;
use crate::mapping::Mapping;
use crate::rng::{WyRand, hash2, mix64};

/// Pages handed to a fill thread at a time: large enough that the shared
/// counter is not contended, small enough to balance threads at the end.
const CHUNK_PAGES: u64 = 512;

/// What a page holds after the fill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PageKind {
    Zero,
    Random,
    Text,
}

/// The kind of page `page`, a pure function of (seed, page index) so the fill
/// is reproducible and parallelisable in any order.
pub(crate) fn page_kind(mix: ContentMix, seed: u64, page: u64) -> PageKind {
    let h = hash2(seed, page);
    // Maps the high 32 bits uniformly onto 0..100.
    let percent = ((h >> 32) * 100) >> 32;
    if percent < u64::from(mix.zero) {
        PageKind::Zero
    } else if percent < u64::from(mix.zero) + u64::from(mix.random) {
        PageKind::Random
    } else {
        PageKind::Text
    }
}

/// Words for text-like pages. 128 tokens so that 7 random bits pick one; a
/// few are punctuation and line breaks so the text has some structure. Drawn
/// uniformly, the result compresses about as well as plain English prose.
const VOCABULARY: [&[u8]; 128] = [
    b"the ", b"of ", b"and ", b"to ", b"a ", b"in ", b"is ", b"it ", b"you ", b"that ", b"he ",
    b"was ", b"for ", b"on ", b"are ", b"with ", b"as ", b"I ", b"his ", b"they ", b"be ", b"at ",
    b"one ", b"have ", b"this ", b"from ", b"or ", b"had ", b"by ", b"hot ", b"word ", b"but ",
    b"what ", b"some ", b"we ", b"can ", b"out ", b"other ", b"were ", b"all ", b"there ",
    b"when ", b"up ", b"use ", b"your ", b"how ", b"said ", b"an ", b"each ", b"she ", b"which ",
    b"do ", b"their ", b"time ", b"if ", b"will ", b"way ", b"about ", b"many ", b"then ",
    b"them ", b"write ", b"would ", b"like ", b"so ", b"these ", b"her ", b"long ", b"make ",
    b"thing ", b"see ", b"him ", b"two ", b"has ", b"look ", b"more ", b"day ", b"could ", b"go ",
    b"come ", b"did ", b"number ", b"sound ", b"no ", b"most ", b"people ", b"my ", b"over ",
    b"know ", b"water ", b"than ", b"call ", b"first ", b"who ", b"may ", b"down ", b"side ",
    b"been ", b"now ", b"find ", b"any ", b"new ", b"work ", b"part ", b"take ", b"get ",
    b"place ", b"made ", b"live ", b"where ", b"after ", b"back ", b"little ", b"only ", b"round ",
    b"man ", b"year ", b"came ", b"show ", b"every ", b"good ", b"me ", b". ", b", ", b".\n",
    b"; ", b"? ", b"\n\n",
];

/// Fills a page buffer with random bytes.
fn random_page(rng: &mut WyRand, buf: &mut [u8; PAGE_SIZE + 8]) {
    for chunk in buf[..PAGE_SIZE].chunks_exact_mut(8) {
        chunk.copy_from_slice(&rng.next_u64().to_le_bytes());
    }
}

/// [`VOCABULARY`] as (bytes in a little-endian word, length): every token
/// fits in 8 bytes, so the text generator stores a whole word at once and
/// advances by its length, instead of a variable-length copy per token.
const PACKED: [(u64, usize); 128] = {
    let mut packed = [(0u64, 0usize); 128];
    let mut index = 0;
    while index < 128 {
        let token = VOCABULARY[index];
        assert!(token.len() <= 8);
        let mut word = 0u64;
        let mut byte = 0;
        while byte < token.len() {
            word |= (token[byte] as u64) << (8 * byte);
            byte += 1;
        }
        packed[index] = (word, token.len());
        index += 1;
    }
    packed
};

/// Fills a page buffer with words from [`VOCABULARY`]. The buffer has 8
/// bytes of slack past the page for the last whole-word store.
fn text_page(rng: &mut WyRand, buf: &mut [u8; PAGE_SIZE + 8]) {
    let mut pos = 0;
    'page: loop {
        // Nine 7-bit token choices per generator step.
        let mut bits = rng.next_u64();
        for _ in 0..9 {
            let (word, len) = PACKED[(bits & 127) as usize];
            bits >>= 7;
            buf[pos..pos + 8].copy_from_slice(&word.to_le_bytes());
            pos += len;
            if pos >= PAGE_SIZE {
                break 'page;
            }
        }
    }
}

/// Fills `mapping` (guest page 0 at its start) with `mix` using all available
/// cores. Zero pages are never touched: first-touch faults dominate the cost
/// of a fill, and an untouched page also costs no memory.
///
/// Adds the bytes of each chunk to `filled` as it is done, for progress.
///
/// Must run before any dirtier thread exists; it writes through raw pointers
/// anyway so it never aliases a Rust reference with guest memory.
pub(crate) fn fill(mapping: &Mapping, mix: ContentMix, seed: u64, filled: &AtomicU64) {
    let pages = (mapping.len() / PAGE_SIZE) as u64;
    let next = AtomicU64::new(0);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = threads.min(pages.div_ceil(CHUNK_PAGES) as usize).max(1);
    let work = || {
        let mut buf = [0u8; PAGE_SIZE + 8];
        loop {
            let start = next.fetch_add(CHUNK_PAGES, Ordering::Relaxed);
            if start >= pages {
                break;
            }
            let end = (start + CHUNK_PAGES).min(pages);
            for page in start..end {
                let kind = page_kind(mix, seed, page);
                let mut rng = WyRand(mix64(hash2(seed, page) ^ 0x5eed_f111));
                match kind {
                    PageKind::Zero => continue,
                    PageKind::Random => random_page(&mut rng, &mut buf),
                    PageKind::Text => text_page(&mut rng, &mut buf),
                }
                // `page < pages`, a page of the mapping, whose length is a usize.
                #[expect(clippy::cast_possible_truncation, reason = "a page of the mapping")]
                let offset = page as usize * PAGE_SIZE;
                // SAFETY: `page < pages`, so the destination page lies inside
                // the mapping, and `buf` is a separate stack buffer, so the
                // ranges do not overlap. No references into the mapping exist.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        buf.as_ptr(),
                        mapping.ptr().add(offset),
                        PAGE_SIZE,
                    );
                }
            }
            filled.fetch_add((end - start) * PAGE_SIZE as u64, Ordering::Relaxed);
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(work);
        }
        work();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_follow_the_mix() {
        let mix = ContentMix {
            zero: 20,
            random: 30,
            text: 50,
        };
        let mut counts = [0u32; 3];
        for page in 0..100_000 {
            counts[page_kind(mix, 42, page) as usize] += 1;
        }
        assert!((19_000..21_000).contains(&counts[0]), "{counts:?}");
        assert!((29_000..31_000).contains(&counts[1]), "{counts:?}");
        assert!((49_000..51_000).contains(&counts[2]), "{counts:?}");
    }

    #[test]
    fn fill_progress_reaches_the_memory_size() {
        let memory = 8u64 << 20;
        let filled = AtomicU64::new(0);
        let guest = crate::SyntheticGuest::new_with_fill_progress(
            &crate::SyntheticConfig {
                memory_bytes: memory,
                regions: 1,
                mix: ContentMix::default(),
                seed: 3,
                dirty_rate_bytes_per_sec: 0,
                working_set_bytes: 0,
                dirtier_threads: 1,
            },
            &filled,
        )
        .unwrap();
        assert_eq!(filled.load(Ordering::Relaxed), memory);
        drop(guest);
    }

    #[test]
    fn text_pages_are_vocabulary_words() {
        let mut buf = [0u8; PAGE_SIZE + 8];
        for seed in 0..20 {
            text_page(&mut WyRand(seed), &mut buf);
            let page = &buf[..PAGE_SIZE];
            assert!(
                page.iter()
                    .all(|b| b.is_ascii_graphic() || *b == b' ' || *b == b'\n')
            );
            let text = std::str::from_utf8(page).unwrap();
            // Every whole word (the last one may be cut at the page end).
            let words: Vec<&str> = text.split_whitespace().collect();
            for word in &words[..words.len() - 1] {
                let word = word.trim_end_matches(['.', ',', ';', '?']);
                assert!(
                    word.is_empty() || VOCABULARY.contains(&format!("{word} ").as_bytes()),
                    "{word:?}"
                );
            }
        }
    }
}
