#!/usr/bin/env python3
"""An orchestrator's node agent in miniature: it starts a migration, then
watches, steers and cancels it through the control socket and the metrics
endpoint alone (docs/control.md), as KubeVirt's virt-handler or libvirt
would. Python 3's standard library only.

    python3 examples/steer.py                    # tern from PATH
    python3 examples/steer.py --tern target/release/tern

Two migrations of a synthetic guest over 127.0.0.1, each checked step by
step; any broken promise ends the script with exit status 1 and says which:

* cancel: a capped migration is started; a watcher connects late and
  still learns what happened before it came (query-events); the migration
  is queried on both sides, scraped, slowed down (migrate-set-parameters),
  and cancelled (migrate_cancel): the source exits 5 with its guest
  running, the destination is told and exits 1.
* complete: a migration capped too low to finish soon is let go (the cap
  lifted) and completes; both sides' events arrive in order, the
  destination's MIGRATION_PASS events included.

Prints one JSON line per scenario with what it saw; exits 0 when every
check held.
"""

from __future__ import annotations

import argparse
import json
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

DEADLINE = 120.0
FINAL = {"completed", "failed", "cancelled", "outcome-unknown"}


class Broken(Exception):
    """A promise of the control interface did not hold."""


def check(condition: bool, what: str) -> None:
    if not condition:
        raise Broken(what)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(what: str, probe, deadline: float = DEADLINE):
    """Polls `probe` until it returns something true; that value."""
    end = time.monotonic() + deadline
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > end:
            raise Broken(f"timed out waiting for {what}")
        time.sleep(0.05)


class Qmp:
    """A client of a control socket: replies to its commands, and the
    events pushed between them, kept apart by a reader thread."""

    def __init__(self, path: Path):
        self.sock = wait_for(f"{path} to accept", lambda: self._connect(path))
        self.sock.settimeout(None)
        self.lines = self.sock.makefile("r", encoding="utf-8")
        greeting = json.loads(self.lines.readline())
        check("QMP" in greeting, f"greeting {greeting}")
        self.contract = greeting["QMP"]["version"]["contract"]
        self.replies: queue.Queue = queue.Queue()
        self.events: queue.Queue = queue.Queue()
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    @staticmethod
    def _connect(path: Path):
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(path))
            return sock
        except OSError:
            return None

    def _read(self) -> None:
        for line in self.lines:
            message = json.loads(line)
            (self.events if "event" in message else self.replies).put(message)
        self.events.put(None)

    def execute(self, command: str, **arguments):
        """The command's `return`, or raises with its `error`."""
        self.next_id += 1
        request = {"execute": command, "id": self.next_id}
        if arguments:
            request["arguments"] = arguments
        self.sock.sendall((json.dumps(request) + "\n").encode())
        reply = self.replies.get(timeout=DEADLINE)
        check(reply.get("id") == self.next_id, f"reply {reply} to {request}")
        if "error" in reply:
            raise CommandRefused(reply["error"])
        return reply["return"]

    def event(self, deadline: float = DEADLINE):
        try:
            event = self.events.get(timeout=deadline)
        except queue.Empty:
            raise Broken("no event came") from None
        check(event is not None, "the control socket closed before the end")
        return event

    def close(self) -> None:
        self.sock.close()


class CommandRefused(Exception):
    def __init__(self, error):
        super().__init__(f"{error.get('class')}: {error.get('desc')}")
        self.error = error


def query(client: Qmp):
    """query-migrate's report, or None before the migration started."""
    try:
        return client.execute("query-migrate")
    except CommandRefused:
        return None


def scrape(port: int) -> dict[str, float]:
    """`GET /metrics`: each sample, `name{labels}` to its value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def metric(port: int, name: str, side: str):
    try:
        return scrape(port).get(f'tern_migration_{name}{{side="{side}"}}')
    except OSError:
        return None


STARTED: list[subprocess.Popen] = []


def start(tern: str, work: Path, memory: str, cap: str):
    """A destination, then a source migrating to it, each with a control
    socket and a metrics endpoint: what a node agent starts."""
    ports = {"source": free_port(), "destination": free_port()}
    sockets = {side: work / f"{side}.sock" for side in ports}
    destination = subprocess.Popen(
        [tern, "receive", "--listen", "127.0.0.1:0", "--json", "--progress", "none",
         "--control-socket", str(sockets["destination"]),
         "--metrics-listen", f"127.0.0.1:{ports['destination']}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    STARTED.append(destination)
    listening = json.loads(destination.stdout.readline() or "{}")
    check(listening.get("event") == "listening", f"destination's first line {listening}")
    source = subprocess.Popen(
        [tern, "migrate", "--to", listening["address"], "--json", "--progress", "none",
         "--memory", memory, "--mix", "0:100:0", "--max-bandwidth", cap,
         "--control-socket", str(sockets["source"]),
         "--metrics-listen", f"127.0.0.1:{ports['source']}"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    STARTED.append(source)
    return source, destination, sockets, ports


def finish(process: subprocess.Popen):
    """Its exit status and its JSON report."""
    out, _ = process.communicate(timeout=DEADLINE)
    return process.returncode, json.loads(out)


def cancel_scenario(tern: str, work: Path) -> dict:
    source, destination, sockets, ports = start(tern, work, "128MiB", "4MiB")
    # The metrics show data moving before any client connected.
    moved = wait_for("bytes on the way (metrics)",
                     lambda: (metric(ports["source"], "data_processed_bytes", "source") or 0) > 0)
    check(metric(ports["source"], "data_total_bytes", "source") == 128 << 20, "total bytes")
    check(metric(ports["source"], "succeeded", "source") == 0, "not succeeded yet")
    check((metric(ports["destination"], "data_processed_bytes", "destination") or 0) >= 0,
          "the destination's metrics")
    # A watcher that comes late learns what happened before it came.
    watcher = Qmp(sockets["source"])
    check(watcher.contract == 1, f"contract {watcher.contract}")
    history = watcher.execute("query-events")
    statuses = [e["data"]["status"] for e in history["events"] if e["event"] == "MIGRATION"]
    check(statuses[:2] == ["setup", "active"], f"history {statuses}")
    seqs = [e["seq"] for e in history["events"]]
    check(seqs == sorted(seqs) and seqs[0] == 1, f"seqs {seqs}")
    # Query both sides.
    report = watcher.execute("query-migrate")
    check(report["status"] == "active" and report["ram"]["total"] == 128 << 20, f"{report}")
    receiving = Qmp(sockets["destination"])
    received = wait_for("the destination receiving",
                        lambda: (r := query(receiving)) and r["status"] == "active" and r)
    check(received["memory"] == 128 << 20, f"{received}")
    check(receiving.execute("query-migrate-parameters") == {}, "a destination has no parameters")
    # Steer: slower.
    watcher.execute("migrate-set-parameters", **{"max-bandwidth": 1 << 20})
    check(watcher.execute("query-migrate-parameters")["max-bandwidth"] == 1 << 20, "cap applied")
    try:
        watcher.execute("migrate-set-parameters", **{"max-bandwith": 1})
        raise Broken("a misspelt parameter was accepted")
    except CommandRefused as refused:
        check("max-bandwith" in str(refused), f"{refused}")
    # Cancel, and see it end on both sides.
    watcher.execute("migrate_cancel")
    seen = []
    while True:
        event = watcher.event()
        seen.append(event["event"])
        if event["event"] == "MIGRATION" and event["data"]["status"] in FINAL:
            check(event["data"]["status"] == "cancelled", f"{event}")
            break
    check("MIGRATION_PARAMETERS" in seen, f"the steering event: {seen}")
    status, report = finish(source)
    check(status == 5 and report["status"] == "cancelled", f"source exit {status}: {report}")
    status, received = finish(destination)
    check(status == 1 and received["status"] == "failed", f"destination exit {status}")
    check("cancel" in received.get("error-desc", ""), f"the destination was told: {received}")
    watcher.close()
    receiving.close()
    return {"scenario": "cancel", "moved-before-watching": moved, "events": seen,
            "source-exit": 5, "destination-exit": 1}


def complete_scenario(tern: str, work: Path) -> dict:
    source, destination, sockets, _ = start(tern, work, "32MiB", "1MiB")
    watcher = Qmp(sockets["source"])
    receiving = Qmp(sockets["destination"])
    wait_for("pages on the way",
             lambda: (r := query(watcher)) and r["ram"]["transferred"] > 0)
    # At 1 MiB/s this would take half a minute: lift the cap.
    watcher.execute("migrate-set-parameters", **{"max-bandwidth": 0})
    sides = {}
    for side, client in (("source", watcher), ("destination", receiving)):
        history = client.execute("query-events")["events"]
        names, last_seq = [], 0
        pending = list(history)
        while True:
            event = pending.pop(0) if pending else client.event()
            if event["seq"] <= last_seq:
                continue  # already had it from the history
            check(event["seq"] == last_seq + 1, f"{side}: a gap before {event}")
            last_seq = event["seq"]
            data = event["data"]
            names.append(f"{event['event']}:{data['status']}" if event["event"] == "MIGRATION"
                         else event["event"])
            if event["event"] == "MIGRATION" and data["status"] in FINAL:
                break
        sides[side] = names
    for side, names in sides.items():
        statuses = [n for n in names if n.startswith("MIGRATION:")]
        check(statuses == ["MIGRATION:setup", "MIGRATION:active", "MIGRATION:device",
                           "MIGRATION:completed"], f"{side}: {names}")
        check("MIGRATION_PASS" in names, f"{side} sent no MIGRATION_PASS: {names}")
    status, report = finish(source)
    check(status == 0 and report["status"] == "completed", f"source exit {status}")
    status, received = finish(destination)
    check(status == 0 and received["digest-verified"] is True, f"destination exit {status}")
    watcher.close()
    receiving.close()
    return {"scenario": "complete", "events": sides}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tern", default="tern", help="the tern binary")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tern-steer-") as work:
        for scenario in (cancel_scenario, complete_scenario):
            try:
                print(json.dumps(scenario(args.tern, Path(work))), flush=True)
            except (Broken, CommandRefused, subprocess.TimeoutExpired) as error:
                print(f"steer.py: {scenario.__name__}: {error}", file=sys.stderr)
                return 1
            finally:
                # What this script started ends with it.
                for process in STARTED:
                    if process.poll() is None:
                        process.kill()
                        process.wait()
                STARTED.clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
