//! Writes the seed inputs of the fuzz targets into `fuzz/seeds/<target>/`:
//! a valid session for `destination_session` (and a few damaged copies),
//! its streams for `decode_stream`, structured sessions that end in
//! different ways for `destination_session_structured`, real compressed
//! pages for each decompressor, delta records, snapshot metadata with
//! trailers and working-set files for `snapshot_file`. One command, on stable, in
//! `fuzz/`: `cargo run --release --example write_seeds`. Run it again after
//! any change to the protocol (seeds of an older version end at the
//! version check); it rewrites the seeds it makes and keeps the `found-*`
//! inputs.

use std::fs;
use std::path::Path;

use tern_engine::fuzzing::{join_session_input, sample_session};
use tern_page::PAGE_SIZE;
use tern_page::codec::{CodecId, MAX_COMPRESSED, PageCompressor, corpus_page};

fn main() -> std::io::Result<()> {
    let seeds = Path::new(env!("CARGO_MANIFEST_DIR")).join("seeds");
    let (main, pages) = sample_session();
    let session = seeds.join("destination_session");
    fs::create_dir_all(&session)?;
    fs::write(session.join("sample"), join_session_input(&main, &pages))?;
    // The same session with its page channels swapped, and with one channel.
    let swapped = [pages[1].clone(), pages[0].clone()];
    fs::write(session.join("swapped"), join_session_input(&main, &swapped))?;
    fs::write(
        session.join("one_channel"),
        join_session_input(&main, &pages[..1]),
    )?;
    for (codec, name) in [
        (CodecId::Zstd, "decompress_zstd"),
        (CodecId::Deflate, "decompress_deflate"),
        (CodecId::Lz4, "decompress_lz4"),
    ] {
        let dir = seeds.join(name);
        fs::create_dir_all(&dir)?;
        let mut compressor = PageCompressor::new(codec, codec.default_level()).expect(name);
        let mut sparse = [0u8; PAGE_SIZE];
        sparse[100] = 1;
        sparse[PAGE_SIZE - 1] = 0xff;
        let pages = [
            ("text", corpus_page("text", 7)),
            ("binary", corpus_page("binary", 7)),
            ("sparse", sparse),
            ("ones", [1u8; PAGE_SIZE]),
        ];
        for (kind, page) in pages {
            let mut out = [0u8; MAX_COMPRESSED];
            if let Some(len) = compressor.compress(&page, &mut out) {
                fs::write(dir.join(kind), &out[..len])?;
            }
        }
    }
    write_packet_seeds(&seeds.join("decompress_zstd_packet"))?;
    write_zstd_stream_seeds(&seeds.join("decompress_zstd_stream"))?;
    write_delta_seeds(&seeds.join("apply_delta"))?;
    write_stream_seeds(&seeds.join("decode_stream"), &main, &pages)?;
    write_handover_seed(&seeds.join("decode_stream"))?;
    write_snapshot_seeds(&seeds.join("snapshot_file"))?;
    write_structured_seeds(&seeds.join("destination_session_structured"))
}

/// The sample session's streams, each behind the byte that sets the
/// receiver-like driver's read size.
fn write_stream_seeds(dir: &Path, main: &[u8], pages: &[Vec<u8>]) -> std::io::Result<()> {
    fs::create_dir_all(dir)?;
    let streams = std::iter::once(("main", main)).chain(
        pages
            .iter()
            .enumerate()
            .map(|(index, stream)| (["pages-1", "pages-2"][index.min(1)], stream.as_slice())),
    );
    for (name, stream) in streams {
        for read_size in [255u8, 7] {
            let mut seed = vec![read_size];
            seed.extend_from_slice(stream);
            fs::write(dir.join(format!("{name}-reads-{read_size}")), seed)?;
        }
    }
    Ok(())
}

/// A memory hand-over body (kind 19, two regions in one file), which `decode_stream`
/// also decodes from its raw input: a valid start for mutations of the
/// hand-over's entries.
fn write_handover_seed(dir: &Path) -> std::io::Result<()> {
    use tern_wire::{FRAME_HEADER_LEN, HandedRegion, HandoverCoverage, MemoryHandover, Message};
    let handover = Message::MemoryHandover(MemoryHandover {
        coverage: HandoverCoverage::Sampled,
        regions: vec![
            HandedRegion {
                region_id: 0,
                offset: 0,
                len: 1 << 20,
            },
            HandedRegion {
                region_id: 1,
                offset: 1 << 20,
                len: 4096,
            },
        ],
    });
    fs::write(
        dir.join("handover-body"),
        &handover.to_bytes()[FRAME_HEADER_LEN..],
    )
}

/// Structured inputs that end in different ways: pseudo-random choices,
/// one kept per distinct outcome (numbers blanked), plus the empty input
/// (the smallest valid session). Deterministic.
fn write_structured_seeds(dir: &Path) -> std::io::Result<()> {
    use std::collections::BTreeMap;
    if dir.exists() {
        fs::remove_dir_all(dir)?;
    }
    fs::create_dir_all(dir)?;
    let mut kept: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut inputs = vec![Vec::new()];
    for round in 0..2000u64 {
        let len = 8 + (next() % 120) as usize;
        let mut input: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        // Half of the inputs end before the corruption choices: valid
        // sessions of every shape.
        if round % 2 == 0 {
            input.truncate(len / 2);
        }
        inputs.push(input);
    }
    for input in inputs {
        let outcome = match tern_engine::fuzzing::structured_destination_session(&input) {
            Ok(end) if end.digest_comparison.is_some() => "verified".to_string(),
            Ok(_) => "completed-unverified".to_string(),
            Err(error) => blank_numbers(&error.chain()),
        };
        // Kept one per outcome, and besides, the first session of each
        // outcome that sends a delta page (deltas are rarer than the
        // outcomes: without this no kept seed carried one).
        if carries_delta(&input) {
            kept.entry(format!("delta {outcome}"))
                .or_insert_with(|| input.clone());
        }
        kept.entry(outcome).or_insert(input);
    }
    for (index, (outcome, input)) in kept.iter().enumerate() {
        let name: String = outcome
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == ' ')
            .take(48)
            .collect::<String>()
            .trim()
            .replace(' ', "-");
        fs::write(dir.join(format!("{index:03}-{name}")), input)?;
    }
    println!("destination_session_structured: {} seeds", kept.len());
    Ok(())
}

/// Whether the session `input` builds sends a delta page on any channel.
fn carries_delta(input: &[u8]) -> bool {
    use tern_wire::{Frame, Message, PageKind, decode_stream};
    let (main, pages) = tern_engine::fuzzing::structured::structured_session(input);
    let Ok(frames) = decode_stream(&main, None) else {
        return false;
    };
    let Some(setup) = frames.iter().find_map(|frame| match frame {
        Frame::Message(Message::Hello(hello)) => Some(hello.setup.clone()),
        _ => None,
    }) else {
        return false;
    };
    pages.iter().any(|stream| {
        decode_stream(stream, Some(&setup))
            .unwrap_or_default()
            .iter()
            .any(|frame| {
                matches!(frame, Frame::Pages(_, entries)
                    if entries.iter().any(|entry| entry.kind == PageKind::Delta))
            })
    })
}

/// Packet frames of text and binary pages, with and without the target's
/// dictionary, each behind the byte that gives its page count.
fn write_packet_seeds(dir: &Path) -> std::io::Result<()> {
    fs::create_dir_all(dir)?;
    let dictionary = tern_fuzz::packet_dictionary();
    for (name, with_dictionary, pages) in [("text", false, 5u8), ("mixed_dict", true, 9)] {
        let content: Vec<[u8; PAGE_SIZE]> = (0..u64::from(pages))
            .map(|i| corpus_page(if i % 2 == 0 { "text" } else { "binary" }, i + 1))
            .collect();
        let mut compressor = PageCompressor::with_dictionary(
            CodecId::ZstdPacket,
            1,
            with_dictionary.then_some(&dictionary),
        )
        .expect("zstd");
        let (batch, compressed) = compress_packet(&mut compressor, &content);
        let mut seed = vec![(compressed - 1) | if with_dictionary { 0x80 } else { 0 }];
        seed.extend_from_slice(&batch.data);
        fs::write(dir.join(name), seed)?;
    }
    Ok(())
}

/// `content` compressed as one packet by `compressor`, and how many of its
/// pages went compressed.
fn compress_packet(
    compressor: &mut PageCompressor,
    content: &[[u8; PAGE_SIZE]],
) -> (tern_page::codec::CompressedBatch, u8) {
    use tern_page::codec::{CompressedBatch, PageOutcome};
    let pointers: Vec<*const u8> = content.iter().map(|page| page.as_ptr()).collect();
    let mut batch = CompressedBatch::new();
    // SAFETY: whole pages of `content`, alive during the call.
    unsafe { compressor.compress_batch(&pointers, &mut batch) };
    let compressed = batch
        .outcomes
        .iter()
        .filter(|outcome| matches!(outcome, PageOutcome::Compressed { .. }))
        .count() as u8;
    (batch, compressed)
}

/// A channel's zstd stream: three packets of text and binary pages (the
/// first restarts the stream, the later ones refer back to it), then the
/// same after a new level, in the target's layout
/// ([`tern_fuzz::stream_packets`]).
fn write_zstd_stream_seeds(dir: &Path) -> std::io::Result<()> {
    fs::create_dir_all(dir)?;
    let mut compressor = PageCompressor::new(CodecId::ZstdStream, 1).expect("zstd");
    let mut seed = Vec::new();
    for packet in 0..4u64 {
        if packet == 3 {
            compressor.set_level(3);
        }
        let content: Vec<[u8; PAGE_SIZE]> = (0..6)
            .map(|i| corpus_page(if i % 3 == 2 { "binary" } else { "text" }, packet * 6 + i))
            .collect();
        let (batch, compressed) = compress_packet(&mut compressor, &content);
        let len = u16::try_from(batch.data.len()).expect("a small packet");
        seed.push((compressed - 1) | if batch.stream_restart { 0x80 } else { 0 });
        seed.extend_from_slice(&len.to_le_bytes());
        seed.extend_from_slice(&batch.data);
    }
    fs::write(dir.join("four-packets"), seed)
}

/// Real delta records: a small change, the longest record, an unchanged
/// page; and two the decoder must refuse.
fn write_delta_seeds(dir: &Path) -> std::io::Result<()> {
    use tern_page::delta::{MAX_DELTA_LEN, create_delta};
    fs::create_dir_all(dir)?;
    let old = corpus_page("text", 3);
    let mut small = old;
    small[1000..1064].fill(7);
    let mut longest = old;
    for word in 0..MAX_DELTA_LEN / 10 {
        longest[word * 8] ^= 0xff;
    }
    for (name, new) in [("small", small), ("longest", longest), ("unchanged", old)] {
        let mut record = [0u8; MAX_DELTA_LEN];
        let len = create_delta(&old, &new, &mut record).expect("fits");
        fs::write(dir.join(name), &record[..len])?;
    }
    fs::write(dir.join("bad_word"), [0x00, 0x02, 1, 2, 3, 4, 5, 6, 7, 8])?;
    fs::write(
        dir.join("bad_order"),
        [
            [2, 0, 1, 1, 1, 1, 1, 1, 1, 1],
            [1, 0, 1, 1, 1, 1, 1, 1, 1, 1],
        ]
        .concat(),
    )
}

/// Snapshot files as `snapshot_file` reads them: the metadata block, then
/// the trailer (the page slots left out, so each seed stays small), for
/// one and for several regions, complete and incomplete, full and diff; a
/// trailer with no sections; and standalone working-set files. The seed
/// `tracked_page_diff` is not made here: it is a real tracked diff (pages
/// changed alone, 1 % spread across 64 MiB) from `tern save
/// --track-dirty-pages --diff-output`, cut the same way, and kept.
fn write_snapshot_seeds(dir: &Path) -> std::io::Result<()> {
    use tern_wire::snapshot::{
        SnapshotMetadata, SnapshotSection, Trailer, WorkingSet, plan_layout,
    };
    fs::create_dir_all(dir)?;
    let working_set = WorkingSet {
        pages: vec![(0, 3), (0, 0), (1, 2)],
    };
    let trailer = Trailer {
        guest_kind: "synthetic".into(),
        sections: vec![
            SnapshotSection {
                name: "synthetic".into(),
                version: 1,
                data: (0..64).collect(),
            },
            SnapshotSection {
                name: "vcpu0".into(),
                version: 3,
                data: vec![0xaa; 16],
            },
        ],
        working_set: working_set.clone(),
    }
    .encode();
    let bare = Trailer::default().encode();
    let two_regions = [(0, 0, 64 << 12), (7, 1 << 32, 3 << 12)];
    let one_region = [(0, 0, 40 << 12)];
    for (name, regions, trailer, complete) in [
        ("two_regions", &two_regions[..], &trailer, true),
        ("two_regions_incomplete", &two_regions[..], &trailer, false),
        ("one_region_bare", &one_region[..], &bare, true),
    ] {
        let layout = plan_layout(regions).expect("a valid layout");
        let mut metadata = SnapshotMetadata::new(&layout);
        for present in &mut metadata.present {
            // Pages 0 and 2 hold data, the rest are holes (every region
            // here has at least 3 pages).
            present[0] = 0b101;
        }
        for (index, hashes) in metadata.chunk_hashes.iter_mut().enumerate() {
            hashes[0] = 0x1234_5678 + index as u64;
        }
        if complete {
            metadata.complete(0xfeed_f00d, trailer);
        }
        let mut seed = metadata.encode();
        seed.extend_from_slice(trailer);
        fs::write(dir.join(name), seed)?;
    }
    // A diff of two regions on the memory with digest 0xba5e: pages 0 and
    // 1 changed (page 1 to zeros), page 2 left to the base.
    let layout = tern_wire::snapshot::plan_diff_layout(&two_regions).expect("a valid layout");
    let mut metadata = SnapshotMetadata::new(&layout);
    metadata.header.base_digest = Some(0xba5e);
    for (changed, present) in metadata.changed.iter_mut().zip(&mut metadata.present) {
        changed[0] = 0b11;
        present[0] = 0b01;
    }
    metadata.complete(0xd1ff, &trailer);
    let mut seed = metadata.encode();
    seed.extend_from_slice(&trailer);
    fs::write(dir.join("two_regions_diff"), seed)?;
    fs::write(dir.join("working_set"), working_set.encode_file())?;
    fs::write(
        dir.join("working_set_empty"),
        WorkingSet::default().encode_file(),
    )
}

/// An error's text with its numbers blanked (decimal digits, and words of
/// hexadecimal digits such as digests), so errors of one kind compare equal.
fn blank_numbers(text: &str) -> String {
    text.split(' ')
        .map(|word| {
            let core = word.trim_matches(|c: char| !c.is_ascii_alphanumeric());
            if core.len() >= 4 && core.chars().all(|c| c.is_ascii_hexdigit()) {
                word.replace(core, "#")
            } else {
                word.chars()
                    .map(|c| if c.is_ascii_digit() { '#' } else { c })
                    .collect()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}
