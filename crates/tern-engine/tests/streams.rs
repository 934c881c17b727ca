//! zstd as one stream per page channel end to end: real migrations over
//! TCP checked by digest, `auto` choosing it on a slow link, and a
//! hand-driven source sending what a correct one never does (a packet
//! that continues a stream its channel never began). Each must end in a
//! clear error within a bounded time.

use crate::common;
use crate::dictionary::{compressed, hello, migrate_guest, packet, sliced_text_guest};

use common::*;
use tern_engine::Address;
use tern_page::codec::{CodecChoice, CodecId, CompressedBatch, PageCompressor};
use tern_wire::{PageEntry, codec_id};

/// Migrates the benchmarks' `mixed`-like guest with zstd in packet frames
/// or in streams over `channels` channels; returns the codec's figures.
fn migrate_sliced(channels: u16, stream: bool) -> tern_engine::stats::CodecReport {
    let stats = migrate_guest(
        &mut sliced_text_guest(32 * MIB),
        |config| {
            config.channels = channels;
            config.compression = CodecChoice::Zstd;
            config.packet_frames = !stream;
            config.stream_frames = stream;
        },
        Address::clone,
    );
    let report = stats.compression.expect("compression report");
    let name = if stream { "zstd-stream" } else { "zstd-packet" };
    report.codecs[name].clone()
}

/// A packet frame holds a few dozen 4 KiB slices of one 64 KiB passage
/// and starts from nothing; a channel's stream has the whole passage in
/// its window after its first packets, so every later slice is a match.
#[test]
fn a_stream_reaches_back_across_packets_where_packet_frames_cannot() {
    for channels in [1, 3] {
        let stream = migrate_sliced(channels, true);
        let packet = migrate_sliced(channels, false);
        assert!(stream.compressed > 0 && stream.compressed == packet.compressed);
        // The sampled random pages go raw in both; the text costs the rest.
        let raw = stream.skipped_by_sampling * 4096;
        assert_eq!(raw, packet.skipped_by_sampling * 4096);
        let (in_stream, in_frames) = (stream.bytes_out - raw, packet.bytes_out - raw);
        assert!(
            in_stream * 4 < in_frames,
            "{channels} channels: the text took {in_stream} bytes in streams, {in_frames} in \
             packet frames"
        );
    }
}

/// Issue 31, item 4 (protocol 14): on a link slower than zstd, `auto`
/// takes zstd as a stream per channel, and says why it trains no
/// dictionary for it.
#[test]
fn auto_takes_a_stream_per_channel_on_a_slow_link() {
    let stats = migrate_guest(
        &mut sliced_text_guest(96 * MIB),
        |config| config.compression = CodecChoice::Auto,
        |destination| paced_proxy(destination, 12 * MIB),
    );
    let report = stats.compression.expect("compression report");
    let stream = &report.codecs["zstd-stream"];
    assert!(stream.compressed > 0, "{:?}", report.codecs);
    let auto = report.auto.as_ref().expect("auto's report");
    let off = auto
        .decisions
        .iter()
        .find(|decision| decision.subject == "dictionary" && decision.choice == "off")
        .unwrap_or_else(|| panic!("no dictionary decision: {auto:?}"));
    assert!(
        off.reason.contains("zstd-stream on the measured") && !off.reason.contains(" 0 MB/s"),
        "{off:?}"
    );
}

/// The second packet of a stream, alone: its bytes refer to the first,
/// which this channel never carried.
fn second_packet_of_a_stream(pages: usize) -> Vec<u8> {
    let text: Vec<[u8; 4096]> = (0..2 * pages)
        .map(|i| tern_page::codec::corpus_page("text", i as u64 % 3))
        .collect();
    let mut compressor = PageCompressor::new(CodecId::ZstdStream, 1).unwrap();
    let mut batch = CompressedBatch::new();
    for chunk in text.chunks(pages) {
        let pointers: Vec<*const u8> = chunk.iter().map(|page| page.as_ptr()).collect();
        // SAFETY: whole pages of `text`, alive during the call.
        unsafe { compressor.compress_batch(&pointers, &mut batch) };
    }
    assert!(!batch.stream_restart);
    batch.data
}

#[test]
fn a_packet_continuing_a_stream_the_channel_never_began_is_refused() {
    let attack = hello(1 << codec_id::ZSTD_STREAM, 0);
    let mut channel = attack.page_channel();
    let bytes = second_packet_of_a_stream(4);
    let entries: Vec<PageEntry> = (0..4)
        .map(|page| compressed(page, if page == 0 { bytes.len() } else { 0 }))
        .collect();
    let _ = channel.write_all(&packet(codec_id::ZSTD_STREAM, 0, &entries, &bytes));
    attack.expect_error("zstd stream page malformed");
}

#[test]
fn stream_frames_outside_plain_zstd_are_refused_up_front() {
    let refused = |configure: fn(&mut tern_engine::MigrationConfig), needle: &str| {
        let mut config = migration_config(2);
        config.stream_frames = true;
        configure(&mut config);
        let error = tern_engine::Source::new(config).unwrap_err().to_string();
        assert!(
            error.contains("stream_frames") && error.contains(needle),
            "{error}"
        );
    };
    refused(
        |config| config.compression = CodecChoice::Auto,
        "compression is auto",
    );
    refused(
        |config| {
            config.compression = CodecChoice::Zstd;
            config.packet_frames = true;
        },
        "with packet frames",
    );
    refused(
        |config| {
            config.compression = CodecChoice::Zstd;
            config.compression_dictionary = Some(4096);
        },
        "with a dictionary",
    );
    let mut config = migration_config(2);
    config.compression = CodecChoice::Zstd;
    config.stream_frames = true;
    assert!(tern_engine::Source::new(config).is_ok());
}
