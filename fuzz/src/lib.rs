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
