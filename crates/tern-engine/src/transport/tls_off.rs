//! TLS in a build without the `tls` feature: the same API, and no way to
//! make a [`TlsConfig`], so no channel ever runs TLS. Loading one fails with
//! [`TlsError::NotBuilt`], "tern-engine was built without the tls feature".

use std::convert::Infallible;
use std::os::fd::RawFd;
use std::path::Path;
use std::time::Duration;

use super::{Channel, Segment, TransferClock};
use crate::error::ChannelError;

pub use super::tls_types::{KernelTls, TlsError};

/// Certificates, trust and options for both roles; never made in this
/// build.
#[derive(Clone, Debug)]
pub struct TlsConfig {
    /// The name the source checks in the destination's certificate; `None`
    /// takes the host of the address.
    pub hostname: Option<String>,
    /// Kernel offload.
    pub kernel: KernelTls,
    never: Infallible,
}

impl TlsConfig {
    /// Fails: this build has no TLS.
    pub fn from_dir(_dir: &Path) -> Result<Self, TlsError> {
        Err(TlsError::NotBuilt)
    }

    /// Fails: this build has no TLS.
    pub fn from_pem(_ca: &[u8], _chain: &[u8], _key: &[u8]) -> Result<Self, TlsError> {
        Err(TlsError::NotBuilt)
    }
}

/// Never called: there is no [`TlsConfig`] to call it with.
pub fn connect(
    _channel: Channel,
    config: &TlsConfig,
    _hostname: &str,
) -> Result<Channel, ChannelError> {
    match config.never {}
}

/// Never called: there is no [`TlsConfig`] to call it with.
pub fn accept(_channel: Channel, config: &TlsConfig) -> Result<Channel, ChannelError> {
    match config.never {}
}

/// A TLS channel, which this build never has.
#[derive(Debug)]
pub(crate) enum TlsStream {}

impl TlsStream {
    pub(super) fn raw_fd(&self) -> RawFd {
        match *self {}
    }

    pub(super) fn has_buffered_plaintext(&self) -> bool {
        match *self {}
    }

    /// # Safety
    /// As [`Channel::send_vectored`].
    pub(super) unsafe fn send_segments(
        &mut self,
        _segments: &[Segment],
        _timeout: Option<Duration>,
    ) -> Result<(), ChannelError> {
        match *self {}
    }

    /// # Safety
    /// As [`Channel::read_scattered`].
    pub(super) unsafe fn read_segments(
        &mut self,
        _segments: &[Segment],
        _clock: TransferClock,
    ) -> Result<(), ChannelError> {
        match *self {}
    }
}
