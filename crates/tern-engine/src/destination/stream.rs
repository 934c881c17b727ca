//! Reading frames with the protocol's decoder, from a channel or, to drive
//! the destination without sockets, from anything else that gives bytes.

use std::time::{Duration, Instant};

use tern_wire::{Event, Expect, FrameDecoder, FrameKind, Message, WireError};

use crate::error::ChannelError;
use crate::transport::{Channel, Segment, ShutdownHandle};

/// The bytes a destination reads on one channel. [`Channel`] is the real
/// one; a buffer stands in for it in tests.
pub(crate) trait FrameSource {
    /// Waits up to `timeout` for data (or the end of the stream).
    fn wait_readable(&self, timeout: Duration) -> Result<bool, ChannelError>;

    /// Reads exactly `buf.len()` bytes.
    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), ChannelError>;

    /// Reads exactly the segments' total length, scattering the bytes into
    /// them in order.
    ///
    /// # Safety
    /// As [`Channel::read_scattered`]: every segment points to `len`
    /// writable bytes, bounds-checked by the caller, that nothing else
    /// accesses during the call.
    unsafe fn read_scattered(&mut self, segments: &[Segment]) -> Result<(), ChannelError>;

    /// Starts one message that takes several reads (a frame's header and
    /// body, a packet's header, table and payload): they share one
    /// deadline, the I/O timeout from its first byte or `limit` if sooner.
    /// A buffer has no deadlines.
    fn begin_transfer(&mut self, _limit: Option<Instant>) {}

    /// Ends the message [`FrameSource::begin_transfer`] started.
    fn end_transfer(&mut self) {}

    /// Bytes that have arrived and wait to be read, when the stream can
    /// tell (a socket's receive queue): the switch-over's timeline.
    fn unread_bytes(&self) -> Option<u64> {
        None
    }
}

impl FrameSource for Channel {
    fn wait_readable(&self, timeout: Duration) -> Result<bool, ChannelError> {
        Channel::wait_readable(self, timeout)
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), ChannelError> {
        Channel::read_exact(self, buf)
    }

    unsafe fn read_scattered(&mut self, segments: &[Segment]) -> Result<(), ChannelError> {
        // SAFETY: the caller upholds the same contract.
        unsafe { Channel::read_scattered(self, segments) }
    }

    fn begin_transfer(&mut self, limit: Option<Instant>) {
        Channel::begin_transfer(self, limit);
    }

    fn end_transfer(&mut self) {
        Channel::end_transfer(self);
    }

    fn unread_bytes(&self) -> Option<u64> {
        crate::switch_over_timeline::socket_unread(self.raw_fd())
    }
}

/// Where a destination sends its messages: the main channel, or a buffer
/// that collects them when the session runs from memory.
pub(crate) trait FrameSink {
    /// Sends one message.
    fn send_message(&mut self, message: &Message) -> Result<(), ChannelError>;
}

impl FrameSink for Channel {
    fn send_message(&mut self, message: &Message) -> Result<(), ChannelError> {
        Channel::send_message(self, message)
    }
}

/// A page channel as the live phase holds it: read by its receiver thread,
/// and interrupted from the main thread when the migration fails, so a
/// receiver blocked in a read returns at once.
pub(crate) trait PageStream: FrameSource + Send {
    /// What interrupts the stream from another thread.
    type Interrupt;

    /// A handle that interrupts this stream.
    fn interrupt_handle(&self) -> Result<Self::Interrupt, ChannelError>;

    /// Makes every pending and later read of the stream fail.
    fn interrupt(handle: &Self::Interrupt);
}

impl PageStream for Channel {
    type Interrupt = ShutdownHandle;

    fn interrupt_handle(&self) -> Result<ShutdownHandle, ChannelError> {
        self.shutdown_handle()
    }

    fn interrupt(handle: &ShutdownHandle) {
        handle.shutdown();
    }
}

/// Reads until `decoder` completes a structure: a control message, or a
/// page packet's header and table (placing its payload is the caller's
/// job). Each read is exactly the rest of the structure, so nothing of the
/// next frame, and no payload, is read here. It is one transfer with one
/// deadline; for a packet, the transfer goes on through its payload, and
/// the caller ends it ([`FrameSource::end_transfer`]) once the payload is
/// read.
pub(crate) fn read_event(
    source: &mut impl FrameSource,
    decoder: &mut FrameDecoder,
) -> Result<Event, ChannelError> {
    read_event_in_transfer(source, decoder, usize::MAX, None)
}

/// Reads one whole frame (a control message, or a packet's header and
/// table) as one transfer: header and body within one deadline, the I/O
/// timeout from its first byte or `limit` if sooner. A packet's payload
/// belongs to the same transfer: its reader ends the transfer after it.
fn read_event_in_transfer(
    source: &mut impl FrameSource,
    decoder: &mut FrameDecoder,
    max_frame: usize,
    limit: Option<Instant>,
) -> Result<Event, ChannelError> {
    source.begin_transfer(limit);
    let event = read_event_within(source, decoder, max_frame);
    if !matches!(event, Ok(Event::Pages(_))) {
        source.end_transfer();
    }
    event
}

/// As [`read_event`], refusing a frame longer than `max_frame` bytes
/// (header included) at its header, before its body is read or buffered.
fn read_event_within(
    source: &mut impl FrameSource,
    decoder: &mut FrameDecoder,
    max_frame: usize,
) -> Result<Event, ChannelError> {
    loop {
        if let Expect::Payload { .. } = decoder.expect() {
            // Only a receiver that skipped a packet's payload gets here.
            return Err(ChannelError::Protocol(WireError::Truncated("page payload")));
        }
        let buf = decoder.buffer();
        let len = buf.len();
        source.read_exact(buf)?;
        if let Some(event) = decoder.filled(len)? {
            return Ok(event);
        }
        // The header is read whole, so the frame's length is known from the
        // first call on. A seal adds its own bytes to any frame.
        let max = if decoder.is_sealed() {
            max_frame.saturating_add(tern_wire::SEAL_LEN)
        } else {
            max_frame
        };
        if decoder.frame_len() > max {
            return Err(ChannelError::Protocol(WireError::FieldTooLong {
                field: "frame",
                len: decoder.frame_len(),
                max,
            }));
        }
    }
}

/// Reads one control message whose frame, header included, is at most
/// `max_frame` bytes: a longer one is refused at its header.
pub(crate) fn read_message_within(
    source: &mut impl FrameSource,
    decoder: &mut FrameDecoder,
    max_frame: usize,
) -> Result<Message, ChannelError> {
    control_message(read_event_in_transfer(source, decoder, max_frame, None)?)
}

/// Reads one control message.
pub(crate) fn read_message(
    source: &mut impl FrameSource,
    decoder: &mut FrameDecoder,
) -> Result<Message, ChannelError> {
    control_message(read_event_in_transfer(source, decoder, usize::MAX, None)?)
}

/// Reads one control message, cut off at `limit` however its bytes
/// trickle in (a switch-over answer has its own deadline).
pub(crate) fn read_message_until(
    source: &mut impl FrameSource,
    decoder: &mut FrameDecoder,
    limit: Instant,
) -> Result<Message, ChannelError> {
    control_message(read_event_in_transfer(
        source,
        decoder,
        usize::MAX,
        Some(limit),
    )?)
}

fn control_message(event: Event) -> Result<Message, ChannelError> {
    match event {
        Event::Message(message) => Ok(message),
        Event::Pages(_) => Err(ChannelError::Protocol(WireError::Unexpected {
            got: FrameKind::Pages,
            expected: "a control message",
        })),
    }
}
