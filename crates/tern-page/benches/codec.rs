//! Per-page codec throughput on the synthetic corpus (random, text,
//! binary-like pages), one thread. `tern bench codec` reports the same
//! through `tern_page::codec::bench_codecs`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use tern_page::PAGE_SIZE;
use tern_page::codec::{
    CodecId, PageCompressor, PageDecompressor, corpus_page, default_bench_levels,
};

fn codecs(c: &mut Criterion) {
    let mut g = c.benchmark_group("codec");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1));
    for kind in ["random", "text", "binary"] {
        let pages: Vec<[u8; PAGE_SIZE]> = (1..=64).map(|s| corpus_page(kind, s)).collect();
        g.throughput(Throughput::Bytes((pages.len() * PAGE_SIZE) as u64));
        for (codec, level) in default_bench_levels() {
            let id = format!("{kind}/{codec}-{level}");
            let mut comp = PageCompressor::new(codec, level).unwrap();
            let mut out = vec![[0u8; PAGE_SIZE - 1]; pages.len()];
            let mut lens = vec![None; pages.len()];
            g.bench_function(BenchmarkId::new("compress", &id), |b| {
                b.iter(|| {
                    for (i, p) in pages.iter().enumerate() {
                        lens[i] = comp.compress(black_box(p), &mut out[i]);
                    }
                })
            });
            if lens.iter().all(Option::is_none) || codec == CodecId::None {
                continue;
            }
            let mut dec = PageDecompressor::new(codec).unwrap();
            let mut page = [0u8; PAGE_SIZE];
            g.bench_function(BenchmarkId::new("decompress", &id), |b| {
                b.iter(|| {
                    for (i, l) in lens.iter().enumerate() {
                        if let Some(n) = *l {
                            dec.decompress(black_box(&out[i][..n]), &mut page).unwrap();
                        }
                    }
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, codecs);
criterion_main!(benches);
