//! What a side requires of every channel (TLS, a shared key), and what a
//! channel's handshake established.

use std::sync::Arc;

use tern_wire::{AuthHello, AuthProof, Handshake, Message};

use super::auth::{self, AuthKey, Bound};
pub use super::channel_security::{ChannelSecurity, TlsInfo};
use super::tls::{self, TlsConfig};
use super::{Channel, Expected};
use crate::error::ChannelError;

/// The protections one side applies to each of its channels.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct Security {
    /// TLS on every channel.
    pub tls: Option<Arc<TlsConfig>>,
    /// The shared-key handshake on every channel (inside TLS when both are
    /// set).
    pub auth_key: Option<Arc<AuthKey>>,
}

impl Security {
    /// Whether the peer has to prove who it is (a key or a certificate).
    pub fn authenticates(&self) -> bool {
        self.tls.is_some() || self.auth_key.is_some()
    }
}

/// The source's side of a channel's protections: TLS (checking `hostname`
/// in the destination's certificate), then the shared-key handshake for
/// `handshake`'s session and channel. The hello follows.
pub fn secure_client(
    channel: Channel,
    security: &Security,
    hostname: Option<&str>,
    handshake: Handshake,
) -> Result<Channel, ChannelError> {
    let mut channel = match &security.tls {
        Some(config) => {
            let hostname = config.hostname.as_deref().or(hostname).ok_or_else(|| {
                ChannelError::Tls(std::io::Error::other(
                    "no host name to check the destination's certificate against \
                     (give one with --tls-hostname)",
                ))
            })?;
            tls::connect(channel, config, hostname)?
        }
        None => channel,
    };
    if let Some(key) = &security.auth_key {
        let bound = client_auth(&mut channel, key, handshake)?;
        channel.mark_key_authenticated();
        if handshake.channel_index == 0 {
            // The main channel carries the switch-over: from its hello on,
            // every control frame is sealed with the session's keys.
            let (sealer, opener) = key.session_keys(&bound).for_source();
            channel.seal_control(sealer, Some(opener));
        }
    }
    Ok(channel)
}

fn client_auth(
    channel: &mut Channel,
    key: &AuthKey,
    handshake: Handshake,
) -> Result<Bound, ChannelError> {
    let source_nonce = auth::nonce().map_err(auth_failed)?;
    channel.send_message(&Message::AuthHello(AuthHello {
        handshake,
        nonce: source_nonce,
    }))?;
    let challenge = match channel.read_expected(Expected::AUTH_CHALLENGE)? {
        Message::AuthChallenge(challenge) => challenge,
        Message::Abort(abort) => {
            return Err(ChannelError::Auth(format!(
                "the destination refused the channel: {}",
                abort.message
            )));
        }
        other => {
            return Err(ChannelError::Auth(format!(
                "expected an auth challenge, got {:?}",
                other.kind()
            )));
        }
    };
    let bound = Bound {
        handshake,
        source_nonce,
        destination_nonce: challenge.nonce,
    };
    if key.verify_destination(&bound, &challenge.proof).is_err() {
        let reason = "the destination's proof does not match this side's auth key";
        // The destination hears it too: it cannot tell on its own.
        let _ = channel.send_message(&Message::Abort(tern_wire::Abort {
            reason: tern_wire::AbortReason::ProtocolError,
            message: format!("authentication failed at the source: {reason}"),
        }));
        return Err(ChannelError::Auth(reason.into()));
    }
    channel.send_message(&Message::AuthProof(AuthProof {
        proof: key.source_proof(&bound),
    }))?;
    Ok(bound)
}

fn auth_failed(error: auth::AuthError) -> ChannelError {
    ChannelError::Auth(error.to_string())
}
