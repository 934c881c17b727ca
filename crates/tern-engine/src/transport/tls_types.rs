//! The TLS types both builds have: with the `tls` feature (rustls, in
//! `tls.rs`) and without it (`tls_off.rs`, where no configuration can be
//! made).

use std::io;

/// Why a TLS configuration cannot be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A PEM file cannot be read.
    #[error("Cannot read {path}")]
    Read {
        /// The file.
        path: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// A PEM file holds nothing usable.
    #[error("{what}: {detail}")]
    Pem {
        /// Which file or part.
        what: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// rustls refused the certificates or key.
    #[cfg(feature = "tls")]
    #[error("TLS configuration")]
    Rustls(#[source] rustls::Error),
    /// This build has no TLS.
    #[error("tern-engine was built without the tls feature")]
    NotBuilt,
}

/// Whether the records may be handed to the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KernelTls {
    /// kTLS where the kernel offers it, user-space rustls elsewhere.
    #[default]
    Auto,
    /// Always user-space rustls.
    Off,
}
