//! Dictionaries and packet frames: round trips and refusals.

use super::*;
use crate::PAGE_SIZE;

fn sample(kind: &str, pages: u64, seed: u64) -> Vec<[u8; PAGE_SIZE]> {
    (0..pages).map(|i| corpus_page(kind, seed + i)).collect()
}

fn trained(id: u8) -> CodecDictionary {
    let bytes = train_dictionary(&sample("text", 256, 10_000), 16 << 10).expect("trains");
    assert!(!bytes.is_empty() && bytes.len() <= 16 << 10);
    CodecDictionary::new(id, CodecId::Zstd, bytes).unwrap()
}

fn compress_all(c: &mut PageCompressor, pages: &[[u8; PAGE_SIZE]]) -> CompressedBatch {
    let pointers: Vec<*const u8> = pages.iter().map(|page| page.as_ptr()).collect();
    let mut batch = CompressedBatch::new();
    // SAFETY: every pointer is a whole page of `pages`, alive for the call.
    unsafe { c.compress_batch(&pointers, &mut batch) };
    batch
}

fn wire_bytes(batch: &CompressedBatch) -> usize {
    batch
        .outcomes
        .iter()
        .map(|outcome| match outcome {
            PageOutcome::Compressed { len, .. } => *len,
            PageOutcome::Raw(_) => PAGE_SIZE,
        })
        .sum()
}

#[test]
fn pages_compressed_with_a_dictionary_decode_alone_and_are_smaller() {
    let dictionary = trained(1);
    let pages = sample("text", 64, 1);
    let mut plain = PageCompressor::new(CodecId::Zstd, 1).unwrap();
    let mut with = PageCompressor::with_dictionary(CodecId::Zstd, 1, Some(&dictionary)).unwrap();
    assert_eq!(with.dictionary_id(), 1);
    let plain_batch = compress_all(&mut plain, &pages);
    let batch = compress_all(&mut with, &pages);
    assert!(
        wire_bytes(&batch) < wire_bytes(&plain_batch),
        "{} with the dictionary, {} without",
        wire_bytes(&batch),
        wire_bytes(&plain_batch)
    );
    let mut decoder = PageDecompressor::new(CodecId::Zstd)
        .unwrap()
        .with_dictionaries(std::slice::from_ref(&dictionary))
        .unwrap();
    // Any page alone, in reverse order.
    for (i, page) in pages.iter().enumerate().rev() {
        let mut out = [0u8; PAGE_SIZE];
        decoder
            .decompress_with(batch.compressed(i).unwrap(), 1, &mut out)
            .unwrap();
        assert_eq!(&out, page);
    }
    // Without the dictionary the page does not decode to itself.
    let mut out = [0u8; PAGE_SIZE];
    let without = decoder.decompress_with(batch.compressed(0).unwrap(), 0, &mut out);
    assert!(without.is_err() || out != pages[0]);
}

#[test]
fn a_packet_naming_a_dictionary_the_decoder_lacks_is_refused() {
    let dictionary = trained(1);
    let pages = sample("text", 4, 1);
    let mut with = PageCompressor::with_dictionary(CodecId::Zstd, 1, Some(&dictionary)).unwrap();
    let batch = compress_all(&mut with, &pages);
    let mut decoder = PageDecompressor::new(CodecId::Zstd).unwrap();
    let mut out = [0u8; PAGE_SIZE];
    let error = decoder
        .decompress_with(batch.compressed(0).unwrap(), 1, &mut out)
        .unwrap_err();
    assert!(
        matches!(error, CodecError::UnknownDictionary { id: 1, .. }),
        "{error}"
    );
    let mut lz4 = PageDecompressor::new(CodecId::Lz4).unwrap();
    assert!(matches!(
        lz4.decompress_with(&[1, 2, 3], 2, &mut out),
        Err(CodecError::UnknownDictionary { id: 2, .. })
    ));
}

#[test]
fn dictionaries_outside_the_wire_limits_are_refused() {
    let too_long = vec![1u8; tern_wire::MAX_DICTIONARY_LEN + 1];
    assert!(CodecDictionary::new(1, CodecId::Zstd, too_long).is_err());
    assert!(CodecDictionary::new(0, CodecId::Zstd, vec![1]).is_err());
    assert!(CodecDictionary::new(tern_wire::MAX_DICTIONARIES + 1, CodecId::Zstd, vec![1]).is_err());
    assert!(CodecDictionary::new(1, CodecId::Lz4, vec![1]).is_err());
    assert!(CodecDictionary::new(1, CodecId::Zstd, Vec::new()).is_err());
    let dictionary = trained(1);
    assert!(PageCompressor::with_dictionary(CodecId::Deflate, 1, Some(&dictionary)).is_err());
    // Random pages are left out of training; too few remain.
    assert!(train_dictionary(&sample("random", 64, 1), 16 << 10).is_err());
}

#[test]
fn a_packet_frame_round_trips_with_and_without_a_dictionary() {
    let dictionary = trained(2);
    let mut pages = sample("text", 40, 100);
    pages.extend(sample("random", 3, 7));
    pages.extend(sample("binary", 40, 200));
    for dictionary in [None, Some(&dictionary)] {
        let mut c = PageCompressor::with_dictionary(CodecId::ZstdPacket, 1, dictionary).unwrap();
        let batch = compress_all(&mut c, &pages);
        let lens: Vec<usize> = batch
            .outcomes
            .iter()
            .filter_map(|outcome| match outcome {
                PageOutcome::Compressed { len, .. } => Some(*len),
                PageOutcome::Raw(_) => None,
            })
            .collect();
        assert_eq!(lens.len(), 80, "the random pages go raw");
        assert!(lens[0] > 0 && lens[1..].iter().all(|&len| len == 0));
        assert_eq!(batch.data.len(), lens[0]);
        let mut decoder = PageDecompressor::new(CodecId::ZstdPacket)
            .unwrap()
            .with_dictionaries(&dictionary.into_iter().cloned().collect::<Vec<_>>())
            .unwrap();
        let id = dictionary.map_or(0, CodecDictionary::id);
        let decoded = decoder.decompress_packet(&batch.data, id, 80).unwrap();
        let expected: Vec<u8> = pages
            .iter()
            .enumerate()
            .filter(|(i, _)| matches!(batch.outcomes[*i], PageOutcome::Compressed { .. }))
            .flat_map(|(_, page)| page.iter().copied())
            .collect();
        assert_eq!(decoded, &expected[..]);
        let stats = c.stats().get(CodecImpl::ZstdPacket);
        assert_eq!(stats.pages, 83);
        assert_eq!(stats.compressed, 80);
        assert_eq!(stats.skipped_by_sampling, 3);
    }
}

#[test]
fn a_packet_frame_of_the_wrong_size_or_truncated_is_refused() {
    let pages = sample("text", 8, 1);
    let mut c = PageCompressor::new(CodecId::ZstdPacket, 1).unwrap();
    let batch = compress_all(&mut c, &pages);
    let frame = &batch.data[..];
    let mut decoder = PageDecompressor::new(CodecId::ZstdPacket).unwrap();
    // Fewer pages than the frame holds: decoding stops at the buffer's end.
    assert!(matches!(
        decoder.decompress_packet(frame, 0, 7),
        Err(CodecError::PacketSize { expected, .. }) if expected == 7 * PAGE_SIZE
    ));
    // More pages than it holds.
    assert!(matches!(
        decoder.decompress_packet(frame, 0, 9),
        Err(CodecError::PacketSize { decoded, .. }) if decoded == 8 * PAGE_SIZE
    ));
    // Cut short.
    assert!(
        decoder
            .decompress_packet(&frame[..frame.len() - 3], 0, 8)
            .is_err()
    );
    // Garbage, empty, too long, too many pages, unknown dictionary.
    assert!(decoder.decompress_packet(&[0xff; 100], 0, 8).is_err());
    assert!(decoder.decompress_packet(&[], 0, 8).is_err());
    assert!(
        decoder
            .decompress_packet(&vec![0; 8 * PAGE_SIZE], 0, 8)
            .is_err()
    );
    assert!(decoder.decompress_packet(frame, 0, 129).is_err());
    assert!(matches!(
        decoder.decompress_packet(frame, 3, 8),
        Err(CodecError::UnknownDictionary { id: 3, .. })
    ));
    // A per-page decoder takes no packet frames.
    let mut per_page = PageDecompressor::new(CodecId::Zstd).unwrap();
    assert!(per_page.decompress_packet(frame, 0, 8).is_err());
    // And it still decodes well after all that.
    assert_eq!(
        decoder.decompress_packet(frame, 0, 8).unwrap().len(),
        8 * PAGE_SIZE
    );
}

#[test]
fn random_pages_make_no_packet_frame() {
    let pages = sample("random", 16, 1);
    let mut c = PageCompressor::new(CodecId::ZstdPacket, 1).unwrap();
    c.set_sampling(false);
    let batch = compress_all(&mut c, &pages);
    assert!(batch.data.is_empty());
    assert!(
        batch
            .outcomes
            .iter()
            .all(|outcome| *outcome == PageOutcome::Raw(RawReason::DidNotShrink))
    );
}
