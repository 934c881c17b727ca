//! The destination's report: what `tern receive --json` prints on every
//! outcome and what its handle's `query` returns while it runs.

use serde::{Deserialize, Serialize};

use crate::stats::{DestinationStats, DigestComparison, MigrationStatus, SessionSecurity};

/// What became of the guest on the destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum GuestState {
    /// It runs here.
    Running,
    /// Verified and committed, kept paused for the embedder to resume
    /// (`keep_paused`, `tern receive --paused`).
    Paused,
}

/// The destination's report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct ReceiveReport {
    /// The contract's version.
    pub version: u32,
    /// `setup` (waiting for the source), `active` (receiving), `device`
    /// (verifying and restoring), then `completed`, `failed` or
    /// `cancelled`.
    pub status: MigrationStatus,
    /// The status the reception was in when it failed.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub failed_in: Option<MigrationStatus>,
    /// Guest memory size in bytes, 0 until the source's setup arrives.
    pub memory: u64,
    /// Dirty iterations every channel has finished.
    pub iterations: u64,
    /// Whether the destination compared the memory digest with the
    /// source's and found them equal (false until completed, and when the
    /// source asked for no verification).
    pub digest_verified: bool,
    /// The two digests the switch-over compared, when it compared them
    /// (also on a mismatch): the evidence behind `digest-verified`.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub digest_comparison: Option<DigestComparison>,
    /// The guest, once completed: running, or paused for a hand-over.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub guest: Option<GuestState>,
    /// Connections refused so far (failed or late handshakes, strays).
    pub refused_connections: u64,
    /// Bytes, pages, digest time and CPU seconds; the final figures once
    /// the reception ended.
    #[serde(flatten)]
    pub stats: DestinationStats,
    /// How the channels were carried and protected, once the source's main
    /// channel finished its handshake.
    #[serde(flatten, default)]
    pub security: Option<SessionSecurity>,
    /// Why it failed.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error_desc: Option<String>,
}
