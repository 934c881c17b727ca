//! The transport seam: how the engine gets its channels. A source opens
//! one main channel and N page channels through a [`Connect`]; a
//! destination takes them from a [`Listener`](super::Listener), which may wrap an
//! [`Accept`]. Both are small so that an embedder can supply its own (a
//! VMM's already-connected sockets, a tunnel); TLS and the shared-key
//! handshake are layered on top by the engine, whatever the transport.

use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::Mutex;
use std::time::Duration;

use super::{Address, Channel, socket};
use crate::cancel::CancelToken;
use crate::error::ChannelError;

/// Opens the source's channels.
pub trait Connect: Send + Sync + fmt::Debug {
    /// Opens channel `index` (0 is the main channel, then the page
    /// channels in order), trying for at most `timeout`.
    fn connect(&self, index: u16, timeout: Duration) -> Result<Channel, ChannelError>;

    /// [`Connect::connect`], giving up early once `cancel` is cancelled.
    /// The engine calls this one; the default does not watch `cancel`
    /// (the engine checks it between channels), so a connector that waits
    /// for its peer should override it.
    fn connect_cancellable(
        &self,
        index: u16,
        timeout: Duration,
        cancel: &CancelToken,
    ) -> Result<Channel, ChannelError> {
        let _ = cancel;
        self.connect(index, timeout)
    }

    /// The destination, as reports and errors name it.
    fn address(&self) -> Address;
}

/// Hands the destination its channels, one per call.
pub trait Accept: Send + Sync + fmt::Debug {
    /// The next channel, waiting at most `timeout`; a
    /// [`ChannelError::Timeout`] when none came.
    fn accept_timeout(&self, timeout: Duration) -> Result<Channel, ChannelError>;

    /// What reports call this listener.
    fn address(&self) -> Address;
}

/// The built-in [`Connect`]: dial an address (TCP, Unix, vsock), or hand
/// out sockets connected beforehand (`fd:` addresses, an embedder's).
#[derive(Debug)]
#[non_exhaustive]
pub enum Connector {
    /// Dials the address once per channel.
    Dial(Address),
    /// One connected socket per channel, main first; each is taken once.
    Sockets {
        /// What reports call the destination.
        address: Address,
        /// The sockets not handed out yet, by channel index.
        sockets: Mutex<Vec<Option<OwnedFd>>>,
    },
}

impl Connector {
    /// The connector for `address`; `fd:` descriptors are taken here.
    pub fn for_address(address: &Address) -> Result<Self, ChannelError> {
        match address {
            Address::Fd(fds) => Ok(Self::Sockets {
                address: address.clone(),
                sockets: Mutex::new(socket::take_fds(fds)?.into_iter().map(Some).collect()),
            }),
            other => Ok(Self::Dial(other.clone())),
        }
    }

    /// Connected stream sockets, one per channel (main first), that an
    /// embedder made itself.
    pub fn from_sockets(address: Address, sockets: Vec<OwnedFd>) -> Self {
        Self::Sockets {
            address,
            sockets: Mutex::new(sockets.into_iter().map(Some).collect()),
        }
    }
}

impl Connect for Connector {
    fn connect(&self, index: u16, timeout: Duration) -> Result<Channel, ChannelError> {
        self.connect_cancellable(index, timeout, &CancelToken::new())
    }

    fn connect_cancellable(
        &self,
        index: u16,
        timeout: Duration,
        cancel: &CancelToken,
    ) -> Result<Channel, ChannelError> {
        match self {
            Self::Dial(address) => Channel::connect_cancellable(address, timeout, cancel),
            Self::Sockets { address, sockets } => {
                let mut sockets = sockets.lock().unwrap_or_else(|e| e.into_inner());
                let count = sockets.len();
                let socket = sockets
                    .get_mut(usize::from(index))
                    .and_then(Option::take)
                    .ok_or_else(|| {
                        ChannelError::Connect(
                            address.to_string(),
                            std::io::Error::new(
                                std::io::ErrorKind::InvalidInput,
                                format!(
                                    "{count} sockets were passed in; channel {index} needs one \
                                     socket per channel (main first)"
                                ),
                            ),
                        )
                    })?;
                Channel::from_socket(socket)
            }
        }
    }

    fn address(&self) -> Address {
        match self {
            Self::Dial(address) | Self::Sockets { address, .. } => address.clone(),
        }
    }
}
