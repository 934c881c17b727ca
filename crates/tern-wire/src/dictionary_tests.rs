//! Dictionaries and packet frames on the wire.

use super::*;

fn zstd_setup(codecs: u8, dictionaries: u8) -> SessionSetup {
    SessionSetup {
        page_size: PAGE_SIZE,
        channel_count: 1,
        codecs,
        digest: DigestAlgorithm::Xxh3Pages,
        regions: vec![RegionInfo {
            id: 0,
            guest_addr: 0,
            len: 16 * 4096,
        }],
        guest_kind: String::new(),
        dictionaries,
        vmm_config_len: 0,
    }
}

fn dictionary(id: u8, len: usize) -> Message {
    Message::Dictionary(Dictionary {
        id,
        codec: codec_id::ZSTD,
        data: vec![7; len],
    })
}

fn decode(message: &Message) -> Result<Message, WireError> {
    let bytes = message.to_bytes();
    let header = FrameHeader::decode(bytes[..FRAME_HEADER_LEN].try_into().unwrap())?;
    Message::decode(header.kind, &bytes[FRAME_HEADER_LEN..])
}

#[test]
fn a_dictionary_round_trips_within_its_limits() {
    for len in [1, 4096, MAX_DICTIONARY_LEN] {
        let message = dictionary(1, len);
        assert_eq!(decode(&message).unwrap(), message);
    }
    // Too long: refused at the frame header, before any body byte.
    let bytes = dictionary(1, MAX_DICTIONARY_LEN + 1).to_bytes();
    assert!(matches!(
        FrameHeader::decode(bytes[..FRAME_HEADER_LEN].try_into().unwrap()),
        Err(WireError::FrameTooLong {
            kind: FrameKind::Dictionary,
            ..
        })
    ));
    assert!(decode(&dictionary(0, 10)).is_err(), "id 0 means none");
    assert!(decode(&dictionary(MAX_DICTIONARIES + 1, 10)).is_err());
    assert!(decode(&dictionary(1, 0)).is_err(), "empty");
    let lz4 = Message::Dictionary(Dictionary {
        id: 1,
        codec: codec_id::LZ4,
        data: vec![1; 10],
    });
    assert!(decode(&lz4).is_err(), "only zstd takes one");
}

#[test]
fn the_hello_announces_dictionaries_only_with_zstd() {
    let hello = |setup: SessionSetup| {
        Message::Hello(Hello {
            handshake: Handshake {
                session_id: 1,
                channel_index: 0,
            },
            setup,
        })
    };
    let good = hello(zstd_setup(1 << codec_id::ZSTD_PACKET, 2));
    assert_eq!(decode(&good).unwrap(), good);
    assert!(decode(&hello(zstd_setup(1 << codec_id::LZ4, 1))).is_err());
    assert!(
        decode(&hello(zstd_setup(
            1 << codec_id::ZSTD,
            MAX_DICTIONARIES + 1
        )))
        .is_err()
    );
}

fn packet(header: PagesHeader, entries: &[PageEntry], payload: usize) -> Vec<u8> {
    let mut out = Vec::new();
    encode_packet_prefix(&mut out, &header, entries);
    out.resize(out.len() + payload, 0xab);
    out
}

fn header(codec: u8, dictionary: u8) -> PagesHeader {
    PagesHeader {
        region_id: 0,
        iteration: 0,
        page_count: 0,
        codec,
        dictionary,
    }
}

fn compressed(page_index: u32, encoded_len: u32) -> PageEntry {
    PageEntry {
        page_index,
        kind: PageKind::Compressed,
        encoded_len,
    }
}

#[test]
fn a_packet_names_only_a_dictionary_the_session_announced() {
    let setup = zstd_setup(1 << codec_id::ZSTD | 1 << codec_id::LZ4, 1);
    let entries = [compressed(0, 100)];
    let frames = decode_stream(
        &packet(header(codec_id::ZSTD, 1), &entries, 100),
        Some(&setup),
    );
    assert!(matches!(&frames.unwrap()[..], [Frame::Pages(h, _)] if h.dictionary == 1));
    for (codec, dictionary) in [(codec_id::ZSTD, 2), (codec_id::LZ4, 1), (0, 1)] {
        let bytes = packet(header(codec, dictionary), &entries, 100);
        assert!(
            matches!(
                decode_stream(&bytes, Some(&setup)),
                Err(WireError::InvalidField {
                    field: "packet dictionary",
                    ..
                }) | Err(WireError::InvalidField {
                    field: "page entry",
                    ..
                })
            ),
            "codec {codec} dictionary {dictionary}"
        );
    }
}

#[test]
fn a_packet_frame_belongs_to_its_first_compressed_entry_and_must_shrink() {
    for codec in [codec_id::ZSTD_PACKET, codec_id::ZSTD_STREAM] {
        a_frame_per_packet_belongs_to_its_first_entry(codec);
    }
    // Per-page zstd keeps its rule: every compressed page has bytes.
    let setup = zstd_setup(1 << codec_id::ZSTD, 0);
    let bytes = packet(header(codec_id::ZSTD, 0), &[compressed(0, 0)], 0);
    assert!(decode_stream(&bytes, Some(&setup)).is_err());
}

fn a_frame_per_packet_belongs_to_its_first_entry(codec: u8) {
    let setup = zstd_setup(1 << codec, 0);
    let raw = PageEntry {
        page_index: 5,
        kind: PageKind::Raw,
        encoded_len: PAGE_SIZE,
    };
    let good = [compressed(0, 300), raw, compressed(1, 0), compressed(2, 0)];
    let bytes = packet(header(codec, 0), &good, 300 + 4096);
    let frames = decode_stream(&bytes, Some(&setup)).unwrap();
    assert!(matches!(&frames[..], [Frame::Pages(_, entries)] if entries[..] == good[..]));
    // The decoder hands out the frame as the first entry's payload, then
    // the raw page, and skips the empty entries.
    let mut decoder = FrameDecoder::with_setup(setup.clone());
    let mut input = &bytes[..];
    let mut payloads = Vec::new();
    while let Some(decoded) = decoder.decode(&mut input).unwrap() {
        if let Decoded::Payload { entry, bytes } = decoded {
            payloads.push((entry, bytes.len()));
        }
    }
    assert_eq!(payloads, [(0, 300), (1, 4096)]);
    let refused: [&[PageEntry]; 4] = [
        // Bytes on a later compressed entry.
        &[compressed(0, 300), compressed(1, 10)],
        // None on the first.
        &[compressed(0, 0), compressed(1, 300)],
        // A frame as long as its pages.
        &[compressed(0, 8192), compressed(1, 0)],
        &[compressed(0, 4096)],
    ];
    for entries in refused {
        let payload: u32 = entries.iter().map(|entry| entry.encoded_len).sum();
        let bytes = packet(header(codec, 0), entries, payload as usize);
        assert!(
            decode_stream(&bytes, Some(&setup)).is_err(),
            "{entries:?} must be refused"
        );
    }
    // A packet whose pages all went raw has no frame, and is fine.
    let bytes = packet(header(codec, 0), &[raw], 4096);
    assert!(decode_stream(&bytes, Some(&setup)).is_ok());
}

#[test]
fn a_stream_packets_dictionary_byte_is_its_restart_flag() {
    // A session with dictionaries: the byte still names none of them.
    let setup = zstd_setup(1 << codec_id::ZSTD_STREAM | 1 << codec_id::ZSTD, 3);
    let entries = [compressed(0, 100)];
    for (byte, restarts) in [(0, false), (codec_id::STREAM_RESTART, true)] {
        let bytes = packet(header(codec_id::ZSTD_STREAM, byte), &entries, 100);
        let frames = decode_stream(&bytes, Some(&setup)).unwrap();
        let [Frame::Pages(header, _)] = &frames[..] else {
            panic!("one packet expected, got {frames:?}");
        };
        assert_eq!(header.restarts_stream(), restarts);
        assert_eq!(header.named_dictionary(), 0);
    }
    let bytes = packet(header(codec_id::ZSTD_STREAM, 2), &entries, 100);
    assert!(matches!(
        decode_stream(&bytes, Some(&setup)),
        Err(WireError::InvalidField {
            field: "packet dictionary",
            ..
        })
    ));
    // Other codecs' byte names a dictionary, and never restarts a stream.
    let bytes = packet(header(codec_id::ZSTD, 1), &entries, 100);
    let frames = decode_stream(&bytes, Some(&setup)).unwrap();
    assert!(
        matches!(&frames[..], [Frame::Pages(h, _)] if h.named_dictionary() == 1 && !h.restarts_stream())
    );
}
