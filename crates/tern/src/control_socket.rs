//! The control socket of `tern migrate`, `tern receive` and `tern vm`
//! (`--control-socket PATH`): a Unix socket, mode 0600 and refused to other
//! users, speaking a QMP-shaped JSON protocol, one JSON object per line,
//! to any number of clients at once (docs/control.md).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};
use tern_engine::{
    Address, CONTRACT_VERSION, ControlError, Event, EventBody, MigrationHandle,
    MigrationParameters, ReceiveHandle,
};

/// Longest request line accepted; a longer one closes the connection.
pub(crate) const MAX_REQUEST_BYTES: u64 = 64 << 10;
/// Most clients connected at once; more are told so and closed.
pub(crate) const MAX_CLIENTS: usize = 16;
/// How long closing the socket waits for the events of an ended migration
/// to reach the clients (they are written from a thread of their own).
const FLUSH_DEADLINE: Duration = Duration::from_secs(5);
/// Every command the socket knows, for `query-commands`.
pub(crate) const COMMANDS: &[&str] = &[
    "qmp_capabilities",
    "query-version",
    "query-commands",
    "query-migrate",
    "query-migrate-parameters",
    "query-events",
    "migrate-set-parameters",
    "migrate_cancel",
    "migrate-switch-over",
    "migrate-start-postcopy",
    "migrate-resume",
    "migrate",
    "migrate-recover",
    "cont",
];

/// What the socket steers: a source's migration or a destination.
#[derive(Clone)]
pub(crate) enum Target {
    /// `tern migrate`, `tern vm migrate`.
    Source(MigrationHandle),
    /// `tern receive`, `tern vm receive`.
    Destination(ReceiveHandle),
}

/// Resumes a guest handed over paused (`cont`).
pub(crate) type Resume = Box<dyn FnOnce() -> anyhow::Result<()> + Send>;

/// A running control socket; removed when dropped.
pub(crate) struct ControlSocket {
    path: PathBuf,
    shared: Arc<Shared>,
    /// One per steered target: disconnected once its forwarding thread
    /// has written the target's last event.
    forwarders: Mutex<Vec<Forwarder>>,
}

/// A thread writing one target's events to the clients.
struct Forwarder {
    target: Target,
    finished: Receiver<()>,
}

struct Shared {
    target: Mutex<Option<Target>>,
    resume: Mutex<Option<Resume>>,
    clients: Mutex<Vec<Arc<Mutex<UnixStream>>>>,
    connected: AtomicUsize,
    stopping: AtomicBool,
    /// Tests stand in for a forwarding thread the scheduler runs late.
    #[cfg(test)]
    forward_pause: Mutex<Duration>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl ControlSocket {
    /// Creates the socket at `path` (mode 0600) and serves it from a
    /// thread of its own. A stale socket file nobody listens on is
    /// replaced; a live one is an error.
    pub(crate) fn start(path: &Path) -> anyhow::Result<Self> {
        if path.exists() {
            anyhow::ensure!(
                UnixStream::connect(path).is_err(),
                "--control-socket {}: another process listens on it",
                path.display()
            );
            std::fs::remove_file(path)
                .with_context(|| format!("--control-socket {}", path.display()))?;
        }
        let listener = UnixListener::bind(path)
            .with_context(|| format!("cannot create the control socket {}", path.display()))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("cannot restrict {} to mode 0600", path.display()))?;
        let shared = Arc::new(Shared {
            target: Mutex::new(None),
            resume: Mutex::new(None),
            clients: Mutex::new(Vec::new()),
            connected: AtomicUsize::new(0),
            stopping: AtomicBool::new(false),
            #[cfg(test)]
            forward_pause: Mutex::new(Duration::ZERO),
        });
        let accepting = shared.clone();
        std::thread::Builder::new()
            .name("tern-control".into())
            .spawn(move || accept_loop(&listener, &accepting))
            .context("cannot start the control socket's thread")?;
        Ok(Self {
            path: path.to_path_buf(),
            shared,
            forwarders: Mutex::new(Vec::new()),
        })
    }

    /// Steers `target` from now on, and forwards its events to every
    /// client.
    pub(crate) fn set_target(&self, target: Target) {
        let events = match &target {
            Target::Source(handle) => handle.subscribe(),
            Target::Destination(handle) => handle.subscribe(),
        };
        *lock(&self.shared.target) = Some(target.clone());
        let shared = self.shared.clone();
        let (finishing, finished): (Sender<()>, _) = channel();
        let spawned = std::thread::Builder::new()
            .name("tern-control-events".into())
            .spawn(move || {
                // Dropped when the thread ends: the socket's Drop knows.
                let _finishing = finishing;
                for event in events {
                    #[cfg(test)]
                    std::thread::sleep(*lock(&shared.forward_pause));
                    shared.broadcast(&event);
                }
            });
        if spawned.is_ok() {
            lock(&self.forwarders).push(Forwarder { target, finished });
        }
    }

    /// Waits, at most [`FLUSH_DEADLINE`] in all, until every event of the
    /// targets that ended has been written to the clients: the command
    /// returns as soon as the migration ends, and closing the clients
    /// before its last events reached them would lose the final status
    /// change. A target that never ended is not waited for.
    fn flush_ended_targets(&self) {
        let deadline = Instant::now() + FLUSH_DEADLINE;
        for forwarder in lock(&self.forwarders).iter() {
            if !has_ended(&forwarder.target) {
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if let Err(RecvTimeoutError::Timeout) = forwarder.finished.recv_timeout(left) {
                tracing::warn!("control socket: closing before every event reached the clients");
                return;
            }
        }
    }

    /// Lets `cont` resume a guest handed over paused.
    pub(crate) fn offer_resume(&self, resume: Resume) {
        *lock(&self.shared.resume) = Some(resume);
    }

    /// Sends `event` to every client: one the target's subscription no
    /// longer carries (a `RESUME` after the final status change).
    pub(crate) fn forward(&self, event: &Event) {
        self.shared.broadcast(event);
    }
}

/// Whether `target` has published its final status change, after which its
/// event subscriptions end.
fn has_ended(target: &Target) -> bool {
    let history = match target {
        Target::Source(handle) => handle.history(),
        Target::Destination(handle) => handle.history(),
    };
    history
        .events
        .iter()
        .rev()
        .find_map(|event| match &event.body {
            EventBody::Migration(change) => Some(change.status.is_final()),
            _ => None,
        })
        .unwrap_or(false)
}

impl Drop for ControlSocket {
    fn drop(&mut self) {
        self.flush_ended_targets();
        self.shared.stopping.store(true, Ordering::Relaxed);
        // Wakes the accept loop so that its thread ends.
        let _ = UnixStream::connect(&self.path);
        let _ = std::fs::remove_file(&self.path);
        for client in lock(&self.shared.clients).iter() {
            let _ = lock(client).shutdown(std::net::Shutdown::Both);
        }
    }
}

impl Shared {
    fn broadcast(&self, event: &Event) {
        let Ok(line) = serde_json::to_string(event) else {
            return;
        };
        // Not under the list's lock: a client's greeting takes its writer's
        // lock, then the list's.
        let clients = lock(&self.clients).clone();
        let gone: Vec<_> = clients
            .into_iter()
            .filter(|client| write_line(&mut lock(client), &line).is_err())
            .collect();
        if !gone.is_empty() {
            lock(&self.clients).retain(|client| !gone.iter().any(|g| Arc::ptr_eq(client, g)));
        }
    }

    fn target(&self) -> Option<Target> {
        lock(&self.target).clone()
    }
}

fn write_line(stream: &mut UnixStream, line: &str) -> std::io::Result<()> {
    stream.write_all(line.as_bytes())?;
    stream.write_all(b"\n")
}

fn accept_loop(listener: &UnixListener, shared: &Arc<Shared>) {
    for stream in listener.incoming() {
        if shared.stopping.load(Ordering::Relaxed) {
            return;
        }
        let Ok(stream) = stream else { continue };
        if let Err(reason) = admit(&stream, shared) {
            tracing::warn!("control socket: refused a client: {reason}");
            let mut stream = stream;
            let _ = write_line(
                &mut stream,
                &error_reply(&Value::Null, "GenericError", &reason),
            );
            continue;
        }
        let shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("tern-control-client".into())
            .spawn(move || {
                serve_client(stream, &shared);
                shared.connected.fetch_sub(1, Ordering::Relaxed);
            });
        if spawned.is_err() {
            tracing::warn!("control socket: cannot start a client's thread");
        }
    }
}

/// Takes a client if it runs as this user (or root) and there is room.
fn admit(stream: &UnixStream, shared: &Shared) -> Result<(), String> {
    let uid = peer_uid(stream).map_err(|error| format!("cannot read its credentials: {error}"))?;
    // SAFETY: geteuid has no preconditions.
    let ours = unsafe { libc::geteuid() };
    if uid != ours && uid != 0 {
        return Err(format!("user {uid} is not the socket's owner"));
    }
    if shared.connected.fetch_add(1, Ordering::Relaxed) >= MAX_CLIENTS {
        shared.connected.fetch_sub(1, Ordering::Relaxed);
        return Err(format!("Too many clients (at most {MAX_CLIENTS})"));
    }
    Ok(())
}

fn peer_uid(stream: &UnixStream) -> std::io::Result<libc::uid_t> {
    use std::os::fd::AsRawFd;
    let mut credentials = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    #[expect(
        clippy::cast_possible_truncation,
        reason = "a ucred is three ints, 12 bytes"
    )]
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the buffer is a ucred and `len` its size, as SO_PEERCRED
    // requires; the descriptor is open for the stream's lifetime.
    let result = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut credentials).cast(),
            &mut len,
        )
    };
    if result != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(credentials.uid)
}

fn serve_client(stream: UnixStream, shared: &Arc<Shared>) {
    let Ok(reader) = stream.try_clone() else {
        return;
    };
    let writer = Arc::new(Mutex::new(stream));
    let greeting = json!({
        "QMP": {
            "version": {"tern": env!("CARGO_PKG_VERSION"), "contract": CONTRACT_VERSION},
            "capabilities": [],
        }
    });
    {
        // Subscribed and greeted under the writer's lock: events come after
        // the greeting, and none sent from then on is missed.
        let mut stream = lock(&writer);
        lock(&shared.clients).push(writer.clone());
        if write_line(&mut stream, &greeting.to_string()).is_err() {
            return;
        }
    }
    let mut reader = BufReader::new(reader);
    loop {
        let mut line = Vec::new();
        match (&mut reader)
            .take(MAX_REQUEST_BYTES + 1)
            .read_until(b'\n', &mut line)
        {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if line.len() as u64 > MAX_REQUEST_BYTES {
            let reply = error_reply(
                &Value::Null,
                "GenericError",
                &format!("Request longer than {MAX_REQUEST_BYTES} bytes; closing"),
            );
            let _ = write_line(&mut lock(&writer), &reply);
            drain_before_close(&mut reader, &writer);
            break;
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let reply = answer(&line, shared);
        if write_line(&mut lock(&writer), &reply).is_err() {
            break;
        }
    }
    lock(&shared.clients).retain(|client| !Arc::ptr_eq(client, &writer));
    let _ = lock(&writer).shutdown(std::net::Shutdown::Both);
}

/// The reply to one request line.
fn answer(line: &[u8], shared: &Shared) -> String {
    let request: Value = match serde_json::from_slice(line) {
        Ok(request) => request,
        Err(error) => {
            return error_reply(
                &Value::Null,
                "GenericError",
                &format!("JSON parse error: {error}"),
            );
        }
    };
    let id = request.get("id").cloned().unwrap_or(Value::Null);
    let Some(command) = request.get("execute").and_then(Value::as_str) else {
        return error_reply(
            &id,
            "GenericError",
            "Expected an object with \"execute\": the command's name",
        );
    };
    let arguments = request.get("arguments").cloned().unwrap_or(json!({}));
    if !arguments.is_object() {
        return error_reply(&id, "GenericError", "\"arguments\" must be an object");
    }
    match execute(command, arguments, shared) {
        Ok(value) => {
            let mut reply = json!({"return": value});
            if !id.is_null() {
                reply["id"] = id;
            }
            reply.to_string()
        }
        Err(CommandError { class, desc }) => error_reply(&id, class, &desc),
    }
}

fn error_reply(id: &Value, class: &str, desc: &str) -> String {
    let mut reply = json!({"error": {"class": class, "desc": desc}});
    if !id.is_null() {
        reply["id"] = id.clone();
    }
    reply.to_string()
}

/// A refused command: QMP's error class and a one-line description.
struct CommandError {
    class: &'static str,
    desc: String,
}

impl CommandError {
    fn generic(desc: impl Into<String>) -> Self {
        Self {
            class: "GenericError",
            desc: desc.into(),
        }
    }
}

impl From<ControlError> for CommandError {
    fn from(error: ControlError) -> Self {
        Self::generic(error.to_string())
    }
}

fn execute(command: &str, arguments: Value, shared: &Shared) -> Result<Value, CommandError> {
    let takes_no_arguments = || -> Result<(), CommandError> {
        match arguments.as_object() {
            Some(map) if !map.is_empty() => Err(CommandError::generic(format!(
                "{command} takes no arguments"
            ))),
            _ => Ok(()),
        }
    };
    match command {
        "qmp_capabilities" => Ok(json!({})),
        "query-version" => {
            Ok(json!({"tern": env!("CARGO_PKG_VERSION"), "contract": CONTRACT_VERSION}))
        }
        "query-commands" => Ok(Value::Array(
            COMMANDS.iter().map(|name| json!({"name": name})).collect(),
        )),
        "query-migrate" => {
            takes_no_arguments()?;
            to_value(match target(shared)? {
                Target::Source(handle) => serde_json::to_value(handle.query()),
                Target::Destination(handle) => serde_json::to_value(handle.query()),
            })
        }
        "query-migrate-parameters" => {
            takes_no_arguments()?;
            match target(shared)? {
                Target::Source(handle) => to_value(serde_json::to_value(handle.parameters())),
                // A destination has no live parameters (docs/control.md).
                Target::Destination(_) => Ok(json!({})),
            }
        }
        "query-events" => query_events(&arguments, shared),
        "migrate-set-parameters" => {
            let patch: MigrationParameters = serde_json::from_value(arguments)
                .map_err(|error| CommandError::generic(format!("Invalid parameters: {error}")))?;
            if patch.is_empty() {
                return Err(CommandError::generic("No parameter given"));
            }
            source(shared, command)?.set_parameters(&patch)?;
            Ok(json!({}))
        }
        "migrate_cancel" | "migrate-cancel" => {
            takes_no_arguments()?;
            match target(shared)? {
                Target::Source(handle) => handle.cancel(),
                Target::Destination(handle) => handle.cancel(),
            }
            Ok(json!({}))
        }
        "migrate-switch-over" => {
            takes_no_arguments()?;
            source(shared, command)?.switch_over_now()?;
            Ok(json!({}))
        }
        "migrate-start-postcopy" => {
            takes_no_arguments()?;
            source(shared, command)?.start_postcopy()?;
            Ok(json!({}))
        }
        // QEMU's `migrate` with `resume: true` on the source; tern starts
        // migrations from its command line, so that is all `migrate` does.
        "migrate" => {
            if arguments.get("resume").and_then(Value::as_bool) != Some(true) {
                return Err(CommandError::generic(
                    "tern starts migrations from its command line: migrate here only resumes a \
                     postcopy-paused one ({\"resume\": true})",
                ));
            }
            only_arguments(command, &arguments, &["resume", "uri"])?;
            resume_postcopy(&source(shared, command)?, &arguments)
        }
        "migrate-resume" => {
            only_arguments(command, &arguments, &["uri"])?;
            resume_postcopy(&source(shared, command)?, &arguments)
        }
        // QEMU's `migrate-recover` names the address to listen on; without
        // one, tern's destination accepts again where the reception started.
        "migrate-recover" => {
            only_arguments(command, &arguments, &["uri"])?;
            let handle = match target(shared)? {
                Target::Destination(handle) => handle,
                Target::Source(_) => {
                    return Err(CommandError::generic(
                        "migrate-recover is a destination's command; a source resumes with \
                         migrate-resume (or migrate with resume=true)",
                    ));
                }
            };
            match uri_argument(&arguments)? {
                Some(address) => {
                    let bound = handle.recover_postcopy_at(&address)?;
                    Ok(json!({"uri": bound.to_string()}))
                }
                None => {
                    handle.recover_postcopy()?;
                    Ok(json!({}))
                }
            }
        }
        "cont" => {
            takes_no_arguments()?;
            cont(shared)
        }
        other => Err(CommandError {
            class: "CommandNotFound",
            desc: format!("The command {other} has not been found"),
        }),
    }
}

/// Refuses arguments other than `allowed`.
fn only_arguments(command: &str, arguments: &Value, allowed: &[&str]) -> Result<(), CommandError> {
    let Some(map) = arguments.as_object() else {
        return Ok(());
    };
    match map.keys().find(|name| !allowed.contains(&name.as_str())) {
        Some(name) => Err(CommandError::generic(format!(
            "{command} takes no argument {name:?} (it takes: {})",
            allowed.join(", ")
        ))),
        None => Ok(()),
    }
}

/// The optional `uri` argument (QEMU's name), as an address.
fn uri_argument(arguments: &Value) -> Result<Option<Address>, CommandError> {
    let Some(uri) = arguments.get("uri") else {
        return Ok(None);
    };
    let text = uri
        .as_str()
        .ok_or_else(|| CommandError::generic("uri must be a string such as tcp:HOST:PORT"))?;
    text.parse::<Address>()
        .map(Some)
        .map_err(|error| CommandError::generic(format!("uri: {error}")))
}

/// A postcopy-paused source reconnects, to the `uri` given if any.
fn resume_postcopy(handle: &MigrationHandle, arguments: &Value) -> Result<Value, CommandError> {
    match uri_argument(arguments)? {
        Some(address) => handle.resume_postcopy_to(address)?,
        None => handle.resume_postcopy()?,
    }
    Ok(json!({}))
}

fn to_value(value: Result<Value, serde_json::Error>) -> Result<Value, CommandError> {
    value.map_err(|error| CommandError::generic(error.to_string()))
}

fn target(shared: &Shared) -> Result<Target, CommandError> {
    shared
        .target()
        .ok_or_else(|| CommandError::generic("No migration has started yet"))
}

fn source(shared: &Shared, command: &str) -> Result<MigrationHandle, CommandError> {
    match target(shared)? {
        Target::Source(handle) => Ok(handle),
        Target::Destination(_) => Err(CommandError::generic(format!(
            "{command} is a source's command; this is a destination, which has no live \
             parameters (the source paces the migration)"
        ))),
    }
}

/// Resumes a guest the destination handed over paused.
fn cont(shared: &Shared) -> Result<Value, CommandError> {
    let handle = match target(shared)? {
        Target::Destination(handle) => handle,
        Target::Source(_) => {
            return Err(CommandError::generic(
                "cont resumes a guest handed over paused at a destination; this is a source",
            ));
        }
    };
    let resume = lock(&shared.resume).take().ok_or_else(|| {
        CommandError::generic("No guest is waiting paused (receive with --paused)")
    })?;
    resume().map_err(|error| CommandError::generic(format!("Cannot resume: {error:#}")))?;
    shared.broadcast(&handle.note_resumed());
    Ok(json!({}))
}

/// The events the target kept (`query-events`), those after `since` when
/// given: `{"events": [...], "dropped": N}`. Before any migration
/// started, none.
fn query_events(arguments: &Value, shared: &Shared) -> Result<Value, CommandError> {
    let arguments = arguments.as_object().cloned().unwrap_or_default();
    let mut since = 0;
    for (name, value) in &arguments {
        match (name.as_str(), value.as_u64()) {
            ("since", Some(seq)) => since = seq,
            ("since", None) => {
                return Err(CommandError::generic(
                    "Parameter 'since' must be an event's seq (a whole number)",
                ));
            }
            (other, _) => {
                return Err(CommandError::generic(format!(
                    "query-events takes only 'since', not '{other}'"
                )));
            }
        }
    }
    let mut history = match shared.target() {
        Some(Target::Source(handle)) => handle.history(),
        Some(Target::Destination(handle)) => handle.history(),
        None => tern_engine::EventHistory::default(),
    };
    history.events.retain(|event| event.seq > since);
    to_value(serde_json::to_value(history))
}

/// Ends a client that sent too much: our side of the stream is shut (the
/// reply already written reaches it), and what it still sends is read and
/// dropped for up to a second and 1 MiB, so that closing does not reset
/// the connection and lose the reply before the client reads it.
fn drain_before_close(reader: &mut BufReader<UnixStream>, writer: &Mutex<UnixStream>) {
    let _ = lock(writer).shutdown(std::net::Shutdown::Write);
    let _ = reader
        .get_ref()
        .set_read_timeout(Some(std::time::Duration::from_secs(1)));
    let _ = std::io::copy(&mut reader.take(1 << 20), &mut std::io::sink());
}

#[cfg(test)]
mod tests {
    use super::*;
    use tern_engine::{MigrationConfig, Source};
    use tern_synthetic::{SyntheticConfig, SyntheticGuest};

    /// The command drops its socket as soon as the migration returns; the
    /// final status change must still reach a watching client, which
    /// otherwise reads the end of the stream where it waits for
    /// `completed`, `failed` or `cancelled`.
    #[test]
    fn the_final_status_reaches_watchers_before_the_socket_closes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control");
        let socket = ControlSocket::start(&path).unwrap();
        let client = UnixStream::connect(&path).unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let mut reader = BufReader::new(client);
        let mut greeting = String::new();
        reader.read_line(&mut greeting).unwrap();
        assert!(greeting.contains("QMP"), "{greeting}");
        // Each event reaches the clients 50 ms after it happened.
        *lock(&socket.shared.forward_pause) = Duration::from_millis(50);
        let source = Source::new(MigrationConfig::default()).unwrap();
        socket.set_target(Target::Source(source.handle()));
        let mut guest = SyntheticGuest::new(&SyntheticConfig {
            memory_bytes: 1 << 20,
            ..SyntheticConfig::default()
        })
        .unwrap();
        source.cancel_token().cancel();
        let nowhere: tern_engine::Address = "127.0.0.1:9".parse().unwrap();
        assert!(source.migrate(&mut guest, &nowhere).is_err());
        drop(socket);
        let lines: Vec<Value> = reader
            .lines()
            .map(|line| serde_json::from_str(&line.unwrap()).unwrap())
            .collect();
        let last = lines.last().expect("at least the final status change");
        assert_eq!(last["event"], "MIGRATION", "{lines:?}");
        assert_eq!(last["data"]["status"], "cancelled", "{lines:?}");
    }
}
