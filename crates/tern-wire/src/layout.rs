//! The fixed-layout parts of control frames, as `zerocopy` records: every
//! field little-endian and unaligned, no padding (the derives refuse a
//! layout with any), each size pinned to the protocol's constant below. A
//! record is read or written in one step ([`crate::Reader::record`],
//! [`crate::Writer::record`]); the variable parts (strings, byte strings,
//! lists) follow it through the cursor as before.

use zerocopy::little_endian::{U16, U32, U64, U128};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout, Unaligned};

/// What a record derives: read from and written as bytes, nothing else.
macro_rules! record {
    ($(#[$meta:meta])* struct $name:ident { $($(#[$field_meta:meta])* $field:ident: $ty:ty,)* }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable, Unaligned)]
        #[repr(C)]
        pub(crate) struct $name { $($(#[$field_meta])* pub(crate) $field: $ty,)* }
    };
}

record! {
    /// [`crate::Handshake`]: magic, version, channel index, reserved, session id.
    struct HandshakeRecord {
        magic: [u8; 8],
        version: U16,
        channel_index: U16,
        reserved: [u8; 4],
        session_id: U64,
    }
}

record! {
    /// The fixed start of a hello's [`crate::SessionSetup`], before its regions.
    struct SetupRecord {
        page_size: U32,
        channel_count: U16,
        codecs: u8,
        digest: u8,
        region_count: U16,
    }
}

record! {
    /// [`crate::RegionInfo`]: id, reserved, guest address, length.
    struct RegionRecord {
        id: U32,
        reserved: [u8; 4],
        guest_addr: U64,
        len: U64,
    }
}

record! {
    /// [`crate::Welcome`].
    struct WelcomeRecord {
        session_id: U64,
        channel_index: U16,
        reserved: [u8; 6],
    }
}

record! {
    /// [`crate::Sync`].
    struct SyncRecord {
        iteration: U32,
        last: u8,
        dictionaries: u8,
        reserved: [u8; 2],
    }
}

record! {
    /// [`crate::Complete`].
    struct CompleteRecord {
        final_iteration: U32,
        sections: U32,
        reserved: [u8; 8],
        digest: U128,
    }
}

record! {
    /// The fixed start of an [`crate::Outcome`], before its detail text.
    struct OutcomeRecord {
        verified: u8,
        reserved: [u8; 7],
        digest: U128,
    }
}

record! {
    /// The fixed start of a [`crate::Dictionary`], before its data
    /// (whose length follows it).
    struct DictionaryRecord {
        id: u8,
        codec: u8,
        reserved: [u8; 2],
    }
}

// The records are the protocol's sizes: a field added or widened by
// mistake fails the build, not a peer.
const _: () = {
    assert!(size_of::<HandshakeRecord>() == crate::Handshake::ENCODED_LEN);
    assert!(size_of::<RegionRecord>() == crate::RegionInfo::ENCODED_LEN);
    assert!(size_of::<SetupRecord>() == 10);
    assert!(size_of::<WelcomeRecord>() == 16);
    assert!(size_of::<SyncRecord>() == 8);
    assert!(size_of::<CompleteRecord>() == 32);
    assert!(size_of::<OutcomeRecord>() == 24);
    assert!(size_of::<DictionaryRecord>() + 4 == crate::Dictionary::HEADER_LEN);
};
