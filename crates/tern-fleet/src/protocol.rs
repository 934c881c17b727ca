//! The agent's socket protocol, version [`FLEET_PROTOCOL_VERSION`]: the
//! control socket's QMP shape (docs/control.md), one JSON object per line
//! each way, with the commands and events of docs/fleet.md.
//!
//! Types only, no I/O: the agent ([`crate::agent`]) and the member
//! ([`crate::member`]) both read and write these.

use serde::{Deserialize, Serialize};
use tern_engine::{MigrationParameters, MigrationStatus};

/// The protocol's version: in the greeting, every event and every listing.
/// Within a version fields may be added; one that changes meaning or goes
/// away raises it.
pub const FLEET_PROTOCOL_VERSION: u32 = 1;

/// Longest request line the agent accepts; a longer one closes the
/// connection.
pub const MAX_LINE_BYTES: u64 = 64 << 10;

/// Which way a migration moves a guest, as seen from this host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Direction {
    /// A source (`tern migrate`, `tern vm migrate`): the guest leaves.
    Outbound,
    /// A destination (`tern receive`, `tern vm receive`): the guest arrives.
    Inbound,
}

impl Direction {
    /// The name used in listings and metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Outbound => "outbound",
            Self::Inbound => "inbound",
        }
    }
}

/// What to do when the completion timeout expires (KubeVirt aborts; Nova's
/// `live_migration_timeout_action` chooses `abort` or `force_complete`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CompletionAction {
    /// Cancel the migration; the source guest runs on (Nova's `abort`).
    #[default]
    Cancel,
    /// Switch over now whatever the expected downtime: the guest pauses
    /// until the rest is sent (Nova's `force_complete` without postcopy,
    /// QEMU's pause-and-complete).
    SwitchOver,
}

/// A migration's policy in KubeVirt's `MigrationPolicy` names; every
/// field optional, the defaults KubeVirt's.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigrationPolicy {
    /// Seconds allowed per GiB of guest memory, counted while the
    /// migration holds a slot and is not held by the agent (KubeVirt's
    /// `completionTimeoutPerGiB`, default 150; Nova's
    /// `live_migration_completion_timeout`, default 800). 0 disables it.
    #[serde(
        rename = "completionTimeoutPerGiB",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub completion_timeout_per_gib: Option<u64>,
    /// What the completion timeout does (Nova's
    /// `live_migration_timeout_action`); with `allowPostCopy`, postcopy
    /// comes first.
    #[serde(
        rename = "completionAction",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub completion_action: Option<CompletionAction>,
    /// Seconds without a new low of remaining bytes before the migration is
    /// cancelled (KubeVirt's `progressTimeout`, default 150). 0 disables it.
    #[serde(
        rename = "progressTimeout",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub progress_timeout: Option<u64>,
    /// Whether the agent lets the migration throttle its guest
    /// (KubeVirt's `allowAutoConverge`, Nova's
    /// `live_migration_permit_auto_converge`); unset leaves the
    /// migration's own setting.
    #[serde(
        rename = "allowAutoConverge",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub allow_auto_converge: Option<bool>,
    /// Whether the completion timeout may switch to postcopy (KubeVirt's
    /// `allowPostCopy`, Nova's `live_migration_permit_post_copy`).
    #[serde(
        rename = "allowPostCopy",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub allow_post_copy: Option<bool>,
    /// Cap on this migration's share, bytes per second (KubeVirt's
    /// `bandwidthPerMigration`, Nova's `live_migration_bandwidth`).
    #[serde(
        rename = "bandwidthPerMigration",
        skip_serializing_if = "Option::is_none",
        default
    )]
    pub bandwidth_per_migration: Option<u64>,
    /// Higher goes first, in the queue and in the division (0 by default;
    /// KubeVirt's migration priority queue).
    #[serde(rename = "priority", skip_serializing_if = "Option::is_none", default)]
    pub priority: Option<i32>,
}

/// KubeVirt's default `completionTimeoutPerGiB`.
pub const DEFAULT_COMPLETION_TIMEOUT_PER_GIB: u64 = 150;
/// KubeVirt's default `progressTimeout`.
pub const DEFAULT_PROGRESS_TIMEOUT: u64 = 150;

impl MigrationPolicy {
    /// The completion timeout per GiB in force (0: none).
    pub fn completion_timeout_per_gib(&self) -> u64 {
        self.completion_timeout_per_gib
            .unwrap_or(DEFAULT_COMPLETION_TIMEOUT_PER_GIB)
    }

    /// The progress timeout in force, seconds (0: none).
    pub fn progress_timeout(&self) -> u64 {
        self.progress_timeout.unwrap_or(DEFAULT_PROGRESS_TIMEOUT)
    }

    /// The priority in force.
    pub fn priority(&self) -> i32 {
        self.priority.unwrap_or(0)
    }

    /// Fields `patch` gives replace these.
    pub fn merge(&mut self, patch: &MigrationPolicy) {
        let MigrationPolicy {
            completion_timeout_per_gib,
            completion_action,
            progress_timeout,
            allow_auto_converge,
            allow_post_copy,
            bandwidth_per_migration,
            priority,
        } = patch.clone();
        self.completion_timeout_per_gib =
            completion_timeout_per_gib.or(self.completion_timeout_per_gib);
        self.completion_action = completion_action.or(self.completion_action);
        self.progress_timeout = progress_timeout.or(self.progress_timeout);
        self.allow_auto_converge = allow_auto_converge.or(self.allow_auto_converge);
        self.allow_post_copy = allow_post_copy.or(self.allow_post_copy);
        self.bandwidth_per_migration = bandwidth_per_migration.or(self.bandwidth_per_migration);
        self.priority = priority.or(self.priority);
    }
}

/// `fleet-join`'s arguments: a migration asks for a slot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct JoinRequest {
    /// A name for listings (a VM's name); need not be unique.
    pub name: String,
    /// Source or destination.
    pub direction: Direction,
    /// Guest memory in bytes, when known (0 otherwise): the completion
    /// timeout scales with it.
    #[serde(default)]
    pub memory: u64,
    /// The migration's policy.
    #[serde(default)]
    pub policy: MigrationPolicy,
    /// Rejoining after the agent restarted: the id the agent gave before,
    /// kept when free.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub resume: Option<String>,
    /// Already running (a rejoin after a restart): admitted at once, over
    /// the slots if need be, since a running migration is never stopped to
    /// honour a slot.
    #[serde(default)]
    pub running: bool,
}

/// Where a migration stands with the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FleetState {
    /// Waiting for a slot (`position` says where in the line).
    Queued,
    /// Holds a slot and a share of the budget.
    Running,
    /// Holds a slot, kept at the keep-alive share until the migrations
    /// ahead of it converge (the division's choice, docs/fleet.md).
    Held,
}

/// `fleet-join`'s answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct JoinReply {
    /// The agent's id for the migration, for every later command.
    pub migration: String,
    /// Queued or running.
    pub state: FleetState,
    /// Place in the queue, 1 first; absent when running.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub position: Option<u32>,
}

/// `fleet-report`'s arguments: a member's figures, from its own
/// `query-migrate` (QEMU's names where they exist).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Progress {
    /// The migration's own status.
    pub status: Option<MigrationStatus>,
    /// Bytes sent (source) or received (destination) so far.
    #[serde(default)]
    pub transferred: u64,
    /// Dirty bytes still to send (source; 0 when unknown).
    #[serde(default)]
    pub remaining: u64,
    /// Guest memory.
    #[serde(default)]
    pub total: u64,
    /// Bytes per second the guest dirties, at the last sync.
    #[serde(default)]
    pub dirty_rate: u64,
    /// Bytes per second over the latest window.
    #[serde(default)]
    pub transfer_rate: u64,
    /// Dirty iterations so far.
    #[serde(default)]
    pub iterations: u64,
    /// The guest's auto-converge throttle, percent.
    #[serde(default)]
    pub cpu_throttle_percentage: u64,
    /// Downtime, milliseconds, once switched over.
    #[serde(default)]
    pub downtime: u64,
}

/// A command the agent passes to a member, to run on its migration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "command", content = "arguments")]
pub enum MemberCommand {
    /// `migrate_cancel`.
    Cancel,
    /// `migrate-switch-over`.
    SwitchOver,
    /// `migrate-start-postcopy`: the completion timeout's postcopy hook.
    /// A member whose migration cannot start postcopy cancels instead.
    StartPostcopy,
    /// `migrate-set-parameters` (everything but `max-bandwidth`, which is
    /// the agent's share).
    SetParameters(MigrationParameters),
}

/// What the agent pushes to a member, between replies.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE", tag = "event", content = "data")]
pub enum Directive {
    /// Still queued, now at `position`.
    FleetQueued {
        /// Place in the line, 1 first.
        position: u32,
    },
    /// A slot was granted: start.
    FleetSlot {
        /// The migration's id.
        migration: String,
    },
    /// The share changed: set `max-bandwidth`, and `auto-converge` when
    /// given.
    FleetShare {
        /// Bytes per second.
        #[serde(rename = "max-bandwidth")]
        max_bandwidth: u64,
        /// Auto-converge on or off; absent leaves it.
        #[serde(
            rename = "auto-converge",
            skip_serializing_if = "Option::is_none",
            default
        )]
        auto_converge: Option<bool>,
        /// Held at the keep-alive share.
        held: bool,
    },
    /// Run a command.
    FleetCommand {
        /// The command.
        #[serde(flatten)]
        command: MemberCommand,
        /// Why (an operator's command, a timeout), for the member's log.
        reason: String,
    },
}

/// A directive as one line: the protocol version, the event and its data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PushedEvent {
    /// [`FLEET_PROTOCOL_VERSION`].
    pub version: u32,
    /// The event.
    #[serde(flatten)]
    pub directive: Directive,
}

/// `fleet-set`'s arguments: the host's settings, each optional.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct FleetSettings {
    /// The host's bandwidth budget, bytes per second (0: none, every
    /// migration uncapped).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub bandwidth: Option<u64>,
    /// Migrations leaving at once (KubeVirt's
    /// `parallelOutboundMigrationsPerNode`, Nova's
    /// `max_concurrent_live_migrations`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub outbound_slots: Option<u32>,
    /// Migrations arriving at once (KubeVirt's inbound limit).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub inbound_slots: Option<u32>,
    /// How the budget is divided.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub division: Option<crate::division::Division>,
}

/// One migration in `query-fleet`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct MigrationView {
    /// The agent's id.
    pub migration: String,
    /// The name it joined with.
    pub name: String,
    /// Source or destination.
    pub direction: Direction,
    /// The member's process id (SO_PEERCRED).
    pub pid: u32,
    /// Queued, running or held.
    pub state: FleetState,
    /// Place in the queue, when queued.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub position: Option<u32>,
    /// The share in force, bytes per second (0: uncapped or queued).
    pub share: u64,
    /// The policy.
    pub policy: MigrationPolicy,
    /// The member's latest figures.
    pub progress: Progress,
    /// Bytes per second the agent saw the member's process write (sources
    /// only; `None` where it cannot measure).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub measured_rate: Option<u64>,
    /// False once the member claimed more than the agent measured.
    pub progress_verified: bool,
    /// Seconds waited in the queue.
    pub queued_seconds: f64,
    /// Seconds since the slot was granted.
    pub running_seconds: f64,
    /// The last command the agent sent it, and why.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub last_action: Option<String>,
}

/// Counters over the agent's life, for the metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct FleetCounters {
    /// Migrations that left with status `completed`.
    pub succeeded: u64,
    /// Migrations that left failed or cancelled, or whose member vanished.
    pub failed: u64,
}

/// `query-fleet`'s answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct FleetView {
    /// [`FLEET_PROTOCOL_VERSION`].
    pub version: u32,
    /// Bytes per second shared (0: no budget).
    pub bandwidth: u64,
    /// Outbound slots.
    pub outbound_slots: u32,
    /// Inbound slots.
    pub inbound_slots: u32,
    /// How the budget is divided.
    pub division: crate::division::Division,
    /// Every migration, running first, then the queue in order.
    pub migrations: Vec<MigrationView>,
    /// Counters since the agent started.
    pub counters: FleetCounters,
}

/// Every command the agent knows, for `query-commands`.
pub const COMMANDS: &[&str] = &[
    "qmp_capabilities",
    "query-version",
    "query-commands",
    "fleet-join",
    "fleet-report",
    "fleet-leave",
    "query-fleet",
    "fleet-set",
    "migrate-set-policy",
    "query-migrate",
    "migrate-set-parameters",
    "migrate_cancel",
    "migrate-switch-over",
];

#[cfg(test)]
mod tests {
    use super::{Directive, MemberCommand, MigrationPolicy, PushedEvent};

    #[test]
    fn a_policy_speaks_kubevirts_names() {
        let policy: MigrationPolicy = serde_json::from_str(
            r#"{"completionTimeoutPerGiB": 800, "allowPostCopy": true, "priority": 2}"#,
        )
        .unwrap();
        assert_eq!(policy.completion_timeout_per_gib(), 800);
        assert_eq!(policy.allow_post_copy, Some(true));
        assert_eq!(policy.progress_timeout(), 150);
        let error = serde_json::from_str::<MigrationPolicy>(r#"{"completionTimeout": 1}"#)
            .unwrap_err()
            .to_string();
        assert!(error.contains("completionTimeout"), "{error}");
    }

    #[test]
    fn events_are_one_flat_object() {
        let event = PushedEvent {
            version: 1,
            directive: Directive::FleetCommand {
                command: MemberCommand::Cancel,
                reason: "operator".into(),
            },
        };
        let line = serde_json::to_string(&event).unwrap();
        assert_eq!(
            line,
            r#"{"version":1,"event":"FLEET_COMMAND","data":{"command":"cancel","reason":"operator"}}"#
        );
        assert_eq!(serde_json::from_str::<PushedEvent>(&line).unwrap(), event);
        let share = PushedEvent {
            version: 1,
            directive: Directive::FleetShare {
                max_bandwidth: 5,
                auto_converge: Some(false),
                held: true,
            },
        };
        let line = serde_json::to_string(&share).unwrap();
        assert!(line.contains(r#""max-bandwidth":5"#), "{line}");
        assert_eq!(serde_json::from_str::<PushedEvent>(&line).unwrap(), share);
    }
}
