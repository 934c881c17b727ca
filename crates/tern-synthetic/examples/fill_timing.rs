//! Measures how long `SyntheticGuest::new` takes to map and fill guests.
//!
//! Run in release mode, sizes in MiB:
//! `cargo run --release -p tern-synthetic --example fill_timing -- 1024 4096`
//!
//! `--mix zero:random:text` changes the content mix (default 50:25:25).
//! With `--dump-text PATH` it also writes 4 MiB of text-only pages to PATH,
//! to check their compressibility with an external tool such as `zstd`.

use std::time::Instant;

use tern_synthetic::{ContentMix, SyntheticConfig, SyntheticGuest};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut sizes = Vec::new();
    let mut mix = ContentMix::default();
    while let Some(arg) = args.next() {
        if arg == "--mix" {
            mix = args.next().ok_or("--mix needs zero:random:text")?.parse()?;
        } else if arg == "--dump-text" {
            let path = args.next().ok_or("--dump-text needs a path")?;
            let guest = SyntheticGuest::new(&SyntheticConfig {
                memory_bytes: 4 << 20,
                mix: ContentMix::new(0, 0, 100)?,
                ..SyntheticConfig::default()
            })?;
            std::fs::write(&path, guest.region_bytes(0).ok_or("no region")?)?;
            println!("wrote 4 MiB of text pages to {path}");
        } else {
            sizes.push(arg.parse::<u64>()?);
        }
    }
    if sizes.is_empty() {
        sizes = vec![1024, 4096];
    }
    for mib in sizes {
        let start = Instant::now();
        let guest = SyntheticGuest::new(&SyntheticConfig {
            memory_bytes: mib << 20,
            mix,
            ..SyntheticConfig::default()
        })?;
        let filled = start.elapsed();
        drop(guest);
        println!(
            "{mib} MiB, mix {}: filled in {:.2} s ({:.2} GiB/s), total with unmap {:.2} s",
            mix,
            filled.as_secs_f64(),
            mib as f64 / 1024.0 / filled.as_secs_f64(),
            start.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
