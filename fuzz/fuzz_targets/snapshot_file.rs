//! Snapshot files: the fixed header, the metadata block and the trailer,
//! parsed the way a restore reads an untrusted file. No input may panic,
//! and whatever parses must describe a file the layout accepts.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tern_wire::snapshot::{SnapshotHeader, SnapshotMetadata, Trailer, WorkingSet};

fuzz_target!(|data: &[u8]| {
    let _ = WorkingSet::decode_file(data);
    let Ok(header) = SnapshotHeader::decode(data) else {
        return;
    };
    let _ = header.check_file_len(data.len() as u64);
    let Some(block) = data.get(..header.metadata_len as usize) else {
        return;
    };
    let Ok(metadata) = SnapshotMetadata::decode(block) else {
        return;
    };
    assert!(metadata.header.data_end >= metadata.header.metadata_len);
    let rest = &data[block.len()..];
    let _ = Trailer::decode(rest, &metadata.header, &metadata.regions);
});
