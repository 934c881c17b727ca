//! Sealed control frames (protocol version 7): with a shared key, every
//! control frame on the main channel after the key exchange carries a
//! sequence number and a MAC, so that a frame forged, altered, replayed,
//! dropped or reordered on the way fails the session on the side that
//! reads it.
//!
//! A sealed frame is an ordinary frame with bit [`FRAME_SEALED`] set in its
//! flags byte, followed by a [`SEAL_LEN`]-byte seal: `sequence u64, tag
//! [u8; 32]`. The body length in the header does not count the seal. What
//! the tag is (a keyed MAC over the sequence, the header and the body) is
//! the engine's business: this crate has no cryptography and only frames
//! it, and hands the parts to a [`FrameOpener`] before decoding the body.
//!
//! Page packets are never sealed; the memory digest, carried in a sealed
//! `Complete` and compared before the guest may resume, covers their
//! content (docs/security.md).

use std::fmt;

use crate::error::WireError;
use crate::{FRAME_HEADER_LEN, FrameKind};

/// The flag bit (in the frame header's byte 1) of a sealed frame.
pub const FRAME_SEALED: u8 = 0x01;
/// Length of the seal after a sealed frame's body: sequence and tag.
pub const SEAL_LEN: usize = 8 + SEAL_TAG_LEN;
/// Length of a seal's tag (HMAC-SHA256).
pub const SEAL_TAG_LEN: usize = 32;

/// The seal of one frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seal {
    /// The frame's number in its direction of its channel: 0 for the first
    /// sealed frame, then one more for each.
    pub sequence: u64,
    /// The MAC over the sequence, the frame header and the body.
    pub tag: [u8; SEAL_TAG_LEN],
}

impl Seal {
    /// The seal's bytes on the wire.
    pub fn encode(&self) -> [u8; SEAL_LEN] {
        let mut out = [0u8; SEAL_LEN];
        out[..8].copy_from_slice(&self.sequence.to_le_bytes());
        out[8..].copy_from_slice(&self.tag);
        out
    }

    /// Splits a seal's bytes.
    pub fn decode(bytes: &[u8; SEAL_LEN]) -> Self {
        let mut sequence = [0u8; 8];
        sequence.copy_from_slice(&bytes[..8]);
        let mut tag = [0u8; SEAL_TAG_LEN];
        tag.copy_from_slice(&bytes[8..]);
        Self {
            sequence: u64::from_le_bytes(sequence),
            tag,
        }
    }
}

/// Whether a frame header has the sealed flag.
pub fn header_is_sealed(header: &[u8; FRAME_HEADER_LEN]) -> bool {
    header[1] & FRAME_SEALED != 0
}

/// Sets the sealed flag in an encoded frame (header first); the caller
/// appends the seal, computed over the frame as it is after this call.
///
/// # Panics
/// If `frame` is shorter than a frame header.
pub fn mark_sealed(frame: &mut [u8]) {
    frame[1] |= FRAME_SEALED;
}

/// Checks sealed frames as a [`crate::FrameDecoder`] completes them, before
/// their body is decoded: the engine's implementation knows the session key
/// and the sequence number it expects next.
pub trait FrameOpener: Send + fmt::Debug {
    /// Accepts the frame (header with the sealed flag, body, seal) or says
    /// why not: [`WireError::SealSequence`] for a frame out of order,
    /// [`WireError::SealForged`] for a tag that does not match.
    fn open(
        &mut self,
        header: &[u8; FRAME_HEADER_LEN],
        body: &[u8],
        seal: &Seal,
    ) -> Result<(), WireError>;
}

/// Every kind that may open a connection: a hello, a channel hello, an
/// auth hello, a paused postcopy's resume, or an abort. A destination
/// refuses any other first frame at its header.
pub const OPENING_KINDS: [FrameKind; 5] = [
    FrameKind::Hello,
    FrameKind::ChannelHello,
    FrameKind::AuthHello,
    FrameKind::PostcopyResume,
    FrameKind::Abort,
];

/// The longest frame (header included) that may open a connection: the
/// largest legal hello (1024 regions and the longest guest kind), which is
/// longer than any other opening kind. A destination reads at most this
/// much from a connection that has not authenticated.
pub const MAX_OPENING_FRAME: usize = FRAME_HEADER_LEN + max_opening_body();

const fn max_opening_body() -> usize {
    let hello = FrameKind::Hello.max_body();
    let abort = FrameKind::Abort.max_body();
    if hello > abort { hello } else { abort }
}

/// The frames that may answer an auth challenge: the proof, or an abort.
pub const PROOF_KINDS: [FrameKind; 2] = [FrameKind::AuthProof, FrameKind::Abort];

/// The longest frame that may answer an auth challenge (an abort with its
/// longest text; a proof is exactly 40 bytes).
pub const MAX_PROOF_FRAME: usize = FRAME_HEADER_LEN + FrameKind::Abort.max_body();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seal_round_trips() {
        let seal = Seal {
            sequence: 0x0102_0304_0506_0708,
            tag: [7; SEAL_TAG_LEN],
        };
        assert_eq!(Seal::decode(&seal.encode()), seal);
    }

    /// Accepts a seal whose tag is the sequence number repeated, in order.
    #[derive(Debug, Default)]
    struct CountingOpener {
        next: u64,
    }

    impl FrameOpener for CountingOpener {
        fn open(
            &mut self,
            _header: &[u8; FRAME_HEADER_LEN],
            _body: &[u8],
            seal: &Seal,
        ) -> Result<(), WireError> {
            if seal.sequence != self.next {
                return Err(WireError::SealSequence {
                    got: seal.sequence,
                    expected: self.next,
                });
            }
            if seal.tag != [seal.sequence.to_le_bytes()[0]; SEAL_TAG_LEN] {
                return Err(WireError::SealForged(FrameKind::Commit));
            }
            self.next += 1;
            Ok(())
        }
    }

    fn sealed(message: &crate::Message, sequence: u64) -> Vec<u8> {
        let mut frame = message.to_bytes();
        mark_sealed(&mut frame);
        frame.extend_from_slice(
            &Seal {
                sequence,
                tag: [sequence.to_le_bytes()[0]; SEAL_TAG_LEN],
            }
            .encode(),
        );
        frame
    }

    fn decode_with_opener(bytes: &[u8]) -> Result<Vec<crate::Frame>, WireError> {
        let mut decoder = crate::FrameDecoder::new();
        decoder.seal_with(Box::new(CountingOpener::default()));
        let mut input = bytes;
        let mut frames = Vec::new();
        while let Some(decoded) = decoder.decode(&mut input)? {
            if let crate::Decoded::Event(crate::Event::Message(message)) = decoded {
                frames.push(crate::Frame::Message(message));
            }
        }
        decoder.finish()?;
        Ok(frames)
    }

    #[test]
    fn a_sealing_decoder_takes_sealed_frames_in_order_only() {
        let commit = crate::Message::Commit;
        let mut stream = sealed(&crate::Message::Heartbeat(Default::default()), 0);
        stream.extend(sealed(&commit, 1));
        assert_eq!(decode_with_opener(&stream).unwrap().len(), 2);
        // Unsealed, replayed, forged.
        assert_eq!(
            decode_with_opener(&commit.to_bytes()),
            Err(WireError::Unsealed(FrameKind::Commit))
        );
        let mut replayed = sealed(&commit, 0);
        replayed.extend(sealed(&commit, 0));
        assert_eq!(
            decode_with_opener(&replayed),
            Err(WireError::SealSequence {
                got: 0,
                expected: 1
            })
        );
        let mut forged = sealed(&commit, 0);
        let last = forged.len() - 1;
        forged[last] ^= 1;
        assert!(matches!(
            decode_with_opener(&forged),
            Err(WireError::SealForged(_))
        ));
        // A decoder without a session key refuses a sealed frame.
        assert_eq!(
            crate::decode_stream(&sealed(&commit, 0), None),
            Err(WireError::SealUnexpected(FrameKind::Commit))
        );
    }

    #[test]
    fn the_largest_opening_frame_is_a_few_kib() {
        // Header, then the hello: session and channel, page size, regions,
        // codecs, guest kind, dictionaries, the VMM configuration's length.
        assert_eq!(MAX_OPENING_FRAME, 8 + 32 + 2 + 1024 * 24 + 4 + 64 + 1 + 4);
        const { assert!(MAX_OPENING_FRAME < 32 << 10) };
    }
}
