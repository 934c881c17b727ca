//! Delta encoding of a re-sent page against its previous version, in Intel
//! DSA's delta record format so that the CPU, the software DSA device and a
//! real DSA produce and consume the same bytes.
//!
//! A delta record is a list of 10-byte entries: the index of an 8-byte word
//! in the page (`u16`, little-endian) and that word's new value (8 bytes).
//! It carries only the words that changed, so a page whose guest rewrote 64
//! bytes costs about 90 bytes instead of 4096. A page where more than
//! [`MAX_DELTA_LEN`] bytes of entries would be needed is an *overflow*: the
//! caller sends the page whole instead (QEMU's xbzrle has the same rule).
//!
//! Applying a record on the destination is bounded and validated before a
//! byte of the page is written: the length is a multiple of the entry size
//! and at most [`MAX_DELTA_LEN`], every word index is inside the page, and
//! the indices rise strictly (each word written at most once, as the
//! create operation writes them). See `docs/compression.md`.

use crate::PAGE_SIZE;

/// Bytes of one delta record entry: word index (`u16`) and new value.
pub const DELTA_ENTRY_LEN: usize = tern_wire::DELTA_ENTRY_LEN as usize;
/// Bytes of the word a delta entry replaces.
pub const DELTA_WORD_LEN: usize = 8;
/// 8-byte words in a page: the bound on a word index.
pub const WORDS_PER_PAGE: usize = PAGE_SIZE / DELTA_WORD_LEN;
/// Longest delta record worth sending: the most whole entries that are
/// still shorter than a page (409 entries, 4090 bytes).
pub const MAX_DELTA_LEN: usize = (PAGE_SIZE - 1) / DELTA_ENTRY_LEN * DELTA_ENTRY_LEN;

/// Why a delta record was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeltaError {
    /// Empty, longer than [`MAX_DELTA_LEN`], or not whole entries.
    #[error("delta record of {0} bytes (must be 1 to {MAX_DELTA_LEN} whole 10-byte entries)")]
    Length(usize),
    /// A word index outside the page.
    #[error("delta entry {entry} names word {word}, outside the page's {WORDS_PER_PAGE} words")]
    WordOutOfPage {
        /// The entry's position in the record.
        entry: usize,
        /// The word index it names.
        word: u16,
    },
    /// A word index not above the previous one.
    #[error("delta entry {entry} names word {word}, not after the previous entry's word")]
    OutOfOrder {
        /// The entry's position in the record.
        entry: usize,
        /// The word index it names.
        word: u16,
    },
}

/// Writes into `out` the delta record that turns `old` into `new`, and
/// returns its length; `None` when it would be longer than `out` (an
/// overflow: send the page whole). A page that did not change gets one entry
/// rewriting its first word, since a record is never empty.
pub fn create_delta(old: &[u8; PAGE_SIZE], new: &[u8; PAGE_SIZE], out: &mut [u8]) -> Option<usize> {
    let limit = out.len().min(MAX_DELTA_LEN);
    let mut len = 0;
    let (old_words, _) = old.as_chunks::<DELTA_WORD_LEN>();
    let (new_words, _) = new.as_chunks::<DELTA_WORD_LEN>();
    for (word, (old_word, new_word)) in old_words.iter().zip(new_words).enumerate() {
        if old_word == new_word {
            continue;
        }
        if len + DELTA_ENTRY_LEN > limit {
            return None;
        }
        write_entry(&mut out[len..len + DELTA_ENTRY_LEN], word, new_word);
        len += DELTA_ENTRY_LEN;
    }
    if len == 0 {
        if limit < DELTA_ENTRY_LEN {
            return None;
        }
        write_entry(&mut out[..DELTA_ENTRY_LEN], 0, &new_words[0]);
        len = DELTA_ENTRY_LEN;
    }
    Some(len)
}

fn write_entry(out: &mut [u8], word: usize, value: &[u8; DELTA_WORD_LEN]) {
    let index = u16::try_from(word).expect("a page has fewer than 65536 words");
    out[..2].copy_from_slice(&index.to_le_bytes());
    out[2..DELTA_ENTRY_LEN].copy_from_slice(value);
}

/// The entries of a record: word index and new value.
fn entries(record: &[u8]) -> impl Iterator<Item = (u16, &[u8; DELTA_WORD_LEN])> {
    record.as_chunks::<DELTA_ENTRY_LEN>().0.iter().map(|entry| {
        let (index, value) = entry.split_at(2);
        let value: &[u8; DELTA_WORD_LEN] = value.try_into().expect("8 bytes after the index");
        (u16::from_le_bytes([index[0], index[1]]), value)
    })
}

/// Checks a delta record from the peer: whole entries, 1 to
/// [`MAX_DELTA_LEN`] bytes, word indices inside the page and strictly
/// rising.
pub fn validate_delta(record: &[u8]) -> Result<(), DeltaError> {
    if record.is_empty()
        || record.len() > MAX_DELTA_LEN
        || !record.len().is_multiple_of(DELTA_ENTRY_LEN)
    {
        return Err(DeltaError::Length(record.len()));
    }
    let mut next_allowed = 0usize;
    for (entry, (word, _)) in entries(record).enumerate() {
        if usize::from(word) >= WORDS_PER_PAGE {
            return Err(DeltaError::WordOutOfPage { entry, word });
        }
        if usize::from(word) < next_allowed {
            return Err(DeltaError::OutOfOrder { entry, word });
        }
        next_allowed = usize::from(word) + 1;
    }
    Ok(())
}

/// Applies a delta record to `page` after validating all of it: on an
/// error the page is untouched.
pub fn apply_delta(record: &[u8], page: &mut [u8; PAGE_SIZE]) -> Result<(), DeltaError> {
    validate_delta(record)?;
    for (word, value) in entries(record) {
        let at = usize::from(word) * DELTA_WORD_LEN;
        page[at..at + DELTA_WORD_LEN].copy_from_slice(value);
    }
    Ok(())
}

/// [`apply_delta`] on a page of guest memory, which is reached through a
/// pointer (no Rust reference may exist to memory another party may
/// access). Validates all of the record before writing.
///
/// # Safety
///
/// `page` must be valid for writes of [`PAGE_SIZE`] bytes that no other
/// thread accesses during the call.
pub unsafe fn apply_delta_to_page(record: &[u8], page: *mut u8) -> Result<(), DeltaError> {
    validate_delta(record)?;
    for (word, value) in entries(record) {
        // SAFETY: `validate_delta` checked `word < WORDS_PER_PAGE`, so the 8
        // bytes lie inside the page the caller vouches for; unaligned writes
        // need no alignment.
        unsafe {
            page.add(usize::from(word) * DELTA_WORD_LEN)
                .cast::<[u8; DELTA_WORD_LEN]>()
                .write_unaligned(*value);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(seed: u8) -> Box<[u8; PAGE_SIZE]> {
        let mut page = Box::new([0u8; PAGE_SIZE]);
        let mut state = u32::from(seed).wrapping_mul(2_654_435_761).wrapping_add(1);
        for byte in page.iter_mut() {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            *byte = state.to_le_bytes()[0];
        }
        page
    }

    fn round_trip(old: &[u8; PAGE_SIZE], new: &[u8; PAGE_SIZE]) -> Option<usize> {
        let mut record = [0u8; MAX_DELTA_LEN];
        let len = create_delta(old, new, &mut record)?;
        let mut rebuilt = Box::new(*old);
        apply_delta(&record[..len], &mut rebuilt).unwrap();
        assert_eq!(&rebuilt[..], &new[..]);
        let mut through_pointer = Box::new(*old);
        // SAFETY: a whole page we own.
        unsafe { apply_delta_to_page(&record[..len], through_pointer.as_mut_ptr()) }.unwrap();
        assert_eq!(&through_pointer[..], &new[..]);
        Some(len)
    }

    #[test]
    fn a_small_write_costs_a_few_entries() {
        let old = page(1);
        let mut new = old.clone();
        new[1000..1064].fill(0x5a);
        // 64 bytes from offset 1000 (a word boundary) are words 125..=132.
        assert_eq!(round_trip(&old, &new), Some(8 * DELTA_ENTRY_LEN));
    }

    #[test]
    fn edges_of_the_page_round_trip() {
        let old = page(2);
        let mut new = old.clone();
        new[0] ^= 1;
        new[PAGE_SIZE - 1] ^= 1;
        assert_eq!(round_trip(&old, &new), Some(2 * DELTA_ENTRY_LEN));
    }

    #[test]
    fn an_unchanged_page_is_one_entry() {
        let old = page(3);
        assert_eq!(round_trip(&old, &old), Some(DELTA_ENTRY_LEN));
    }

    #[test]
    fn a_rewritten_page_overflows() {
        assert_eq!(round_trip(&page(4), &page(5)), None);
    }

    #[test]
    fn the_longest_record_fits_and_one_more_word_overflows() {
        let old = page(6);
        let max_entries = MAX_DELTA_LEN / DELTA_ENTRY_LEN;
        let mut new = old.clone();
        for word in 0..max_entries {
            new[word * DELTA_WORD_LEN] ^= 0xff;
        }
        assert_eq!(round_trip(&old, &new), Some(MAX_DELTA_LEN));
        new[max_entries * DELTA_WORD_LEN] ^= 0xff;
        assert_eq!(round_trip(&old, &new), None);
    }

    #[test]
    fn a_short_output_buffer_is_an_overflow() {
        let old = page(7);
        let mut new = old.clone();
        new[8] ^= 1;
        new[16] ^= 1;
        let mut record = [0u8; DELTA_ENTRY_LEN + 5];
        assert_eq!(create_delta(&old, &new, &mut record), None);
    }

    #[test]
    fn malicious_records_are_refused_before_any_write() {
        let original = page(8);
        let entry = |word: u16| {
            let mut bytes = word.to_le_bytes().to_vec();
            bytes.extend_from_slice(&[0xee; 8]);
            bytes
        };
        let cases: Vec<(Vec<u8>, DeltaError)> = vec![
            (Vec::new(), DeltaError::Length(0)),
            (vec![0; 9], DeltaError::Length(9)),
            (vec![0; MAX_DELTA_LEN + 10], DeltaError::Length(4100)),
            (
                [entry(1), entry(512)].concat(),
                DeltaError::WordOutOfPage {
                    entry: 1,
                    word: 512,
                },
            ),
            (
                entry(u16::MAX),
                DeltaError::WordOutOfPage {
                    entry: 0,
                    word: u16::MAX,
                },
            ),
            (
                [entry(3), entry(3)].concat(),
                DeltaError::OutOfOrder { entry: 1, word: 3 },
            ),
            (
                [entry(5), entry(4)].concat(),
                DeltaError::OutOfOrder { entry: 1, word: 4 },
            ),
        ];
        for (record, expected) in cases {
            let mut target = original.clone();
            assert_eq!(apply_delta(&record, &mut target), Err(expected));
            assert_eq!(&target[..], &original[..], "a refused record wrote");
            // SAFETY: a whole page we own.
            let through_pointer = unsafe { apply_delta_to_page(&record, target.as_mut_ptr()) };
            assert!(through_pointer.is_err());
            assert_eq!(&target[..], &original[..], "a refused record wrote");
        }
    }

    #[test]
    fn random_edits_round_trip() {
        let old = page(9);
        let mut state = 0x1234_5678u32;
        for _ in 0..200 {
            let mut new = old.clone();
            state = state.wrapping_mul(1_103_515_245).wrapping_add(12345);
            let edits = (state >> 16) % 64;
            for _ in 0..edits {
                state = state.wrapping_mul(1_103_515_245).wrapping_add(12345);
                let at = (state >> 8) as usize % PAGE_SIZE;
                new[at] = new[at].wrapping_add(1);
            }
            assert!(round_trip(&old, &new).is_some());
        }
    }
}
