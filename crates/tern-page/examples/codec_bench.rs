//! Prints `bench_codecs` rows as JSON lines: `cargo run --release -p
//! tern-page --example codec_bench [PAGES]`.

fn main() {
    let pages = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(768);
    let levels = tern_page::codec::default_bench_levels();
    for row in tern_page::codec::bench_codecs(pages, &levels).expect("bench") {
        println!("{}", row.to_json());
    }
}
