#!/usr/bin/env python3
"""Evacuating a host: four synthetic guests leave over one shared 1 Gbit/s
link, under four (or five) regimes, side by side (docs/benchmarks.md,
"Evacuating a host").

    python3 bench/fleet.py                     # 3 repetitions, 1 GiB guests (as root)
    python3 bench/fleet.py --repetitions 1 --memory 256MiB   # a quick look
    python3 bench/fleet.py --report-only       # the table from bench/results/fleet.json
    python3 bench/fleet.py --postcopy --regimes coordinator,one-at-a-time \
        --results bench/results/fleet-postcopy.json   # the hopeless guest may use postcopy

The guests: one idle, two moderate dirtiers, one that dirties faster than the
link and cannot converge without auto-converge's throttle. The link: a token
bucket (tc tbf, 1gbit) on the loopback of a network namespace, where every
process runs (the agent too: sock_diag, with which it measures its members,
sees only its own namespace).

The regimes, all started from the same barrier: every source has filled its
guest and waits in the agent's queue behind a gate member holding the one
slot; the regime's settings are applied (`fleet-set`) and the gate leaves.

* uncoordinated: four slots, no budget: all at once, each on its own.
* one-at-a-time: one slot (Nova's max_concurrent_live_migrations = 1).
* two-at-a-time: two slots (KubeVirt's old parallelOutboundMigrationsPerNode).
* coordinator: four slots and a 1 Gbit/s budget, converge-first division.
* coordinator-equal: the same budget in equal shares (--with-equal).

With --postcopy, in every regime run, the guest that cannot converge runs
with `--postcopy auto` (postcopy instead of any auto-converge throttle) and
the policy `allowPostCopy` (the agent's completion timeout starts postcopy
too): KubeVirt's `allowPostCopy`, Nova's `live_migration_permit_post_copy`.

Recorded per run: the evacuation time (gate open to the last source's
exit), each guest's finish time from the gate and its own total time, its
downtime, its peak auto-converge throttle (polled from the agent every
quarter second, and the final report's), bytes sent, and that every guest
arrived verified (source completed, destination digest-verified). The load
average is recorded before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "fleet.json"
NETNS = os.environ.get("TERNFLEET_NETNS", "ternfleet")
LINK_BYTES = 125_000_000  # 1 Gbit/s
DEADLINE = 900.0

GUESTS = [
    # name, dirty rate, working set
    ("idle", "0", "256MiB"),
    ("moderate-1", "24MiB", "256MiB"),
    ("moderate-2", "24MiB", "256MiB"),
    ("hopeless", "160MiB", "512MiB"),
]
# The guests that, with --postcopy, may hand over to postcopy.
POSTCOPY_GUESTS = {"hopeless"}
POSTCOPY_ARGS = ["--postcopy", "auto", "--migration-policy", '{"allowPostCopy": true}']

REGIMES = {
    "uncoordinated": {"outbound-slots": 4, "bandwidth": 0},
    "one-at-a-time": {"outbound-slots": 1, "bandwidth": 0},
    "two-at-a-time": {"outbound-slots": 2, "bandwidth": 0},
    "coordinator": {"outbound-slots": 4, "bandwidth": LINK_BYTES, "division": "converge-first"},
    "coordinator-equal": {"outbound-slots": 4, "bandwidth": LINK_BYTES, "division": "equal"},
}


def in_netns(cmd: list[str]) -> list[str]:
    return ["ip", "netns", "exec", NETNS] + cmd


def setup_link() -> None:
    subprocess.run(["ip", "netns", "del", NETNS], stderr=subprocess.DEVNULL)
    subprocess.run(["ip", "netns", "add", NETNS], check=True)
    subprocess.run(["ip", "-n", NETNS, "link", "set", "lo", "up"], check=True)
    subprocess.run(in_netns(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "1gbit",
                             "burst", "256kb", "latency", "50ms"]), check=True)


def cleanup_link() -> None:
    subprocess.run(["ip", "netns", "del", NETNS], stderr=subprocess.DEVNULL)


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


class Agent:
    """A client of the agent's socket: one request per call."""

    def __init__(self, path: str):
        deadline = time.monotonic() + 30
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX)
                self.sock.connect(path)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.sock.settimeout(60)
        self.file = self.sock.makefile("rw")
        greeting = json.loads(self.file.readline())
        assert greeting["QMP"]["version"]["fleet"] == 1, greeting
        self.lock = threading.Lock()

    def execute(self, command: str, arguments: dict | None = None) -> dict:
        with self.lock:
            self.file.write(json.dumps({"execute": command, "arguments": arguments or {}}) + "\n")
            self.file.flush()
            while True:
                reply = json.loads(self.file.readline())
                if "event" in reply:
                    continue
                if "error" in reply:
                    raise RuntimeError(f"{command}: {reply['error']}")
                return reply["return"]

    def close(self) -> None:
        self.sock.close()


def wait_for(what: str, check, deadline: float):
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def start_receiver(tern: str, agent: str, name: str) -> tuple[subprocess.Popen, str]:
    child = subprocess.Popen(
        in_netns([tern, "receive", "--json", "--listen", "127.0.0.1:0", "--progress", "none",
                  "--agent", agent, "--agent-name", f"{name}-in"]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = child.stdout.readline()
    event = json.loads(line)
    assert event["event"] == "listening", line
    return child, event["address"]


def size_bytes(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * factor)
    return int(text)


def start_source(tern: str, agent: str, name: str, dirty: str, working_set: str, memory: str,
                 to: str, extra: list[str]) -> subprocess.Popen:
    # A smaller guest than the default keeps the working set's share of it.
    scale = size_bytes(memory) / (1 << 30)
    working_set = f"{max(1, int(size_bytes(working_set) * scale) >> 20)}MiB"
    return subprocess.Popen(
        in_netns([tern, "migrate", "--json", "--progress", "none", "--to", to,
                  "--memory", memory, "--dirty-rate", dirty, "--working-set", working_set,
                  "--agent", agent, "--agent-name", name] + extra),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_regime(tern: str, regime: str, memory: str, postcopy: bool) -> dict:
    """One evacuation under `regime`; its record."""
    work = tempfile.mkdtemp(prefix="ternfleet-")
    path = os.path.join(work, "agent.sock")
    children: list[subprocess.Popen] = []
    deadline = time.monotonic() + DEADLINE
    load_before = loadavg()
    agent_process = subprocess.Popen(
        in_netns([tern, "agent", "--socket", path, "--outbound-slots", "1", "--inbound-slots", "4"]),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    children.append(agent_process)
    try:
        agent_process.stdout.readline()
        gate = Agent(path)
        gate.execute("fleet-join", {"name": "gate", "direction": "outbound"})
        keep_gate = threading.Event()
        keep_gate.set()

        def gate_reports():
            while keep_gate.is_set():
                try:
                    gate.execute("fleet-report", {"status": "active"})
                except Exception:
                    return
                time.sleep(1)

        threading.Thread(target=gate_reports, daemon=True).start()
        operator = Agent(path)
        sources = {}
        receivers = {}
        for name, dirty, working_set in GUESTS:
            receiver, address = start_receiver(tern, path, name)
            children.append(receiver)
            receivers[name] = receiver
            extra = POSTCOPY_ARGS if postcopy and name in POSTCOPY_GUESTS else []
            source = start_source(tern, path, name, dirty, working_set, memory, address, extra)
            children.append(source)
            sources[name] = source
        def all_queued():
            for name, source in sources.items():
                if source.poll() is not None:
                    raise RuntimeError(f"{name} exited {source.returncode} before the gate opened: "
                                       f"{source.stderr.read().strip()}")
            return sum(1 for m in operator.execute("query-fleet")["migrations"]
                       if m["state"] == "queued" and m["direction"] == "outbound") == len(GUESTS)

        wait_for("every source filled and queued", all_queued, deadline)
        operator.execute("fleet-set", REGIMES[regime])
        keep_gate.clear()
        opened = time.monotonic()
        gate.execute("fleet-leave", {"status": "completed"})
        gate.close()
        peak = {name: 0 for name in sources}
        finished: dict[str, float] = {}
        while len(finished) < len(sources):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{regime}: the evacuation did not end")
            for member in operator.execute("query-fleet")["migrations"]:
                if member["name"] in peak:
                    peak[member["name"]] = max(peak[member["name"]],
                                               member["progress"]["cpu-throttle-percentage"])
            for name, source in sources.items():
                if name not in finished and source.poll() is not None:
                    finished[name] = time.monotonic() - opened
            time.sleep(0.25)
        evacuation = max(finished.values())
        guests = {}
        for name, source in sources.items():
            out, err = source.communicate(timeout=60)
            report = json.loads(out) if out.strip() else {}
            r_out, r_err = receivers[name].communicate(timeout=120)
            received = json.loads(r_out) if r_out.strip() else {}
            guests[name] = {
                "exit": source.returncode,
                "status": report.get("status"),
                "verified": report.get("status") == "completed"
                and received.get("digest-verified") is True,
                "finished-s": round(finished[name], 2),
                "total-time-ms": report.get("total-time"),
                "downtime-ms": report.get("downtime"),
                "peak-throttle": max(peak[name], report.get("cpu-throttle-percentage", 0)),
                "bytes": report.get("ram", {}).get("transferred"),
                "postcopy-trigger": (report.get("postcopy") or {}).get("trigger"),
                "error": None if source.returncode == 0 else err.strip().splitlines()[-1:],
            }
        operator.close()
        return {
            "regime": regime,
            "postcopy": postcopy,
            "memory": memory,
            "evacuation-s": round(evacuation, 2),
            "guests": guests,
            "load-before": load_before,
            "load-after": loadavg(),
        }
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def label(run: dict) -> str:
    return run["regime"] + (" + postcopy" if run.get("postcopy") else "")


def report(runs: list[dict]) -> str:
    regimes = list(dict.fromkeys(label(run) for run in runs))
    lines = ["| regime | runs | evacuation (s) | all verified | "
             + " | ".join(f"{name}: finish s / downtime ms / peak throttle %" for name, _, _ in GUESTS)
             + " | bytes sent (MiB) | load before–after |",
             "|---" * (6 + len(GUESTS)) + "|"]
    for regime in regimes:
        mine = [run for run in runs if label(run) == regime]
        cells = []
        for name, _, _ in GUESTS:
            g = [run["guests"][name] for run in mine]
            cells.append("{} / {} / {}".format(
                median([x["finished-s"] for x in g]), median([x["downtime-ms"] for x in g]),
                median([x["peak-throttle"] for x in g])))
        total_bytes = median([sum(x["bytes"] or 0 for x in run["guests"].values()) for run in mine])
        verified = all(x["verified"] for run in mine for x in run["guests"].values())
        loads = "; ".join(f"{run['load-before']:.1f}–{run['load-after']:.1f}" for run in mine)
        lines.append(f"| {regime} | {len(mine)} | {median([run['evacuation-s'] for run in mine])} | "
                     f"{'yes' if verified else 'NO'} | " + " | ".join(cells)
                     + f" | {total_bytes / 2**20:.0f} | {loads} |")
    for suffix in ("", " + postcopy"):
        best_other = min((median([run["evacuation-s"] for run in runs if label(run) == r + suffix])
                          for r in ("uncoordinated", "one-at-a-time", "two-at-a-time")
                          if r + suffix in regimes), default=None)
        coordinator = median([run["evacuation-s"] for run in runs
                              if label(run) == "coordinator" + suffix])
        if best_other and coordinator:
            lines.append("")
            lines.append(f"coordinator{suffix} / best of the others{suffix}: "
                         f"{coordinator / best_other:.2f}x")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--memory", default="1GiB")
    parser.add_argument("--with-equal", action="store_true")
    parser.add_argument("--regimes", default=None, help="comma-separated subset")
    parser.add_argument("--tern", default=str(ROOT / "target" / "release" / "tern"))
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--postcopy", action="store_true",
                        help="the guest that cannot converge may use postcopy")
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args()
    if args.report_only:
        print(report(json.loads(Path(args.results).read_text())["runs"]))
        return 0
    if os.geteuid() != 0:
        print("bench/fleet.py: needs root (a network namespace for the 1 Gbit/s link)",
              file=sys.stderr)
        return 2
    # SIGTERM ends the run through the `finally` clauses: no child left.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    regimes = (args.regimes.split(",") if args.regimes else
               [r for r in REGIMES if r != "coordinator-equal" or args.with_equal])
    runs = []
    setup_link()
    try:
        for repetition in range(args.repetitions):
            # Rotated, so that no regime always runs first on a warming machine.
            order = regimes[repetition % len(regimes):] + regimes[:repetition % len(regimes)]
            for regime in order:
                print(f"repetition {repetition + 1}: {regime}...", file=sys.stderr, flush=True)
                run = run_regime(args.tern, regime, args.memory, args.postcopy)
                print(json.dumps(run), file=sys.stderr, flush=True)
                runs.append(run)
                results = Path(args.results)
                results.parent.mkdir(parents=True, exist_ok=True)
                results.write_text(json.dumps({"link": "tbf 1gbit, burst 256kb, latency 50ms",
                                               "guests": GUESTS, "runs": runs}, indent=1))
    finally:
        cleanup_link()
    print(report(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
