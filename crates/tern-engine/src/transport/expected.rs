//! Which control frames a reader accepts next. Every reader of a
//! [`super::Channel`] says so: the channel's frame decoder refuses any other
//! kind at its header, before a byte of its body is read or buffered, as
//! the destination's decoder does for its own channels.

use tern_wire::FrameKind;

/// The control frames a reader accepts next, and how its error names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expected {
    /// The kinds accepted.
    pub kinds: &'static [FrameKind],
    /// The kinds in words, for [`tern_wire::WireError::Unexpected`].
    pub name: &'static str,
}

impl Expected {
    /// Any control frame (never page packets): for tools and tests that
    /// play a peer and look at whatever comes.
    pub const ANY_CONTROL: Self = Self {
        kinds: &[
            FrameKind::Hello,
            FrameKind::ChannelHello,
            FrameKind::Welcome,
            FrameKind::Sync,
            FrameKind::StateSection,
            FrameKind::Complete,
            FrameKind::Outcome,
            FrameKind::Abort,
            FrameKind::Ready,
            FrameKind::Commit,
            FrameKind::Heartbeat,
            FrameKind::Dictionary,
            FrameKind::VmmConfig,
            FrameKind::PostcopySwitch,
            FrameKind::PageRequest,
            FrameKind::UrgentPages,
            FrameKind::PostcopyComplete,
            FrameKind::MemoryHandover,
            FrameKind::PostcopyResume,
            FrameKind::PostcopyMissing,
            FrameKind::PassApplied,
            FrameKind::AuthHello,
            FrameKind::AuthChallenge,
            FrameKind::AuthProof,
        ],
        name: "a control message",
    };

    /// The destination's answer to a channel's hello.
    pub const WELCOME: Self = Self {
        kinds: &[FrameKind::Welcome, FrameKind::Abort],
        name: "a welcome",
    };

    /// The destination's answer to an auth hello.
    pub const AUTH_CHALLENGE: Self = Self {
        kinds: &[FrameKind::AuthChallenge, FrameKind::Abort],
        name: "an auth challenge",
    };

    /// What the destination sends on its own while the live phase runs:
    /// heartbeats, and the passes it has applied.
    pub const LIVE: Self = Self {
        kinds: &[
            FrameKind::Heartbeat,
            FrameKind::PassApplied,
            FrameKind::Abort,
        ],
        name: "a heartbeat or a pass applied",
    };

    /// The destination's answer to the switch-over (`Complete`, then
    /// `Commit`), with the heartbeats and passes applied it sent meanwhile
    /// (one sent before it read the completion may still be on its way).
    pub const SWITCH_OVER_ANSWER: Self = Self {
        kinds: &[
            FrameKind::Outcome,
            FrameKind::Ready,
            FrameKind::Heartbeat,
            FrameKind::PassApplied,
            FrameKind::Abort,
        ],
        name: "the destination's answer",
    };

    /// The destination's echo of a memory hand-over: it mapped the files.
    pub const HANDOVER_ECHO: Self = Self {
        kinds: &[FrameKind::MemoryHandover, FrameKind::Abort],
        name: "the destination's confirmation of the memory hand-over",
    };

    /// A paused postcopy's destination, after welcoming the source back:
    /// the pages it still lacks.
    pub const POSTCOPY_MISSING: Self = Self {
        kinds: &[FrameKind::PostcopyMissing, FrameKind::Abort],
        name: "the pages postcopy still lacks",
    };

    /// What the destination sends during postcopy: page requests, its
    /// completion, heartbeats, and a pass applied sent before it read the
    /// switch.
    pub const POSTCOPY: Self = Self {
        kinds: &[
            FrameKind::PageRequest,
            FrameKind::PostcopyComplete,
            FrameKind::Heartbeat,
            FrameKind::PassApplied,
            FrameKind::Abort,
        ],
        name: "a page request or the postcopy completion",
    };
}

#[cfg(test)]
mod tests {
    use tern_wire::{FrameHeader, FrameKind};

    use super::Expected;

    /// `ANY_CONTROL` is written out by hand: every kind the wire knows but
    /// page packets must be in it, so a kind added to tern-wire and
    /// forgotten here fails this test rather than a tool's read.
    #[test]
    fn any_control_lists_every_kind_but_page_packets() {
        let known: Vec<FrameKind> = (0..=u8::MAX)
            .filter_map(|byte| FrameHeader::decode(&[byte, 0, 0, 0, 0, 0, 0, 0]).ok())
            .map(|header| header.kind)
            .collect();
        assert!(known.contains(&FrameKind::Hello), "headers decode");
        for kind in known {
            assert_eq!(
                Expected::ANY_CONTROL.kinds.contains(&kind),
                kind != FrameKind::Pages,
                "{kind:?}"
            );
        }
    }
}
