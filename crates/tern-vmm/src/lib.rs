//! A small reference KVM VMM that tern migrates.
//!
//! [`KvmGuest`] creates a KVM virtual machine with one vCPU and one slot of
//! RAM, loads a test guest of our own (see [`guest_code`]) that loops forever
//! adding one to the first byte of every page of a working set and reports
//! each pass on an emulated serial port, and runs the vCPU in a thread of its
//! own. It implements the engine's traits ([`tern_engine::GuestMemory`],
//! [`tern_engine::DirtyLog`], [`tern_engine::GuestControl`],
//! [`tern_engine::DeviceState`]) with KVM's dirty log, a pausable vCPU thread
//! and state sections for the vCPU, the in-kernel interrupt controllers and
//! the serial port, so a running guest can be migrated and resumed on the
//! destination.
//!
//! The modules follow Firecracker's split of runtime structures from their
//! saved state: [`memory`] holds guest RAM (rust-vmm's `GuestMemoryMmap`),
//! [`vcpu`] runs the vCPU thread,
//! [`dirty`] drives the dirty log, [`serial`] is the UART, [`state`] holds
//! the saved forms of all of them and their encoding.
#![warn(missing_docs)]

pub mod dirty;
pub mod guest_code;
pub mod memory;
pub mod serial;
pub mod state;
pub mod vcpu;
mod vm;

pub use vm::{
    ConsistencyReport, DestinationVm, GUEST_KIND, KvmGuest, MAX_MEMORY, VmConfig, check_working_set,
};

use std::path::Path;

/// Path of the KVM device.
pub const KVM_DEVICE: &str = "/dev/kvm";

/// Whether `/dev/kvm` exists on this host (it may still be unusable, for
/// example without permission; [`KvmGuest::new`] then reports why).
pub fn kvm_available() -> bool {
    Path::new(KVM_DEVICE).exists()
}

/// Errors of the KVM VMM.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VmmError {
    /// /dev/kvm is missing: this host cannot run KVM guests.
    #[error("/dev/kvm is not available: this host cannot run KVM guests")]
    KvmUnavailable,
    /// A KVM ioctl failed.
    #[error("KVM {operation} failed: {source}")]
    Kvm {
        /// What was attempted.
        operation: &'static str,
        /// The error the kernel returned.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// The host's KVM lacks a capability the VMM needs.
    #[error("KVM lacks the {0} capability")]
    MissingCapability(&'static str),
    /// A bad configuration.
    #[error("invalid VM configuration: {0}")]
    Config(String),
    /// Mapping guest memory failed.
    #[error("cannot map {bytes} bytes of guest memory: {source}")]
    Mmap {
        /// Size requested.
        bytes: u64,
        /// vm-memory's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The memory image could not be opened or read.
    #[error("cannot use memory image {path}: {source}")]
    Image {
        /// The file.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The vCPU thread could not be started or signalled.
    #[error("vCPU thread: {0}")]
    Thread(String),
    /// The vCPU stopped on an exit the VMM cannot handle.
    #[error("the vCPU stopped: {0}")]
    VcpuStopped(String),
    /// An operation that needs the vCPU paused was called while it runs.
    #[error("the vCPU must be paused for this operation")]
    NotPaused,
    /// A state section could not be decoded or does not fit this VM.
    #[error("bad state section {section:?}: {reason}")]
    BadState {
        /// The section's name.
        section: String,
        /// What is wrong with it.
        reason: String,
    },
}

impl VmmError {
    pub(crate) fn kvm(operation: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Self {
        move |source| Self::Kvm { operation, source }
    }
}

impl From<VmmError> for tern_engine::GuestError {
    fn from(error: VmmError) -> Self {
        let message = error.to_string();
        tern_engine::GuestError::with_source(message, error)
    }
}

/// Result of the VMM's operations.
pub type Result<T> = std::result::Result<T, VmmError>;
