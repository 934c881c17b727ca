//! Events of a running migration, shaped as QMP's (`event`, `data`,
//! `timestamp`), and the hub that hands each to every subscriber.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::CONTRACT_VERSION;
use crate::stats::MigrationStatus;

/// Which end of the migration sent an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Side {
    /// The side whose guest leaves (`tern migrate`).
    Source,
    /// The side whose guest arrives (`tern receive`).
    Destination,
}

/// When an event happened: wall-clock time, as QMP gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[non_exhaustive]
pub struct Timestamp {
    /// Seconds since the Unix epoch.
    pub seconds: u64,
    /// Microseconds within that second.
    pub microseconds: u32,
}

impl Timestamp {
    /// The time now.
    pub fn now() -> Self {
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Self {
            seconds: since.as_secs(),
            microseconds: since.subsec_micros(),
        }
    }
}

/// One event: what happened (`event` and its `data`), on which side, when,
/// under which version of the contract.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct Event {
    /// The contract's version ([`CONTRACT_VERSION`]).
    pub version: u32,
    /// The side that sent it.
    pub side: Side,
    /// When it happened.
    pub timestamp: Timestamp,
    /// What happened.
    #[serde(flatten)]
    pub body: EventBody,
}

impl Event {
    /// An event of this contract version ([`CONTRACT_VERSION`]) that
    /// happens now.
    pub fn now(side: Side, body: EventBody) -> Self {
        Self {
            version: CONTRACT_VERSION,
            side,
            timestamp: Timestamp::now(),
            body,
        }
    }
}

/// What happened, with its figures: the `event` name and its `data`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(tag = "event", content = "data", rename_all = "SCREAMING_SNAKE_CASE")]
#[non_exhaustive]
pub enum EventBody {
    /// The migration's status changed (QMP's `MIGRATION`): `active` once
    /// the channels are set up, `device` when the switch-over starts, then
    /// `completed`, `failed`, `cancelled` or `outcome-unknown`, the last
    /// three with the cause.
    Migration(StatusChange),
    /// A dirty iteration ended (QMP's `MIGRATION_PASS`, with its figures).
    MigrationPass(Pass),
    /// Auto-converge changed the guest's throttle.
    MigrationThrottle(ThrottleChange),
    /// Parameters were changed through the handle (all values in force
    /// afterwards).
    MigrationParameters(super::MigrationParameters),
    /// The guest was resumed by a `cont` after a paused hand-over (QMP's
    /// `RESUME`).
    Resume(Empty),
}

/// No data.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[non_exhaustive]
pub struct Empty {}

/// A status change.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct StatusChange {
    /// The new status.
    pub status: MigrationStatus,
    /// Why it failed, for `failed`, `cancelled` and `outcome-unknown`.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error_desc: Option<String>,
}

/// The figures of one dirty iteration, measured at its dirty-log sync.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct Pass {
    /// Iterations completed, counting this one (QMP's `pass`).
    pub pass: u64,
    /// Pages the iteration sent.
    pub sent_pages: u64,
    /// Pages the sync found dirty: what the next iteration sends.
    pub dirty_pages: u64,
    /// Dirty pages per second since the previous sync.
    pub dirty_pages_rate: u64,
    /// Guest bytes per second the link carried.
    pub bandwidth: u64,
    /// Milliseconds a switch-over now would cost.
    pub expected_downtime: u64,
    /// The downtime limit in force, in milliseconds.
    pub downtime_limit: u64,
}

/// A throttle change.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct ThrottleChange {
    /// The guest's throttle now, in percent.
    pub cpu_throttle_percentage: u64,
}

/// Events as they come, from [`crate::control::MigrationHandle::subscribe`]
/// or [`crate::ReceiveHandle::subscribe`]. Iterating blocks until
/// the next event and ends after the final status change.
#[derive(Debug)]
pub struct Subscription {
    events: Receiver<Event>,
}

impl Subscription {
    /// The next event, waiting at most `timeout`; `None` when none came or
    /// the migration has ended and every event was taken.
    pub fn next_within(&self, timeout: Duration) -> Option<Event> {
        self.events.recv_timeout(timeout).ok()
    }

    /// The next event if one is waiting.
    pub fn try_next(&self) -> Option<Event> {
        self.events.try_recv().ok()
    }
}

impl Iterator for Subscription {
    type Item = Event;

    fn next(&mut self) -> Option<Event> {
        self.events.recv().ok()
    }
}

/// Hands events to subscribers. After the final status change it keeps
/// that event for late subscribers and closes every subscription.
#[derive(Debug)]
pub(crate) struct EventHub {
    side: Side,
    state: Mutex<HubState>,
}

#[derive(Debug, Default)]
struct HubState {
    subscribers: Vec<Sender<Event>>,
    /// The final status change, once sent.
    last: Option<Event>,
}

impl EventHub {
    pub(crate) fn new(side: Side) -> Self {
        Self {
            side,
            state: Mutex::new(HubState::default()),
        }
    }

    fn state(&self) -> MutexGuard<'_, HubState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn subscribe(&self) -> Subscription {
        let (sender, events) = channel();
        let mut state = self.state();
        match &state.last {
            // Ended: the final event, then the end.
            Some(last) => {
                let _ = sender.send(last.clone());
            }
            None => state.subscribers.push(sender),
        }
        Subscription { events }
    }

    /// Sends `body` to every subscriber; a final status change closes the
    /// subscriptions. Nothing is sent after the final status change.
    pub(crate) fn publish(&self, body: EventBody) {
        let final_status = matches!(
            &body,
            EventBody::Migration(change) if change.status.is_final()
        );
        let event = Event::now(self.side, body);
        let mut state = self.state();
        if state.last.is_some() {
            return;
        }
        state
            .subscribers
            .retain(|subscriber| subscriber.send(event.clone()).is_ok());
        if final_status {
            state.subscribers.clear();
            state.last = Some(event);
        }
    }

    pub(crate) fn status(&self, status: MigrationStatus, error_desc: Option<String>) {
        self.publish(EventBody::Migration(StatusChange { status, error_desc }));
    }
}

#[cfg(test)]
mod tests {
    use super::{EventBody, EventHub, Side, ThrottleChange};
    use crate::stats::MigrationStatus;
    use std::time::Duration;

    #[test]
    fn subscribers_get_events_in_order_and_end_after_the_final_one() {
        let hub = EventHub::new(Side::Source);
        let early = hub.subscribe();
        hub.status(MigrationStatus::Active, None);
        hub.publish(EventBody::MigrationThrottle(ThrottleChange {
            cpu_throttle_percentage: 20,
        }));
        hub.status(MigrationStatus::Failed, Some("broken".into()));
        hub.status(MigrationStatus::Active, None);
        let names: Vec<String> = early
            .map(|event| serde_json::to_value(&event).unwrap()["event"].to_string())
            .collect();
        assert_eq!(
            names,
            ["\"MIGRATION\"", "\"MIGRATION_THROTTLE\"", "\"MIGRATION\""]
        );
        let late = hub.subscribe();
        let last = late.next_within(Duration::from_secs(5)).expect("replayed");
        let json = serde_json::to_value(&last).unwrap();
        assert_eq!(json["data"]["status"], "failed");
        assert_eq!(json["data"]["error-desc"], "broken");
        assert_eq!(json["side"], "source");
        assert!(late.next_within(Duration::from_millis(1)).is_none());
    }
}
