//! Events of a running migration, shaped as QMP's (`event`, `data`,
//! `timestamp`), and the hub that numbers each, hands it to every
//! subscriber and keeps a bounded history for those who come late.

use std::collections::VecDeque;
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
    /// Its number on this side of this migration: 1, 2, 3, ... in the
    /// order the events happened, without gaps, so that a client that
    /// reads both the history ([`EVENT_HISTORY`]) and the live events
    /// drops what it already has, and a gap in what it holds shows events
    /// the history no longer kept. 0 for an event no hub numbered.
    #[serde(default)]
    pub seq: u64,
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
            seq: 0,
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
    /// A dirty iteration ended (QMP's `MIGRATION_PASS`, with its figures):
    /// on the source at its dirty-log sync, on the destination when every
    /// page channel crossed the iteration's barrier.
    MigrationPass(PassFigures),
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

/// A `MIGRATION_PASS` event's figures: the source's or the destination's
/// (the event's `side` says which; both have `pass`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(untagged)]
#[non_exhaustive]
pub enum PassFigures {
    /// What the source measured at the iteration's dirty-log sync.
    Source(Pass),
    /// What the destination received in the iteration.
    Destination(ReceivedPass),
}

impl PassFigures {
    /// Iterations completed, counting this one (QMP's `pass`).
    pub fn pass(&self) -> u64 {
        match self {
            Self::Source(pass) => pass.pass,
            Self::Destination(pass) => pass.pass,
        }
    }
}

/// The figures of one dirty iteration as the destination saw it, taken
/// when every page channel had reached the iteration's sync (no page of
/// the next iteration is counted).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct ReceivedPass {
    /// Iterations every page channel has finished, counting this one (the
    /// source's `pass` for the same iteration).
    pub pass: u64,
    /// Pages the iteration brought, with data and zero pages.
    pub received_pages: u64,
    /// Of them, zero pages.
    pub zero_pages: u64,
    /// Bytes read from all page channels during the iteration.
    pub received_bytes: u64,
    /// Bytes per second read from all page channels since the previous
    /// pass (or since the channels were set up, for the first).
    pub bandwidth: u64,
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

/// Most events a side keeps for clients that subscribe late
/// ([`crate::MigrationHandle::history`], the control socket's
/// `query-events`), besides its status changes: those (`MIGRATION`, at
/// most seven per migration) are always kept. When it is full the oldest
/// other event goes first.
pub const EVENT_HISTORY: usize = 256;

/// The events a side has kept, oldest first: every status change, and the
/// latest [`EVENT_HISTORY`] others.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub struct EventHistory {
    /// The events kept, in order (their `seq` rising).
    pub events: Vec<Event>,
    /// Events no longer kept: the gaps in `seq` add up to this.
    pub dropped: u64,
}

/// Numbers events, hands them to subscribers and keeps a bounded history.
/// After the final status change it closes every subscription; an event
/// after it (a `RESUME` after a paused hand-over) only enters the history.
#[derive(Debug)]
pub(crate) struct EventHub {
    side: Side,
    state: Mutex<HubState>,
}

#[derive(Debug, Default)]
struct HubState {
    subscribers: Vec<Sender<Event>>,
    /// The number the next event gets, less one.
    published: u64,
    history: VecDeque<Event>,
    /// Events evicted from the history.
    dropped: u64,
    /// Whether the final status change was sent.
    ended: bool,
}

impl HubState {
    fn keep(&mut self, event: Event) {
        self.history.push_back(event);
        let others = self
            .history
            .iter()
            .filter(|event| !matches!(event.body, EventBody::Migration(_)))
            .count();
        if others > EVENT_HISTORY
            && let Some(oldest) = self
                .history
                .iter()
                .position(|event| !matches!(event.body, EventBody::Migration(_)))
        {
            self.history.remove(oldest);
            self.dropped += 1;
        }
    }
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

    /// Events from now on; after the end, the final status change alone.
    pub(crate) fn subscribe(&self) -> Subscription {
        let (sender, events) = channel();
        let mut state = self.state();
        if state.ended {
            let last = state
                .history
                .iter()
                .rev()
                .find(|event| matches!(event.body, EventBody::Migration(_)));
            if let Some(last) = last {
                let _ = sender.send(last.clone());
            }
        } else {
            state.subscribers.push(sender);
        }
        Subscription { events }
    }

    /// The history, then the events from now on, with neither gap nor
    /// repeat between them (both taken under one lock).
    pub(crate) fn subscribe_with_history(&self) -> Subscription {
        let (sender, events) = channel();
        let mut state = self.state();
        for event in &state.history {
            let _ = sender.send(event.clone());
        }
        if !state.ended {
            state.subscribers.push(sender);
        }
        Subscription { events }
    }

    /// The events kept so far.
    pub(crate) fn history(&self) -> EventHistory {
        let state = self.state();
        EventHistory {
            events: state.history.iter().cloned().collect(),
            dropped: state.dropped,
        }
    }

    /// Numbers `body`, keeps it, and sends it to every subscriber; a final
    /// status change closes the subscriptions. After the end nothing is
    /// sent: a status change is dropped, anything else only kept. Returns
    /// the event, unless dropped.
    pub(crate) fn publish(&self, body: EventBody) -> Option<Event> {
        let status_change = matches!(&body, EventBody::Migration(_));
        let final_status = matches!(
            &body,
            EventBody::Migration(change) if change.status.is_final()
        );
        let mut state = self.state();
        if state.ended && status_change {
            return None;
        }
        state.published += 1;
        let event = Event {
            seq: state.published,
            ..Event::now(self.side, body)
        };
        state
            .subscribers
            .retain(|subscriber| subscriber.send(event.clone()).is_ok());
        state.keep(event.clone());
        if final_status {
            state.subscribers.clear();
            state.ended = true;
        }
        Some(event)
    }

    pub(crate) fn status(&self, status: MigrationStatus, error_desc: Option<String>) {
        self.publish(EventBody::Migration(StatusChange { status, error_desc }));
    }
}

#[cfg(test)]
mod tests {
    use super::{EVENT_HISTORY, EventBody, EventHub, Side, ThrottleChange};
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

    fn throttle(percent: u64) -> EventBody {
        EventBody::MigrationThrottle(ThrottleChange {
            cpu_throttle_percentage: percent,
        })
    }

    #[test]
    fn the_history_keeps_every_status_change_and_the_latest_others() {
        let hub = EventHub::new(Side::Destination);
        hub.status(MigrationStatus::Setup, None);
        hub.status(MigrationStatus::Active, None);
        let extra = 10;
        for percent in 0..(EVENT_HISTORY as u64 + extra) {
            hub.publish(throttle(percent));
        }
        hub.status(MigrationStatus::Completed, None);
        let history = hub.history();
        assert_eq!(history.dropped, extra);
        assert_eq!(history.events.len(), EVENT_HISTORY + 3);
        let seqs: Vec<u64> = history.events.iter().map(|event| event.seq).collect();
        // setup (1) and active (2) kept, the first `extra` throttles gone.
        assert_eq!(seqs[..3], [1, 2, 3 + extra]);
        assert!(seqs[2..].windows(2).all(|pair| pair[1] == pair[0] + 1));
        // After the end, an event that is not a status change is kept and
        // numbered; a status change is dropped.
        let resumed = hub.publish(EventBody::Resume(super::Empty::default()));
        assert_eq!(
            resumed.map(|event| event.seq),
            Some(seqs[seqs.len() - 1] + 1)
        );
        assert!(hub.publish(throttle(1)).is_some());
        hub.status(MigrationStatus::Failed, None);
        // Still bounded: two more others pushed the two oldest out.
        let late: Vec<_> = hub.subscribe_with_history().collect();
        assert_eq!(late.len(), EVENT_HISTORY + 3);
        assert_eq!(hub.history().dropped, extra + 2);
        assert_eq!(
            serde_json::to_value(&late[late.len() - 3]).unwrap()["data"]["status"],
            "completed"
        );
    }

    #[test]
    fn a_late_subscriber_gets_the_history_then_the_live_events_without_a_gap() {
        let hub = EventHub::new(Side::Source);
        hub.status(MigrationStatus::Setup, None);
        hub.publish(throttle(20));
        let late = hub.subscribe_with_history();
        hub.publish(throttle(30));
        hub.status(MigrationStatus::Completed, None);
        let seqs: Vec<u64> = late.map(|event| event.seq).collect();
        assert_eq!(seqs, [1, 2, 3, 4]);
    }
}
