"""tern's side: `tern vm receive` and `tern vm migrate` as two processes,
synchronised by their JSON events (docs/cli.md, "Events"): the receiver's
`listening` line gives the address, the source's `migrating` line (with
`--events`) marks the start of the migration, when CPU is sampled."""

from __future__ import annotations

import json
import selectors
import subprocess
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any

from . import netem, procfs
from .config import Artifacts, Config
from .contenders import Case, Outcome, TernContender, is_running, workload
from .processes import kill, wait_exit_unreaped


class EventError(RuntimeError):
    pass


def parse_event(line: str, expected: str) -> dict[str, Any]:
    """The event of one stdout line, which must be `expected`."""
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        event = None
    if not isinstance(event, dict) or event.get("event") != expected:
        raise EventError(f"expected a {expected!r} event, got {line!r}")
    return event


def read_event(stream: IO[str], expected: str, timeout: float) -> dict[str, Any]:
    """Waits up to `timeout` s for the next line of a child's stdout and
    parses it as the event `expected`. The child flushes each event line
    whole; an exited child gives an empty line."""
    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        ready = sel.select(timeout)
    if not ready:
        raise EventError(f"no {expected!r} event within {timeout:.0f} s")
    return parse_event(stream.readline(), expected)


def tls_args(artifacts: Artifacts, who: TernContender, role: str) -> list[str]:
    """--tls-dir for a TLS row: `role` is server (receiver) or client."""
    if not who.tls:
        return []
    assert artifacts.tls is not None, "certificates are made when a TLS row runs"
    return ["--tls-dir", str(artifacts.tls / f"tern-{role}")]


def tern_binary(artifacts: Artifacts, who: TernContender) -> str:
    """The binary both ends of `who` run: its own (a before/after series)
    or the one built here."""
    return who.binary or str(artifacts.tern)


def receiver_args(cfg: Config, artifacts: Artifacts, who: TernContender,
                  mode: str = "paused", run_after_ms: int | None = None) -> list[str]:
    # The rewriting guest's passes take about half a second here.
    run_after = run_after_ms or (3000 if mode == "running-rewrite" else 1000)
    # Port 0: the ready event says which port the system picked.
    args = [tern_binary(artifacts, who), "vm", "receive", "--listen", "127.0.0.1:0", "--json",
            "--progress", "none",
            "--run-after", str(run_after),
            "--accept-timeout", str(int(cfg.timeout))]
    if who.verify == "none":
        # The destination decides whether a source may skip the digest;
        # without this it refuses the session and keeps listening.
        args.append("--allow-unverified")
    return args + tls_args(artifacts, who, "server")


def source_args(cfg: Config, artifacts: Artifacts, case: Case, who: TernContender,
                address: str) -> list[str]:
    compression = who.compression_for(case)
    args = [tern_binary(artifacts, who), "vm", "migrate", "--to", address, "--json", "--events",
            "--progress", "none",
            "--memory", str(cfg.memory), "--working-set", str(cfg.working_set_for(case.mode)),
            "--image", str(artifacts.image), "--warmup", str(cfg.warmup),
            "--downtime-limit", str(cfg.downtime_limit)]
    if not who.defaults:
        args += ["--channels", str(who.channels_for(case)),
                 "--compression", compression, "--verify", who.verify]
    if compression == "zstd" and not who.defaults:
        args += ["--compression-level", "1"]  # QEMU's default level
    args += list(who.options)
    if case.mode == "paused":
        args.append("--paused")
    else:
        args += ["--workload", workload(case.mode)]
    if who.delta:
        args += ["--delta-cache-size", str(cfg.delta_cache)]
    return args + tls_args(artifacts, who, "client")


def _tail(path: Path) -> str:
    try:
        return path.read_text()[-2000:]
    except OSError:
        return ""


def run(cfg: Config, artifacts: Artifacts, case: Case, who: TernContender,
        work: Path, raw: dict[str, Any] | None = None,
        run_after_ms: int | None = None) -> Outcome:
    """One migration between two tern processes on this machine; `raw`, if
    given, receives both sides' whole `--json` reports (`source`,
    `destination`: bench/compare/postcopy.py reads fields the outcome
    leaves out); `run_after_ms`, the receiver's `--run-after` (a guest
    whose pass takes longer than the default would not be seen to run)."""
    recv_err_path, mig_err_path = work / "trecv.err", work / "tmig.err"
    with ExitStack() as stack:
        # Unwound in reverse: the source stopped, the receiver, the files.
        recv_err = stack.enter_context(open(recv_err_path, "w"))
        mig_err = stack.enter_context(open(mig_err_path, "w"))
        recv = subprocess.Popen(netem.wrap(receiver_args(cfg, artifacts, who, case.mode,
                                                         run_after_ms), case.link),
                                stdout=subprocess.PIPE, stderr=recv_err, text=True)
        stack.callback(kill, recv)
        try:
            address = read_event(recv.stdout, "listening", 20)["address"]
        except EventError as error:
            raise RuntimeError(f"tern vm receive did not start: {error}: "
                               + _tail(recv_err_path)) from None
        mig = subprocess.Popen(netem.wrap(source_args(cfg, artifacts, case, who, address),
                                          case.link),
                               stdout=subprocess.PIPE, stderr=mig_err, text=True)
        stack.callback(kill, mig)
        try:
            # The source prints it after its warm-up, as it starts migrating.
            read_event(mig.stdout, "migrating", 60 + cfg.warmup / 1000)
        except EventError as error:
            raise RuntimeError(f"tern vm migrate did not start: {error}: "
                               + _tail(mig_err_path)) from None
        src_cpu0, dst_cpu0 = procfs.cpu_seconds(mig.pid), procfs.cpu_seconds(recv.pid)
        dst_thr0 = procfs.thread_cpu(recv.pid)
        t0 = time.time()
        src_report, dst_report = _Reader(mig.stdout), _Reader(recv.stdout)
        # The source exits right after completion: its CPU comes from the
        # zombie, before it is reaped.
        if not wait_exit_unreaped(mig, cfg.timeout):
            raise RuntimeError("tern migration timed out")
        src_cpu1, dst_cpu1 = procfs.cpu_seconds(mig.pid), procfs.cpu_seconds(recv.pid)
        # A zombie has no threads left to list: per-thread source figures
        # come from tern's own report; the destination's from /proc.
        dst_threads = procfs.thread_delta(dst_thr0, procfs.thread_cpu(recv.pid))
        wall = time.time() - t0
        mig.wait(30)
        stats = _json_or_none(src_report.text(30))
        if stats is None:
            raise RuntimeError("tern vm migrate: no JSON report: " + _tail(mig_err_path))
        # A failed source says why at once; a destination that refused the
        # session would still be listening.
        if mig.returncode != 0 or stats.get("status") not in (None, "completed"):
            raise RuntimeError(f"tern migration failed: {stats.get('status')} "
                               f"{stats.get('error-desc') or _tail(mig_err_path)[-1000:]}")
        recv.wait(30)
        rstats = _json_or_none(dst_report.text(30)) or {}
        if raw is not None:
            raw |= {"source": stats, "destination": rstats}
        return outcome(case, stats, rstats, src_cpu1 - src_cpu0, dst_cpu1 - dst_cpu0, wall,
                       dst_threads)


class _Reader:
    """The rest of a child's stdout, read on a thread so that the child
    never blocks on a full pipe while the harness waits for its exit."""

    def __init__(self, stream: IO[str]):
        self._parts: list[str] = []
        self._thread = threading.Thread(target=lambda: self._parts.append(stream.read()),
                                        daemon=True)
        self._thread.start()

    def text(self, timeout: float) -> str:
        self._thread.join(timeout)
        return "".join(self._parts)


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def outcome(case: Case, stats: dict[str, Any], rstats: dict[str, Any], src_cpu: float,
            dst_cpu: float, wall: float, dst_threads: dict[str, float]) -> Outcome:
    """The source's and destination's `--json` reports and the CPU samples
    as an outcome."""
    ram = stats.get("ram", {})
    ok = rstats.get("guest-runs-on-destination") if is_running(case.mode) else None
    if ok is not None:
        ok = bool(ok and rstats.get("consistency-check", {}).get("passed", False))
    details = {k: stats[k] for k in ("setup-time", "ram", "compression", "digest-verified",
                                     "cpu-seconds") if k in stats}
    details |= {k: stats[k] for k in ("xbzrle-cache", "dedup") if k in stats}
    # Where the downtime went, and what the last sync predicted (overruns).
    details |= {k: stats[k] for k in ("expected-downtime", "downtime-parts",
                                      "downtime-exceeded-cause", "digest-time",
                                      "expected-downtime-parts", "downtime-overrun",
                                      # Protocol 12: the switch-over's wait for
                                      # the destination, when it had one.
                                      "destination-catch-up")
                if k in stats}
    # Whether (and how soon) a running guest was seen healthy on the
    # destination, every run: a failed proof says why.
    if is_running(case.mode):
        details["guest-proof"] = {k: rstats.get(k) for k in (
            "consistency-check", "pass-count-before", "pass-count-after", "first-pass-after-ms",
            "guest-runs-on-destination")}
    # The switch-over's steps on both sides (issue 31), when the build
    # records them: the same host's CLOCK_MONOTONIC lines them up.
    timelines = {side: report["switch-over-timeline"]
                 for side, report in (("source", stats), ("destination", rstats))
                 if isinstance(report.get("switch-over-timeline"), dict)}
    if timelines:
        details["switch-over-timeline"] = timelines
    details |= {"dirty-sync-count": ram.get("dirty-sync-count"), "dst-threads": dst_threads,
                # Auto-converge only raises the throttle: the last is the peak.
                "peak-throttle": stats.get("cpu-throttle-percentage", 0)}
    return Outcome(
        total_time_s=stats["total-time"] / 1000,
        downtime_s=stats.get("downtime", 0) / 1000,
        bytes=ram.get("transferred"),
        src_cpu_s=src_cpu, dst_cpu_s=dst_cpu, wall_s=wall, guest_ok=ok, details=details,
    )
