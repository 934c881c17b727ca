//! Replays the decompressor fuzz targets' kept inputs
//! (`fuzz/seeds/decompress_<codec>/`: real compressed pages and every input
//! that once found a bug) through the decoder the targets call, on stable.

use std::path::PathBuf;

use tern_page::PAGE_SIZE;
use tern_page::codec::{CodecError, CodecId, PageDecompressor};

/// What each decompressor target checks: a page decodes whole or fails
/// with a typed error.
fn decompress(codec: CodecId, data: &[u8]) -> Result<(), CodecError> {
    let mut decompressor = PageDecompressor::new(codec)?;
    let mut page = [0u8; PAGE_SIZE];
    let result = decompressor.decompress(data, &mut page);
    if result.is_ok() {
        assert!(!data.is_empty() && data.len() < PAGE_SIZE);
    }
    result
}

fn replay(codec: CodecId) {
    if !codec.is_built() {
        return;
    }
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/seeds")
        .join(format!("decompress_{}", codec.name()));
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        let data = std::fs::read(&path).expect("a seed");
        let result = decompress(codec, &data);
        // The seeds the write_seeds example made are real pages; the rest
        // are inputs that once broke something and must fail cleanly.
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if ["text", "binary", "sparse", "ones"].contains(&name) {
            result.unwrap_or_else(|error| panic!("{}: {error}", path.display()));
        }
        count += 1;
    }
    assert!(count > 0, "no seeds in {}", dir.display());
}

#[test]
fn zstd_seeds() {
    replay(CodecId::Zstd);
}

#[test]
fn deflate_seeds() {
    replay(CodecId::Deflate);
}

#[test]
fn lz4_seeds() {
    replay(CodecId::Lz4);
}

/// The `decompress_zstd_packet` target's seeds, through what it calls
/// (`fuzz/src/lib.rs`): a page count byte, then a packet frame.
#[test]
fn zstd_packet_seeds() {
    use tern_page::codec::CodecDictionary;
    if !CodecId::ZstdPacket.is_built() {
        return;
    }
    let dictionary = CodecDictionary::new(
        1,
        CodecId::Zstd,
        b"tern packet frame dictionary ".repeat(32),
    )
    .expect("the target's dictionary");
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/decompress_zstd_packet");
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        let data = std::fs::read(&path).expect("a seed");
        let (&first, frame) = data.split_first().expect("a page count");
        let pages = usize::from(first & 0x7f) + 1;
        let mut decoder = PageDecompressor::new(CodecId::ZstdPacket)
            .and_then(|decoder| decoder.with_dictionaries(std::slice::from_ref(&dictionary)))
            .expect("zstd");
        let result = decoder.decompress_packet(frame, u8::from(first & 0x80 != 0), pages);
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if ["text", "mixed_dict"].contains(&name) {
            let decoded = result.unwrap_or_else(|error| panic!("{}: {error}", path.display()));
            assert_eq!(decoded.len(), pages * PAGE_SIZE);
        }
        count += 1;
    }
    assert!(count > 0, "no seeds in {}", dir.display());
}

/// The `decompress_zstd_stream` target's seeds, through the layout it
/// reads (`fuzz/src/lib.rs`, `stream_packets`: a head byte with the pages
/// and the restart flag, a u16 length, the bytes): the written seed's four
/// packets decode in order on one stream decoder.
#[test]
fn zstd_stream_seeds() {
    if !CodecId::ZstdStream.is_built() {
        return;
    }
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/decompress_zstd_stream");
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        let mut data = &std::fs::read(&path).expect("a seed")[..];
        let mut decoder = PageDecompressor::new(CodecId::ZstdStream).expect("zstd");
        let mut packets = 0;
        while let [head, low, high, rest @ ..] = data {
            let len = usize::from(u16::from_le_bytes([*low, *high])).min(rest.len());
            let (bytes, after) = rest.split_at(len);
            let pages = usize::from(head & 0x7f) + 1;
            let result = decoder.decompress_packet(bytes, u8::from(head & 0x80 != 0), pages);
            if path.ends_with("four-packets") {
                let decoded = result.unwrap_or_else(|error| panic!("{}: {error}", path.display()));
                assert_eq!(decoded.len(), pages * PAGE_SIZE);
            }
            packets += 1;
            data = after;
        }
        if path.ends_with("four-packets") {
            assert_eq!(packets, 4);
        }
        count += 1;
    }
    assert!(count > 0, "no seeds in {}", dir.display());
}

/// The `apply_delta` target's kept inputs: real records apply, the named
/// bad ones are refused without touching the page.
#[test]
fn apply_delta_seeds() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/apply_delta");
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        let data = std::fs::read(&path).expect("a seed");
        let original = [0x5au8; PAGE_SIZE];
        let mut page = original;
        let result = tern_page::delta::apply_delta(&data, &mut page);
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name.starts_with("bad_") {
            assert!(result.is_err(), "{name} was applied");
            assert_eq!(page, original, "{name} wrote before being refused");
        } else {
            result.unwrap_or_else(|error| panic!("{}: {error}", path.display()));
        }
        count += 1;
    }
    assert!(count >= 5, "seeds missing in {}", dir.display());
}
