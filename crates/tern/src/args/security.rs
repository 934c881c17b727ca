//! The security options of both sides (applied by `crate::secure`).

use std::path::PathBuf;

use clap::Args;

/// How the source proves itself and checks the destination.
#[derive(Debug, Args)]
pub(crate) struct SourceSecurityArgs {
    /// A file holding a secret shared with the destination (at least 16
    /// bytes; e.g. `openssl rand -hex 32`): every channel runs a mutual
    /// HMAC-SHA256 challenge and response with it.
    #[arg(long, value_name = "FILE")]
    pub auth_key: Option<PathBuf>,
    /// Run TLS 1.3 on every channel, with ca.pem, cert.pem and key.pem from
    /// this directory (docs/security.md shows how to make them).
    #[arg(long, value_name = "DIR")]
    pub tls_dir: Option<PathBuf>,
    /// The name to check in the destination's certificate; default: the
    /// host of --to (needed for unix:, vsock: and fd: addresses).
    #[arg(long, value_name = "NAME", requires = "tls_dir")]
    pub tls_hostname: Option<String>,
}

/// What the destination requires of the source.
#[derive(Debug, Args)]
pub(crate) struct DestinationSecurityArgs {
    /// A file holding the secret shared with the source: every channel must
    /// prove it (mutual HMAC-SHA256 challenge and response).
    #[arg(long, value_name = "FILE")]
    pub auth_key: Option<PathBuf>,
    /// Require TLS 1.3 with a client certificate on every channel, with
    /// ca.pem, cert.pem and key.pem from this directory.
    #[arg(long, value_name = "DIR")]
    pub tls_dir: Option<PathBuf>,
    /// Accept sessions nobody authenticated on an address other machines
    /// reach. Without it, listening there needs --auth-key or --tls-dir.
    #[arg(long)]
    pub insecure: bool,
    /// Accept a source that skips the memory digest (--verify none); by
    /// default such a session is refused before anything is allocated.
    #[arg(long)]
    pub allow_unverified: bool,
}
