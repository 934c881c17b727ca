//! The agent's I/O: the Unix socket (mode 0600, peers of another user
//! refused by `SO_PEERCRED`), a thread per connection, and a ticker that
//! measures members' processes, advances the [`Fleet`] and pushes its
//! directives. Every decision is the registry's; this file only moves
//! lines.

use std::collections::BTreeMap;
use std::io::BufReader;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tern_engine::{MigrationParameters, MigrationStatus};

use crate::error::FleetError;
use crate::line::{LineError, read_line, write_line};
use crate::peer::{Peer, own_uid, peer, tcp_bytes_sent};
use crate::protocol::{
    COMMANDS, FLEET_PROTOCOL_VERSION, FleetSettings, FleetView, JoinRequest, MAX_LINE_BYTES,
    MemberCommand, MigrationPolicy, Progress, PushedEvent,
};
use crate::registry::{Fleet, Settings};

/// Most connections at once (members and operators).
pub const MAX_CONNECTIONS: usize = 256;
/// How often the agent re-divides the budget and checks limits.
pub const TICK: Duration = Duration::from_millis(100);
/// A member that does not take a line within this long is skipped.
const WRITE_TIMEOUT: Duration = Duration::from_secs(1);

/// A running agent; its socket is removed and every connection closed
/// when dropped (as when its process dies).
#[derive(Debug)]
pub struct Agent {
    path: PathBuf,
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    fleet: Mutex<Fleet>,
    started: Instant,
    writers: Mutex<BTreeMap<String, Writer>>,
    connections: Mutex<Vec<Writer>>,
    connected: AtomicUsize,
    stopping: AtomicBool,
}

type Writer = Arc<Mutex<UnixStream>>;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl Agent {
    /// Creates the socket at `path` (mode 0600) and serves it, with
    /// `settings`. A stale socket file nobody listens on is replaced.
    pub fn start(path: &Path, settings: Settings) -> Result<Self, FleetError> {
        let socket_error = |source| FleetError::Socket {
            path: path.to_path_buf(),
            source,
        };
        if path.exists() {
            if UnixStream::connect(path).is_ok() {
                return Err(FleetError::InUse(path.to_path_buf()));
            }
            std::fs::remove_file(path).map_err(socket_error)?;
        }
        let listener = UnixListener::bind(path).map_err(socket_error)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(socket_error)?;
        let shared = Arc::new(Shared {
            fleet: Mutex::new(Fleet::new(settings)),
            started: Instant::now(),
            writers: Mutex::new(BTreeMap::new()),
            connections: Mutex::new(Vec::new()),
            connected: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
        });
        let accepting = shared.clone();
        std::thread::Builder::new()
            .name("tern-agent".into())
            .spawn(move || accept_loop(&listener, &accepting))
            .map_err(socket_error)?;
        let ticking = shared.clone();
        std::thread::Builder::new()
            .name("tern-agent-tick".into())
            .spawn(move || {
                while !ticking.stopping.load(Ordering::Relaxed) {
                    ticking.tick();
                    std::thread::sleep(TICK);
                }
            })
            .map_err(socket_error)?;
        Ok(Self {
            path: path.to_path_buf(),
            shared,
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every migration, as `query-fleet` answers.
    pub fn view(&self) -> FleetView {
        self.shared.view()
    }

    /// Changes the host's settings (`fleet-set`).
    pub fn set(&self, patch: &FleetSettings) -> Result<(), FleetError> {
        lock(&self.shared.fleet).set(patch)?;
        self.shared.tick();
        Ok(())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::Relaxed);
        // Wakes the accept loop so that its thread ends.
        let _ = UnixStream::connect(&self.path);
        let _ = std::fs::remove_file(&self.path);
        for connection in lock(&self.shared.connections).iter() {
            let _ = lock(connection).shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Shared {
    fn now(&self) -> Duration {
        self.started.elapsed()
    }

    fn view(&self) -> FleetView {
        lock(&self.fleet).view(self.now())
    }

    /// Measures, advances the fleet and pushes what changed.
    fn tick(&self) {
        let pids = lock(&self.fleet).pids();
        let now = self.now();
        let written = tcp_bytes_sent(&pids);
        let directives = {
            let mut fleet = lock(&self.fleet);
            for (pid, bytes) in written {
                fleet.measured(pid, bytes, now);
            }
            fleet.tick(now)
        };
        for (id, directive) in directives {
            self.push(
                &id,
                &PushedEvent {
                    version: FLEET_PROTOCOL_VERSION,
                    directive,
                },
            );
        }
    }

    fn push(&self, id: &str, event: &PushedEvent) {
        let Some(writer) = lock(&self.writers).get(id).cloned() else {
            return;
        };
        if let Ok(line) = serde_json::to_string(event) {
            let _ = write_line(&mut *lock(&writer), &line);
        }
    }
}

fn accept_loop(listener: &UnixListener, shared: &Arc<Shared>) {
    for stream in listener.incoming() {
        if shared.stopping.load(Ordering::Relaxed) {
            return;
        }
        let Ok(stream) = stream else { continue };
        let peer = match admit(&stream, shared) {
            Ok(peer) => peer,
            Err(reason) => {
                tracing::warn!("agent: refused a client: {reason}");
                let mut stream = stream;
                let _ = write_line(
                    &mut stream,
                    &error_reply(&Value::Null, "GenericError", &reason),
                );
                continue;
            }
        };
        let shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("tern-agent-client".into())
            .spawn(move || {
                serve(stream, peer, &shared);
                shared.connected.fetch_sub(1, Ordering::Relaxed);
            });
        if spawned.is_err() {
            tracing::warn!("agent: cannot start a client's thread");
        }
    }
}

/// Takes a client that runs as this user (or root), if there is room.
fn admit(stream: &UnixStream, shared: &Shared) -> Result<Peer, String> {
    let peer = peer(stream).map_err(|error| format!("cannot read its credentials: {error}"))?;
    if peer.uid != own_uid() && peer.uid != 0 {
        return Err(format!("user {} is not the socket's owner", peer.uid));
    }
    if shared.connected.fetch_add(1, Ordering::Relaxed) >= MAX_CONNECTIONS {
        shared.connected.fetch_sub(1, Ordering::Relaxed);
        return Err(format!("Too many clients (at most {MAX_CONNECTIONS})"));
    }
    Ok(peer)
}

/// One connection: an operator, or a member once it sent `fleet-join`.
struct Connection<'a> {
    shared: &'a Shared,
    peer: Peer,
    writer: Writer,
    member: Option<String>,
}

fn serve(stream: UnixStream, peer: Peer, shared: &Shared) {
    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
    let Ok(reader) = stream.try_clone() else {
        return;
    };
    let writer = Arc::new(Mutex::new(stream));
    lock(&shared.connections).push(writer.clone());
    let greeting = json!({
        "QMP": {
            "version": {"tern": env!("CARGO_PKG_VERSION"), "fleet": FLEET_PROTOCOL_VERSION},
            "capabilities": ["fleet"],
        }
    });
    let mut connection = Connection {
        shared,
        peer,
        writer,
        member: None,
    };
    if connection.send(&greeting.to_string()).is_ok() {
        connection.read_requests(&mut BufReader::new(reader));
    }
    if let Some(id) = connection.member.take() {
        // Gone without a leave: its process died, or it closed early.
        tracing::info!(migration = %id, "member gone: its slot and share are released");
        lock(&shared.writers).remove(&id);
        lock(&shared.fleet).leave(&id, None);
        shared.tick();
    }
    let writer = connection.writer;
    lock(&shared.connections).retain(|other| !Arc::ptr_eq(other, &writer));
    let _ = lock(&writer).shutdown(std::net::Shutdown::Both);
}

impl Connection<'_> {
    fn send(&self, line: &str) -> std::io::Result<()> {
        write_line(&mut *lock(&self.writer), line)
    }

    fn read_requests(&mut self, reader: &mut BufReader<UnixStream>) {
        loop {
            let line = match read_line(reader, MAX_LINE_BYTES) {
                Ok(line) => line,
                Err(LineError::Closed) => return,
                Err(LineError::TooLong) => {
                    let _ = self.send(&error_reply(
                        &Value::Null,
                        "GenericError",
                        &format!("Request longer than {MAX_LINE_BYTES} bytes; closing"),
                    ));
                    return;
                }
            };
            let (reply, then_tick) = self.answer(&line);
            if self.send(&reply).is_err() {
                return;
            }
            if then_tick {
                self.shared.tick();
            }
        }
    }

    /// The reply to one line, and whether the fleet changed (tick now).
    fn answer(&mut self, line: &[u8]) -> (String, bool) {
        let request: Value = match serde_json::from_slice(line) {
            Ok(request) => request,
            Err(error) => {
                let desc = format!("JSON parse error: {error}");
                return (error_reply(&Value::Null, "GenericError", &desc), false);
            }
        };
        let id = request.get("id").cloned().unwrap_or(Value::Null);
        let Some(command) = request.get("execute").and_then(Value::as_str) else {
            let desc = "Expected an object with \"execute\": the command's name";
            return (error_reply(&id, "GenericError", desc), false);
        };
        let arguments = request.get("arguments").cloned().unwrap_or(json!({}));
        if !arguments.is_object() {
            let desc = "\"arguments\" must be an object";
            return (error_reply(&id, "GenericError", desc), false);
        }
        let changes = !matches!(
            command,
            "query-fleet" | "query-migrate" | "query-version" | "query-commands" | "fleet-report"
        );
        match self.execute(command, arguments) {
            Ok(value) => {
                let mut reply = json!({"return": value});
                if !id.is_null() {
                    reply["id"] = id;
                }
                (reply.to_string(), changes)
            }
            Err((class, desc)) => (error_reply(&id, class, &desc), false),
        }
    }

    fn execute(
        &mut self,
        command: &str,
        arguments: Value,
    ) -> Result<Value, (&'static str, String)> {
        let generic = |error: String| ("GenericError", error);
        let now = self.shared.now();
        match command {
            "qmp_capabilities" => Ok(json!({})),
            "query-version" => {
                Ok(json!({"tern": env!("CARGO_PKG_VERSION"), "fleet": FLEET_PROTOCOL_VERSION}))
            }
            "query-commands" => Ok(Value::Array(
                COMMANDS.iter().map(|name| json!({"name": name})).collect(),
            )),
            "fleet-join" => self.join(arguments).map_err(generic),
            "fleet-report" => {
                let id = self.member_id().map_err(generic)?;
                let progress: Progress = parse(arguments).map_err(generic)?;
                lock(&self.shared.fleet)
                    .report(&id, progress, now)
                    .map_err(|error| generic(error.to_string()))?;
                Ok(json!({}))
            }
            "fleet-leave" => {
                let id = self.member_id().map_err(generic)?;
                let status: Option<MigrationStatus> = arguments
                    .get("status")
                    .cloned()
                    .and_then(|status| serde_json::from_value(status).ok());
                lock(&self.shared.writers).remove(&id);
                lock(&self.shared.fleet).leave(&id, status);
                self.member = None;
                Ok(json!({}))
            }
            "query-fleet" => to_value(&self.shared.view()),
            "fleet-set" => {
                let patch: FleetSettings = parse(arguments).map_err(generic)?;
                lock(&self.shared.fleet)
                    .set(&patch)
                    .map_err(|error| generic(error.to_string()))?;
                Ok(json!({}))
            }
            _ => self.for_migration(command, arguments),
        }
    }

    /// The commands that name a migration: `{"migration": ID, ...}`.
    // long: one match over the per-migration commands, each a few lines
    fn for_migration(
        &mut self,
        command: &str,
        mut arguments: Value,
    ) -> Result<Value, (&'static str, String)> {
        let generic = |error: String| ("GenericError", error);
        let id = match arguments
            .as_object_mut()
            .and_then(|map| map.remove("migration"))
        {
            Some(Value::String(id)) => id,
            _ if COMMANDS.contains(&command) => {
                return Err(generic(format!(
                    "{command} needs \"migration\": the id query-fleet lists"
                )));
            }
            _ => {
                return Err((
                    "CommandNotFound",
                    format!("The command {command} has not been found"),
                ));
            }
        };
        let takes_no_more = || match arguments.as_object() {
            Some(map) if !map.is_empty() => {
                Err(generic(format!("{command} takes only \"migration\"")))
            }
            _ => Ok(()),
        };
        let fleet_error = |error: FleetError| generic(error.to_string());
        let member_command = match command {
            "query-migrate" => {
                takes_no_more()?;
                let progress = lock(&self.shared.fleet)
                    .progress(&id)
                    .map_err(fleet_error)?;
                return to_value(&progress);
            }
            "migrate-set-policy" => {
                let patch: MigrationPolicy = parse(arguments).map_err(generic)?;
                lock(&self.shared.fleet)
                    .set_policy(&id, &patch)
                    .map_err(fleet_error)?;
                return Ok(json!({}));
            }
            "migrate-set-parameters" => {
                let patch: MigrationParameters = parse(arguments).map_err(generic)?;
                patch
                    .validate()
                    .map_err(|error| generic(error.to_string()))?;
                if patch.is_empty() {
                    return Err(generic("No parameter given".into()));
                }
                MemberCommand::SetParameters(patch)
            }
            "migrate_cancel" | "migrate-cancel" => {
                takes_no_more()?;
                MemberCommand::Cancel
            }
            "migrate-switch-over" => {
                takes_no_more()?;
                MemberCommand::SwitchOver
            }
            other => {
                return Err((
                    "CommandNotFound",
                    format!("The command {other} has not been found"),
                ));
            }
        };
        let directive = lock(&self.shared.fleet)
            .command(&id, member_command)
            .map_err(fleet_error)?;
        if let Some(directive) = directive {
            self.shared.push(
                &id,
                &PushedEvent {
                    version: FLEET_PROTOCOL_VERSION,
                    directive,
                },
            );
        }
        Ok(json!({}))
    }

    fn join(&mut self, arguments: Value) -> Result<Value, String> {
        if let Some(id) = &self.member
            && lock(&self.shared.fleet).contains(id)
        {
            return Err(format!("This connection already joined as {id}"));
        }
        let request: JoinRequest = parse(arguments)?;
        if request.name.len() > 256 {
            return Err("\"name\" is longer than 256 bytes".into());
        }
        let reply = lock(&self.shared.fleet).join(request, self.peer.pid, self.shared.now());
        lock(&self.shared.writers).insert(reply.migration.clone(), self.writer.clone());
        self.member = Some(reply.migration.clone());
        serde_json::to_value(&reply).map_err(|error| error.to_string())
    }

    fn member_id(&self) -> Result<String, String> {
        let id = self
            .member
            .clone()
            .ok_or_else(|| "Join first (fleet-join)".to_string())?;
        if !lock(&self.shared.fleet).contains(&id) {
            return Err(FleetError::UnknownMigration(id).to_string());
        }
        Ok(id)
    }
}

fn parse<T: serde::de::DeserializeOwned>(arguments: Value) -> Result<T, String> {
    serde_json::from_value(arguments).map_err(|error| format!("Invalid arguments: {error}"))
}

fn to_value(value: &impl serde::Serialize) -> Result<Value, (&'static str, String)> {
    serde_json::to_value(value).map_err(|error| ("GenericError", error.to_string()))
}

fn error_reply(id: &Value, class: &str, desc: &str) -> String {
    let mut reply = json!({"error": {"class": class, "desc": desc}});
    if !id.is_null() {
        reply["id"] = id.clone();
    }
    reply.to_string()
}
