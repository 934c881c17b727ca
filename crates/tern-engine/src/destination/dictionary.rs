//! The session's compression dictionaries: read on the main channel right
//! after the welcome, exactly as many as the hello announced, before any
//! page channel is accepted; so every receiver has every dictionary before
//! its first packet, and a packet naming another is refused.

use tern_page::codec::{CodecDictionary, CodecId};
use tern_wire::{FRAME_HEADER_LEN, FrameDecoder, FrameKind, Message, SessionSetup};

use super::handshake::peer_aborted;
use super::stream::{FrameSource, read_message_within};
use crate::error::MigrationError;

/// Reads the `setup.dictionaries` dictionaries, ids 1, 2, … in order. A
/// dictionary frame longer than the protocol allows is refused at its
/// header, before its body is read; anything else than the next expected
/// dictionary (another id, another message) is a protocol error.
pub(super) fn receive_dictionaries(
    main: &mut impl FrameSource,
    decoder: &mut FrameDecoder,
    setup: &SessionSetup,
) -> Result<Vec<CodecDictionary>, MigrationError> {
    let max_frame = FRAME_HEADER_LEN + FrameKind::Dictionary.max_body();
    let mut dictionaries = Vec::with_capacity(usize::from(setup.dictionaries));
    for expected in 1..=setup.dictionaries {
        let message =
            read_message_within(main, decoder, max_frame).map_err(MigrationError::channel(0))?;
        let dictionary = match message {
            Message::Dictionary(dictionary) if dictionary.id == expected => dictionary,
            Message::Abort(abort) => return Err(peer_aborted(abort)),
            other => {
                return Err(MigrationError::Protocol(format!(
                    "expected dictionary {expected} of {}, got {}",
                    setup.dictionaries,
                    describe(&other)
                )));
            }
        };
        let dictionary = CodecDictionary::new(dictionary.id, CodecId::Zstd, dictionary.data)
            .map_err(|error| MigrationError::Protocol(error.to_string()))?;
        dictionaries.push(dictionary);
    }
    Ok(dictionaries)
}

fn describe(message: &Message) -> String {
    match message {
        Message::Dictionary(dictionary) => format!("dictionary {}", dictionary.id),
        other => format!("{:?}", other.kind()),
    }
}
