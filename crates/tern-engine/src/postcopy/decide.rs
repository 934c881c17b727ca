//! Whether precopy hands over to postcopy at a sync: one pure function of
//! the mode, what the source measured and what the convergence rules
//! decided (`source/convergence.rs`), taken after that decision. It never
//! overrides a switch-over that meets the downtime limit, nor a
//! cancellation.

use std::time::Duration;

use super::{PostcopyMode, PostcopyTrigger};
use crate::source::convergence::Decision;

/// What the postcopy rules look at, besides the convergence decision.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct PostcopyFacts {
    pub mode: PostcopyMode,
    /// Dirty iterations completed, counting the one just sent.
    pub iteration: u32,
    /// Time since the live phase started.
    pub live_elapsed: Duration,
    /// `migrate-start-postcopy` was called.
    pub requested: bool,
    /// `on-request`: start without a request after this long.
    pub after: Option<Duration>,
    /// `auto`: the highest throttle precopy may set.
    pub max_throttle: u8,
}

/// Postcopy instead of `decision`, and why; `None` keeps the decision.
pub(crate) fn switch_to_postcopy(
    facts: &PostcopyFacts,
    decision: &Decision,
) -> Option<PostcopyTrigger> {
    match decision {
        // Converged: precopy's switch-over is shorter and safer. A
        // cancellation is never turned into a migration.
        Decision::SwitchOver { forced: false } | Decision::Cancel => return None,
        Decision::SwitchOver { forced: true } | Decision::GiveUp(_) | Decision::Iterate { .. } => {}
    }
    match facts.mode {
        PostcopyMode::Off => None,
        PostcopyMode::OnRequest if facts.requested => Some(PostcopyTrigger::Requested),
        PostcopyMode::OnRequest => facts
            .after
            .is_some_and(|after| facts.live_elapsed >= after)
            .then_some(PostcopyTrigger::Timer),
        PostcopyMode::AfterFirstPass => {
            (facts.iteration >= 1).then_some(PostcopyTrigger::FirstPass)
        }
        PostcopyMode::Auto => match decision {
            Decision::SwitchOver { forced: true } | Decision::GiveUp(_) => {
                Some(PostcopyTrigger::Limit)
            }
            Decision::Iterate {
                throttle: Some(percent),
            } if *percent > facts.max_throttle => Some(PostcopyTrigger::Throttle),
            _ if facts.requested => Some(PostcopyTrigger::Requested),
            _ => None,
        },
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{PostcopyFacts, switch_to_postcopy};
    use crate::postcopy::{PostcopyMode, PostcopyTrigger};
    use crate::source::convergence::Decision;

    fn facts(mode: PostcopyMode) -> PostcopyFacts {
        PostcopyFacts {
            mode,
            iteration: 2,
            live_elapsed: Duration::from_secs(5),
            requested: false,
            after: None,
            max_throttle: 20,
        }
    }

    const ITERATE: Decision = Decision::Iterate { throttle: None };

    #[test]
    fn the_modes_in_a_table() {
        use PostcopyMode as M;
        use PostcopyTrigger as T;
        let requested = PostcopyFacts {
            requested: true,
            ..facts(M::OnRequest)
        };
        let timed = PostcopyFacts {
            after: Some(Duration::from_secs(4)),
            ..facts(M::OnRequest)
        };
        let not_yet = PostcopyFacts {
            after: Some(Duration::from_secs(6)),
            ..facts(M::OnRequest)
        };
        let throttle = |percent| Decision::Iterate {
            throttle: Some(percent),
        };
        let cases = [
            (facts(M::Off), throttle(99), None),
            (facts(M::Off), Decision::GiveUp("limit".into()), None),
            (facts(M::OnRequest), ITERATE, None),
            (requested, ITERATE, Some(T::Requested)),
            (timed, ITERATE, Some(T::Timer)),
            (not_yet, ITERATE, None),
            (facts(M::AfterFirstPass), ITERATE, Some(T::FirstPass)),
            (facts(M::Auto), ITERATE, None),
            (facts(M::Auto), throttle(20), None),
            (facts(M::Auto), throttle(30), Some(T::Throttle)),
            (
                facts(M::Auto),
                Decision::SwitchOver { forced: true },
                Some(T::Limit),
            ),
            (
                facts(M::Auto),
                Decision::GiveUp("limit".into()),
                Some(T::Limit),
            ),
        ];
        for (facts, decision, expected) in cases {
            assert_eq!(
                switch_to_postcopy(&facts, &decision),
                expected,
                "{facts:?} {decision:?}"
            );
        }
    }

    #[test]
    fn a_converged_switch_over_or_a_cancellation_is_never_overridden() {
        for mode in [
            PostcopyMode::OnRequest,
            PostcopyMode::Auto,
            PostcopyMode::AfterFirstPass,
        ] {
            let asked = PostcopyFacts {
                requested: true,
                ..facts(mode)
            };
            assert_eq!(
                switch_to_postcopy(&asked, &Decision::SwitchOver { forced: false }),
                None
            );
            assert_eq!(switch_to_postcopy(&asked, &Decision::Cancel), None);
        }
    }
}
