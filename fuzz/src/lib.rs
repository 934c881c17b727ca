//! What the decompressor targets share.

use tern_page::PAGE_SIZE;
use tern_page::codec::{CodecDictionary, CodecError, CodecId, PageDecompressor};

/// Decodes `data` as one compressed page of `codec`. A page decodes
/// whole or not at all: success means exactly `PAGE_SIZE` bytes came out.
pub fn decompress(codec: CodecId, data: &[u8]) {
    let mut decompressor = PageDecompressor::new(codec).expect("the codec is built");
    let mut page = [0u8; PAGE_SIZE];
    match decompressor.decompress(data, &mut page) {
        Ok(()) => assert!(!data.is_empty() && data.len() < PAGE_SIZE),
        Err(CodecError::BadInputLength { len, .. }) => {
            assert!(len == 0 || len >= PAGE_SIZE)
        }
        Err(_) => {}
    }
}

/// The dictionary the zstd packet target decodes against (dictionary id 1):
/// raw content, as zstd takes any bytes without its magic.
pub fn packet_dictionary() -> CodecDictionary {
    CodecDictionary::new(
        1,
        CodecId::Zstd,
        b"tern packet frame dictionary ".repeat(32),
    )
    .expect("within the limits")
}

/// Decodes `data` as a zstd packet frame: the first byte gives the
/// packet's compressed pages (1 to 128) and, in its top bit, whether the
/// frame names the dictionary; the rest is the frame. Success means exactly
/// that many pages came out; nothing larger is ever written.
pub fn decompress_packet(data: &[u8]) {
    let Some((&first, frame)) = data.split_first() else {
        return;
    };
    let pages = usize::from(first & 0x7f) + 1;
    let dictionary = if first & 0x80 != 0 { 1 } else { 0 };
    let mut decompressor = PageDecompressor::new(CodecId::ZstdPacket)
        .and_then(|decoder| decoder.with_dictionaries(&[packet_dictionary()]))
        .expect("zstd is built");
    if let Ok(decoded) = decompressor.decompress_packet(frame, dictionary, pages) {
        assert_eq!(decoded.len(), pages * PAGE_SIZE);
        assert!(!frame.is_empty() && frame.len() < pages * PAGE_SIZE);
    }
}

/// Applies `data` as a delta record to a page: a record is applied whole
/// or refused whole, and then the page is untouched; whatever is refused
/// fails validation too.
pub fn apply_delta(data: &[u8]) {
    let original = [0x5au8; PAGE_SIZE];
    let mut page = original;
    match tern_page::delta::apply_delta(data, &mut page) {
        Ok(()) => {
            assert!(tern_page::delta::validate_delta(data).is_ok());
            assert!(!data.is_empty() && data.len() < PAGE_SIZE);
        }
        Err(_) => {
            assert_eq!(page, original, "a refused record wrote");
            assert!(tern_page::delta::validate_delta(data).is_err());
        }
    }
}

/// The packets of a channel stream in `data`, in order: each a head byte
/// (the packet's compressed pages, 1 to 128, less one, and in its top bit
/// the restart flag), a little-endian u16 length, then that many bytes (or
/// what is left). Shared by the target and the seed writer.
pub fn stream_packets(mut data: &[u8]) -> Vec<(usize, bool, &[u8])> {
    let mut packets = Vec::new();
    while let [head, low, high, rest @ ..] = data {
        let len = usize::from(u16::from_le_bytes([*low, *high])).min(rest.len());
        let (bytes, after) = rest.split_at(len);
        packets.push((usize::from(head & 0x7f) + 1, head & 0x80 != 0, bytes));
        data = after;
    }
    packets
}

/// Decodes `data`'s packets ([`stream_packets`]) one after another with one
/// channel's zstd stream decoder, as a receiver does: each decodes to
/// exactly its pages or fails with a typed error, never writing more, and
/// after a failure the stream is given up (as the receiver ends the
/// session).
pub fn decompress_stream(data: &[u8]) {
    let mut decompressor = PageDecompressor::new(CodecId::ZstdStream).expect("zstd is built");
    for (pages, restart, bytes) in stream_packets(data) {
        match decompressor.decompress_packet(bytes, u8::from(restart), pages) {
            Ok(decoded) => {
                assert_eq!(decoded.len(), pages * PAGE_SIZE);
                assert!(!bytes.is_empty() && bytes.len() < pages * PAGE_SIZE);
            }
            Err(_) => return,
        }
    }
}
