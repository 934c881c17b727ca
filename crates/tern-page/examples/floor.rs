//! The floor of a memory image: the fewest bytes its data pages take under
//! the strongest setting at hand, and the time a link needs for them.
//!
//! ```text
//! cargo run --release -p tern-page --example floor -- IMAGE [--level 19] [--link-mbit 1000]
//! ```
//!
//! Zero pages and duplicates (a page whose bytes an earlier page has) are
//! removed: a migration sends them as a few bytes of header. The unique
//! data pages are then compressed two ways at zstd `--level`, and the
//! smaller total is the floor:
//!
//! * in packet frames of 128 pages (as tern cuts memory) against a 110 KiB
//!   dictionary trained on 4096 of the pages (libzstd's trainer);
//! * as one stream over all of them with long-distance matching and a
//!   128 MiB window (what no migration can do with independent packets,
//!   but a bound below every per-packet setting).
//!
//! Prints one JSON line (bytes are on the wire's scale: compressed bytes,
//! without tern's 12-byte page entries or packet headers).

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::Write;
use std::time::Instant;

const PAGE: usize = 4096;
const PACKET_PAGES: usize = 128;
const DICTIONARY_BYTES: usize = 110 << 10;
const TRAINING_PAGES: usize = 4096;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut image = None;
    let mut level = 19;
    let mut link_mbit = 1000.0_f64;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--level" => level = args.next().ok_or("--level needs a value")?.parse()?,
            "--link-mbit" => link_mbit = args.next().ok_or("--link-mbit needs a value")?.parse()?,
            _ if image.is_none() => image = Some(arg),
            _ => return Err(format!("unexpected argument {arg}").into()),
        }
    }
    let image = image.ok_or("usage: floor IMAGE [--level N] [--link-mbit M]")?;
    let bytes = std::fs::read(&image)?;
    let started = Instant::now();
    let pages: Vec<&[u8]> = bytes.chunks_exact(PAGE).collect();
    let (unique, zero, duplicates) = unique_data_pages(&pages);
    let packets = packet_frames_with_dictionary(&unique, level)?;
    let stream = long_stream(&unique, level)?;
    let floor = packets.min(stream);
    let seconds = floor as f64 * 8.0 / (link_mbit * 1e6);
    let line = format!(
        "{{\"image\":\"{image}\",\"pages\":{},\"zero-pages\":{zero},\"duplicate-pages\":{duplicates},\
         \"data-pages\":{},\"level\":{level},\"packet-frames-dictionary-bytes\":{packets},\
         \"long-stream-bytes\":{stream},\"floor-bytes\":{floor},\"link-mbit\":{link_mbit},\
         \"floor-seconds\":{seconds:.3},\"compute-seconds\":{:.1}}}",
        pages.len(),
        unique.len(),
        started.elapsed().as_secs_f64()
    );
    writeln!(std::io::stdout(), "{line}")?;
    Ok(())
}

/// The data pages whose bytes no earlier page has, and the counts of zero
/// and duplicate pages.
fn unique_data_pages<'a>(pages: &[&'a [u8]]) -> (Vec<&'a [u8]>, u64, u64) {
    let mut seen: HashMap<u64, Vec<usize>> = HashMap::new();
    let mut unique: Vec<&[u8]> = Vec::new();
    let (mut zero, mut duplicates) = (0, 0);
    for page in pages {
        if page.iter().all(|&byte| byte == 0) {
            zero += 1;
            continue;
        }
        let mut hasher = DefaultHasher::new();
        page.hash(&mut hasher);
        let same = seen.entry(hasher.finish()).or_default();
        if same.iter().any(|&index| unique[index] == *page) {
            duplicates += 1;
            continue;
        }
        same.push(unique.len());
        unique.push(page);
    }
    (unique, zero, duplicates)
}

/// Packet frames of [`PACKET_PAGES`] against a trained dictionary (the
/// dictionary's own bytes counted once); a frame larger than its pages
/// counts as the pages.
fn packet_frames_with_dictionary(
    pages: &[&[u8]],
    level: i32,
) -> Result<u64, Box<dyn std::error::Error>> {
    let step = (pages.len() / TRAINING_PAGES).max(1);
    let training: Vec<u8> = pages
        .iter()
        .step_by(step)
        .flat_map(|page| page.iter())
        .copied()
        .collect();
    let sizes: Vec<usize> = vec![PAGE; training.len() / PAGE];
    let dictionary = zstd::dict::from_continuous(&training, &sizes, DICTIONARY_BYTES)?;
    let mut compressor = zstd::bulk::Compressor::with_dictionary(level, &dictionary)?;
    let mut total = dictionary.len() as u64;
    let mut packet = Vec::with_capacity(PACKET_PAGES * PAGE);
    for chunk in pages.chunks(PACKET_PAGES) {
        packet.clear();
        chunk.iter().for_each(|page| packet.extend_from_slice(page));
        let frame = compressor.compress(&packet)?;
        total += frame.len().min(packet.len()) as u64;
    }
    Ok(total)
}

/// One zstd stream over every page, long-distance matching on.
fn long_stream(pages: &[&[u8]], level: i32) -> Result<u64, Box<dyn std::error::Error>> {
    let mut encoder = zstd::stream::Encoder::new(Vec::new(), level)?;
    encoder.long_distance_matching(true)?;
    encoder.window_log(27)?;
    for page in pages {
        encoder.write_all(page)?;
    }
    Ok(encoder.finish()?.len() as u64)
}
