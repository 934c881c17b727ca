//! Joining the agent: the one call a migration (the CLI's or an
//! embedder's) makes, [`join`], and the thread that then keeps the agent
//! informed and applies what it decides.
//!
//! The member reports its migration's figures four times a second and
//! applies the agent's share (`max-bandwidth`, `auto-converge`) and
//! commands through the migration's own handle. When the agent goes away
//! the migration goes on at its last share, and the member rejoins as soon
//! as an agent listens on the socket again (as running, keeping its id).

use std::io::BufReader;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tern_engine::{
    CancelToken, MigrationHandle, MigrationParameters, MigrationStatus, ReceiveHandle,
};

use crate::error::FleetError;
use crate::line::{read_line, write_line};
use crate::protocol::{
    Direction, Directive, JoinReply, JoinRequest, MAX_LINE_BYTES, MemberCommand, MigrationPolicy,
    Progress, PushedEvent,
};

/// How often a member reports.
pub const REPORT_INTERVAL: Duration = Duration::from_millis(250);
/// How often a member whose agent went away tries to rejoin.
pub const REJOIN_INTERVAL: Duration = Duration::from_millis(500);
/// How long the agent has to answer a join.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The migration a member steers.
#[derive(Clone, Debug)]
pub enum Steered {
    /// A source's migration: shares and commands apply.
    Source(MigrationHandle),
    /// A destination: an inbound slot; cancel applies.
    Destination(ReceiveHandle),
}

impl Steered {
    fn direction(&self) -> Direction {
        match self {
            Self::Source(_) => Direction::Outbound,
            Self::Destination(_) => Direction::Inbound,
        }
    }

    fn status(&self) -> MigrationStatus {
        match self {
            Self::Source(handle) => handle.status(),
            Self::Destination(handle) => handle.query().status,
        }
    }

    fn progress(&self) -> Progress {
        match self {
            Self::Source(handle) => {
                let report = handle.query();
                Progress {
                    status: Some(report.status),
                    transferred: report.ram.transferred,
                    remaining: report.ram.remaining,
                    total: report.ram.total,
                    dirty_rate: report
                        .ram
                        .dirty_pages_rate
                        .saturating_mul(report.ram.page_size),
                    transfer_rate: report.ram.transfer_rate,
                    iterations: report.ram.iterations,
                    cpu_throttle_percentage: report.cpu_throttle_percentage,
                    downtime: report.downtime,
                }
            }
            Self::Destination(handle) => {
                let report = handle.query();
                Progress {
                    status: Some(report.status),
                    transferred: report.stats.received,
                    total: report.memory,
                    iterations: report.iterations,
                    ..Progress::default()
                }
            }
        }
    }

    fn cancel(&self) {
        match self {
            Self::Source(handle) => handle.cancel(),
            Self::Destination(handle) => handle.cancel(),
        }
    }
}

/// How a migration joins.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct JoinOptions {
    /// Its name in the agent's listings (a VM's name).
    pub name: String,
    /// Guest memory in bytes, when known before the migration starts.
    pub memory: u64,
    /// Its policy.
    pub policy: MigrationPolicy,
    /// How long to wait in the queue for a slot.
    pub queue_timeout: Duration,
    /// Stops waiting for a slot once cancelled (a signal): [`join`] then
    /// returns, and the migration, cancelled, ends at once.
    pub cancel: Option<CancelToken>,
}

impl JoinOptions {
    /// `name`, default policy, an hour's queue timeout.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            memory: 0,
            policy: MigrationPolicy::default(),
            queue_timeout: Duration::from_secs(3600),
            cancel: None,
        }
    }
}

/// Where the member stands, as the agent last said.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemberState {
    /// The agent's id for it.
    pub migration: Option<String>,
    /// A slot was granted.
    pub granted: bool,
    /// The agent (an operator, a limit) cancelled it.
    pub cancelled: bool,
    /// Place in the queue, while queued.
    pub position: Option<u32>,
    /// The share applied last, bytes per second.
    pub share: Option<u64>,
    /// Held at the keep-alive share.
    pub held: bool,
    /// Connected to an agent now.
    pub connected: bool,
    /// Sessions opened so far (1 + rejoins).
    pub sessions: u64,
}

/// A migration's membership; leaves the agent when dropped.
#[derive(Debug)]
pub struct Membership {
    shared: Arc<Shared>,
    session: Option<JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    agent: PathBuf,
    steered: Steered,
    request: JoinRequest,
    /// The migration's own `max-bandwidth` and `auto-converge`, restored
    /// when the agent says "your own".
    own: MigrationParameters,
    state: Mutex<MemberState>,
    changed: Condvar,
    stop: AtomicBool,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// Joins the agent listening on `agent` with the migration `steered`
/// steers, and waits for a slot: returns once one is granted, or once the
/// agent cancelled the migration while it waited (its handle is then
/// cancelled, and starting it ends at once as cancelled). Call it after
/// creating the migration and before starting it. The migration's own
/// `max-bandwidth`, if any, becomes its cap (`bandwidthPerMigration`)
/// unless the policy gives one.
pub fn join(
    agent: &Path,
    steered: Steered,
    options: JoinOptions,
) -> Result<Membership, FleetError> {
    let own = match &steered {
        Steered::Source(handle) => handle.parameters(),
        Steered::Destination(_) => MigrationParameters::default(),
    };
    let mut policy = options.policy;
    // The migration's own cap stays its cap under the agent.
    if policy.bandwidth_per_migration.is_none() {
        policy.bandwidth_per_migration = own.max_bandwidth.filter(|&cap| cap > 0);
    }
    let shared = Arc::new(Shared {
        agent: agent.to_path_buf(),
        request: JoinRequest {
            name: options.name,
            direction: steered.direction(),
            memory: options.memory,
            policy,
            resume: None,
            running: false,
        },
        steered,
        own,
        state: Mutex::new(MemberState::default()),
        changed: Condvar::new(),
        stop: AtomicBool::new(false),
    });
    let stream = shared.open_session()?;
    let session_shared = shared.clone();
    let session = std::thread::Builder::new()
        .name("tern-fleet-member".into())
        .spawn(move || session_shared.run(Some(stream)))
        .map_err(|source| FleetError::Socket {
            path: agent.to_path_buf(),
            source,
        })?;
    let membership = Membership {
        shared,
        session: Some(session),
    };
    membership.wait_for_slot(options.queue_timeout, options.cancel.as_ref())?;
    Ok(membership)
}

impl Membership {
    /// Where it stands.
    pub fn state(&self) -> MemberState {
        lock(&self.shared.state).clone()
    }

    fn wait_for_slot(
        &self,
        timeout: Duration,
        cancel: Option<&CancelToken>,
    ) -> Result<(), FleetError> {
        let deadline = Instant::now() + timeout;
        let mut state = lock(&self.shared.state);
        while !state.granted && !state.cancelled {
            if cancel.is_some_and(CancelToken::is_cancelled) {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(FleetError::QueueTimeout(timeout.as_secs()));
            }
            // Wakes now and then to notice a cancellation.
            state = self
                .shared
                .changed
                .wait_timeout(state, left.min(Duration::from_millis(100)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(())
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(session) = self.session.take() {
            let _ = session.join();
        }
    }
}

impl Shared {
    /// Connects, joins (or rejoins) and starts the connection's reader.
    fn open_session(self: &Arc<Self>) -> Result<UnixStream, FleetError> {
        let socket_error = |source| FleetError::Socket {
            path: self.agent.clone(),
            source,
        };
        let stream = UnixStream::connect(&self.agent).map_err(socket_error)?;
        stream
            .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
            .map_err(socket_error)?;
        stream
            .set_write_timeout(Some(HANDSHAKE_TIMEOUT))
            .map_err(socket_error)?;
        let mut reader = BufReader::new(stream.try_clone().map_err(socket_error)?);
        let greeting = self.read_value(&mut reader)?;
        if greeting.get("QMP").is_none() {
            return Err(FleetError::Refused(describe(&greeting)));
        }
        let mut request = self.request.clone();
        {
            let state = lock(&self.state);
            request.resume = state.migration.clone();
            request.running = state.granted;
        }
        let join = json!({"execute": "fleet-join", "arguments": request});
        write_line(&mut &stream, &join.to_string()).map_err(socket_error)?;
        let reply = loop {
            let value = self.read_value(&mut reader)?;
            if value.get("event").is_some() {
                self.apply_line(&value);
                continue;
            }
            break value;
        };
        let Some(answer) = reply.get("return") else {
            return Err(FleetError::Refused(describe(&reply)));
        };
        let answer: JoinReply = serde_json::from_value(answer.clone())
            .map_err(|error| FleetError::Protocol(format!("fleet-join's answer: {error}")))?;
        {
            let mut state = lock(&self.state);
            tracing::info!(migration = %answer.migration, state = ?answer.state, "joined the agent");
            state.migration = Some(answer.migration);
            state.position = answer.position;
            state.connected = true;
            state.sessions += 1;
            if answer.state != crate::protocol::FleetState::Queued {
                state.granted = true;
            }
        }
        self.changed.notify_all();
        stream.set_read_timeout(None).map_err(socket_error)?;
        let reading = self.clone();
        let session = lock(&self.state).sessions;
        std::thread::Builder::new()
            .name("tern-fleet-events".into())
            .spawn(move || reading.read_events(reader, session))
            .map_err(socket_error)?;
        Ok(stream)
    }

    fn read_value(&self, reader: &mut BufReader<UnixStream>) -> Result<Value, FleetError> {
        let line = read_line(reader, MAX_LINE_BYTES)
            .map_err(|_| FleetError::Protocol("the agent closed the connection".into()))?;
        serde_json::from_slice(&line)
            .map_err(|error| FleetError::Protocol(format!("not JSON: {error}")))
    }

    /// Applies events until the connection ends.
    fn read_events(&self, mut reader: BufReader<UnixStream>, session: u64) {
        while let Ok(line) = read_line(&mut reader, MAX_LINE_BYTES) {
            match serde_json::from_slice::<Value>(&line) {
                Ok(value) if value.get("error").is_some() => {
                    tracing::warn!("the agent refused a report: {}", describe(&value));
                    // It forgot us (it took us for gone): rejoin.
                    break;
                }
                Ok(value) => self.apply_line(&value),
                Err(error) => tracing::warn!("the agent sent a line that is not JSON: {error}"),
            }
        }
        let mut state = lock(&self.state);
        if state.sessions == session {
            state.connected = false;
        }
    }

    fn apply_line(&self, value: &Value) {
        if value.get("event").is_none() {
            return;
        }
        match serde_json::from_value::<PushedEvent>(value.clone()) {
            Ok(event) => self.apply(event.directive),
            Err(error) => tracing::warn!("an event this version does not know: {error}"),
        }
    }

    fn apply(&self, directive: Directive) {
        match directive {
            Directive::FleetQueued { position } => {
                tracing::info!(position, "queued for a slot");
                lock(&self.state).position = Some(position);
            }
            Directive::FleetSlot { migration } => {
                tracing::info!(%migration, "slot granted");
                let mut state = lock(&self.state);
                state.granted = true;
                state.position = None;
            }
            Directive::FleetShare {
                max_bandwidth,
                auto_converge,
                held,
            } => self.apply_share(max_bandwidth, auto_converge, held),
            Directive::FleetCommand { command, reason } => {
                tracing::info!(?command, %reason, "the agent's command");
                self.run_command(command);
            }
        }
        self.changed.notify_all();
    }

    fn apply_share(&self, max_bandwidth: u64, auto_converge: Option<bool>, held: bool) {
        {
            let mut state = lock(&self.state);
            state.share = Some(max_bandwidth);
            state.held = held;
        }
        let Steered::Source(handle) = &self.steered else {
            return;
        };
        let mut patch = MigrationParameters::default();
        patch.max_bandwidth = Some(if max_bandwidth == 0 {
            self.own.max_bandwidth.unwrap_or(0)
        } else {
            max_bandwidth
        });
        patch.auto_converge = auto_converge.or(self.own.auto_converge);
        if let Err(error) = handle.set_parameters(&patch) {
            tracing::debug!("share not applied: {error}");
        }
    }

    fn run_command(&self, command: MemberCommand) {
        let result = match (&self.steered, command) {
            (steered, MemberCommand::Cancel) => {
                steered.cancel();
                lock(&self.state).cancelled = true;
                Ok(())
            }
            (Steered::Source(handle), MemberCommand::SwitchOver) => handle.switch_over_now(),
            (Steered::Source(handle), MemberCommand::StartPostcopy) => {
                // The postcopy hook: when this build cannot start postcopy,
                // the completion timeout cancels instead (KubeVirt's abort).
                handle.start_postcopy().or_else(|error| {
                    tracing::warn!("cannot start postcopy ({error}); cancelling instead");
                    handle.cancel();
                    lock(&self.state).cancelled = true;
                    Ok(())
                })
            }
            (Steered::Source(handle), MemberCommand::SetParameters(patch)) => {
                handle.set_parameters(&patch)
            }
            (Steered::Destination(_), other) => {
                tracing::warn!(?other, "a destination has no such command");
                Ok(())
            }
        };
        if let Err(error) = result {
            tracing::warn!("the agent's command failed: {error}");
        }
    }

    /// Reports until the migration ends or the membership is dropped;
    /// rejoins when the agent comes back.
    fn run(self: Arc<Self>, mut stream: Option<UnixStream>) {
        let mut next_rejoin = Instant::now();
        loop {
            let stopping = self.stop.load(Ordering::Relaxed);
            let status = self.steered.status();
            let ended = status.is_final();
            if stream.is_some() && !lock(&self.state).connected {
                stream = None;
            }
            if let Some(connection) = &stream {
                let report =
                    json!({"execute": "fleet-report", "arguments": self.steered.progress()});
                let mut sent = write_line(&mut &*connection, &report.to_string()).is_ok();
                if sent && (ended || stopping) {
                    let leave = json!({"execute": "fleet-leave", "arguments": {"status": status}});
                    sent = write_line(&mut &*connection, &leave.to_string()).is_ok();
                }
                if !sent {
                    lock(&self.state).connected = false;
                    stream = None;
                }
            }
            if ended || stopping {
                if let Some(connection) = stream {
                    let _ = connection.shutdown(std::net::Shutdown::Both);
                }
                return;
            }
            if stream.is_none() && Instant::now() >= next_rejoin {
                next_rejoin = Instant::now() + REJOIN_INTERVAL;
                match self.open_session() {
                    Ok(connection) => stream = Some(connection),
                    Err(error) => tracing::debug!("rejoining the agent: {error}"),
                }
            }
            self.sleep(REPORT_INTERVAL);
        }
    }

    fn sleep(&self, duration: Duration) {
        let deadline = Instant::now() + duration;
        while !self.stop.load(Ordering::Relaxed) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(25));
        }
    }
}

fn describe(value: &Value) -> String {
    match value.get("error") {
        Some(error) => format!(
            "{}: {}",
            error["class"].as_str().unwrap_or("Error"),
            error["desc"].as_str().unwrap_or("(no description)")
        ),
        None => format!("unexpected answer: {value}"),
    }
}
