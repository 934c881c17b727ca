//! What the decompressor targets share.

use tern_page::PAGE_SIZE;
use tern_page::codec::{CodecError, CodecId, PageDecompressor};

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
