//! The fault service: guest memory that fills itself on demand.
//!
//! Lazy snapshot restore, the external page server (`tern serve-pages`)
//! and postcopy all do the same thing: guest memory is registered with a
//! userfaultfd for missing pages; a thread that touches a page no one has
//! placed yet waits while the service fetches it from a [`PageSource`] (a
//! snapshot file here, the migration source over the network for
//! postcopy) and places it atomically with `UFFDIO_COPY`, or
//! `UFFDIO_ZEROPAGE` for a zero page. Meanwhile background loaders place
//! everything else, first the pages of a recorded working set, so the
//! guest stops depending on the source in bounded time.
//!
//! Pages move in *units* of [`FaultConfig::unit_pages`] (a snapshot
//! chunk): a fault fetches its whole unit, which both verifies the unit's
//! hash and prefetches its neighbours. A bitmap of units present keeps
//! the loaders from fetching what a fault placed; when both race for a
//! unit, the kernel settles it (`EEXIST`: the page is there already, the
//! loser's copy is dropped).

pub mod firecracker;
mod service;
pub(crate) mod uffd;

pub use service::{FaultConfig, FaultService, FaultStats, ServedRegion};

/// Why the fault service stopped serving.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FaultError {
    /// The kernel offers no userfaultfd for this process or this memory.
    #[error("cannot register guest memory with userfaultfd")]
    Userfaultfd(#[source] std::io::Error),
    /// The page source could not deliver a unit.
    #[error("page {page} of region {region}: {source}")]
    Source {
        /// Region index.
        region: usize,
        /// First page of the unit.
        page: u64,
        /// Why.
        #[source]
        source: PageSourceError,
    },
    /// The kernel refused a placement.
    #[error("placing page {page} of region {region} failed")]
    Place {
        /// Region index.
        region: usize,
        /// First page of the unit.
        page: u64,
        /// The system call's error.
        #[source]
        source: std::io::Error,
    },
    /// A page arrived after the service had stopped and released guest
    /// memory from userfaultfd (it failed, or was stopped): the guest may
    /// already have found zeros there, so the page is refused rather than
    /// counted as delivered.
    #[error(
        "page {page} of region {region} arrived after the fault service had stopped and \
         released guest memory; the guest may have read zeros there"
    )]
    Released {
        /// Region index.
        region: usize,
        /// First page of the placement.
        page: u64,
    },
    /// A thread of the service could not be started.
    #[error("cannot start the fault service's threads")]
    Spawn(#[source] std::io::Error),
    /// The process whose memory was served closed its userfaultfd (it
    /// exited or died).
    #[error("the faulting process closed its userfaultfd")]
    PeerGone,
    /// Background loading did not finish in time.
    #[error("memory was not fully loaded within {0:?}")]
    Timeout(std::time::Duration),
}

/// Why a [`PageSource`] could not deliver pages: one line for the operator.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct PageSourceError {
    message: String,
    #[source]
    source: Option<std::io::Error>,
}

impl PageSourceError {
    /// An error with a message only.
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            source: None,
        }
    }

    /// An I/O error with what was being done.
    pub fn io(message: impl Into<String>, source: std::io::Error) -> Self {
        Self {
            message: message.into(),
            source: Some(source),
        }
    }
}

/// Where missing pages come from: a snapshot file, a raw memory file, the
/// migration source. Called from the fault thread and the loaders at once.
pub trait PageSource: Send + Sync {
    /// Reads pages `first..first + zero.len()` of region `region` (an index
    /// into the served regions) into `buf` (`zero.len()` pages), and sets
    /// `zero[i]` for each page that is all zero (its bytes in `buf` are
    /// then not looked at: it is placed with `UFFDIO_ZEROPAGE`). An error
    /// stops the service: a page that cannot be trusted is never placed.
    fn fetch(
        &self,
        region: usize,
        first: u64,
        buf: &mut [u8],
        zero: &mut [bool],
    ) -> Result<(), PageSourceError>;
}
