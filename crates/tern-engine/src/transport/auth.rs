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
//! made to answer its own challenge. Tags are compared in constant time.
//!
//! The two primitives, HMAC-SHA256 and SHA-256, come through
//! [`AuthCrypto`]: ring's with the `ring` feature (on by default, and with
//! `tls`), or the embedder's own (aws-lc-rs, OpenSSL) through
//! [`AuthKey::from_bytes_with`], so that a VMM linking another crypto
//! library need not link ring too. Nonces come from the kernel
//! (`getrandom(2)`).
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
use std::sync::Arc;

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
    /// No HMAC-SHA256 implementation: the `ring` feature is off and none was
    /// given.
    #[error(
        "tern-engine was built without the ring feature: give an AuthCrypto \
         (AuthKey::from_bytes_with) for the auth key"
    )]
    NoCrypto,
}

/// Length of an HMAC-SHA256 tag and of a SHA-256 digest.
pub const SHA256_LEN: usize = 32;

/// The hash primitives of the shared-key handshake and of the control-frame
/// seals. tern builds every proof, key and seal from these two, and compares
/// tags itself, in constant time. [`RingCrypto`] (feature `ring`) is the
/// default; an embedder that links another crypto library implements it in
/// a few lines over that library's HMAC and SHA-256 and passes it to
/// [`AuthKey::from_bytes_with`].
pub trait AuthCrypto: Send + Sync {
    /// HMAC-SHA256 of `message` under `key` (RFC 2104 with SHA-256).
    fn hmac_sha256(&self, key: &[u8], message: &[u8]) -> [u8; SHA256_LEN];

    /// SHA-256 of `data`.
    fn sha256(&self, data: &[u8]) -> [u8; SHA256_LEN];
}

/// ring's HMAC-SHA256 and SHA-256.
#[cfg(feature = "ring")]
#[derive(Clone, Copy, Debug, Default)]
pub struct RingCrypto;

#[cfg(feature = "ring")]
impl AuthCrypto for RingCrypto {
    fn hmac_sha256(&self, key: &[u8], message: &[u8]) -> [u8; SHA256_LEN] {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
        to_array(ring::hmac::sign(&key, message).as_ref())
    }

    fn sha256(&self, data: &[u8]) -> [u8; SHA256_LEN] {
        to_array(ring::digest::digest(&ring::digest::SHA256, data).as_ref())
    }
}

/// The default implementation, when this build has one.
fn default_crypto() -> Result<Arc<dyn AuthCrypto>, AuthError> {
    #[cfg(feature = "ring")]
    return Ok(Arc::new(RingCrypto));
    #[cfg(not(feature = "ring"))]
    return Err(AuthError::NoCrypto);
}

/// A secret and the primitives that use it.
#[derive(Clone)]
struct Keyed {
    secret: Vec<u8>,
    crypto: Arc<dyn AuthCrypto>,
}

impl Keyed {
    fn sign(&self, message: &[u8]) -> [u8; SHA256_LEN] {
        self.crypto.hmac_sha256(&self.secret, message)
    }

    /// Whether `tag` is `message`'s tag, compared in constant time.
    fn verify(&self, message: &[u8], tag: &[u8]) -> bool {
        tags_equal(&self.sign(message), tag)
    }

    fn derive(&self, label: &[u8]) -> Self {
        Self {
            secret: self.sign(label).to_vec(),
            crypto: self.crypto.clone(),
        }
    }
}

/// Constant-time comparison: the time depends on the lengths only, never on
/// where the bytes differ.
fn tags_equal(expected: &[u8], got: &[u8]) -> bool {
    if expected.len() != got.len() {
        return false;
    }
    let difference = expected
        .iter()
        .zip(got)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b));
    std::hint::black_box(difference) == 0
}

/// A shared secret both sides hold.
#[derive(Clone)]
pub struct AuthKey(Keyed);

impl fmt::Debug for AuthKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AuthKey(..)")
    }
}

impl AuthKey {
    /// A key from its bytes; trailing white space (a newline left by an
    /// editor or `openssl rand -hex 32 > file`) is not part of it.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, AuthError> {
        Self::from_bytes_with(bytes, default_crypto()?)
    }

    /// [`AuthKey::from_bytes`] with the embedder's hash primitives.
    pub fn from_bytes_with(bytes: &[u8], crypto: Arc<dyn AuthCrypto>) -> Result<Self, AuthError> {
        let end = bytes
            .iter()
            .rposition(|byte| !byte.is_ascii_whitespace())
            .map_or(0, |last| last + 1);
        if end < MIN_KEY_LEN {
            return Err(AuthError::TooShort { len: end });
        }
        Ok(Self(Keyed {
            secret: bytes[..end].to_vec(),
            crypto,
        }))
    }

    /// Reads a key file.
    pub fn load(path: &Path) -> Result<Self, AuthError> {
        Self::load_with(path, default_crypto()?)
    }

    /// [`AuthKey::load`] with the embedder's hash primitives.
    pub fn load_with(path: &Path, crypto: Arc<dyn AuthCrypto>) -> Result<Self, AuthError> {
        let bytes = std::fs::read(path).map_err(|source| AuthError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_bytes_with(&bytes, crypto)
    }

    /// The destination's proof for this exchange.
    pub fn destination_proof(&self, bound: &Bound) -> [u8; AUTH_PROOF_LEN] {
        self.0.sign(&bound.message(Role::Destination))
    }

    /// The source's proof for this exchange.
    pub fn source_proof(&self, bound: &Bound) -> [u8; AUTH_PROOF_LEN] {
        self.0.sign(&bound.message(Role::Source))
    }

    /// Checks the destination's proof, in constant time.
    pub fn verify_destination(&self, bound: &Bound, proof: &[u8]) -> Result<(), AuthError> {
        self.0
            .verify(&bound.message(Role::Destination), proof)
            .then_some(())
            .ok_or(AuthError::WrongProof)
    }

    /// Checks the source's proof, in constant time.
    pub fn verify_source(&self, bound: &Bound, proof: &[u8]) -> Result<(), AuthError> {
        self.0
            .verify(&bound.message(Role::Source), proof)
            .then_some(())
            .ok_or(AuthError::WrongProof)
    }

    /// The keys that seal the control frames of the channel this exchange
    /// opened: derived from the shared key, the session, the channel and
    /// both nonces, one per direction, so a frame sealed in one session or
    /// direction opens in no other.
    pub fn session_keys(&self, bound: &Bound) -> SessionKeys {
        let mut label = b"tern control v1".to_vec();
        bound.append_fields(&mut label);
        let session = self.0.derive(&label);
        let direction = |name: &[u8]| session.derive(name);
        SessionKeys {
            source_to_destination: direction(b"source to destination"),
            destination_to_source: direction(b"destination to source"),
        }
    }
}

/// The two directions' keys of one channel ([`AuthKey::session_keys`]).
#[derive(Clone)]
pub struct SessionKeys {
    source_to_destination: Keyed,
    destination_to_source: Keyed,
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
/// copy of it).
fn tagged(key: &Keyed, sequence: u64, header: &[u8], body: &[u8]) -> Vec<u8> {
    let mut message = Vec::with_capacity(8 + FRAME_HEADER_LEN + SHA256_LEN);
    message.extend_from_slice(&sequence.to_le_bytes());
    message.extend_from_slice(header);
    message.extend_from_slice(&key.crypto.sha256(body));
    message
}

/// Seals the control frames one side sends on a channel, numbering them.
pub struct ControlSealer {
    key: Keyed,
    next: u64,
}

impl fmt::Debug for ControlSealer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ControlSealer(next {})", self.next)
    }
}

impl ControlSealer {
    fn new(key: Keyed) -> Self {
        Self { key, next: 0 }
    }

    /// Seals an encoded frame (header and body) in place: sets its sealed
    /// flag and appends the seal.
    pub fn seal(&mut self, frame: &mut Vec<u8>) {
        tern_wire::mark_sealed(frame);
        let (header, body) = frame.split_at(FRAME_HEADER_LEN);
        let tag = self.key.sign(&tagged(&self.key, self.next, header, body));
        let mut seal = Seal {
            sequence: self.next,
            tag: [0; tern_wire::SEAL_TAG_LEN],
        };
        seal.tag.copy_from_slice(&tag);
        frame.extend_from_slice(&seal.encode());
        self.next += 1;
    }
}

/// Checks the sealed control frames one side reads on a channel: each must
/// carry the next sequence number and a tag made with the peer's key.
pub struct ControlOpener {
    key: Keyed,
    next: u64,
}

impl fmt::Debug for ControlOpener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ControlOpener(next {})", self.next)
    }
}

impl ControlOpener {
    fn new(key: Keyed) -> Self {
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
        let message = tagged(&self.key, seal.sequence, header, body);
        if !self.key.verify(&message, &seal.tag) {
            return Err(WireError::SealForged(kind));
        }
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
#[non_exhaustive]
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
    random_bytes(&mut nonce).map_err(|_| AuthError::Random)?;
    Ok(nonce)
}

/// Fills `buffer` from the kernel's random source (`getrandom(2)`, which
/// blocks only until the pool is first seeded at boot).
pub(crate) fn random_bytes(buffer: &mut [u8]) -> std::io::Result<()> {
    let mut filled = 0;
    while filled < buffer.len() {
        let rest = &mut buffer[filled..];
        // SAFETY: `rest` is a writable buffer of `rest.len()` bytes, which
        // getrandom writes at most.
        let got = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        match usize::try_from(got) {
            Ok(count) => filled += count,
            Err(_) => {
                let error = std::io::Error::last_os_error();
                if error.kind() != std::io::ErrorKind::Interrupted {
                    return Err(error);
                }
            }
        }
    }
    Ok(())
}

#[cfg(feature = "ring")]
fn to_array(bytes: &[u8]) -> [u8; SHA256_LEN] {
    let mut out = [0u8; SHA256_LEN];
    out.copy_from_slice(bytes);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_compare_whole() {
        assert!(tags_equal(&[1, 2, 3], &[1, 2, 3]));
        assert!(!tags_equal(&[1, 2, 3], &[1, 2, 4]));
        assert!(!tags_equal(&[1, 2, 3], &[1, 2]));
        assert!(!tags_equal(&[], &[0]));
        // Two differences that cancel out under an exclusive or.
        assert!(!tags_equal(&[1, 2], &[2, 1]));
    }

    #[cfg(not(feature = "ring"))]
    #[test]
    fn without_ring_a_key_needs_the_embedders_crypto() {
        assert!(matches!(
            AuthKey::from_bytes(b"0123456789abcdef"),
            Err(AuthError::NoCrypto)
        ));
    }

    #[cfg(feature = "ring")]
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

    #[cfg(feature = "ring")]
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

    #[cfg(feature = "ring")]
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

    /// A frame as the channel writes it: encoded, then sealed.
    #[cfg(feature = "ring")]
    fn sealed(sealer: &mut ControlSealer, message: &tern_wire::Message) -> Vec<u8> {
        let mut frame = message.to_bytes();
        sealer.seal(&mut frame);
        frame
    }

    /// Hands a sealed frame to `opener` as the decoder does.
    #[cfg(feature = "ring")]
    fn open(opener: &mut ControlOpener, frame: &[u8]) -> Result<(), WireError> {
        let (header, rest) = frame.split_at(FRAME_HEADER_LEN);
        let (body, seal) = rest.split_at(rest.len() - tern_wire::SEAL_LEN);
        opener.open(
            header.try_into().unwrap(),
            body,
            &Seal::decode(seal.try_into().unwrap()),
        )
    }

    #[cfg(feature = "ring")]
    fn abort(text: &str) -> tern_wire::Message {
        tern_wire::Message::Abort(tern_wire::Abort {
            reason: tern_wire::AbortReason::ProtocolError,
            message: text.into(),
        })
    }

    #[cfg(feature = "ring")]
    #[test]
    fn sealed_frames_open_once_in_order_unaltered_and_in_their_direction_only() {
        let key = AuthKey::from_bytes(b"0123456789abcdef0123").unwrap();
        let here = bound(7, 0);
        let (mut source_sealer, mut source_opener) = key.session_keys(&here).for_source();
        let (_, mut destination_opener) = key.session_keys(&here).for_destination();

        let frames: Vec<Vec<u8>> = (0..3)
            .map(|n| sealed(&mut source_sealer, &abort(&format!("frame {n}"))))
            .collect();
        for (expected, frame) in frames.iter().enumerate() {
            let seal = &frame[frame.len() - tern_wire::SEAL_LEN..];
            let seal = Seal::decode(seal.try_into().unwrap());
            assert_eq!(seal.sequence, expected as u64, "numbered in order");
        }
        // The destination opens them in order; the source cannot open its
        // own direction's frames.
        assert!(matches!(
            open(&mut source_opener, &frames[0]),
            Err(WireError::SealForged(_))
        ));
        for frame in &frames {
            open(&mut destination_opener, frame).unwrap();
        }
        // Replayed: its number is behind.
        assert!(matches!(
            open(&mut destination_opener, &frames[1]),
            Err(WireError::SealSequence {
                got: 1,
                expected: 3
            })
        ));

        // Altered body: the body's hash is in the tag.
        let mut altered = sealed(&mut source_sealer, &abort("frame 3"));
        altered[FRAME_HEADER_LEN + 8] ^= 1;
        assert!(matches!(
            open(&mut destination_opener, &altered),
            Err(WireError::SealForged(_))
        ));

        // Altered header: a commit made a heartbeat, same body length.
        let (mut sealer, _) = key.session_keys(&here).for_source();
        let (_, mut opener) = key.session_keys(&here).for_destination();
        let mut relabelled = sealed(&mut sealer, &tern_wire::Message::Commit);
        relabelled[0] = tern_wire::FrameKind::Heartbeat as u8;
        assert!(matches!(
            open(&mut opener, &relabelled),
            Err(WireError::SealForged(_))
        ));

        // Another session's keys (same key, same channel) open nothing.
        let (mut sealer, _) = key.session_keys(&here).for_source();
        let (_, mut elsewhere) = key.session_keys(&bound(8, 0)).for_destination();
        let frame = sealed(&mut sealer, &tern_wire::Message::Commit);
        assert!(matches!(
            open(&mut elsewhere, &frame),
            Err(WireError::SealForged(_))
        ));
    }

    #[cfg(feature = "ring")]
    #[test]
    fn debug_output_never_shows_a_secret() {
        let secret = "0123456789abcdef0123";
        let key = AuthKey::from_bytes(secret.as_bytes()).unwrap();
        let keys = key.session_keys(&bound(7, 0));
        let (mut sealer, opener) = keys.for_source();
        sealed(&mut sealer, &tern_wire::Message::Commit);
        let shown = [
            format!("{key:?}"),
            format!("{keys:?}"),
            format!("{sealer:?}"),
            format!("{opener:?}"),
        ];
        assert_eq!(
            shown,
            [
                "AuthKey(..)",
                "SessionKeys(..)",
                "ControlSealer(next 1)",
                "ControlOpener(next 0)"
            ]
        );
    }
}
