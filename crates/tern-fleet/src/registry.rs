//! The agent's state, without I/O: who holds a slot, who waits and where,
//! each running migration's share and clocks. Time comes in as `now`
//! (since the agent started), so every rule is tested with a table.
//!
//! ```text
//!   join ──▶ Queued ──(slot free, first in line)──▶ Running ⇄ Held
//!              │                                       │
//!              └────────── leave / vanished ───────────┘──▶ gone (slot and share released)
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use tern_engine::MigrationStatus;

use crate::division::{self, Division, Load, Share};
use crate::error::FleetError;
use crate::limits::{self, LimitClock};
use crate::protocol::{
    Direction, Directive, FLEET_PROTOCOL_VERSION, FleetCounters, FleetSettings, FleetState,
    FleetView, JoinReply, JoinRequest, MemberCommand, MigrationPolicy, MigrationView, Progress,
};

/// The default [`Settings::silence_limit`]: a member reports four times a
/// second.
pub const SILENCE_LIMIT: Duration = Duration::from_secs(5);
/// A share is steady when not raised for this long (see [`Load`]).
const STEADY_AFTER: Duration = Duration::from_secs(2);
/// The window over which the agent measures a process's write rate.
const MEASURE_WINDOW: Duration = Duration::from_secs(1);

/// The host's settings in force.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Bytes per second shared by outbound migrations (0: no budget).
    pub bandwidth: u64,
    /// Outbound slots (at least 1).
    pub outbound_slots: u32,
    /// Inbound slots (at least 1).
    pub inbound_slots: u32,
    /// How the budget is divided.
    pub division: Division,
    /// A member silent for this long (its connection open) is taken for
    /// gone: its slot and share are released. A member whose connection
    /// closes is released at once, whatever this is.
    pub silence_limit: Duration,
}

impl Default for Settings {
    /// KubeVirt's `parallelOutboundMigrationsPerNode` (2) both ways, no
    /// budget.
    fn default() -> Self {
        Self {
            bandwidth: 0,
            outbound_slots: 2,
            inbound_slots: 2,
            division: Division::ConvergeFirst,
            silence_limit: SILENCE_LIMIT,
        }
    }
}

impl Settings {
    /// Applies `patch`, all or nothing.
    pub fn apply(&mut self, patch: &FleetSettings) -> Result<(), FleetError> {
        for (name, slots) in [
            ("outbound-slots", patch.outbound_slots),
            ("inbound-slots", patch.inbound_slots),
        ] {
            if slots == Some(0) {
                return Err(FleetError::InvalidSetting {
                    name,
                    reason: "must be at least 1".into(),
                });
            }
        }
        self.bandwidth = patch.bandwidth.unwrap_or(self.bandwidth);
        self.outbound_slots = patch.outbound_slots.unwrap_or(self.outbound_slots);
        self.inbound_slots = patch.inbound_slots.unwrap_or(self.inbound_slots);
        self.division = patch.division.unwrap_or(self.division);
        Ok(())
    }

    fn slots(&self, direction: Direction) -> u32 {
        match direction {
            Direction::Outbound => self.outbound_slots,
            Direction::Inbound => self.inbound_slots,
        }
    }
}

#[derive(Debug)]
struct Member {
    id: String,
    arrival: u64,
    request: JoinRequest,
    pid: u32,
    state: FleetState,
    joined_at: Duration,
    granted_at: Option<Duration>,
    progress: Progress,
    last_heard: Duration,
    share: Option<Share>,
    share_raised_at: Duration,
    sent_auto_converge: Option<Option<bool>>,
    sent_position: Option<u32>,
    clock: LimitClock,
    lowest_remaining: Option<u64>,
    limit_fired: bool,
    last_tick: Option<Duration>,
    last_action: Option<String>,
}

/// What a process sent on TCP, sampled by the agent (`sock_diag`).
#[derive(Debug, Default)]
struct Measured {
    samples: Vec<(Duration, u64)>,
}

impl Measured {
    fn record(&mut self, now: Duration, written: u64) {
        self.samples.push((now, written));
        // Keeps one sample older than the window to measure across it.
        while self.samples.len() > 2 && now.saturating_sub(self.samples[1].0) >= MEASURE_WINDOW {
            self.samples.remove(0);
        }
    }

    fn written(&self) -> Option<u64> {
        self.samples.last().map(|&(_, written)| written)
    }

    fn rate(&self) -> Option<u64> {
        let (&(start, first), &(end, last)) = (self.samples.first()?, self.samples.last()?);
        let span = end.saturating_sub(start);
        if span < MEASURE_WINDOW {
            return None;
        }
        let rate = last.saturating_sub(first) as f64 / span.as_secs_f64();
        // Not negative (a difference that saturates at zero over a positive
        // span); a float beyond u64 saturates, as `as` does.
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "a non-negative rate, saturating"
        )]
        let rate = rate as u64;
        Some(rate)
    }
}

/// Every migration the agent knows, and the host's settings.
#[derive(Debug, Default)]
pub struct Fleet {
    settings: Settings,
    members: BTreeMap<String, Member>,
    measured: BTreeMap<u32, Measured>,
    next_arrival: u64,
    counters: FleetCounters,
}

impl Fleet {
    /// An empty fleet with `settings`.
    pub fn new(settings: Settings) -> Self {
        Self {
            settings,
            ..Self::default()
        }
    }

    /// The settings in force.
    pub fn settings(&self) -> Settings {
        self.settings
    }

    /// Changes the settings (`fleet-set`); the next tick applies them.
    pub fn set(&mut self, patch: &FleetSettings) -> Result<(), FleetError> {
        self.settings.apply(patch)
    }

    /// A migration joins from process `pid`: queued, or running at once
    /// when it says it already runs (a rejoin).
    pub fn join(&mut self, request: JoinRequest, pid: u32, now: Duration) -> JoinReply {
        let id = match &request.resume {
            Some(id) if !id.is_empty() && !self.members.contains_key(id) => id.clone(),
            _ => self.fresh_id(),
        };
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let state = if request.running {
            FleetState::Running
        } else {
            FleetState::Queued
        };
        self.members.insert(
            id.clone(),
            Member {
                id: id.clone(),
                arrival,
                pid,
                state,
                joined_at: now,
                granted_at: request.running.then_some(now),
                progress: Progress {
                    total: request.memory,
                    ..Progress::default()
                },
                last_heard: now,
                share: None,
                share_raised_at: now,
                sent_auto_converge: None,
                sent_position: None,
                clock: LimitClock {
                    memory: request.memory,
                    ..LimitClock::default()
                },
                lowest_remaining: None,
                limit_fired: false,
                last_tick: None,
                last_action: None,
                request,
            },
        );
        let position = self.position(&id);
        JoinReply {
            migration: id,
            state,
            position,
        }
    }

    fn fresh_id(&mut self) -> String {
        loop {
            let id = format!("m{}", self.next_arrival + 1);
            if !self.members.contains_key(&id) {
                return id;
            }
            self.next_arrival += 1;
        }
    }

    /// A member's figures.
    pub fn report(
        &mut self,
        id: &str,
        progress: Progress,
        now: Duration,
    ) -> Result<(), FleetError> {
        let member = self.member_mut(id)?;
        member.last_heard = now;
        if progress.total > 0 {
            member.clock.memory = progress.total;
        }
        member.progress = progress;
        Ok(())
    }

    /// A member left, its migration in `status` (or vanished: `None`);
    /// its slot and share are free from the next tick.
    pub fn leave(&mut self, id: &str, status: Option<MigrationStatus>) {
        let Some(member) = self.members.remove(id) else {
            return;
        };
        let status = status.or(member.progress.status);
        match status {
            Some(MigrationStatus::Completed) => self.counters.succeeded += 1,
            // Left before its slot came, or before starting: neither.
            _ if member.state == FleetState::Queued => {}
            Some(MigrationStatus::Setup) | None if member.progress.transferred == 0 => {}
            _ => self.counters.failed += 1,
        }
    }

    /// What process `pid` has sent on its open TCP sockets, measured by the
    /// agent.
    pub fn measured(&mut self, pid: u32, written: u64, now: Duration) {
        self.measured.entry(pid).or_default().record(now, written);
    }

    /// Forgets measurements of processes with no member left.
    fn prune_measured(&mut self) {
        let pids: Vec<u32> = self.members.values().map(|member| member.pid).collect();
        self.measured.retain(|pid, _| pids.contains(pid));
    }

    /// The processes the agent should measure.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self
            .members
            .values()
            .filter(|member| member.request.direction == Direction::Outbound)
            .map(|member| member.pid)
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Whether the outbound members of `pid` claim no more than it sent:
    /// within a twentieth and 1 MiB (headers, the handshake, what a closed
    /// channel sent).
    fn verified(&self, pid: u32) -> bool {
        let Some(written) = self.measured.get(&pid).and_then(Measured::written) else {
            return true;
        };
        let claimed: u64 = self
            .members
            .values()
            .filter(|member| member.pid == pid && member.request.direction == Direction::Outbound)
            .map(|member| member.progress.transferred)
            .sum();
        claimed <= written + written / 20 + (1 << 20)
    }

    /// The transfer rate the agent believes for `member`: what it claims,
    /// at most what its process was seen writing.
    fn believed_rate(&self, member: &Member) -> u64 {
        let measured = self.measured.get(&member.pid).and_then(Measured::rate);
        match measured {
            Some(rate) => member.progress.transfer_rate.min(rate),
            None => member.progress.transfer_rate,
        }
    }

    /// The remaining bytes the agent believes: a member whose claims
    /// exceed what its process wrote is taken to have sent only that.
    fn believed_remaining(&self, member: &Member) -> u64 {
        let claimed = if member.progress.remaining > 0 || member.progress.iterations > 0 {
            member.progress.remaining
        } else {
            member.progress.total.max(member.request.memory)
        };
        if self.verified(member.pid) {
            return claimed;
        }
        let written = self
            .measured
            .get(&member.pid)
            .and_then(Measured::written)
            .unwrap_or(0);
        claimed.max(member.progress.total.saturating_sub(written))
    }

    fn member_mut(&mut self, id: &str) -> Result<&mut Member, FleetError> {
        self.members
            .get_mut(id)
            .ok_or_else(|| FleetError::UnknownMigration(id.into()))
    }

    /// Whether `id` is a member.
    pub fn contains(&self, id: &str) -> bool {
        self.members.contains_key(id)
    }

    /// An operator's command for migration `id`: the directive to pass on.
    /// `max-bandwidth` becomes the migration's cap
    /// (`bandwidthPerMigration`, 0 removes it), applied by the division.
    pub fn command(
        &mut self,
        id: &str,
        command: MemberCommand,
    ) -> Result<Option<Directive>, FleetError> {
        let member = self.member_mut(id)?;
        let command = match command {
            MemberCommand::SetParameters(mut parameters) => {
                if let Some(cap) = parameters.max_bandwidth.take() {
                    member.request.policy.bandwidth_per_migration = (cap > 0).then_some(cap);
                }
                if parameters.is_empty() {
                    return Ok(None);
                }
                MemberCommand::SetParameters(parameters)
            }
            other => other,
        };
        member.last_action = Some(format!("{command:?} (operator)"));
        Ok(Some(Directive::FleetCommand {
            command,
            reason: "the operator's command".into(),
        }))
    }

    /// Changes a migration's policy (`migrate-set-policy`).
    pub fn set_policy(&mut self, id: &str, patch: &MigrationPolicy) -> Result<(), FleetError> {
        self.member_mut(id)?.request.policy.merge(patch);
        Ok(())
    }

    /// One member's latest figures.
    pub fn progress(&self, id: &str) -> Result<Progress, FleetError> {
        self.members
            .get(id)
            .map(|member| member.progress.clone())
            .ok_or_else(|| FleetError::UnknownMigration(id.into()))
    }

    /// The queue of `direction` in order: priority first, then arrival.
    fn queue(&self, direction: Direction) -> Vec<&Member> {
        let mut queue: Vec<&Member> = self
            .members
            .values()
            .filter(|member| {
                member.state == FleetState::Queued && member.request.direction == direction
            })
            .collect();
        queue.sort_by_key(|member| (-member.request.policy.priority(), member.arrival));
        queue
    }

    fn position(&self, id: &str) -> Option<u32> {
        let member = self.members.get(id)?;
        if member.state != FleetState::Queued {
            return None;
        }
        let queue = self.queue(member.request.direction);
        let index = queue.iter().position(|queued| queued.id == id)?;
        u32::try_from(index + 1).ok()
    }

    /// Advances to `now`: forgets silent members, grants free slots,
    /// divides the budget, checks each migration's limits. Returns what to
    /// tell each member (by id), changes only.
    pub fn tick(&mut self, now: Duration) -> Vec<(String, Directive)> {
        let limit = self.settings.silence_limit;
        let silent: Vec<String> = self
            .members
            .values()
            .filter(|member| now.saturating_sub(member.last_heard) > limit)
            .map(|member| member.id.clone())
            .collect();
        for id in silent {
            tracing::warn!(migration = %id, "no report for {limit:?}: its slot is released");
            self.leave(&id, None);
        }
        self.prune_measured();
        let mut directives = self.grant_slots(now);
        directives.extend(self.queue_positions());
        directives.extend(self.divide(now));
        directives.extend(self.check_limits(now));
        directives
    }

    fn grant_slots(&mut self, now: Duration) -> Vec<(String, Directive)> {
        let mut granted = Vec::new();
        for direction in [Direction::Outbound, Direction::Inbound] {
            let running = self
                .members
                .values()
                .filter(|member| {
                    member.state != FleetState::Queued && member.request.direction == direction
                })
                .count();
            let free = (self.settings.slots(direction) as usize).saturating_sub(running);
            let free = self.admissible(direction, free);
            let ids: Vec<String> = self
                .queue(direction)
                .iter()
                .take(free)
                .map(|member| member.id.clone())
                .collect();
            for id in ids {
                if let Some(member) = self.members.get_mut(&id) {
                    member.state = FleetState::Running;
                    member.granted_at = Some(now);
                    member.last_heard = now;
                    granted.push((
                        id.clone(),
                        Directive::FleetSlot {
                            migration: id.clone(),
                        },
                    ));
                }
            }
        }
        granted
    }

    /// Of `free` slots, how many may be granted now. Under a budget divided
    /// converge-first, outbound migrations are admitted one first pass at a
    /// time: a migration's dirty rate is unknown until its first pass ends,
    /// and one admitted beside another's first pass would only be held, its
    /// dirty log running and its guest's pages sent again for nothing. Once
    /// every running migration knows its dirty rate, the next may start
    /// and fill what the ones converging leave of the link.
    fn admissible(&self, direction: Direction, free: usize) -> usize {
        let gated = direction == Direction::Outbound
            && self.settings.bandwidth > 0
            && self.settings.division == Division::ConvergeFirst;
        if !gated {
            return free;
        }
        let in_first_pass = self.members.values().any(|member| {
            member.state != FleetState::Queued
                && member.request.direction == Direction::Outbound
                && member.progress.iterations == 0
                && !member
                    .progress
                    .status
                    .is_some_and(|status| status.is_final() || status == MigrationStatus::Device)
        });
        if in_first_pass { 0 } else { free.min(1) }
    }

    fn queue_positions(&mut self) -> Vec<(String, Directive)> {
        let positions: Vec<(String, u32)> = self
            .members
            .keys()
            .filter_map(|id| Some((id.clone(), self.position(id)?)))
            .collect();
        let mut directives = Vec::new();
        for (id, position) in positions {
            if let Some(member) = self.members.get_mut(&id)
                && member.sent_position != Some(position)
            {
                member.sent_position = Some(position);
                directives.push((id, Directive::FleetQueued { position }));
            }
        }
        directives
    }

    fn divide(&mut self, now: Duration) -> Vec<(String, Directive)> {
        let mut running: Vec<&Member> = self
            .members
            .values()
            .filter(|member| {
                member.state != FleetState::Queued
                    && member.request.direction == Direction::Outbound
            })
            .collect();
        running.sort_by_key(|member| member.arrival);
        let loads: Vec<Load> = running
            .iter()
            .map(|member| Load {
                priority: member.request.policy.priority(),
                remaining: self.believed_remaining(member),
                dirty_rate: member.progress.dirty_rate,
                transfer_rate: self.believed_rate(member),
                previous_share: member.share.map_or(0, |share| share.bandwidth),
                share_steady: now.saturating_sub(member.share_raised_at) >= STEADY_AFTER,
                cap: member.request.policy.bandwidth_per_migration,
                switching_over: member.progress.status == Some(MigrationStatus::Device),
            })
            .collect();
        let shares = division::divide(self.settings.bandwidth, &loads, self.settings.division);
        let ids: Vec<String> = running.iter().map(|member| member.id.clone()).collect();
        let mut directives = Vec::new();
        for (id, share) in ids.into_iter().zip(shares) {
            let Some(member) = self.members.get_mut(&id) else {
                continue;
            };
            let cap = member.request.policy.bandwidth_per_migration;
            let share = if self.settings.bandwidth == 0 {
                Share {
                    bandwidth: cap.unwrap_or(0),
                    held: false,
                }
            } else {
                share
            };
            if let Some(directive) = member.update_share(share, now) {
                directives.push((id, directive));
            }
        }
        directives
    }

    fn check_limits(&mut self, now: Duration) -> Vec<(String, Directive)> {
        let mut directives = Vec::new();
        for member in self.members.values_mut() {
            let Some(command) = member.advance_clock(now) else {
                continue;
            };
            directives.push((member.id.clone(), command));
        }
        directives
    }

    /// Everything, for `query-fleet`.
    pub fn view(&self, now: Duration) -> FleetView {
        let mut members: Vec<&Member> = self.members.values().collect();
        members.sort_by_key(|member| {
            (
                member.state == FleetState::Queued,
                self.position(&member.id),
                member.arrival,
            )
        });
        FleetView {
            version: FLEET_PROTOCOL_VERSION,
            bandwidth: self.settings.bandwidth,
            outbound_slots: self.settings.outbound_slots,
            inbound_slots: self.settings.inbound_slots,
            division: self.settings.division,
            migrations: members
                .into_iter()
                .map(|member| self.member_view(member, now))
                .collect(),
            counters: self.counters.clone(),
        }
    }

    fn member_view(&self, member: &Member, now: Duration) -> MigrationView {
        let outbound = member.request.direction == Direction::Outbound;
        MigrationView {
            migration: member.id.clone(),
            name: member.request.name.clone(),
            direction: member.request.direction,
            pid: member.pid,
            state: member.state,
            position: self.position(&member.id),
            share: member.share.map_or(0, |share| share.bandwidth),
            policy: member.request.policy.clone(),
            progress: member.progress.clone(),
            measured_rate: outbound
                .then(|| self.measured.get(&member.pid).and_then(Measured::rate))
                .flatten(),
            progress_verified: !outbound || self.verified(member.pid),
            queued_seconds: member
                .granted_at
                .unwrap_or(now)
                .saturating_sub(member.joined_at)
                .as_secs_f64(),
            running_seconds: member
                .granted_at
                .map_or(0.0, |granted| now.saturating_sub(granted).as_secs_f64()),
            last_action: member.last_action.clone(),
        }
    }
}

impl Member {
    /// Records the new share; the directive when it changed enough to tell.
    fn update_share(&mut self, share: Share, now: Duration) -> Option<Directive> {
        let previous = self.share;
        if previous.is_none_or(|previous| share.bandwidth > previous.bandwidth) {
            self.share_raised_at = now;
        }
        self.share = Some(share);
        self.state = if share.held {
            FleetState::Held
        } else {
            FleetState::Running
        };
        // Held: no throttle for a wait the agent chose. Otherwise the
        // policy's choice, or the migration's own (`None`).
        let auto_converge = if share.held {
            Some(false)
        } else {
            self.request.policy.allow_auto_converge
        };
        // Every decrease is sent (the shares in force never add up to more
        // than the budget); a rise only when it is worth a line.
        let moved = previous.is_none_or(|previous| {
            let (old, new) = (previous.bandwidth, share.bandwidth);
            previous.held != share.held || new < old || new - old > old / 100
        });
        if !moved && self.sent_auto_converge == Some(auto_converge) {
            return None;
        }
        self.sent_auto_converge = Some(auto_converge);
        Some(Directive::FleetShare {
            max_bandwidth: share.bandwidth,
            auto_converge,
            held: share.held,
        })
    }

    /// Advances the limit clocks; the command of a limit that expired,
    /// once.
    fn advance_clock(&mut self, now: Duration) -> Option<Directive> {
        let last = self.last_tick.unwrap_or(now);
        self.last_tick = Some(now);
        let counting = self.state == FleetState::Running
            && self.request.direction == Direction::Outbound
            && matches!(self.progress.status, Some(MigrationStatus::Active));
        if !counting || self.limit_fired {
            return None;
        }
        let elapsed = now.saturating_sub(last);
        self.clock.active += elapsed;
        let remaining = self.progress.remaining;
        if self.progress.iterations > 0
            && self
                .lowest_remaining
                .is_none_or(|lowest| remaining < lowest)
        {
            self.lowest_remaining = Some(remaining);
            self.clock.since_new_low = Duration::ZERO;
        } else {
            self.clock.since_new_low += elapsed;
        }
        let (command, reason) = limits::check(&self.request.policy, &self.clock)?;
        self.limit_fired = true;
        tracing::warn!(migration = %self.id, "{reason}: {command:?}");
        self.last_action = Some(format!("{command:?}: {reason}"));
        Some(Directive::FleetCommand { command, reason })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tern_engine::MigrationStatus;

    use super::{Fleet, SILENCE_LIMIT, Settings};
    use crate::protocol::{
        Direction, Directive, FleetState, JoinRequest, MemberCommand, MigrationPolicy, Progress,
    };

    const MB: u64 = 1_000_000;

    fn request(name: &str, direction: Direction) -> JoinRequest {
        JoinRequest {
            name: name.into(),
            direction,
            memory: 1 << 30,
            policy: MigrationPolicy::default(),
            resume: None,
            running: false,
        }
    }

    fn fleet(slots: u32, bandwidth: u64) -> Fleet {
        Fleet::new(Settings {
            bandwidth,
            outbound_slots: slots,
            inbound_slots: slots,
            ..Settings::default()
        })
    }

    fn at(millis: u64) -> Duration {
        Duration::from_millis(millis)
    }

    fn active(remaining: u64, dirty_rate: u64) -> Progress {
        Progress {
            status: Some(MigrationStatus::Active),
            remaining,
            total: 1 << 30,
            dirty_rate,
            iterations: 1,
            ..Progress::default()
        }
    }

    fn state(fleet: &Fleet, id: &str, now: Duration) -> (FleetState, Option<u32>, u64) {
        let view = fleet.view(now);
        let member = view
            .migrations
            .iter()
            .find(|member| member.migration == id)
            .unwrap();
        (member.state, member.position, member.share)
    }

    #[test]
    fn beyond_its_slots_a_migration_waits_with_its_position() {
        let mut fleet = fleet(1, 0);
        let first = fleet.join(request("a", Direction::Outbound), 1, at(0));
        let second = fleet.join(request("b", Direction::Outbound), 1, at(0));
        let inbound = fleet.join(request("c", Direction::Inbound), 1, at(0));
        assert_eq!(second.position, Some(2));
        let directives = fleet.tick(at(100));
        let granted: Vec<&str> = directives
            .iter()
            .filter(|(_, directive)| matches!(directive, Directive::FleetSlot { .. }))
            .map(|(id, _)| id.as_str())
            .collect();
        assert_eq!(
            granted,
            vec![first.migration.as_str(), inbound.migration.as_str()]
        );
        assert_eq!(state(&fleet, &second.migration, at(100)).1, Some(1));
        assert!(directives.contains(&(
            second.migration.clone(),
            Directive::FleetQueued { position: 1 }
        )));
        fleet.leave(&first.migration, Some(MigrationStatus::Completed));
        fleet.tick(at(200));
        assert_eq!(
            state(&fleet, &second.migration, at(200)).0,
            FleetState::Running
        );
        assert_eq!(fleet.view(at(200)).counters.succeeded, 1);
    }

    #[test]
    fn priority_jumps_the_queue_and_a_rejoin_is_never_queued() {
        let mut fleet = fleet(1, 0);
        fleet.join(request("a", Direction::Outbound), 1, at(0));
        fleet.tick(at(0));
        let plain = fleet.join(request("b", Direction::Outbound), 1, at(0));
        let mut urgent = request("c", Direction::Outbound);
        urgent.policy.priority = Some(5);
        let urgent = fleet.join(urgent, 1, at(0));
        assert_eq!(urgent.position, Some(1));
        assert_eq!(state(&fleet, &plain.migration, at(0)).1, Some(2));
        let mut rejoin = request("d", Direction::Outbound);
        rejoin.running = true;
        rejoin.resume = Some("m42".into());
        let rejoined = fleet.join(rejoin, 2, at(0));
        assert_eq!(rejoined.migration, "m42");
        assert_eq!(rejoined.state, FleetState::Running);
    }

    #[test]
    fn a_member_that_falls_silent_releases_its_slot() {
        let mut fleet = fleet(1, 100 * MB);
        let gone = fleet.join(request("a", Direction::Outbound), 1, at(0));
        let waiting = fleet.join(request("b", Direction::Outbound), 1, at(0));
        fleet.tick(at(0));
        fleet
            .report(&waiting.migration, Progress::default(), at(5_000))
            .unwrap();
        fleet.tick(at(5_000));
        assert!(fleet.contains(&gone.migration));
        let later = at(5_000) + SILENCE_LIMIT - at(4_000);
        fleet
            .report(&waiting.migration, Progress::default(), later)
            .unwrap();
        fleet.tick(later + at(1));
        assert!(!fleet.contains(&gone.migration));
        assert_eq!(
            state(&fleet, &waiting.migration, later).0,
            FleetState::Running
        );
    }

    #[test]
    fn shares_are_redivided_as_migrations_start_and_finish() {
        let mut fleet = fleet(2, 100 * MB);
        let a = fleet.join(request("a", Direction::Outbound), 1, at(0));
        fleet.tick(at(0));
        assert_eq!(state(&fleet, &a.migration, at(0)).2, 100 * MB);
        let b = fleet.join(request("b", Direction::Outbound), 1, at(0));
        fleet
            .report(&a.migration, active(1 << 30, 0), at(100))
            .unwrap();
        fleet
            .report(&b.migration, active(1 << 30, 20 * MB), at(100))
            .unwrap();
        let directives = fleet.tick(at(100));
        let (_, _, share_a) = state(&fleet, &a.migration, at(100));
        let (_, _, share_b) = state(&fleet, &b.migration, at(100));
        assert!(share_b > share_a, "the dirtier first: {share_a} {share_b}");
        assert!(share_a + share_b <= 100 * MB);
        assert!(directives.iter().any(|(id, directive)| id == &b.migration
            && matches!(directive, Directive::FleetShare { .. })));
        fleet.leave(&b.migration, Some(MigrationStatus::Completed));
        fleet.tick(at(200));
        assert_eq!(state(&fleet, &a.migration, at(200)).2, 100 * MB);
    }

    #[test]
    fn a_held_migration_is_told_to_stop_throttling() {
        let mut fleet = fleet(2, 100 * MB);
        let hopeless = fleet.join(request("a", Direction::Outbound), 1, at(0));
        let moderate = fleet.join(request("b", Direction::Outbound), 1, at(0));
        fleet.tick(at(0));
        fleet
            .report(&hopeless.migration, active(1 << 30, 150 * MB), at(100))
            .unwrap();
        fleet
            .report(&moderate.migration, active(1 << 30, 40 * MB), at(100))
            .unwrap();
        let directives = fleet.tick(at(100));
        assert_eq!(
            state(&fleet, &hopeless.migration, at(100)).0,
            FleetState::Held
        );
        assert!(directives.contains(&(
            hopeless.migration.clone(),
            Directive::FleetShare {
                max_bandwidth: crate::division::keep_alive(100 * MB, 2),
                auto_converge: Some(false),
                held: true,
            }
        )));
    }

    #[test]
    fn the_progress_timeout_counts_only_unheld_time_and_fires_once() {
        let mut fleet = fleet(1, 0);
        let mut slow = request("a", Direction::Outbound);
        slow.policy.progress_timeout = Some(2);
        let slow = fleet.join(slow, 1, at(0));
        fleet.tick(at(0));
        let mut fired = Vec::new();
        for step in 1..=40 {
            let now = at(step * 100);
            fleet
                .report(&slow.migration, active(1 << 20, 0), now)
                .unwrap();
            fired.extend(
                fleet
                    .tick(now)
                    .into_iter()
                    .filter(|(_, directive)| matches!(directive, Directive::FleetCommand { .. })),
            );
        }
        assert_eq!(fired.len(), 1, "{fired:?}");
        let Directive::FleetCommand { command, reason } = &fired[0].1 else {
            unreachable!()
        };
        assert_eq!(*command, MemberCommand::Cancel);
        assert!(reason.contains("progressTimeout"), "{reason}");
    }

    #[test]
    fn a_liars_claims_are_bounded_by_what_its_process_wrote() {
        let mut fleet = fleet(2, 100 * MB);
        let liar = fleet.join(request("liar", Direction::Outbound), 7, at(0));
        fleet.tick(at(0));
        fleet.measured(7, 1_000, at(0));
        fleet.measured(7, 1_000 + 10 * MB, at(1_000));
        let mut claim = active(1 << 10, 0);
        claim.transferred = 1 << 30;
        claim.transfer_rate = 500 * MB;
        fleet.report(&liar.migration, claim, at(1_000)).unwrap();
        fleet.tick(at(1_000));
        let view = fleet.view(at(1_000));
        let member = &view.migrations[0];
        assert!(!member.progress_verified);
        assert_eq!(member.measured_rate, Some(10 * MB));
        let liar_member = fleet.members.get(&liar.migration).unwrap();
        assert_eq!(fleet.believed_rate(liar_member), 10 * MB);
        assert!(fleet.believed_remaining(liar_member) >= (1 << 30) - 20 * MB);
    }

    #[test]
    fn an_operators_bandwidth_becomes_the_migrations_cap() {
        let mut fleet = fleet(1, 100 * MB);
        let a = fleet.join(request("a", Direction::Outbound), 1, at(0));
        fleet.tick(at(0));
        let mut patch = tern_engine::MigrationParameters::default();
        patch.max_bandwidth = Some(10 * MB);
        let forwarded = fleet
            .command(&a.migration, MemberCommand::SetParameters(patch))
            .unwrap();
        assert_eq!(forwarded, None, "nothing left to forward");
        fleet.tick(at(100));
        assert_eq!(state(&fleet, &a.migration, at(100)).2, 10 * MB);
        assert!(fleet.command("m99", MemberCommand::Cancel).is_err());
    }

    #[test]
    fn converge_first_admits_one_first_pass_at_a_time() {
        let mut fleet = fleet(4, 100 * MB);
        let ids: Vec<String> = ["a", "b", "c"]
            .iter()
            .map(|name| {
                fleet
                    .join(request(name, Direction::Outbound), 1, at(0))
                    .migration
            })
            .collect();
        fleet.tick(at(0));
        let running = |fleet: &Fleet| {
            ids.iter()
                .filter(|id| state(fleet, id, at(0)).0 != FleetState::Queued)
                .count()
        };
        assert_eq!(running(&fleet), 1, "one first pass at a time");
        let mut first_pass = active(1 << 30, 0);
        first_pass.iterations = 0;
        fleet.report(&ids[0], first_pass, at(100)).unwrap();
        fleet.tick(at(100));
        assert_eq!(running(&fleet), 1);
        fleet.report(&ids[0], active(1 << 20, 0), at(200)).unwrap();
        fleet.tick(at(200));
        assert_eq!(running(&fleet), 2, "the first knows its dirty rate");
        // Equal shares, or no budget: slots alone decide.
        fleet
            .set(&crate::protocol::FleetSettings {
                division: Some(crate::division::Division::Equal),
                ..Default::default()
            })
            .unwrap();
        fleet.tick(at(300));
        assert_eq!(running(&fleet), 3);
    }

    #[test]
    fn zero_slots_are_refused() {
        let mut fleet = fleet(1, 0);
        let error = fleet
            .set(&crate::protocol::FleetSettings {
                outbound_slots: Some(0),
                bandwidth: Some(5),
                ..Default::default()
            })
            .unwrap_err();
        assert!(error.to_string().contains("outbound-slots"), "{error}");
        assert_eq!(fleet.settings().bandwidth, 0);
    }
}
