//! `tern agent` with real `tern migrate` and `tern receive` processes that
//! join it with `--agent`: the queue seen through `tern ctl`, a migration
//! killed mid-way releasing its slot, the aggregate metrics, the exit on
//! SIGTERM (docs/fleet.md).

use crate::process;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::Stdio;

use process::{Reaped, Receiver, free_port, killed_after_deadline, tern};
use serde_json::Value;
use tern_test_skip::wait::{DEADLINE, wait_for};

/// `tern ctl AGENT query-fleet`'s migrations.
fn fleet(socket: &Path) -> Option<Vec<Value>> {
    let output = tern()
        .arg("ctl")
        .arg(socket)
        .arg("query-fleet")
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    let view: Value = serde_json::from_slice(&output.stdout).ok()?;
    view["migrations"].as_array().cloned()
}

fn named<'a>(migrations: &'a [Value], name: &str) -> Option<&'a Value> {
    migrations.iter().find(|member| member["name"] == name)
}

fn spawn_migrate(to: &str, agent: &Path, name: &str, extra: &[&str]) -> Reaped {
    tern()
        .args(["migrate", "--json", "--progress", "none", "--to", to])
        .args(["--memory", "64MiB", "--mix", "0:100:0"])
        .arg("--agent")
        .arg(agent)
        .args(["--agent-name", name])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map(Reaped::new)
        .unwrap()
}

fn scrape(port: u16) -> String {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    text
}

// long: one scenario across five processes, checked step by step
#[test]
fn migrations_queue_at_the_agent_and_a_killed_one_frees_its_slot() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("agent.sock");
    let metrics_port = free_port();
    let mut agent = tern()
        .args(["agent", "--bandwidth", "200MiB", "--outbound-slots", "1"])
        .arg("--socket")
        .arg(&socket)
        .args(["--metrics-listen", &format!("127.0.0.1:{metrics_port}")])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map(Reaped::new)
        .unwrap();
    let mut ready = String::new();
    let mut stdout = BufReader::new(agent.stdout.take().unwrap());
    killed_after_deadline(agent.id(), "`tern agent` before its ready event", || {
        stdout.read_line(&mut ready)
    })
    .unwrap();
    assert!(ready.contains(r#""event":"listening""#), "{ready}");
    let agent_flag = ["--agent", socket.to_str().unwrap()];
    let slow_receiver = Receiver::spawn(&["receive", "--json"], &agent_flag);
    let receiver = Receiver::spawn(&["receive", "--json"], &agent_flag);
    // The first is slow (its own cap, 2 MiB/s, stays its cap under the
    // agent), so that it still runs when killed.
    let mut slow = spawn_migrate(
        &slow_receiver.address,
        &socket,
        "slow",
        &["--max-bandwidth", "2MiB"],
    );
    wait_for("the slow one to run capped at its own 2 MiB/s", || {
        let migrations = fleet(&socket)?;
        let member = named(&migrations, "slow")?;
        (member["state"] == "running" && member["share"] == 2 << 20).then_some(())
    });
    let next = spawn_migrate(&receiver.address, &socket, "next", &[]);
    wait_for("the next to queue first in line", || {
        let migrations = fleet(&socket)?;
        let member = named(&migrations, "next")?;
        (member["state"] == "queued" && member["position"] == 1).then_some(())
    });
    let text = scrape(metrics_port);
    assert!(
        text.contains(r#"tern_fleet_migrations_in_pending_phase{direction="outbound"} 1"#),
        "{text}"
    );
    assert!(text.contains(r#"name="slow""#), "{text}");
    // The slow one dies mid-migration: its slot passes on.
    slow.kill().unwrap();
    slow.wait().unwrap();
    wait_for("the slot to pass to the next", || {
        let migrations = fleet(&socket)?;
        let gone = named(&migrations, "slow").is_none();
        let next = named(&migrations, "next");
        let running = next.is_some_and(|member| member["state"] != "queued");
        let done = next.is_none();
        (gone && (running || done)).then_some(())
    });
    let output = next.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["status"], "completed");
    assert_eq!(report["digest-verified"], true);
    assert_eq!(receiver.report()["digest-verified"], true);
    let mut slow_receiver = slow_receiver;
    let _ = slow_receiver.child.kill();
    let _ = slow_receiver.child.wait();
    // SIGTERM: the agent exits 143 and removes its socket.
    // SAFETY: kill(2) on our own child's pid.
    unsafe {
        libc::kill(libc::pid_t::try_from(agent.id()).unwrap(), libc::SIGTERM);
    }
    let status = agent.wait().unwrap();
    assert_eq!(status.code(), Some(143));
    assert!(!socket.exists());
}

#[test]
fn an_unreachable_agent_is_a_setup_error_and_a_bad_policy_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("none.sock");
    let output = tern()
        .args(["migrate", "--to", "127.0.0.1:9", "--memory", "4MiB"])
        .arg("--agent")
        .arg(&missing)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--agent"), "{stderr}");
    let output = tern()
        .args(["migrate", "--to", "127.0.0.1:9", "--memory", "4MiB"])
        .arg("--agent")
        .arg(&missing)
        .args(["--migration-policy", r#"{"completionTimeout": 5}"#])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("completionTimeout"), "{stderr}");
}
