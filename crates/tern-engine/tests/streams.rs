//! zstd as one stream per page channel end to end: real migrations over
//! TCP checked by digest, `auto` choosing it on a slow link, and a
//! hand-driven source sending what a correct one never does (a packet
//! that continues a stream its channel never began). Each must end in a
//! clear error within a bounded time.

use crate::common;
use crate::dictionary::{migrate_guest, sliced_text_guest};

use common::*;
use tern_engine::Address;
use tern_page::codec::CodecChoice;

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
