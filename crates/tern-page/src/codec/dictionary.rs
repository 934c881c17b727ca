//! zstd dictionaries trained on the guest's own pages.
//!
//! A 4 KiB page compressed alone pays for its entropy tables and finds
//! matches only inside itself. A dictionary trained at setup on pages
//! sampled across guest memory gives every page the same head start
//! (tables and common byte strings), while pages stay independent: any
//! page still decodes alone, in any order, on any thread, given the
//! session's dictionary.

use std::sync::Arc;

use tern_wire::{MAX_DICTIONARIES, MAX_DICTIONARY_LEN};

use super::error::CodecError;
use super::id::CodecId;

/// The dictionary size trained by default (see docs/compression.md for the
/// sizes measured).
pub const DEFAULT_DICTIONARY_LEN: usize = 32 << 10;

/// Pages sampled across guest memory to train on (4 MiB): zstd's trainer
/// wants about a hundred times the dictionary's size.
pub const DICTIONARY_SAMPLE_PAGES: usize = 1024;

/// A dictionary as the session uses it: its wire id, its codec, its bytes
/// (shared by every worker and receiver).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CodecDictionary {
    id: u8,
    codec: CodecId,
    bytes: Arc<[u8]>,
}

impl CodecDictionary {
    /// Checks what the wire allows: id 1..=[`MAX_DICTIONARIES`], a zstd
    /// codec, 1..=[`MAX_DICTIONARY_LEN`] bytes.
    ///
    /// # Errors
    ///
    /// [`CodecError::Dictionary`] naming the rule broken.
    pub fn new(id: u8, codec: CodecId, bytes: Vec<u8>) -> Result<Self, CodecError> {
        if id == 0 || id > MAX_DICTIONARIES {
            return Err(CodecError::Dictionary(format!(
                "id {id} (must be 1..={MAX_DICTIONARIES})"
            )));
        }
        if !codec.is_zstd() {
            return Err(CodecError::Dictionary(format!(
                "{codec} takes no dictionary"
            )));
        }
        if bytes.is_empty() || bytes.len() > MAX_DICTIONARY_LEN {
            return Err(CodecError::Dictionary(format!(
                "{} bytes (must be 1..={MAX_DICTIONARY_LEN})",
                bytes.len()
            )));
        }
        Ok(Self {
            id,
            codec,
            bytes: bytes.into(),
        })
    }

    /// The id packets name it by.
    pub fn id(&self) -> u8 {
        self.id
    }

    /// The codec it is for.
    pub fn codec(&self) -> CodecId {
        self.codec
    }

    /// Its bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}
