//! Prints `bench_zstd_variants` rows (Debug): `cargo run --release -p
//! tern-page --example zstd_variants [IMAGE [PAGES [DICT_BYTES]]]`; without
//! an image, the synthetic mixed corpus.

fn main() {
    let mut args = std::env::args().skip(1);
    let image = args.next();
    let pages: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(8192);
    let dict: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(32 << 10);
    let corpus = match &image {
        Some(path) => {
            let bytes = std::fs::read(path).expect("read the image");
            tern_page::codec::PacketCorpus::from_image(path, &bytes, pages, 1024)
        }
        None => {
            tern_page::codec::PacketCorpus::synthetic("mixed", &["random", "text", "binary"], pages)
        }
    };
    for row in tern_page::codec::bench_zstd_variants(&corpus, 1, dict, 3).expect("bench") {
        println!("{row:?}");
    }
}
