//! What a channel's handshake established (TLS parameters, a proven key, the
//! peer's certificate). A leaf: the channel, TLS and the security policy all
//! use it, it uses none of them.

/// TLS parameters of a channel, for reports.
#[derive(
    Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct TlsInfo {
    /// Protocol version, such as `TLSv1_3`.
    pub version: String,
    /// Cipher suite, such as `TLS13_AES_256_GCM_SHA384`.
    pub cipher: String,
    /// Whether the kernel handles the records (kTLS).
    pub kernel_offload: bool,
}

/// What a channel's handshake established.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChannelSecurity {
    /// The peer proved it holds the shared key.
    pub key_authenticated: bool,
    /// TLS, when the channel runs it.
    pub tls: Option<TlsInfo>,
    /// The peer's certificate (DER), when it presented one: every channel
    /// of a session must present the same.
    pub peer_identity: Option<Vec<u8>>,
}

impl ChannelSecurity {
    /// Whether the peer proved who it is, by key or certificate.
    pub fn authenticated(&self) -> bool {
        self.key_authenticated || self.peer_identity.is_some()
    }
}
