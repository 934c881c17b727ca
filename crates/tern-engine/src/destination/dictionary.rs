//! The session's compression dictionaries: read on the main channel right
//! after the welcome, exactly as many as the hello announced, before any
//! page channel is accepted; so every receiver has every dictionary before
//! its first packet, and a packet naming another is refused. Refreshed
//! dictionaries arrive on the main channel during the live phase and come
//! into force at an iteration barrier ([`SessionDictionaries`]).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tern_page::codec::{CodecDictionary, CodecId};
use tern_wire::{Dictionary, FRAME_HEADER_LEN, FrameDecoder, FrameKind, Message, SessionSetup};

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
        dictionaries.push(checked_dictionary(dictionary)?);
    }
    Ok(dictionaries)
}

/// A dictionary from the source, checked by loading it into a zstd
/// decoder once on arrival: one libzstd refuses is the source's error, and
/// is named as such (libzstd's own message for a malformed dictionary can
/// read "not enough memory").
fn checked_dictionary(dictionary: Dictionary) -> Result<CodecDictionary, MigrationError> {
    let id = dictionary.id;
    let dictionary = CodecDictionary::new(id, CodecId::Zstd, dictionary.data).map_err(|error| {
        MigrationError::Protocol(format!("the source's dictionary {id}: {error}"))
    })?;
    tern_page::codec::PageDecompressor::new(CodecId::Zstd)
        .and_then(|decoder| decoder.with_dictionaries(std::slice::from_ref(&dictionary)))
        .map_err(|error| {
            MigrationError::Protocol(format!(
                "the source's dictionary {id} ({} bytes) is not a zstd dictionary this side can \
                 load: malformed or corrupt ({error})",
                dictionary.bytes().len()
            ))
        })?;
    Ok(dictionary)
}

fn describe(message: &Message) -> String {
    match message {
        Message::Dictionary(dictionary) => format!("dictionary {}", dictionary.id),
        other => format!("{:?}", other.kind()),
    }
}

/// The session's dictionaries at the destination: those of the setup, and
/// those the source sends on the main channel during the live phase (a
/// refresh), each with the next id. A packet names one *in force*: one
/// the syncs of an earlier iteration announced, once every page channel
/// crossed that iteration's barrier, or (protocol 13) one the main channel
/// has delivered, or delivers within the I/O timeout, which the packet
/// then puts in force (docs/protocol.md, "Dictionaries"). At most
/// `MAX_DICTIONARIES` of at most `MAX_DICTIONARY_LEN` bytes each are ever
/// held: the source cannot make this side allocate more, whatever it
/// sends.
pub(super) struct SessionDictionaries {
    received: Mutex<Vec<CodecDictionary>>,
    /// Rung when the main channel delivers one.
    arrived: Condvar,
    /// How many of `received` packets may name (ids 1..=this).
    in_force: AtomicU8,
}

impl SessionDictionaries {
    /// The setup's dictionaries, all in force from the first packet.
    pub(super) fn new(setup: Vec<CodecDictionary>) -> Self {
        let in_force = u8::try_from(setup.len()).unwrap_or(u8::MAX);
        Self {
            received: Mutex::new(setup),
            arrived: Condvar::new(),
            in_force: AtomicU8::new(in_force),
        }
    }

    fn received(&self) -> MutexGuard<'_, Vec<CodecDictionary>> {
        self.received.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a dictionary the source sent during the live phase: it must
    /// carry the next id (and so be at most the protocol's eighth).
    pub(super) fn receive(&self, dictionary: Dictionary) -> Result<(), MigrationError> {
        let mut received = self.received();
        let expected = received.len() + 1;
        if usize::from(dictionary.id) != expected {
            return Err(MigrationError::Protocol(format!(
                "dictionary {} sent where dictionary {expected} was due",
                dictionary.id
            )));
        }
        received.push(checked_dictionary(dictionary)?);
        self.arrived.notify_all();
        Ok(())
    }

    /// How many dictionaries packets may name.
    pub(super) fn in_force(&self) -> u8 {
        self.in_force.load(Ordering::Acquire)
    }

    /// Checks a sync's dictionary count: never fewer than in force, and
    /// waits (until `deadline`, or until `stop` says the session failed)
    /// for the main channel to have delivered them all. The source sends
    /// a dictionary on the main channel before any sync that counts it,
    /// so a correct source makes this wait short.
    pub(super) fn wait_for(
        &self,
        count: u8,
        deadline: Instant,
        stop: impl Fn() -> Result<(), MigrationError>,
    ) -> Result<(), MigrationError> {
        let in_force = self.in_force();
        if count < in_force {
            return Err(MigrationError::Protocol(format!(
                "a sync counts {count} dictionaries, {in_force} are already in force"
            )));
        }
        self.wait_delivered(count, deadline, stop, |delivered| {
            format!("a sync counts {count} dictionaries, the main channel delivered {delivered}")
        })
    }

    /// Puts dictionary `id`, which a packet names, in force for every
    /// receiver and decoder (protocol 13: a packet may name a dictionary
    /// the source sent on the main channel during the pass, before the
    /// packet), waiting (at most `timeout`, or until `stop` says the
    /// session failed) for the main channel to deliver it, since the two
    /// channels race. A source that names one it never sends is refused
    /// at the deadline. Called for every packet: one that names a
    /// dictionary in force costs an atomic load.
    pub(super) fn put_named_in_force(
        &self,
        id: u8,
        timeout: Duration,
        stop: impl Fn() -> Result<(), MigrationError>,
    ) -> Result<(), MigrationError> {
        if id <= self.in_force() {
            return Ok(());
        }
        self.wait_delivered(id, Instant::now() + timeout, stop, |delivered| {
            format!(
                "a packet names dictionary {id}, the main channel delivered {delivered} within \
                 the I/O timeout"
            )
        })?;
        self.put_in_force(id);
        Ok(())
    }

    /// Waits until the main channel has delivered `count` dictionaries,
    /// or until `stop` says the session failed (its error), or until
    /// `deadline`: a protocol error, `late` of the count delivered.
    fn wait_delivered(
        &self,
        count: u8,
        deadline: Instant,
        stop: impl Fn() -> Result<(), MigrationError>,
        late: impl FnOnce(usize) -> String,
    ) -> Result<(), MigrationError> {
        let mut received = self.received();
        while received.len() < usize::from(count) {
            stop()?;
            if Instant::now() >= deadline {
                return Err(MigrationError::Protocol(late(received.len())));
            }
            received = self
                .arrived
                .wait_timeout(received, DICTIONARY_POLL)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }

    /// Puts the first `count` dictionaries in force: by the last receiver
    /// to reach an iteration's barrier, or by a receiver that read a
    /// packet naming one the main channel delivered. Never fewer: decoders
    /// load what is in force when a packet names one they lack, and the
    /// dictionaries received are only ever appended.
    pub(super) fn put_in_force(&self, count: u8) {
        self.in_force.fetch_max(count, Ordering::AcqRel);
    }

    /// The dictionaries in force after the first `loaded`, for a decoder
    /// catching up.
    pub(super) fn in_force_after(&self, loaded: u8) -> Vec<CodecDictionary> {
        let in_force = usize::from(self.in_force());
        let received = self.received();
        received
            .get(usize::from(loaded)..in_force.min(received.len()))
            .map(<[CodecDictionary]>::to_vec)
            .unwrap_or_default()
    }
}

/// How often a receiver waiting for a dictionary looks whether the session
/// failed meanwhile (a delivery wakes it at once).
const DICTIONARY_POLL: Duration = Duration::from_millis(50);
