//! The shared-key handshake (`--auth-key`): a mutual HMAC-SHA256 challenge
//! and response, first on every channel, before the hello.
//!
//! ```text
//! source                                   destination
//!   AuthHello { session, channel, Ns }  ->
//!                                       <-  AuthChallenge { Nd, Pd }
//!   AuthProof { Ps }                    ->
//!   Hello / ChannelHello (same session and channel)
//! Pd = HMAC(key, "tern auth v1 destination" | session | channel | Ns | Nd)
//! Ps = HMAC(key, "tern auth v1 source"      | session | channel | Ns | Nd)
//! ```
//!
//! Both nonces are fresh, so a recorded proof is worth nothing later; the
//! session and channel are inside both proofs, and the hello that follows
//! must name the same ones, so a proof cannot be moved to another channel
//! or session; the two roles have different labels, so a side cannot be
//! made to answer its own challenge. Tags are compared in constant time
//! (`ring::hmac::verify`).
//!
//! On the main channel the exchange also yields a session key, one per
//! direction, that seals every control frame after it (protocol version
//! 7): a sequence number and an HMAC-SHA256 tag over the sequence, the
//! frame header and the body ([`ControlSealer`], [`ControlOpener`]). So
//! Ready, Commit, Outcome, Abort, heartbeats, state and the completion's
//! digest cannot be forged, altered, replayed from another session,
//! dropped or reordered without the reading side failing the session. Page
//! packets are not sealed: the memory digest in the sealed completion
//! covers them. Their bytes can still be read on the way: for secrecy,
//! use TLS.

use std::fmt;
use std::path::Path;

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use tern_wire::{
    AUTH_NONCE_LEN, AUTH_PROOF_LEN, FRAME_HEADER_LEN, FrameHeader, FrameOpener, Handshake, Seal,
    WireError,
};

/// Fewest bytes a key file may hold.
pub const MIN_KEY_LEN: usize = 16;

/// Why a key could not be loaded or a proof did not match.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// The key file cannot be read.
    #[error("Cannot read the auth key {path}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The key is too short to be a secret.
    #[error("The auth key has {len} bytes; it needs at least {MIN_KEY_LEN}")]
    TooShort {
        /// Its length, after trailing white space.
        len: usize,
    },
    /// The peer's proof does not match the key.
    #[error("the peer's proof does not match this side's auth key")]
    WrongProof,
    /// No random bytes for a nonce.
    #[error("no random bytes for an authentication nonce")]
    Random,
}

/// A shared secret both sides hold.
#[derive(Clone)]
pub struct AuthKey(hmac::Key);

impl fmt::Debug for AuthKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AuthKey(..)")
    }
}

impl AuthKey {
    /// A key from its bytes; trailing white space (a newline left by an
    /// editor or `openssl rand -hex 32 > file`) is not part of it.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, AuthError> {
        let end = bytes
            .iter()
            .rposition(|byte| !byte.is_ascii_whitespace())
            .map_or(0, |last| last + 1);
        if end < MIN_KEY_LEN {
            return Err(AuthError::TooShort { len: end });
        }
        Ok(Self(hmac::Key::new(hmac::HMAC_SHA256, &bytes[..end])))
    }

    /// Reads a key file.
    pub fn load(path: &Path) -> Result<Self, AuthError> {
        let bytes = std::fs::read(path).map_err(|source| AuthError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_bytes(&bytes)
    }

    fn tag(&self, role: Role, bound: &Bound) -> hmac::Tag {
        hmac::sign(&self.0, &bound.message(role))
    }

    /// The destination's proof for this exchange.
    pub fn destination_proof(&self, bound: &Bound) -> [u8; AUTH_PROOF_LEN] {
        to_array(self.tag(Role::Destination, bound))
    }

    /// The source's proof for this exchange.
    pub fn source_proof(&self, bound: &Bound) -> [u8; AUTH_PROOF_LEN] {
        to_array(self.tag(Role::Source, bound))
    }

    /// Checks the destination's proof, in constant time.
    pub fn verify_destination(&self, bound: &Bound, proof: &[u8]) -> Result<(), AuthError> {
        hmac::verify(&self.0, &bound.message(Role::Destination), proof)
            .map_err(|_| AuthError::WrongProof)
    }

    /// Checks the source's proof, in constant time.
    pub fn verify_source(&self, bound: &Bound, proof: &[u8]) -> Result<(), AuthError> {
        hmac::verify(&self.0, &bound.message(Role::Source), proof)
            .map_err(|_| AuthError::WrongProof)
    }

    /// The keys that seal the control frames of the channel this exchange
    /// opened: derived from the shared key, the session, the channel and
    /// both nonces, one per direction, so a frame sealed in one session or
    /// direction opens in no other.
    pub fn session_keys(&self, bound: &Bound) -> SessionKeys {
        let mut label = b"tern control v1".to_vec();
        bound.append_fields(&mut label);
        let session = hmac::sign(&self.0, &label);
        let direction = |name: &[u8]| {
            let derived = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, session.as_ref()), name);
            hmac::Key::new(hmac::HMAC_SHA256, derived.as_ref())
        };
        SessionKeys {
            source_to_destination: direction(b"source to destination"),
            destination_to_source: direction(b"destination to source"),
        }
    }
}

/// The two directions' keys of one channel ([`AuthKey::session_keys`]).
#[derive(Clone)]
pub struct SessionKeys {
    source_to_destination: hmac::Key,
    destination_to_source: hmac::Key,
}

impl fmt::Debug for SessionKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SessionKeys(..)")
    }
}

impl SessionKeys {
    /// The sealer and opener of the source's side.
    pub fn for_source(&self) -> (ControlSealer, ControlOpener) {
        (
            ControlSealer::new(self.source_to_destination.clone()),
            ControlOpener::new(self.destination_to_source.clone()),
        )
    }

    /// The sealer and opener of the destination's side.
    pub fn for_destination(&self) -> (ControlSealer, ControlOpener) {
        (
            ControlSealer::new(self.destination_to_source.clone()),
            ControlOpener::new(self.source_to_destination.clone()),
        )
    }
}

/// What one frame's tag covers: its sequence number, its header, and the
/// SHA-256 of its body (so that checking a 64 MiB state section needs no
/// copy of it, and the tag comparison stays `hmac::verify`'s, in constant
/// time).
fn tagged(sequence: u64, header: &[u8], body: &[u8]) -> Vec<u8> {
    let mut message = Vec::with_capacity(8 + FRAME_HEADER_LEN + 32);
    message.extend_from_slice(&sequence.to_le_bytes());
    message.extend_from_slice(header);
    message.extend_from_slice(ring::digest::digest(&ring::digest::SHA256, body).as_ref());
    message
}

/// Seals the control frames one side sends on a channel, numbering them.
pub struct ControlSealer {
    key: hmac::Key,
    next: u64,
}

impl fmt::Debug for ControlSealer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ControlSealer(next {})", self.next)
    }
}

impl ControlSealer {
    fn new(key: hmac::Key) -> Self {
        Self { key, next: 0 }
    }

    /// Seals an encoded frame (header and body) in place: sets its sealed
    /// flag and appends the seal.
    pub fn seal(&mut self, frame: &mut Vec<u8>) {
        tern_wire::mark_sealed(frame);
        let (header, body) = frame.split_at(FRAME_HEADER_LEN);
        let tag = hmac::sign(&self.key, &tagged(self.next, header, body));
        let mut seal = Seal {
            sequence: self.next,
            tag: [0; tern_wire::SEAL_TAG_LEN],
        };
        seal.tag.copy_from_slice(tag.as_ref());
        frame.extend_from_slice(&seal.encode());
        self.next += 1;
    }
}

/// Checks the sealed control frames one side reads on a channel: each must
/// carry the next sequence number and a tag made with the peer's key.
pub struct ControlOpener {
    key: hmac::Key,
    next: u64,
}

impl fmt::Debug for ControlOpener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ControlOpener(next {})", self.next)
    }
}

impl ControlOpener {
    fn new(key: hmac::Key) -> Self {
        Self { key, next: 0 }
    }
}

impl FrameOpener for ControlOpener {
    fn open(
        &mut self,
        header: &[u8; FRAME_HEADER_LEN],
        body: &[u8],
        seal: &Seal,
    ) -> Result<(), WireError> {
        let kind = FrameHeader::decode(header)?.kind;
        if seal.sequence != self.next {
            return Err(WireError::SealSequence {
                got: seal.sequence,
                expected: self.next,
            });
        }
        let message = tagged(seal.sequence, header, body);
        hmac::verify(&self.key, &message, &seal.tag).map_err(|_| WireError::SealForged(kind))?;
        self.next += 1;
        Ok(())
    }
}

#[derive(Clone, Copy)]
enum Role {
    Source,
    Destination,
}

/// What both proofs of one exchange cover.
#[derive(Clone, Copy, Debug)]
pub struct Bound {
    /// The session and channel the exchange is for.
    pub handshake: Handshake,
    /// The source's nonce.
    pub source_nonce: [u8; AUTH_NONCE_LEN],
    /// The destination's nonce.
    pub destination_nonce: [u8; AUTH_NONCE_LEN],
}

impl Bound {
    fn message(&self, role: Role) -> Vec<u8> {
        let label: &[u8] = match role {
            Role::Source => b"tern auth v1 source",
            Role::Destination => b"tern auth v1 destination",
        };
        let mut message = Vec::with_capacity(label.len() + 10 + 2 * AUTH_NONCE_LEN);
        message.extend_from_slice(label);
        self.append_fields(&mut message);
        message
    }

    /// The session, the channel and both nonces.
    fn append_fields(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.handshake.session_id.to_le_bytes());
        out.extend_from_slice(&self.handshake.channel_index.to_le_bytes());
        out.extend_from_slice(&self.source_nonce);
        out.extend_from_slice(&self.destination_nonce);
    }
}

/// A fresh random nonce.
pub fn nonce() -> Result<[u8; AUTH_NONCE_LEN], AuthError> {
    let mut nonce = [0u8; AUTH_NONCE_LEN];
    SystemRandom::new()
        .fill(&mut nonce)
        .map_err(|_| AuthError::Random)?;
    Ok(nonce)
}

fn to_array(tag: hmac::Tag) -> [u8; AUTH_PROOF_LEN] {
    let mut out = [0u8; AUTH_PROOF_LEN];
    out.copy_from_slice(tag.as_ref());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound(session_id: u64, channel_index: u16) -> Bound {
        Bound {
            handshake: Handshake {
                session_id,
                channel_index,
            },
            source_nonce: [1; AUTH_NONCE_LEN],
            destination_nonce: [2; AUTH_NONCE_LEN],
        }
    }

    #[test]
    fn proofs_verify_only_with_the_same_key_session_channel_and_role() {
        let key = AuthKey::from_bytes(b"0123456789abcdef0123\n").unwrap();
        let other = AuthKey::from_bytes(b"0123456789abcdef0124").unwrap();
        let here = bound(7, 1);
        let proof = key.source_proof(&here);
        key.verify_source(&here, &proof).unwrap();
        assert!(other.verify_source(&here, &proof).is_err(), "another key");
        assert!(
            key.verify_source(&bound(8, 1), &proof).is_err(),
            "another session"
        );
        assert!(
            key.verify_source(&bound(7, 2), &proof).is_err(),
            "another channel"
        );
        assert!(
            key.verify_destination(&here, &proof).is_err(),
            "the other role"
        );
        let mut fresh = here;
        fresh.destination_nonce[0] ^= 1;
        assert!(key.verify_source(&fresh, &proof).is_err(), "another nonce");
        assert!(key.verify_source(&here, &proof[..31]).is_err(), "truncated");
        key.verify_destination(&here, &key.destination_proof(&here))
            .unwrap();
    }

    #[test]
    fn trailing_white_space_is_not_part_of_the_key() {
        let a = AuthKey::from_bytes(b"0123456789abcdef\n").unwrap();
        let b = AuthKey::from_bytes(b"0123456789abcdef").unwrap();
        let here = bound(1, 0);
        b.verify_source(&here, &a.source_proof(&here)).unwrap();
        assert!(matches!(
            AuthKey::from_bytes(b"short  \n"),
            Err(AuthError::TooShort { len: 5 })
        ));
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }
}
