use super::*;
use crate::PAGE_SIZE;

fn pages() -> Vec<(&'static str, [u8; PAGE_SIZE])> {
    let mut v = Vec::new();
    for seed in 1..4 {
        v.push(("random", corpus_page("random", seed)));
        v.push(("text", corpus_page("text", seed)));
        v.push(("binary", corpus_page("binary", seed)));
    }
    v.push(("zero", [0u8; PAGE_SIZE]));
    let mut sparse = [0u8; PAGE_SIZE];
    sparse[100] = 7;
    sparse[4000] = 9;
    v.push(("sparse", sparse));
    v
}

const LEVELS: &[(CodecId, i32)] = &[
    (CodecId::Zstd, -5),
    (CodecId::Zstd, 1),
    (CodecId::Zstd, 3),
    (CodecId::Zstd, 19),
    (CodecId::Deflate, 1),
    (CodecId::Deflate, 6),
    (CodecId::Deflate, 12),
    (CodecId::Lz4, 1),
];

#[test]
fn round_trip_every_codec_and_level() {
    let mut out = [0u8; MAX_COMPRESSED];
    let mut back = [0u8; PAGE_SIZE];
    for &(codec, level) in LEVELS {
        for sampling in [true, false] {
            let mut c = PageCompressor::new(codec, level).unwrap();
            c.set_sampling(sampling);
            let mut d = PageDecompressor::new(codec).unwrap();
            for (kind, page) in pages() {
                match c.compress(&page, &mut out) {
                    Some(n) => {
                        assert!((1..=MAX_COMPRESSED).contains(&n));
                        d.decompress(&out[..n], &mut back).unwrap();
                        assert_eq!(back, page, "{codec} {level} {kind}");
                    }
                    None => assert_eq!(kind, "random", "{codec} {level} {kind} went raw"),
                }
            }
        }
    }
}

#[test]
fn incompressible_page_goes_raw_with_reason() {
    let random = corpus_page("random", 42);
    let mut out = [0u8; MAX_COMPRESSED];
    for codec in [CodecId::Zstd, CodecId::Deflate, CodecId::Lz4] {
        let mut c = PageCompressor::new(codec, 1).unwrap();
        assert_eq!(c.compress(&random, &mut out), None);
        assert_eq!(c.stats().get(c.implementation()).skipped_by_sampling, 1);
        c.set_sampling(false);
        assert_eq!(c.compress(&random, &mut out), None);
        let s = c.stats().get(c.implementation());
        assert_eq!((s.pages, s.raw_fallbacks, s.compressed), (2, 1, 0));
        assert_eq!(s.bytes_out, 2 * PAGE_SIZE as u64);
    }
    let mut none = PageCompressor::new(CodecId::None, 5).unwrap();
    assert_eq!(none.level(), 0);
    assert_eq!(none.compress(&corpus_page("text", 1), &mut out), None);
}

#[test]
fn level_changes_output_and_is_reported() {
    // Several text pages, so a size difference is not a fluke of one page.
    let text: Vec<_> = (1..6).map(|s| corpus_page("text", s)).collect();
    let total = |codec, level| {
        let mut c = PageCompressor::new(codec, level).unwrap();
        assert_eq!(c.level(), level);
        let mut out = [0u8; MAX_COMPRESSED];
        text.iter()
            .map(|p| c.compress(p, &mut out).unwrap())
            .sum::<usize>()
    };
    let (z1, z19) = (total(CodecId::Zstd, 1), total(CodecId::Zstd, 19));
    let (d1, d9) = (total(CodecId::Deflate, 1), total(CodecId::Deflate, 9));
    assert!(z19 < z1, "zstd 19 {z19} vs 1 {z1}");
    assert!(d9 < d1, "deflate 9 {d9} vs 1 {d1}");
}

#[test]
fn out_of_range_level_is_clamped_and_reported() {
    let max_zstd = *::zstd::compression_level_range().end();
    assert_eq!(
        PageCompressor::new(CodecId::Zstd, 1000).unwrap().level(),
        max_zstd
    );
    assert_eq!(PageCompressor::new(CodecId::Zstd, 0).unwrap().level(), 3);
    assert_eq!(PageCompressor::new(CodecId::Deflate, 0).unwrap().level(), 1);
    assert_eq!(
        PageCompressor::new(CodecId::Deflate, 99).unwrap().level(),
        12
    );
    assert_eq!(PageCompressor::new(CodecId::Lz4, 9).unwrap().level(), 1);
}

fn valid_stream(codec: CodecId) -> Vec<u8> {
    let mut c = PageCompressor::new(codec, 1).unwrap();
    let mut out = [0u8; MAX_COMPRESSED];
    let n = c.compress(&corpus_page("text", 3), &mut out).unwrap();
    out[..n].to_vec()
}

const CODECS: [CodecId; 3] = [CodecId::Zstd, CodecId::Deflate, CodecId::Lz4];

#[test]
fn truncated_and_garbage_input_errors() {
    let mut page = [0u8; PAGE_SIZE];
    for codec in CODECS {
        let mut d = PageDecompressor::new(codec).unwrap();
        let s = valid_stream(codec);
        assert!(
            d.decompress(&s[..s.len() / 2], &mut page).is_err(),
            "{codec}"
        );
        assert!(d.decompress(&s[..1], &mut page).is_err(), "{codec}");
        assert!(matches!(
            d.decompress(&[], &mut page),
            Err(CodecError::BadInputLength { .. })
        ));
        assert!(matches!(
            d.decompress(&[0u8; PAGE_SIZE], &mut page),
            Err(CodecError::BadInputLength { .. })
        ));
        assert!(d.decompress(&[0xffu8; 100], &mut page).is_err(), "{codec}");
    }
    let mut none = PageDecompressor::new(CodecId::None).unwrap();
    assert!(matches!(
        none.decompress(&[1, 2], &mut page),
        Err(CodecError::NoCodec)
    ));
}

/// Streams that decode to `len` bytes, made with the codec libraries directly.
fn stream_of_len(codec: CodecId, len: usize) -> Vec<u8> {
    let data: Vec<u8> = (0..len).map(|i| (i % 251).to_le_bytes()[0]).collect();
    match codec {
        CodecId::Zstd | CodecId::ZstdPacket => ::zstd::bulk::compress(&data, 1).unwrap(),
        CodecId::Deflate => {
            let mut c = libdeflater::Compressor::new(libdeflater::CompressionLvl::new(6).unwrap());
            let mut out = vec![0u8; c.deflate_compress_bound(len)];
            let n = c.deflate_compress(&data, &mut out).unwrap();
            out.truncate(n);
            out
        }
        CodecId::Lz4 => lz4_flex::block::compress(&data),
        CodecId::None | CodecId::ZstdStream => unreachable!(),
    }
}

#[test]
fn wrong_decoded_size_errors_and_never_writes_past_the_page() {
    for codec in CODECS {
        let mut d = PageDecompressor::new(codec).unwrap();
        let short = stream_of_len(codec, PAGE_SIZE - 1);
        let long = stream_of_len(codec, PAGE_SIZE + 1);
        let exact = stream_of_len(codec, PAGE_SIZE);
        // A page with guard bytes on both sides, written through the raw
        // pointer API as a receiver would.
        let mut buf = vec![0xa5u8; PAGE_SIZE + 128];
        let page = buf[64..].as_mut_ptr();
        // SAFETY: `page` has PAGE_SIZE + 64 writable bytes, unaliased.
        let r = unsafe { d.decompress_page(&short, page) };
        assert!(
            matches!(r, Err(CodecError::ShortPage { decoded, .. }) if decoded == PAGE_SIZE - 1),
            "{codec}: {r:?}"
        );
        // SAFETY: as above.
        let r = unsafe { d.decompress_page(&long, page) };
        assert!(
            matches!(r, Err(CodecError::OversizedPage { .. })),
            "{codec}: {r:?}"
        );
        assert!(
            buf[..64].iter().all(|&b| b == 0xa5),
            "{codec} wrote before the page"
        );
        assert!(
            buf[64 + PAGE_SIZE..].iter().all(|&b| b == 0xa5),
            "{codec} wrote past the page"
        );
        // SAFETY: as above.
        unsafe { d.decompress_page(&exact, page) }.unwrap();
        assert_eq!(buf[64 + 300], (300 % 251) as u8);
    }
}

#[test]
fn garbage_fuzz_never_panics() {
    let mut state = 0x1234_5678_9abc_def1u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut page = [0u8; PAGE_SIZE];
    for codec in CODECS {
        let mut d = PageDecompressor::new(codec).unwrap();
        let valid = valid_stream(codec);
        for i in 0..1500 {
            let input: Vec<u8> = if i % 2 == 0 {
                let len = 1 + (next() % 600) as usize;
                (0..len).map(|_| next().to_le_bytes()[0]).collect()
            } else {
                // A valid stream with a few bytes flipped or cut.
                let mut v = valid.clone();
                for _ in 0..1 + next() % 4 {
                    let at = below(next(), v.len());
                    v[at] ^= 1 << (next() % 8);
                }
                v.truncate(1 + below(next(), v.len()));
                v
            };
            let _ = d.decompress(&input, &mut page);
        }
    }
}

#[test]
fn deflate_stream_is_raw_and_window_limited() {
    // The stream is raw deflate: libdeflate's raw decoder accepts it and its
    // zlib decoder (which wants a header) does not. Because the input is a
    // single 4096-byte page, no match can reach back more than 4095 bytes,
    // so the 4 KiB history of IAA's decompressor always suffices.
    let s = valid_stream(CodecId::Deflate);
    let mut d = libdeflater::Decompressor::new();
    let mut page = [0u8; PAGE_SIZE];
    assert_eq!(d.deflate_decompress(&s, &mut page).unwrap(), PAGE_SIZE);
    assert!(d.zlib_decompress(&s, &mut page).is_err());
}

#[test]
fn sampling_separates_random_from_text_binary_and_zero() {
    let mut counts: Vec<(&str, u32)> = Vec::new();
    for seed in 1..40 {
        for kind in ["random", "text", "binary"] {
            let p = corpus_page(kind, seed);
            // SAFETY: a page array is PAGE_SIZE readable bytes.
            counts.push((kind, unsafe { sample_distinct_bytes(p.as_ptr()) }));
            assert_eq!(
                looks_incompressible_bytes(&p),
                kind == "random",
                "{kind} {seed}"
            );
        }
    }
    assert!(!looks_incompressible_bytes(&[0u8; PAGE_SIZE]));
    for kind in ["random", "text", "binary"] {
        let v: Vec<u32> = counts.iter().filter(|c| c.0 == kind).map(|c| c.1).collect();
        println!(
            "{kind}: distinct {}..={}",
            v.iter().min().unwrap(),
            v.iter().max().unwrap()
        );
    }
}

fn m(codec: CodecId, rate_mb: f64, ratio: f64) -> CodecMeasurement {
    CodecMeasurement {
        codec,
        level: 1,
        compress_bytes_per_sec: rate_mb * 1e6,
        decompress_bytes_per_sec: None,
        ratio,
    }
}

#[test]
fn auto_selector_choices() {
    let measured = [
        m(CodecId::Zstd, 235.0, 3.0),
        m(CodecId::Lz4, 500.0, 2.0),
        m(CodecId::Deflate, 160.0, 3.1),
    ];
    // 10 Gbit/s with 2 threads: no codec keeps up, send raw.
    let d = choose_codec(1.25e9, 2, &measured, CodecId::None, 0.1);
    assert_eq!(d.codec, CodecId::None);
    // 1 Gbit/s: zstd moves min(470, 125*3=375) MB/s, lz4 min(1000, 250).
    let d = choose_codec(125e6, 2, &measured, CodecId::None, 0.1);
    assert_eq!(d.codec, CodecId::Zstd);
    assert!((d.effective_bytes_per_sec - 375e6).abs() < 1.0);
    // 3 Gbit/s (375 MB/s): lz4 min(1000, 750) beats zstd min(470, 1125).
    let d = choose_codec(375e6, 2, &measured, CodecId::None, 0.1);
    assert_eq!(d.codec, CodecId::Lz4);
    // A slow destination decoder caps zstd at 100 MB/s: deflate (320) wins.
    let mut slow = measured;
    slow[0].decompress_bytes_per_sec = Some(50e6);
    assert_eq!(
        choose_codec(125e6, 2, &slow, CodecId::None, 0.1).codec,
        CodecId::Deflate
    );
    // Hysteresis: lz4 at 250 MB/s stays when zstd would give 260 (< 10 %).
    let close = [m(CodecId::Zstd, 130.0, 3.0), m(CodecId::Lz4, 500.0, 2.0)];
    assert_eq!(
        choose_codec(125e6, 2, &close, CodecId::Lz4, 0.1).codec,
        CodecId::Lz4
    );
    assert_eq!(
        choose_codec(125e6, 2, &close, CodecId::None, 0.1).codec,
        CodecId::Zstd
    );
    // The stateful selector changes codec between iterations as the link does.
    let mut sel = AutoSelector::new(2);
    assert_eq!(sel.next(125e6, &measured).codec, CodecId::Zstd);
    assert_eq!(sel.next(1.25e9, &measured).codec, CodecId::None);
    assert_eq!(sel.current(), CodecId::None);
}

#[test]
fn calibrate_measures_rates_and_ratio() {
    let sample: Vec<_> = (0..6)
        .map(|i| corpus_page(["random", "text", "binary"][i % 3], i as u64))
        .collect();
    let ms = calibrate(
        &sample,
        &[(CodecId::Zstd, 1), (CodecId::Lz4, 1), (CodecId::None, 0)],
    )
    .unwrap();
    assert_eq!(ms.len(), 2);
    for m in &ms {
        assert!(m.compress_bytes_per_sec > 0.0 && m.ratio > 1.0, "{m:?}");
        assert!(m.decompress_bytes_per_sec.unwrap() > 0.0);
    }
}

#[test]
fn batch_api_outcomes_and_stats() {
    let ps = pages();
    let ptrs: Vec<*const u8> = ps.iter().map(|(_, p)| p.as_ptr()).collect();
    let mut c = PageCompressor::new(CodecId::Zstd, 1).unwrap();
    let mut batch = CompressedBatch::new();
    // SAFETY: every pointer is a live PAGE_SIZE array.
    unsafe { c.compress_batch(&ptrs, &mut batch) };
    assert_eq!(batch.outcomes.len(), ps.len());
    let mut d = PageDecompressor::new(CodecId::Zstd).unwrap();
    let mut back = [0u8; PAGE_SIZE];
    for (i, (kind, page)) in ps.iter().enumerate() {
        match batch.compressed(i) {
            Some(bytes) => {
                d.decompress(bytes, &mut back).unwrap();
                assert_eq!(&back, page);
            }
            None => {
                assert_eq!(*kind, "random");
                assert_eq!(batch.outcomes[i], PageOutcome::Raw(RawReason::Sampled));
            }
        }
    }
    let s = *c.stats().get(CodecImpl::Zstd);
    assert_eq!(s.pages, ps.len() as u64);
    assert_eq!(s.skipped_by_sampling, 3);
    assert_eq!(s.compressed, ps.len() as u64 - 3);
    assert!(s.ratio() > 1.5, "{s:?}");
    let mut total = CodecStats::default();
    total.merge(&c.take_stats());
    total.merge(&c.take_stats());
    assert_eq!(total.get(CodecImpl::Zstd).pages, ps.len() as u64);
    assert!(total.to_string().starts_with("zstd: pages"));
}

#[test]
fn names_and_wire_ids() {
    for id in CodecId::ALL {
        assert_eq!(id.name().parse::<CodecId>().unwrap(), id);
        assert_eq!(CodecId::from_wire(id.to_wire()).unwrap(), id);
    }
    assert!(CodecId::from_wire(9).is_err());
    for c in CodecChoice::ALL {
        assert_eq!(c.name().parse::<CodecChoice>().unwrap(), c);
    }
    assert_eq!(CodecChoice::Qpl.wire(), Some(CodecId::Deflate));
    assert_eq!(CodecChoice::Auto.wire(), None);
    assert!("brotli".parse::<CodecChoice>().is_err());
    let zlib = "zlib".parse::<CodecChoice>().unwrap_err().to_string();
    assert!(zlib.contains("use deflate"), "{zlib}");
    assert_eq!("ZSTD".parse::<CodecId>().unwrap().to_wire(), 1);
}

#[test]
fn bench_codecs_small_corpus() {
    let rows = bench_codecs(6, &[(CodecId::Zstd, 1), (CodecId::Lz4, 1)]).unwrap();
    assert_eq!(rows.len(), 10);
    let text = rows
        .iter()
        .find(|r| r.corpus == "text" && r.codec == CodecId::Zstd)
        .unwrap();
    assert!(text.ratio > 2.0 && text.compress_mb_s > 0.0, "{text:?}");
    let random = rows
        .iter()
        .find(|r| r.corpus == "random" && r.sampling)
        .unwrap();
    assert_eq!(random.raw_pages, random.pages);
    assert!(rows[0].to_json().starts_with("{\"corpus\":\"mixed\""));
}

fn deflate_measurement(rate: f64, ratio: f64) -> CodecMeasurement {
    CodecMeasurement {
        codec: CodecId::Deflate,
        level: 1,
        compress_bytes_per_sec: rate,
        decompress_bytes_per_sec: None,
        ratio,
    }
}

#[test]
fn auto_offloads_deflate_only_when_qpl_is_faster_at_a_similar_ratio() {
    let libdeflate = deflate_measurement(150e6, 2.0);
    // IAA-like: several times faster, a little less ratio.
    assert!(prefer_offload(
        &libdeflate,
        &deflate_measurement(1.5e9, 1.92)
    ));
    // Faster but much worse ratio: not worth it.
    assert!(!prefer_offload(
        &libdeflate,
        &deflate_measurement(1.5e9, 1.5)
    ));
    // QPL's software path on a machine without IAA: slower, so no.
    assert!(!prefer_offload(
        &libdeflate,
        &deflate_measurement(90e6, 2.0)
    ));
}

#[test]
fn calibrating_qpl_without_libqpl_says_why() {
    if qpl_available().is_ok() {
        tern_test_skip::skip(
            tern_test_skip::Need::NoQpl,
            "libqpl loads here; this checks the machine without it",
        );
        return;
    }
    let sample = [corpus_page("text", 1)];
    let error = calibrate_qpl(&sample, QplPath::Software, 1).unwrap_err();
    assert!(
        matches!(
            error,
            CodecError::QplUnavailable(_) | CodecError::NotBuilt { .. }
        ),
        "{error}"
    );
}

/// `random % n`, as an index.
fn below(random: u64, n: usize) -> usize {
    usize::try_from(random % u64::try_from(n).expect("a buffer length fits u64"))
        .expect("below a usize")
}
