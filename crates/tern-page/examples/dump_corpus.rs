//! Writes tern's synthetic corpus pages to stdout, for benchmarks that run
//! outside Rust (bench/qpl/huffman_modes.c).
//!
//! `cargo run --release -p tern-page --example dump_corpus -- KIND PAGES`,
//! KIND one of `text`, `binary`, `random`, `mixed` (random/text/binary in
//! turn, as `tern bench codec` builds it).

use std::io::Write;

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let kind = args.next().unwrap_or_else(|| "mixed".to_string());
    let pages: u64 = args.next().and_then(|n| n.parse().ok()).unwrap_or(256);
    let mut out = std::io::stdout().lock();
    for i in 0..pages {
        let page_kind = if kind == "mixed" {
            ["random", "text", "binary"][(i % 3) as usize]
        } else {
            kind.as_str()
        };
        out.write_all(&tern_page::codec::corpus_page(page_kind, i + 1))?;
    }
    out.flush()
}
