//! The agent over its real socket, with real migration handles: slots and
//! the queue, shares applied, the faults (the agent dies, a member dies, a
//! member lies, another user knocks), and two real migrations through one
//! slot.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tern_engine::{
    Address, Destination, GuestError, Listener, MigrationConfig, MigrationHandle, MigrationStatus,
    PostcopyMode, PostcopyTrigger, ReceiveConfig, Source,
};
use tern_fleet::protocol::{FleetState, MigrationView};
use tern_fleet::{Agent, JoinOptions, Settings, Steered, join};
use tern_synthetic::{SyntheticConfig, SyntheticGuest};
use tern_test_skip::userfaultfd_works;
use tern_test_skip::wait::{DEADLINE, join_within, output_within, wait_until};

const MB: u64 = 1_000_000;

fn settings(slots: u32, bandwidth: u64) -> Settings {
    Settings {
        bandwidth,
        outbound_slots: slots,
        inbound_slots: slots,
        ..Settings::default()
    }
}

fn socket_in(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("agent.sock")
}

fn source_handle() -> (Source, MigrationHandle) {
    let source = Source::new(MigrationConfig::default()).expect("source");
    let handle = source.handle();
    (source, handle)
}

fn find(agent: &Agent, id: &str) -> Option<MigrationView> {
    agent
        .view()
        .migrations
        .into_iter()
        .find(|member| member.migration == id)
}

/// A raw client: the greeting read, then one request per call.
struct Client {
    stream: UnixStream,
    reader: BufReader<UnixStream>,
}

impl Client {
    fn connect(path: &Path) -> Self {
        let stream = UnixStream::connect(path).expect("connect");
        stream.set_read_timeout(Some(DEADLINE)).unwrap();
        let mut client = Self {
            reader: BufReader::new(stream.try_clone().unwrap()),
            stream,
        };
        let greeting = client.read();
        assert_eq!(greeting["QMP"]["version"]["fleet"], 1, "{greeting}");
        client
    }

    fn read(&mut self) -> Value {
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("a line");
        serde_json::from_str(&line).unwrap_or_else(|_| panic!("not JSON: {line:?}"))
    }

    /// Sends a command; its reply (events before it skipped).
    fn execute(&mut self, command: &str, arguments: Value) -> Value {
        let request = json!({"execute": command, "arguments": arguments});
        writeln!(self.stream, "{request}").unwrap();
        loop {
            let reply = self.read();
            if reply.get("event").is_none() {
                return reply;
            }
        }
    }
}

#[test]
fn beyond_its_slot_a_migration_waits_queued_and_starts_when_the_slot_frees() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(&socket_in(&dir), settings(1, 100 * MB)).unwrap();
    let (_first_source, first) = source_handle();
    let first = join(
        agent.path(),
        Steered::Source(first),
        JoinOptions::new("first"),
    )
    .unwrap();
    let first_id = first.state().migration.unwrap();
    let (_second_source, second_handle) = source_handle();
    let path = agent.path().to_path_buf();
    let waiting = std::thread::spawn(move || {
        join(
            &path,
            Steered::Source(second_handle),
            JoinOptions::new("second"),
        )
    });
    wait_until("the second to be listed as queued first in line", || {
        agent.view().migrations.iter().any(|member| {
            member.name == "second"
                && member.state == FleetState::Queued
                && member.position == Some(1)
        })
    });
    assert!(!waiting.is_finished());
    assert_eq!(find(&agent, &first_id).unwrap().state, FleetState::Running);
    drop(first);
    let second = join_within(waiting, "the queued join").unwrap();
    assert!(second.state().granted);
    let second_id = second.state().migration.unwrap();
    wait_until("the second to run alone", || {
        agent.view().migrations.len() == 1
            && find(&agent, &second_id).is_some_and(|member| member.state == FleetState::Running)
    });
}

#[test]
fn beyond_the_inbound_slots_a_destination_waits_queued_and_starts_when_a_slot_frees() {
    let dir = tempfile::tempdir().unwrap();
    let mut host = settings(4, 0);
    host.inbound_slots = 1;
    let agent = Agent::start(&socket_in(&dir), host).unwrap();
    let first_destination = Destination::new(ReceiveConfig::default());
    let first = join(
        agent.path(),
        Steered::Destination(first_destination.handle()),
        JoinOptions::new("first-in"),
    )
    .unwrap();
    let first_id = first.state().migration.unwrap();
    let path = agent.path().to_path_buf();
    let waiting = |name: &'static str| {
        let path = path.clone();
        std::thread::spawn(move || {
            let destination = Destination::new(ReceiveConfig::default());
            let joined = join(
                &path,
                Steered::Destination(destination.handle()),
                JoinOptions::new(name),
            );
            (destination, joined)
        })
    };
    let second = waiting("second-in");
    wait_until("the second to queue first in line", || {
        agent.view().migrations.iter().any(|member| {
            member.name == "second-in"
                && member.state == FleetState::Queued
                && member.position == Some(1)
        })
    });
    let third = waiting("third-in");
    wait_until("the third to queue behind it", || {
        agent.view().migrations.iter().any(|member| {
            member.name == "third-in"
                && member.state == FleetState::Queued
                && member.position == Some(2)
        })
    });
    // An outbound migration is not held up by the inbound queue.
    let (_source, outbound) = source_handle();
    let outbound = join(
        agent.path(),
        Steered::Source(outbound),
        JoinOptions::new("leaving"),
    )
    .unwrap();
    assert!(outbound.state().granted);
    assert!(!second.is_finished() && !third.is_finished());
    assert_eq!(find(&agent, &first_id).unwrap().state, FleetState::Running);
    drop(first);
    let (_second_destination, second) = join_within(second, "the second's queued join");
    let second = second.unwrap();
    assert!(second.state().granted);
    let second_id = second.state().migration.unwrap();
    wait_until("the second running, the third first in line", || {
        let view = agent.view();
        find(&agent, &second_id).is_some_and(|member| member.state == FleetState::Running)
            && view
                .migrations
                .iter()
                .any(|member| member.name == "third-in" && member.position == Some(1))
    });
    assert!(!third.is_finished(), "one inbound slot");
    drop(second);
    let (_third_destination, third) = join_within(third, "the third's queued join");
    assert!(third.unwrap().state().granted);
}

#[test]
fn the_share_is_applied_to_the_migration_and_redivided() {
    let dir = tempfile::tempdir().unwrap();
    // Equal shares: converge-first would admit b only once a's first pass
    // ended, and these migrations never start.
    let mut host = settings(2, 100 * MB);
    host.division = tern_fleet::Division::Equal;
    let agent = Agent::start(&socket_in(&dir), host).unwrap();
    let (_a_source, a_handle) = source_handle();
    let a = join(
        agent.path(),
        Steered::Source(a_handle.clone()),
        JoinOptions::new("a"),
    )
    .unwrap();
    wait_until("a to have the whole budget", || {
        a_handle.parameters().max_bandwidth == Some(100 * MB)
    });
    let (_b_source, b_handle) = source_handle();
    let mut options = JoinOptions::new("b");
    options.policy.bandwidth_per_migration = Some(30 * MB);
    let b = join(agent.path(), Steered::Source(b_handle.clone()), options).unwrap();
    wait_until("the budget split, b capped at 30 MB/s", || {
        let (a_share, b_share) = (
            a_handle.parameters().max_bandwidth.unwrap_or(0),
            b_handle.parameters().max_bandwidth.unwrap_or(0),
        );
        b_share <= 30 * MB && a_share + b_share <= 100 * MB && a_share >= 70 * MB
    });
    drop(b);
    wait_until("a to have it all again", || {
        a_handle.parameters().max_bandwidth == Some(100 * MB)
    });
    drop(a);
}

#[test]
fn a_member_that_dies_releases_its_slot_and_share() {
    let dir = tempfile::tempdir().unwrap();
    // Silence alone would release it only after an hour: what releases it
    // here is its connection closing.
    let mut host = settings(1, 100 * MB);
    host.silence_limit = Duration::from_secs(3600);
    let agent = Agent::start(&socket_in(&dir), host).unwrap();
    // A member whose process dies: the kernel closes its socket, which is
    // all the agent sees (no fleet-leave, no report ever).
    let mut doomed = Client::connect(agent.path());
    let reply = doomed.execute(
        "fleet-join",
        json!({"name": "doomed", "direction": "outbound", "memory": 1 << 30}),
    );
    assert_eq!(reply["return"]["state"], "queued", "{reply}");
    wait_until("the doomed member to hold the slot", || {
        agent
            .view()
            .migrations
            .first()
            .is_some_and(|member| member.share == 100 * MB)
    });
    let (_source, handle) = source_handle();
    let path = agent.path().to_path_buf();
    let waiting =
        std::thread::spawn(move || join(&path, Steered::Source(handle), JoinOptions::new("next")));
    wait_until("the next to queue", || agent.view().migrations.len() == 2);
    drop(doomed);
    wait_until("the slot and the whole share to pass on", || {
        let view = agent.view();
        view.migrations.len() == 1
            && view.migrations[0].name == "next"
            && view.migrations[0].state == FleetState::Running
            && view.migrations[0].share == 100 * MB
    });
    let next = join_within(waiting, "the queued join").unwrap();
    assert!(next.state().granted);
}

#[test]
fn when_the_agent_dies_the_migration_keeps_its_share_and_rejoins_the_next() {
    let dir = tempfile::tempdir().unwrap();
    let path = socket_in(&dir);
    let agent = Agent::start(&path, settings(1, 80 * MB)).unwrap();
    let (_source, handle) = source_handle();
    let member = join(
        &path,
        Steered::Source(handle.clone()),
        JoinOptions::new("vm"),
    )
    .unwrap();
    let id = member.state().migration.unwrap();
    wait_until("the share applied", || {
        handle.parameters().max_bandwidth == Some(80 * MB)
    });
    drop(agent);
    wait_until("the member to notice", || !member.state().connected);
    assert_eq!(
        handle.parameters().max_bandwidth,
        Some(80 * MB),
        "its last share"
    );
    // A new agent with another budget, on the same path.
    let agent = Agent::start(&path, settings(1, 50 * MB)).unwrap();
    wait_until("the member to rejoin, running, with its id", || {
        find(&agent, &id).is_some_and(|view| view.state == FleetState::Running)
    });
    wait_until("the new share applied", || {
        handle.parameters().max_bandwidth == Some(50 * MB)
    });
    assert!(member.state().sessions >= 2);
}

#[test]
fn an_operator_cancels_a_queued_migration_through_the_agent() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(&socket_in(&dir), settings(1, 0)).unwrap();
    let (_first_source, first) = source_handle();
    let _first = join(agent.path(), Steered::Source(first), JoinOptions::new("a")).unwrap();
    let (_second_source, second) = source_handle();
    let path = agent.path().to_path_buf();
    let waiting =
        std::thread::spawn(move || join(&path, Steered::Source(second), JoinOptions::new("b")));
    wait_until("b to queue", || agent.view().migrations.len() == 2);
    let queued = agent.view().migrations[1].migration.clone();
    let mut operator = Client::connect(agent.path());
    let reply = operator.execute("migrate_cancel", json!({"migration": queued}));
    assert_eq!(reply, json!({"return": {}}));
    let second = join_within(waiting, "the queued join").unwrap();
    assert!(second.state().cancelled && !second.state().granted);
    // Unknown ids and commands are refused by name; the connection stays.
    let reply = operator.execute("migrate_cancel", json!({"migration": "m999"}));
    assert!(
        reply["error"]["desc"].as_str().unwrap().contains("m999"),
        "{reply}"
    );
    let reply = operator.execute("migrate-now", json!({}));
    assert_eq!(reply["error"]["class"], "CommandNotFound", "{reply}");
    let reply = operator.execute("fleet-set", json!({"outbound-slots": 0}));
    assert!(
        reply["error"]["desc"]
            .as_str()
            .unwrap()
            .contains("outbound-slots")
    );
    let reply = operator.execute("query-fleet", json!({}));
    assert_eq!(reply["return"]["version"], 1, "{reply}");
}

#[test]
fn a_member_claiming_more_than_its_process_wrote_is_not_believed() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(&socket_in(&dir), settings(1, 100 * MB)).unwrap();
    let mut liar = Client::connect(agent.path());
    let reply = liar.execute(
        "fleet-join",
        json!({"name": "liar", "direction": "outbound", "memory": 1u64 << 30}),
    );
    let id = reply["return"]["migration"].as_str().unwrap().to_string();
    // A petabyte claimed sent, at a terabyte per second.
    let claim = json!({
        "status": "active", "transferred": 1u64 << 50, "remaining": 4096,
        "total": 1u64 << 30, "transfer-rate": 1u64 << 40, "iterations": 3,
    });
    wait_until(
        "the agent to have measured the process and disbelieve it",
        || {
            let reply = liar.execute("fleet-report", claim.clone());
            assert_eq!(reply, json!({"return": {}}));
            find(&agent, &id).is_some_and(|view| {
                !view.progress_verified && view.measured_rate.is_some_and(|rate| rate < 1 << 40)
            })
        },
    );
}

#[test]
fn the_socket_is_the_owners_alone() {
    let dir = tempfile::tempdir().unwrap();
    let agent = Agent::start(&socket_in(&dir), settings(1, 0)).unwrap();
    let mode = std::fs::metadata(agent.path())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    // A second agent on a live socket is refused.
    let error = Agent::start(agent.path(), settings(1, 0)).unwrap_err();
    assert!(error.to_string().contains("another process"), "{error}");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return tern_test_skip::skip(
            tern_test_skip::Need::Host,
            "root is needed to knock as another user",
        );
    }
    // Opened to everyone on the file system, another user is still refused
    // by its credentials.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(agent.path(), std::fs::Permissions::from_mode(0o666)).unwrap();
    let reply = as_nobody(agent.path());
    assert!(reply.contains("is not the socket's owner"), "{reply}");
}

/// What a process running as user 65534 reads first from `path`.
fn as_nobody(path: &Path) -> String {
    use std::os::unix::process::CommandExt;
    let script = "import socket,sys\n\
        s=socket.socket(socket.AF_UNIX)\n\
        s.connect(sys.argv[1])\n\
        print(s.makefile().readline())";
    let output = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(path)
        .uid(65534)
        .gid(65534)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let output = output_within(output, "python3 knocking as user 65534");
    String::from_utf8_lossy(&output.stdout).into_owned() + &String::from_utf8_lossy(&output.stderr)
}

/// The default configuration, with a time limit so that a migration that
/// never converges fails the test instead of hanging it.
// The config will be non_exhaustive (issue 29): no struct literal.
#[allow(clippy::field_reassign_with_default)]
fn bounded_config() -> MigrationConfig {
    let mut config = MigrationConfig::default();
    config.max_time = Some(DEADLINE);
    config
}

fn synthetic(memory: u64, dirty_rate: u64, seed: u64) -> SyntheticGuest {
    SyntheticGuest::new(&SyntheticConfig {
        memory_bytes: memory,
        seed,
        dirty_rate_bytes_per_sec: dirty_rate,
        working_set_bytes: memory / 4,
        ..SyntheticConfig::default()
    })
    .expect("synthetic guest")
}

fn destination_guest(setup: &tern_wire::SessionSetup) -> Result<SyntheticGuest, GuestError> {
    let lens: Vec<u64> = setup.regions.iter().map(|region| region.len).collect();
    SyntheticGuest::empty(&lens).map_err(|error| GuestError::with_source("destination", error))
}

/// Migrates a synthetic guest over loopback as a member of the agent;
/// whether it completed with the digests compared equal, and whether an
/// idle guest's memory is equal on both sides afterwards.
fn migrate_as_member(agent: &Path, name: &str, dirty_rate: u64, seed: u64) -> (bool, bool) {
    let listener = Listener::bind(&Address::Tcp("127.0.0.1:0".into())).unwrap();
    let address = listener.local_address().unwrap();
    let mut receive_config = ReceiveConfig::default();
    receive_config.accept_timeout = DEADLINE;
    let destination = Destination::new(receive_config);
    let inbound = join(
        agent,
        Steered::Destination(destination.handle()),
        JoinOptions::new(format!("{name}-in")),
    )
    .unwrap();
    let receiving = std::thread::spawn(move || {
        let received = destination.receive(&listener, destination_guest);
        drop(inbound);
        received
    });
    let source = Source::new(bounded_config()).unwrap();
    let member = join(
        agent,
        Steered::Source(source.handle()),
        JoinOptions::new(name),
    )
    .unwrap();
    let mut guest = synthetic(32 << 20, dirty_rate, seed);
    let stats = source.migrate(&mut guest, &address);
    drop(member);
    let received = join_within(receiving, "the destination");
    let stats = stats.expect("the migration completes");
    let mut received = received.expect("the destination receives");
    tern_engine::GuestControl::pause(&mut received.guest).unwrap();
    // A dirtier goes on dirtying on the destination once resumed: only an
    // idle guest's memory can be compared after the fact; the engine's
    // digest comparison at the switch-over covers both.
    (
        stats.status == MigrationStatus::Completed && stats.digest_verified,
        dirty_rate > 0 || received.guest.digest() == guest.digest(),
    )
}

#[test]
fn two_real_migrations_pass_one_slot_in_turn_and_both_verify() {
    let dir = tempfile::tempdir().unwrap();
    let mut host = settings(1, 400 * MB);
    host.inbound_slots = 2;
    let agent = Agent::start(&socket_in(&dir), host).unwrap();
    let path = agent.path().to_path_buf();
    // A member holding the one outbound slot, so that both migrations queue.
    let (_blocker_source, blocker) = source_handle();
    let blocker = join(&path, Steered::Source(blocker), JoinOptions::new("blocker")).unwrap();
    let migrations: Vec<_> = [(0, 1), (8 * MB, 2)]
        .into_iter()
        .map(|(dirty_rate, seed)| {
            let path = path.clone();
            std::thread::spawn(move || {
                migrate_as_member(&path, &format!("vm{seed}"), dirty_rate, seed)
            })
        })
        .collect();
    wait_until("both to queue behind the blocker", || {
        let view = agent.view();
        let mut positions: Vec<_> = view
            .migrations
            .iter()
            .filter_map(|member| member.position)
            .collect();
        positions.sort_unstable();
        positions == [1, 2]
    });
    drop(blocker);
    let mut most_running = 0;
    // Two migrations one after the other, each within its own deadline.
    let finish_by = Instant::now() + 2 * DEADLINE;
    while !migrations.iter().all(std::thread::JoinHandle::is_finished) {
        assert!(
            Instant::now() < finish_by,
            "the two migrations did not finish"
        );
        let running = agent
            .view()
            .migrations
            .iter()
            .filter(|member| {
                member.direction == tern_fleet::protocol::Direction::Outbound
                    && member.state != FleetState::Queued
            })
            .count();
        most_running = most_running.max(running);
        std::thread::sleep(Duration::from_millis(5));
    }
    for migration in migrations {
        assert_eq!(migration.join().unwrap(), (true, true));
    }
    assert_eq!(most_running, 1, "one outbound slot");
    wait_until("both to have left", || agent.view().migrations.is_empty());
    assert_eq!(
        agent.view().counters.succeeded,
        4,
        "two sources, two destinations"
    );
}

// long: one migration under a policy, watched from start to end
#[test]
fn the_completion_timeout_switches_a_guest_that_cannot_converge_to_postcopy_unthrottled() {
    if !userfaultfd_works() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // 16 MB/s for a guest dirtying 64 MiB/s: precopy alone never ends.
    let mut guest = SyntheticGuest::new(&SyntheticConfig {
        memory_bytes: 48 << 20,
        seed: 5,
        dirty_rate_bytes_per_sec: 64 << 20,
        working_set_bytes: 24 << 20,
        dirtier_threads: 2,
        ..SyntheticConfig::default()
    })
    .expect("synthetic guest");
    let agent = Agent::start(&socket_in(&dir), settings(1, 16 * MB)).unwrap();
    let listener = Listener::bind(&Address::Tcp("127.0.0.1:0".into())).unwrap();
    let address = listener.local_address().unwrap();
    let mut receive_config = ReceiveConfig::default();
    receive_config.accept_timeout = DEADLINE;
    let destination = Destination::new(receive_config);
    let inbound = join(
        agent.path(),
        Steered::Destination(destination.handle()),
        JoinOptions::new("busy-in"),
    )
    .unwrap();
    let receiving = std::thread::spawn(move || {
        let received = destination.receive(&listener, destination_guest);
        drop(inbound);
        received
    });
    // The engine's own auto-converge is on (the default): the policy
    // turns it off. Postcopy on request: only the agent starts it.
    let mut config = bounded_config();
    config.postcopy = PostcopyMode::OnRequest;
    let source = Source::new(config).unwrap();
    let handle = source.handle();
    let mut options = JoinOptions::new("busy");
    // 48 MiB at 40 s per GiB: 1.9 s of precopy, then postcopy.
    options.policy = serde_json::from_value(json!({
        "completionTimeoutPerGiB": 40,
        "allowPostCopy": true,
        "allowAutoConverge": false,
    }))
    .unwrap();
    let member = join(agent.path(), Steered::Source(handle.clone()), options).unwrap();
    let id = member.state().migration.unwrap();
    let watching = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let watcher = {
        let (watching, handle) = (watching.clone(), handle.clone());
        std::thread::spawn(move || {
            let mut peak = 0;
            while watching.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(handle.query().cpu_throttle_percentage);
                std::thread::sleep(Duration::from_millis(10));
            }
            peak
        })
    };
    let stats = source.migrate(&mut guest, &address);
    watching.store(false, std::sync::atomic::Ordering::Relaxed);
    let last_action = find(&agent, &id).and_then(|view| view.last_action);
    drop(member);
    let peak_throttle = join_within(watcher, "the throttle watcher");
    let received = join_within(receiving, "the destination");
    let stats = stats.expect("the migration ends");
    let mut received = received.expect("the destination receives");
    tern_engine::GuestControl::pause(&mut received.guest).unwrap();
    assert_eq!(stats.status, MigrationStatus::Completed, "{last_action:?}");
    assert!(stats.digest_verified, "{:?}", stats.digest_comparison);
    assert!(received.digest_comparison.unwrap().matched());
    assert_eq!(
        stats
            .postcopy
            .as_ref()
            .and_then(|postcopy| postcopy.trigger),
        Some(PostcopyTrigger::Requested),
        "the agent's request started postcopy"
    );
    assert!(
        last_action
            .as_deref()
            .is_some_and(|action| action.contains("completionTimeoutPerGiB")),
        "{last_action:?}"
    );
    assert_eq!(peak_throttle, 0, "postcopy instead of a throttle");
    assert_eq!(stats.cpu_throttle_percentage, 0);
}
