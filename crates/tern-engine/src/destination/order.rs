//! The order in which the source may send messages, as two explicit state
//! machines: one for the main channel, one for each page channel. The
//! receivers ask them about every message before acting on it, so a message
//! out of order is refused instead of assumed away.
//!
//! What no machine can decide: whether a state section arrived "too early"
//! with respect to the page channels. The channels are independent streams,
//! and a correct source's sections, sent after its last syncs, may be read
//! while the page channels still have earlier iterations buffered. So the
//! main channel's sections and completion are only acted on once every
//! page channel has passed its last sync, and the completion's final
//! iteration is checked against each page channel from the moment it is
//! known (see [`PageChannelState::next`]).

use tern_wire::FrameKind;

/// Where the main channel is once the handshake (which takes only a hello
/// or an abort, see `handshake.rs`) has answered the source's hello: the
/// destination's session, read by [`MainChannelState::next`] for every
/// message, and moved to `Ready` by the switch-over (`switch_over.rs`)
/// once memory is verified and the state restored.
///
/// ```mermaid
/// stateDiagram-v2
///     [*] --> Live: Hello answered with Welcome
///     Live --> Live: Dictionary, PostcopySwitch
///     Live --> Sections: StateSection
///     Sections --> Sections: StateSection
///     Live --> Completed: Complete
///     Sections --> Completed: Complete
///     Completed --> Ready: verified, state restored (we send Ready)
///     Ready --> Committed: Commit (we resume, send Outcome)
///     Live --> Aborted: Abort
///     Sections --> Aborted: Abort
///     Completed --> Aborted: Abort
///     Ready --> Aborted: Abort
///     Committed --> [*]
///     Aborted --> [*]
/// ```
///
/// Any other message in any state is refused (the session fails with a
/// protocol error, sent to the source in an abort).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum MainChannelState {
    /// Hello answered; pages flow on the page channels, the main channel
    /// carries nothing but refreshed dictionaries until the switch-over.
    Live,
    /// State sections arriving.
    Sections,
    /// The source said everything was sent; it waits for the verdict.
    Completed,
    /// The destination said it is ready; it waits for the source's commit.
    Ready,
    /// The source committed: the guest is the destination's to resume.
    Committed,
    /// The source gave up; nothing more is read.
    Aborted,
}

impl MainChannelState {
    /// The state after a message of `kind`, or why it is refused.
    pub(super) fn next(self, kind: FrameKind) -> Result<Self, String> {
        use FrameKind as K;
        use MainChannelState as S;
        match (self, kind) {
            (S::Aborted, _) => Err(format!("{kind:?} on the main channel after an abort")),
            (_, K::Abort) => Ok(S::Aborted),
            // A refreshed dictionary: only while pages flow.
            (S::Live, K::Dictionary) => Ok(S::Live),
            // A postcopy switch: its stale list, before the state.
            (S::Live, K::PostcopySwitch) => Ok(S::Live),
            (S::Live | S::Sections, K::StateSection) => Ok(S::Sections),
            (S::Live | S::Sections, K::Complete) => Ok(S::Completed),
            (S::Live | S::Sections, _) => Err(format!("unexpected {kind:?} on the main channel")),
            (S::Completed, _) => Err(format!(
                "{kind:?} on the main channel after the source's completion"
            )),
            (S::Ready, K::Commit) => Ok(S::Committed),
            (S::Ready, _) => Err(format!("{kind:?} on the main channel instead of a commit")),
            (S::Committed, _) => Err(format!("{kind:?} on the main channel after the commit")),
        }
    }
}

/// Where one page channel is.
///
/// ```mermaid
/// stateDiagram-v2
///     [*] --> Iteration0
///     Iteration0 --> Iteration0: Pages of iteration 0
///     Iteration0 --> IterationN: Sync(0), not last
///     IterationN --> IterationN: Pages of iteration n
///     IterationN --> IterationN: Sync(n), not last (n + 1)
///     Iteration0 --> Ended: Sync(0, last)
///     IterationN --> Ended: Sync(n, last)
///     Ended --> [*]: nothing more may come
/// ```
///
/// An iteration after the source's final one (from its `Complete`), a
/// sync of it that is not the last, or pages of another iteration are
/// refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PageChannelState {
    /// Receiving this iteration: its pages, then its sync.
    Iteration(u32),
    /// The last sync arrived, ending this iteration; nothing may follow.
    Ended(u32),
}

/// What a page channel delivers (its decoder refuses other kinds, and an
/// abort ends the channel before it gets here).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PageChannelEvent {
    /// A packet of pages of this iteration.
    Pages { iteration: u32 },
    /// The end of this iteration.
    Sync { iteration: u32, last: bool },
}

impl PageChannelState {
    /// The state after `event`, or why it is refused. `final_iteration` is
    /// the final iteration as the source's completion names it, once the
    /// main channel has it: nothing of a later iteration may follow, and
    /// the sync of that iteration must be the last.
    pub(super) fn next(
        self,
        event: PageChannelEvent,
        final_iteration: Option<u32>,
    ) -> Result<Self, String> {
        let current = match self {
            Self::Ended(last) => {
                return Err(format!("{event:?} after the last sync (iteration {last})"));
            }
            Self::Iteration(current) => current,
        };
        match event {
            PageChannelEvent::Pages { iteration } if iteration != current => Err(format!(
                "packet of iteration {iteration} during iteration {current}"
            )),
            PageChannelEvent::Sync { iteration, .. } if iteration != current => Err(format!(
                "sync for iteration {iteration} during iteration {current}"
            )),
            _ if final_iteration.is_some_and(|last| current > last) => Err(format!(
                "iteration {current} after the source named {} as the final one",
                final_iteration.unwrap_or_default()
            )),
            PageChannelEvent::Pages { .. } => Ok(self),
            PageChannelEvent::Sync { last: true, .. }
                if final_iteration.is_some_and(|last| last != current) =>
            {
                Err(format!(
                    "last sync at iteration {current}, the source named {} as the final one",
                    final_iteration.unwrap_or_default()
                ))
            }
            PageChannelEvent::Sync { last: true, .. } => Ok(Self::Ended(current)),
            PageChannelEvent::Sync { last: false, .. } if final_iteration == Some(current) => {
                Err(format!(
                    "sync of iteration {current} is not the last, the source named it the final one"
                ))
            }
            PageChannelEvent::Sync { last: false, .. } => current
                .checked_add(1)
                .map(Self::Iteration)
                .ok_or_else(|| format!("iteration {current} cannot be followed by another")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_KINDS: [FrameKind; 25] = [
        FrameKind::Hello,
        FrameKind::ChannelHello,
        FrameKind::Welcome,
        FrameKind::Pages,
        FrameKind::Sync,
        FrameKind::StateSection,
        FrameKind::Complete,
        FrameKind::Outcome,
        FrameKind::Abort,
        FrameKind::Ready,
        FrameKind::Commit,
        FrameKind::Heartbeat,
        FrameKind::Dictionary,
        FrameKind::MemoryHandover,
        FrameKind::VmmConfig,
        FrameKind::PostcopySwitch,
        FrameKind::PageRequest,
        FrameKind::UrgentPages,
        FrameKind::PostcopyComplete,
        FrameKind::PostcopyResume,
        FrameKind::PostcopyMissing,
        FrameKind::PassApplied,
        FrameKind::AuthHello,
        FrameKind::AuthChallenge,
        FrameKind::AuthProof,
    ];

    #[test]
    fn main_channel_transitions() {
        use FrameKind as K;
        use MainChannelState as S;
        // Every (state, kind) pair not listed is refused.
        let allowed: &[(S, K, S)] = &[
            (S::Live, K::Dictionary, S::Live),
            (S::Live, K::PostcopySwitch, S::Live),
            (S::Live, K::StateSection, S::Sections),
            (S::Live, K::Complete, S::Completed),
            (S::Live, K::Abort, S::Aborted),
            (S::Sections, K::StateSection, S::Sections),
            (S::Sections, K::Complete, S::Completed),
            (S::Sections, K::Abort, S::Aborted),
            (S::Completed, K::Abort, S::Aborted),
            (S::Ready, K::Commit, S::Committed),
            (S::Ready, K::Abort, S::Aborted),
            (S::Committed, K::Abort, S::Aborted),
        ];
        let states = [
            S::Live,
            S::Sections,
            S::Completed,
            S::Ready,
            S::Committed,
            S::Aborted,
        ];
        for state in states {
            for kind in ALL_KINDS {
                let expected = allowed
                    .iter()
                    .find(|(from, on, _)| *from == state && *on == kind)
                    .map(|&(_, _, to)| to);
                match (state.next(kind), expected) {
                    (Ok(got), Some(to)) => assert_eq!(got, to, "{state:?} + {kind:?}"),
                    (Err(_), None) => {}
                    (got, expected) => {
                        panic!("{state:?} + {kind:?}: got {got:?}, expected {expected:?}")
                    }
                }
            }
        }
    }

    #[test]
    fn refusals_on_the_main_channel_say_what_came_when() {
        let refused = MainChannelState::Completed
            .next(FrameKind::StateSection)
            .unwrap_err();
        assert_eq!(
            refused,
            "StateSection on the main channel after the source's completion"
        );
        let refused = MainChannelState::Live.next(FrameKind::Pages).unwrap_err();
        assert_eq!(refused, "unexpected Pages on the main channel");
        // Only the destination tells passes applied (protocol 12).
        let refused = MainChannelState::Live
            .next(FrameKind::PassApplied)
            .unwrap_err();
        assert_eq!(refused, "unexpected PassApplied on the main channel");
    }

    #[test]
    fn page_channel_transitions() {
        use PageChannelEvent::{Pages, Sync};
        use PageChannelState::{Ended, Iteration};
        type Case = (
            PageChannelState,
            PageChannelEvent,
            Option<u32>,
            Result<PageChannelState, &'static str>,
        );
        let cases: &[Case] = &[
            // Pages and syncs of the current iteration, the final one not
            // known yet.
            (Iteration(0), Pages { iteration: 0 }, None, Ok(Iteration(0))),
            (
                Iteration(0),
                Sync {
                    iteration: 0,
                    last: false,
                },
                None,
                Ok(Iteration(1)),
            ),
            (
                Iteration(3),
                Sync {
                    iteration: 3,
                    last: true,
                },
                None,
                Ok(Ended(3)),
            ),
            // Another iteration's packet or sync.
            (
                Iteration(0),
                Pages { iteration: 4 },
                None,
                Err("packet of iteration 4 during iteration 0"),
            ),
            (
                Iteration(2),
                Pages { iteration: 1 },
                None,
                Err("packet of iteration 1 during iteration 2"),
            ),
            (
                Iteration(0),
                Sync {
                    iteration: 1,
                    last: false,
                },
                None,
                Err("sync for iteration 1 during iteration 0"),
            ),
            // Nothing after the last sync.
            (
                Ended(3),
                Pages { iteration: 3 },
                None,
                Err("after the last sync"),
            ),
            (
                Ended(3),
                Sync {
                    iteration: 4,
                    last: true,
                },
                None,
                Err("after the last sync"),
            ),
            // The completion names iteration 2 as the final one.
            (
                Iteration(2),
                Pages { iteration: 2 },
                Some(2),
                Ok(Iteration(2)),
            ),
            (
                Iteration(2),
                Sync {
                    iteration: 2,
                    last: true,
                },
                Some(2),
                Ok(Ended(2)),
            ),
            (
                Iteration(1),
                Sync {
                    iteration: 1,
                    last: false,
                },
                Some(2),
                Ok(Iteration(2)),
            ),
            (
                Iteration(2),
                Sync {
                    iteration: 2,
                    last: false,
                },
                Some(2),
                Err("not the last"),
            ),
            (
                Iteration(1),
                Sync {
                    iteration: 1,
                    last: true,
                },
                Some(2),
                Err("last sync at iteration 1"),
            ),
            (
                Iteration(3),
                Pages { iteration: 3 },
                Some(2),
                Err("iteration 3 after the source named 2"),
            ),
            (
                Iteration(3),
                Sync {
                    iteration: 3,
                    last: true,
                },
                Some(2),
                Err("iteration 3 after the source named 2"),
            ),
            // The iteration counter cannot wrap.
            (
                Iteration(u32::MAX),
                Sync {
                    iteration: u32::MAX,
                    last: false,
                },
                None,
                Err("cannot be followed"),
            ),
        ];
        for &(state, event, final_iteration, expected) in cases {
            let got = state.next(event, final_iteration);
            match (&got, expected) {
                (Ok(got), Ok(expected)) => {
                    assert_eq!(
                        *got, expected,
                        "{state:?} + {event:?} ({final_iteration:?})"
                    )
                }
                (Err(text), Err(needle)) => assert!(
                    text.contains(needle),
                    "{state:?} + {event:?} ({final_iteration:?}): '{text}' lacks '{needle}'"
                ),
                _ => panic!(
                    "{state:?} + {event:?} ({final_iteration:?}): got {got:?}, expected {expected:?}"
                ),
            }
        }
    }
}
