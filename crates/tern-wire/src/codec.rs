//! Little-endian cursor reading and writing, with truncation reported as an
//! error instead of a panic.

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

use crate::WireError;

/// Reads fields from a byte slice; every read checks the remaining length.
#[derive(Debug)]
pub struct Reader<'a> {
    bytes: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// A reader over `bytes`; `what` names the structure in error messages.
    pub fn new(bytes: &'a [u8], what: &'static str) -> Self {
        Self { bytes, what }
    }

    /// Takes the next `len` bytes.
    pub fn take(&mut self, len: usize) -> Result<&'a [u8], WireError> {
        if self.bytes.len() < len {
            return Err(WireError::Truncated(self.what));
        }
        let (head, tail) = self.bytes.split_at(len);
        self.bytes = tail;
        Ok(head)
    }

    /// Takes exactly `N` bytes as an array.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    /// Reads a byte.
    pub fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.array::<1>()?[0])
    }

    /// Reads a little-endian u16.
    pub fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.array()?))
    }

    /// Reads a little-endian u32.
    pub fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    /// Reads a little-endian u64.
    pub fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// Reads a little-endian u128.
    pub fn u128(&mut self) -> Result<u128, WireError> {
        Ok(u128::from_le_bytes(self.array()?))
    }

    /// Reads a u32 length followed by that many bytes, at most `max`.
    pub fn bytes_u32(&mut self, max: usize, field: &'static str) -> Result<&'a [u8], WireError> {
        let len = self.u32()? as usize;
        if len > max {
            return Err(WireError::FieldTooLong { field, len, max });
        }
        self.take(len)
    }

    /// Reads a length-prefixed UTF-8 string of at most `max` bytes.
    pub fn string(&mut self, max: usize, field: &'static str) -> Result<String, WireError> {
        let bytes = self.bytes_u32(max, field)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| WireError::InvalidUtf8(field))
    }

    /// Reads a length-prefixed UTF-8 string meant to be shown to an
    /// operator (an abort message, an outcome detail), made harmless with
    /// [`sanitise_peer_text`].
    pub fn peer_text(&mut self, max: usize, field: &'static str) -> Result<String, WireError> {
        Ok(sanitise_peer_text(&self.string(max, field)?))
    }

    /// Requires reserved bytes to be zero.
    pub fn reserved(&mut self, len: usize) -> Result<(), WireError> {
        if self.take(len)?.iter().any(|&b| b != 0) {
            return Err(WireError::ReservedNotZero(self.what));
        }
        Ok(())
    }

    /// Reads a fixed-layout record ([`crate::layout`]) in one step: its
    /// size is checked once and every field comes out of the same bytes.
    pub(crate) fn record<T: FromBytes + KnownLayout + Immutable + Unaligned>(
        &mut self,
    ) -> Result<T, WireError> {
        let what = self.what;
        T::read_from_bytes(self.take(size_of::<T>())?).map_err(|_| WireError::Truncated(what))
    }

    /// Requires the reserved bytes of a record to be zero.
    pub(crate) fn check_reserved(&self, bytes: &[u8]) -> Result<(), WireError> {
        if bytes.iter().any(|&b| b != 0) {
            return Err(WireError::ReservedNotZero(self.what));
        }
        Ok(())
    }

    /// Requires that nothing is left.
    pub fn finish(self) -> Result<(), WireError> {
        if self.bytes.is_empty() {
            Ok(())
        } else {
            Err(WireError::TrailingBytes {
                what: self.what,
                extra: self.bytes.len(),
            })
        }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.bytes.len()
    }
}

/// Appends little-endian fields to a buffer.
#[derive(Debug)]
pub struct Writer<'a> {
    out: &'a mut Vec<u8>,
}

impl<'a> Writer<'a> {
    /// A writer appending to `out`.
    pub fn new(out: &'a mut Vec<u8>) -> Self {
        Self { out }
    }

    /// Appends raw bytes.
    pub fn bytes(&mut self, bytes: &[u8]) -> &mut Self {
        self.out.extend_from_slice(bytes);
        self
    }

    /// Appends a byte.
    pub fn u8(&mut self, value: u8) -> &mut Self {
        self.out.push(value);
        self
    }

    /// Appends a little-endian u16.
    pub fn u16(&mut self, value: u16) -> &mut Self {
        self.bytes(&value.to_le_bytes())
    }

    /// Appends a little-endian u32.
    pub fn u32(&mut self, value: u32) -> &mut Self {
        self.bytes(&value.to_le_bytes())
    }

    /// Appends a little-endian u64.
    pub fn u64(&mut self, value: u64) -> &mut Self {
        self.bytes(&value.to_le_bytes())
    }

    /// Appends a little-endian u128.
    pub fn u128(&mut self, value: u128) -> &mut Self {
        self.bytes(&value.to_le_bytes())
    }

    /// Appends a u32 length and the bytes. Callers keep lengths within the
    /// protocol's limits; longer input is truncated to `u32::MAX`, which the
    /// peer then rejects.
    pub fn bytes_u32(&mut self, bytes: &[u8]) -> &mut Self {
        let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
        self.u32(len);
        self.bytes(&bytes[..len as usize])
    }

    /// Appends a fixed-layout record ([`crate::layout`]).
    pub(crate) fn record<T: IntoBytes + Immutable>(&mut self, record: &T) -> &mut Self {
        self.bytes(record.as_bytes())
    }

    /// Appends zero bytes.
    pub fn zeros(&mut self, len: usize) -> &mut Self {
        self.out.resize(self.out.len() + len, 0);
        self
    }
}

/// The most characters of peer-supplied text kept for display.
pub const MAX_PEER_TEXT_CHARS: usize = 1024;

/// Makes text that came from the peer safe to put in a log line, an error
/// or a terminal: control characters (escape codes, newlines, carriage
/// returns) and Unicode direction overrides become U+FFFD, and the text is
/// cut to [`MAX_PEER_TEXT_CHARS`] characters. A peer could otherwise
/// rewrite the operator's screen or forge log lines.
pub fn sanitise_peer_text(text: &str) -> String {
    let mut out = String::with_capacity(text.len().min(MAX_PEER_TEXT_CHARS * 4));
    for (count, ch) in text.chars().enumerate() {
        if count == MAX_PEER_TEXT_CHARS {
            out.push('…');
            break;
        }
        let harmful = ch.is_control()
            || matches!(ch, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
        out.push(if harmful { '\u{fffd}' } else { ch });
    }
    out
}
