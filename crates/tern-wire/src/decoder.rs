//! The stream decoder: bytes in, frames out, no I/O.
//!
//! [`FrameDecoder`] is what every receiver of tern's protocol uses, whatever
//! carries the bytes: the engine's sockets, a test's buffer, a fuzzer's
//! input. It never reads: it says what it needs next ([`Expect`]) and the
//! caller brings the bytes. Framing bytes (headers, page tables, control
//! bodies) go into the decoder's own buffer; page payloads do not: the
//! decoder says "the next `len` bytes are the payload of page entry `k`",
//! so a receiver can `readv` them straight into guest memory and only tell
//! the decoder how many it placed.
//!
//! Memory is bounded without trusting the peer: the page table buffer has a
//! fixed size ([`MAX_PAGES_PER_PACKET`] entries), and a control body grows
//! only as its bytes arrive, at most [`FrameKind::max_body`] for its kind.

use crate::error::WireError;
use crate::message::{Message, SessionSetup};
use crate::pages::{PageEntry, PageKind, PagesHeader, decode_page_table};
use crate::seal::{FrameOpener, SEAL_LEN, Seal, header_is_sealed};
use crate::{FRAME_HEADER_LEN, FrameHeader, FrameKind, MAX_DICTIONARIES, MAX_PAGES_PER_PACKET};

/// Largest piece of a control body handed out at once: the body buffer
/// grows by at most this much per piece, so a frame that announces 64 MiB
/// and stops costs no more than the bytes that actually arrived.
const BODY_CHUNK: usize = 64 << 10;

/// A body buffer larger than this is released after its frame, so one big
/// state section does not pin its memory for the rest of the session.
const KEEP_BUFFER: usize = 1 << 20;

/// What the decoder needs next from the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// `remaining` more bytes of framing: frame header, page-packet header,
    /// page table or control body. Copy stream bytes into
    /// [`FrameDecoder::buffer`] and report them with [`FrameDecoder::filled`].
    Framing {
        /// Framing bytes left in the current structure.
        remaining: usize,
    },
    /// The next `len` bytes of the stream are payload of entry `entry` of
    /// the current packet's table ([`FrameDecoder::entries`]). Place them
    /// and report them with [`FrameDecoder::consume_payload`]; the payloads
    /// of the following entries come right after, in table order.
    Payload {
        /// Index into [`FrameDecoder::entries`].
        entry: usize,
        /// Payload bytes of that entry not placed yet.
        len: usize,
    },
}

/// A page packet whose header and table were decoded and validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagePacket {
    /// The fixed header.
    pub header: PagesHeader,
    /// Position of the packet's region in [`SessionSetup::regions`].
    pub region_index: usize,
    /// Payload bytes after the table: the sum of the entries' lengths.
    pub payload_len: usize,
}

/// A complete structure decoded from the stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A control message (the whole frame).
    Message(Message),
    /// A page packet's header and table; its table is
    /// [`FrameDecoder::entries`] and its payload follows
    /// ([`Expect::Payload`]) unless every page is a zero page.
    Pages(PagePacket),
}

/// What [`FrameDecoder::decode`] found in a byte slice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decoded<'i> {
    /// A decoded structure.
    Event(Event),
    /// Payload bytes of one page entry, borrowed from the input.
    Payload {
        /// Index into [`FrameDecoder::entries`].
        entry: usize,
        /// The bytes (possibly only part of the entry's payload).
        bytes: &'i [u8],
    },
}

#[derive(Clone, Debug)]
enum State {
    FrameHeader,
    Body {
        kind: FrameKind,
        /// The header of a sealed frame, whose seal follows the body in
        /// the same structure.
        sealed: Option<[u8; FRAME_HEADER_LEN]>,
    },
    PagesHeader {
        body_len: usize,
    },
    PageTable {
        header: PagesHeader,
        region_index: usize,
        payload_len: usize,
    },
    Payload {
        /// Payload bytes of the packet not placed yet.
        remaining: usize,
        entry: usize,
        /// Bytes of `entry` not placed yet.
        entry_left: usize,
    },
    /// The stream is broken; every call reports this error again.
    Failed(WireError),
}

/// Decodes one direction of one channel. See the module documentation.
///
/// A receiver's loop, reading from any byte source (here a slice standing
/// in for a socket):
///
/// ```
/// use tern_wire::{Event, Expect, FrameDecoder, Message, Sync};
///
/// let stream = Message::Sync(Sync { iteration: 0, last: true, dictionaries: 0 }).to_bytes();
/// let mut socket = &stream[..];
/// let mut decoder = FrameDecoder::new();
/// let event = loop {
///     match decoder.expect() {
///         Expect::Framing { .. } => {
///             let buf = decoder.buffer();
///             let len = buf.len();
///             buf.copy_from_slice(&socket[..len]); // read exactly `len` bytes
///             socket = &socket[len..];
///             if let Some(event) = decoder.filled(len)? {
///                 break event;
///             }
///         }
///         // Payload of a page packet: read it into place, then say so.
///         Expect::Payload { len, .. } => decoder.consume_payload(len),
///     }
/// };
/// assert!(matches!(event, Event::Message(Message::Sync(_))));
/// assert!(decoder.at_frame_start());
/// # Ok::<(), tern_wire::WireError>(())
/// ```
#[derive(Debug)]
pub struct FrameDecoder {
    setup: Option<SessionSetup>,
    /// Whether a hello in the stream replaces `setup` (no setup was given).
    learns_setup: bool,
    state: State,
    buf: Vec<u8>,
    /// Bytes of `buf` filled so far.
    filled: usize,
    /// Length of the structure being read into `buf`.
    need: usize,
    frame_len: usize,
    entries: Vec<PageEntry>,
    /// The frame kinds this stream may carry, and how to name them in an
    /// error; `None` = any.
    only: Option<(&'static [FrameKind], &'static str)>,
    /// When set, every control frame must be sealed and pass this opener
    /// before its body is decoded (protocol version 7, a shared key).
    opener: Option<Box<dyn FrameOpener>>,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameDecoder {
    /// A decoder that rejects page packets until the stream carries a
    /// [`Message::Hello`], whose setup it then checks them against.
    pub fn new() -> Self {
        Self::build(None)
    }

    /// A decoder that checks page packets against `setup`: a page channel's.
    pub fn with_setup(setup: SessionSetup) -> Self {
        Self::build(Some(setup))
    }

    fn build(setup: Option<SessionSetup>) -> Self {
        Self {
            learns_setup: setup.is_none(),
            setup,
            state: State::FrameHeader,
            buf: vec![0; FRAME_HEADER_LEN],
            filled: 0,
            need: FRAME_HEADER_LEN,
            frame_len: 0,
            entries: Vec::with_capacity(MAX_PAGES_PER_PACKET),
            only: None,
            opener: None,
        }
    }

    /// From now on, page packets may name dictionaries 1..=`count` (a
    /// refresh came into force at an iteration barrier). Never fewer than
    /// before: a dictionary in force stays so.
    pub fn allow_dictionaries(&mut self, count: u8) {
        if let Some(setup) = &mut self.setup {
            setup.dictionaries = setup.dictionaries.max(count.min(MAX_DICTIONARIES));
        }
    }

    /// Refuses frames of other kinds than `kinds` as soon as their header
    /// arrives, before any of their body is read or buffered: a page
    /// channel, say, carries only pages, syncs and aborts. `expected` names
    /// the allowed kinds in the [`WireError::Unexpected`] error.
    pub fn only(mut self, kinds: &'static [FrameKind], expected: &'static str) -> Self {
        self.only = Some((kinds, expected));
        self
    }

    /// Changes the kinds this stream may carry from the next frame on (see
    /// [`Self::only`]); `None` allows every kind. A destination narrows a
    /// connection's first frames to the opening kinds and widens the main
    /// channel's once it is authenticated.
    pub fn restrict(&mut self, kinds: Option<(&'static [FrameKind], &'static str)>) {
        self.only = kinds;
    }

    /// From the next frame on, every control frame must be sealed and pass
    /// `opener` before its body is decoded; an unsealed one is refused at
    /// its header ([`WireError::Unsealed`]). Without an opener, a sealed
    /// frame is refused ([`WireError::SealUnexpected`]).
    pub fn seal_with(&mut self, opener: Box<dyn FrameOpener>) {
        self.opener = Some(opener);
    }

    /// Whether control frames must be sealed.
    pub fn is_sealed(&self) -> bool {
        self.opener.is_some()
    }

    /// The setup page packets are checked against, if any.
    pub fn setup(&self) -> Option<&SessionSetup> {
        self.setup.as_ref()
    }

    /// What the stream must deliver next.
    pub fn expect(&self) -> Expect {
        match &self.state {
            State::Payload {
                entry, entry_left, ..
            } => Expect::Payload {
                entry: *entry,
                len: *entry_left,
            },
            State::Failed(_) => Expect::Framing { remaining: 0 },
            _ => Expect::Framing {
                remaining: self.need - self.filled,
            },
        }
    }

    /// Whether the next byte starts a new frame: a stream may end here.
    pub fn at_frame_start(&self) -> bool {
        matches!(self.state, State::FrameHeader) && self.filled == 0
    }

    /// Length (header included) of the frame being decoded, or of the one
    /// just decoded when [`Self::at_frame_start`].
    pub fn frame_len(&self) -> usize {
        self.frame_len
    }

    /// The current (or last) page packet's table, validated.
    pub fn entries(&self) -> &[PageEntry] {
        &self.entries
    }

    /// Where the next framing bytes go: fill a prefix of it (or all of it)
    /// and call [`Self::filled`]. Empty while the decoder expects payload
    /// or has failed. Never longer than the current structure, so a caller
    /// that fills it completely never reads past a frame.
    pub fn buffer(&mut self) -> &mut [u8] {
        if matches!(self.state, State::Payload { .. } | State::Failed(_)) {
            return &mut [];
        }
        let end = self.need.min(self.filled + BODY_CHUNK);
        if self.buf.len() < end {
            self.buf.resize(end, 0);
        }
        &mut self.buf[self.filled..end]
    }

    /// Reports that the first `len` bytes of [`Self::buffer`] were filled,
    /// and decodes what they complete.
    ///
    /// # Panics
    /// If `len` is longer than the buffer [`Self::buffer`] handed out.
    pub fn filled(&mut self, len: usize) -> Result<Option<Event>, WireError> {
        if let State::Failed(error) = &self.state {
            return Err(error.clone());
        }
        assert!(
            self.filled + len <= self.buf.len().min(self.need),
            "filled more than the decoder's buffer"
        );
        self.filled += len;
        if self.filled < self.need {
            return Ok(None);
        }
        let result = self.complete();
        if let Err(error) = &result {
            self.state = State::Failed(error.clone());
        }
        result
    }

    /// Reports that the caller placed the next `len` payload bytes of the
    /// current packet (they may span several entries).
    ///
    /// # Panics
    /// If the packet has fewer than `len` payload bytes left.
    pub fn consume_payload(&mut self, len: usize) {
        if len == 0 {
            return;
        }
        let State::Payload {
            remaining,
            entry,
            entry_left,
        } = &mut self.state
        else {
            panic!("consume_payload called while the decoder expects no payload");
        };
        assert!(
            len <= *remaining,
            "consumed more payload than the packet has"
        );
        *remaining -= len;
        if *remaining == 0 {
            self.start(State::FrameHeader, FRAME_HEADER_LEN);
            return;
        }
        let mut left = len;
        while left >= *entry_left {
            left -= *entry_left;
            *entry += 1;
            *entry_left = self.entries[*entry].encoded_len as usize;
        }
        *entry_left -= left;
    }

    /// Decodes from a byte slice, advancing it past what was used: the next
    /// structure or payload piece, or `None` when `input` ran out first
    /// (feed more and call again). Framing is copied; payload is borrowed.
    pub fn decode<'i>(&mut self, input: &mut &'i [u8]) -> Result<Option<Decoded<'i>>, WireError> {
        loop {
            if let State::Failed(error) = &self.state {
                return Err(error.clone());
            }
            if input.is_empty() {
                return Ok(None);
            }
            match self.expect() {
                Expect::Payload { entry, len } => {
                    let (bytes, rest) = input.split_at(len.min(input.len()));
                    *input = rest;
                    self.consume_payload(bytes.len());
                    return Ok(Some(Decoded::Payload { entry, bytes }));
                }
                Expect::Framing { .. } => {
                    let buf = self.buffer();
                    let len = buf.len().min(input.len());
                    let (bytes, rest) = input.split_at(len);
                    buf[..len].copy_from_slice(bytes);
                    *input = rest;
                    if let Some(event) = self.filled(len)? {
                        return Ok(Some(Decoded::Event(event)));
                    }
                }
            }
        }
    }

    /// Checks that the stream may end here: not inside a frame.
    pub fn finish(&self) -> Result<(), WireError> {
        match &self.state {
            State::Failed(error) => Err(error.clone()),
            State::FrameHeader if self.filled == 0 => Ok(()),
            State::FrameHeader => Err(WireError::Truncated("frame header")),
            State::PagesHeader { .. } => Err(WireError::Truncated("pages header")),
            State::PageTable { .. } => Err(WireError::Truncated("page table")),
            State::Body { .. } | State::Payload { .. } => Err(WireError::Truncated("frame body")),
        }
    }

    fn start(&mut self, state: State, need: usize) {
        self.state = state;
        self.filled = 0;
        self.need = need;
    }

    /// Decodes the structure that `buf[..need]` now holds.
    fn complete(&mut self) -> Result<Option<Event>, WireError> {
        match self.state.clone() {
            State::FrameHeader => self.frame_header(),
            State::Body { kind, sealed } => {
                let body_len = match sealed {
                    Some(header) => self.open_sealed(&header)?,
                    None => self.need,
                };
                let message = Message::decode(kind, &self.buf[..body_len]);
                if self.buf.len() > KEEP_BUFFER {
                    self.buf = vec![0; FRAME_HEADER_LEN];
                }
                self.start(State::FrameHeader, FRAME_HEADER_LEN);
                self.message(message?)
            }
            State::PagesHeader { body_len } => {
                let setup = self.setup.as_ref().ok_or(NO_SETUP)?;
                let mut head = [0u8; PagesHeader::ENCODED_LEN];
                head.copy_from_slice(&self.buf[..PagesHeader::ENCODED_LEN]);
                let (header, payload_len) = PagesHeader::decode(&head, body_len, setup)?;
                let region_index = setup
                    .regions
                    .iter()
                    .position(|region| region.id == header.region_id)
                    .ok_or(WireError::UnknownRegion(header.region_id))?;
                let table_len = header.table_len();
                self.start(
                    State::PageTable {
                        header,
                        region_index,
                        payload_len,
                    },
                    table_len,
                );
                Ok(None)
            }
            State::PageTable {
                header,
                region_index,
                payload_len,
            } => {
                let setup = self.setup.as_ref().ok_or(NO_SETUP)?;
                let table = &self.buf[..self.need];
                decode_page_table(&header, table, payload_len, setup, &mut self.entries)?;
                match self.entries.iter().position(|e| e.kind != PageKind::Zero) {
                    Some(entry) if payload_len > 0 => {
                        let entry_left = self.entries[entry].encoded_len as usize;
                        self.start(
                            State::Payload {
                                remaining: payload_len,
                                entry,
                                entry_left,
                            },
                            0,
                        );
                    }
                    _ => self.start(State::FrameHeader, FRAME_HEADER_LEN),
                }
                Ok(Some(Event::Pages(PagePacket {
                    header,
                    region_index,
                    payload_len,
                })))
            }
            State::Payload { .. } | State::Failed(_) => Ok(None),
        }
    }

    fn frame_header(&mut self) -> Result<Option<Event>, WireError> {
        let mut head = [0u8; FRAME_HEADER_LEN];
        head.copy_from_slice(&self.buf[..FRAME_HEADER_LEN]);
        let header = FrameHeader::decode(&head)?;
        let body_len = header.body_len as usize;
        self.frame_len = FRAME_HEADER_LEN + body_len;
        if let Some((kinds, expected)) = self.only
            && !kinds.contains(&header.kind)
        {
            return Err(WireError::Unexpected {
                got: header.kind,
                expected,
            });
        }
        match header.kind {
            FrameKind::Pages => {
                if self.setup.is_none() {
                    return Err(NO_SETUP);
                }
                // Reading a whole pages header out of a shorter body would
                // take bytes of the next frame.
                if body_len < PagesHeader::ENCODED_LEN {
                    return Err(WireError::Truncated("pages header"));
                }
                self.start(State::PagesHeader { body_len }, PagesHeader::ENCODED_LEN);
                Ok(None)
            }
            kind if header_is_sealed(&head) != self.opener.is_some() => {
                Err(if self.opener.is_some() {
                    WireError::Unsealed(kind)
                } else {
                    WireError::SealUnexpected(kind)
                })
            }
            kind if header_is_sealed(&head) => {
                self.frame_len += SEAL_LEN;
                let sealed = Some(head);
                self.start(State::Body { kind, sealed }, body_len + SEAL_LEN);
                Ok(None)
            }
            kind if body_len == 0 => {
                self.start(State::FrameHeader, FRAME_HEADER_LEN);
                self.message(Message::decode(kind, &[])?)
            }
            kind => {
                self.start(State::Body { kind, sealed: None }, body_len);
                Ok(None)
            }
        }
    }

    /// Checks the seal at the end of `buf[..need]`; returns the body's
    /// length.
    fn open_sealed(&mut self, header: &[u8; FRAME_HEADER_LEN]) -> Result<usize, WireError> {
        let body_len = self.need - SEAL_LEN;
        let mut seal = [0u8; SEAL_LEN];
        seal.copy_from_slice(&self.buf[body_len..self.need]);
        let opener = self
            .opener
            .as_mut()
            .ok_or(WireError::Truncated("session key"))?;
        opener.open(header, &self.buf[..body_len], &Seal::decode(&seal))?;
        Ok(body_len)
    }

    fn message(&mut self, message: Message) -> Result<Option<Event>, WireError> {
        if self.learns_setup
            && let Message::Hello(hello) = &message
        {
            self.setup = Some(hello.setup.clone());
        }
        Ok(Some(Event::Message(message)))
    }
}

const NO_SETUP: WireError = WireError::Unexpected {
    got: FrameKind::Pages,
    expected: "a hello first",
};
