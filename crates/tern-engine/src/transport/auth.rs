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
//! (`ring::hmac::verify`). This authenticates who opens a channel, not the
//! bytes that follow it: on a network where someone can alter traffic, use
//! TLS.

use std::fmt;
use std::path::Path;

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use tern_wire::{AUTH_NONCE_LEN, AUTH_PROOF_LEN, Handshake};

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
        message.extend_from_slice(&self.handshake.session_id.to_le_bytes());
        message.extend_from_slice(&self.handshake.channel_index.to_le_bytes());
        message.extend_from_slice(&self.source_nonce);
        message.extend_from_slice(&self.destination_nonce);
        message
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
