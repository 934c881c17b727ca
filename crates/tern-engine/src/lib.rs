//! tern's live-migration engine.
//!
//! A VMM implements the traits in [`guest`]; the engine moves the guest's
//! memory and state to a destination over one main channel and several page
//! channels, with dirty iterations, convergence and a verified switch-over.
#![warn(missing_docs)]

pub mod bitmap;
pub mod guest;

pub use bitmap::DirtyBitmap;
pub use guest::{
    DestinationGuest, DeviceState, DirtyLog, GuestControl, GuestError, GuestMemory, GuestResult,
    MemoryRegion, PAGE_SIZE, SourceGuest, StateSection,
};
