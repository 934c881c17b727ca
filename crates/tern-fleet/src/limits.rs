//! A migration's time limits in KubeVirt's terms, as a pure decision: the
//! completion timeout per GiB (with its action, postcopy first when
//! allowed) and the progress timeout (no new low of remaining bytes).
//!
//! The clocks count only time the migration was given a share it can
//! progress with: time queued for a slot, or held by the division, is the
//! agent's choice and not the migration's fault.

use std::time::Duration;

use crate::protocol::{CompletionAction, MemberCommand, MigrationPolicy};

const GIB: f64 = (1u64 << 30) as f64;

/// What the limits read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitClock {
    /// Time running and not held.
    pub active: Duration,
    /// Of that time, the part since remaining bytes last reached a new low.
    pub since_new_low: Duration,
    /// Guest memory, bytes (0: unknown, no completion timeout).
    pub memory: u64,
}

/// The completion timeout for `memory` bytes under `policy`, if any.
pub fn completion_timeout(policy: &MigrationPolicy, memory: u64) -> Option<Duration> {
    let per_gib = policy.completion_timeout_per_gib();
    if per_gib == 0 || memory == 0 {
        return None;
    }
    Some(Duration::from_secs_f64(
        per_gib as f64 * memory as f64 / GIB,
    ))
}

/// The command a limit calls for now, with the reason, if one expired.
pub fn check(policy: &MigrationPolicy, clock: &LimitClock) -> Option<(MemberCommand, String)> {
    if let Some(timeout) = completion_timeout(policy, clock.memory)
        && clock.active > timeout
    {
        let reason = format!(
            "completionTimeoutPerGiB: not completed within {:.0} s ({} s per GiB)",
            timeout.as_secs_f64(),
            policy.completion_timeout_per_gib()
        );
        let command = if policy.allow_post_copy == Some(true) {
            MemberCommand::StartPostcopy
        } else {
            match policy.completion_action.unwrap_or_default() {
                CompletionAction::Cancel => MemberCommand::Cancel,
                CompletionAction::SwitchOver => MemberCommand::SwitchOver,
            }
        };
        return Some((command, reason));
    }
    let progress = policy.progress_timeout();
    if progress > 0 && clock.since_new_low > Duration::from_secs(progress) {
        return Some((
            MemberCommand::Cancel,
            format!("progressTimeout: no new low of remaining bytes for {progress} s"),
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{LimitClock, check, completion_timeout};
    use crate::protocol::{CompletionAction, MemberCommand, MigrationPolicy};

    fn clock(active: u64, since_new_low: u64) -> LimitClock {
        LimitClock {
            active: Duration::from_secs(active),
            since_new_low: Duration::from_secs(since_new_low),
            memory: 2 << 30,
        }
    }

    #[test]
    fn the_completion_timeout_scales_with_memory() {
        let policy = MigrationPolicy::default();
        assert_eq!(
            completion_timeout(&policy, 2 << 30),
            Some(Duration::from_secs(300))
        );
        assert_eq!(check(&policy, &clock(300, 0)), None);
        let (command, reason) = check(&policy, &clock(301, 0)).unwrap();
        assert_eq!(command, MemberCommand::Cancel);
        assert!(reason.contains("completionTimeoutPerGiB"), "{reason}");
    }

    #[test]
    fn the_completion_action_and_the_postcopy_hook() {
        let mut policy = MigrationPolicy {
            completion_action: Some(CompletionAction::SwitchOver),
            ..MigrationPolicy::default()
        };
        assert_eq!(
            check(&policy, &clock(301, 0)).unwrap().0,
            MemberCommand::SwitchOver
        );
        policy.allow_post_copy = Some(true);
        assert_eq!(
            check(&policy, &clock(301, 0)).unwrap().0,
            MemberCommand::StartPostcopy
        );
    }

    #[test]
    fn the_progress_timeout_and_zero_disables() {
        let mut policy = MigrationPolicy::default();
        assert_eq!(check(&policy, &clock(10, 150)), None);
        let (command, reason) = check(&policy, &clock(10, 151)).unwrap();
        assert_eq!(command, MemberCommand::Cancel);
        assert!(reason.contains("progressTimeout"), "{reason}");
        policy.progress_timeout = Some(0);
        policy.completion_timeout_per_gib = Some(0);
        assert_eq!(check(&policy, &clock(100_000, 100_000)), None);
    }
}
