"""Issue 25's benchmark: the test guest saved to a file and restored, tern
(`tern vm save` / `tern vm restore`, docs/snapshots.md) against QEMU 10's
mapped-ram (`migrate` to a `file:` URI with the mapped-ram and multifd
capabilities; restore with `migrate-incoming` from the same URI).

    python3 -m bench.compare.snapshot --states paused,running --reps 3 \\
        --out bench/results/snapshot25

Per state (paused: the guest stopped before the save; running: saved live)
and repetition, interleaved (order reversed each time):

* `qemu-mapped-ram`: save, then restore into a new QEMU (eager: QEMU
  loads every page, then runs the guest);
* `tern`: `tern vm save` (`--live` when running), then `tern vm restore`
  eager and `tern vm restore --lazy` of the same file.

Both use the same number of writers/channels (`--writers`, default 4:
tern's default; QEMU's `multifd-channels`) and the bench's memory image.
Before each restore the file is written back and dropped from the page
cache (fsync, POSIX_FADV_DONTNEED), so every restore reads from the disk.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack, closing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import image, procfs, qemu, system
from .config import BENCH, ROOT, Artifacts, Config
from .processes import kill
from .stats import median

STATES = ("paused", "running")
NAMES = ("qemu-mapped-ram", "tern", "tern-nosync", "qemu-mapped-ram-direct", "tern-direct")
DEFAULT_NAMES = ("qemu-mapped-ram", "tern")


def is_direct(name: str) -> bool:
    """The `-direct` rows write the file with O_DIRECT: QEMU's `direct-io`
    parameter (mapped-ram only; it applies to the restore too), tern's
    `--direct` (the save only)."""
    return name.endswith("-direct")


def is_no_sync(name: str) -> bool:
    """`tern-nosync` saves with `--no-sync`: the file is not fsynced before
    the save returns, as QEMU's mapped-ram migration to a file does not
    (strace of QEMU 10.0.2's save shows no fsync, fdatasync or
    sync_file_range); plain `tern` waits for the disk."""
    return name == "tern-nosync"


@dataclass
class SnapshotRun:
    state: str
    contender: str
    rep: int
    metrics: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


# ---------------------------------------------------------------- pure parts


def mapped_ram_capabilities() -> list[dict[str, Any]]:
    """mapped-ram needs multifd for parallel writers (both sides)."""
    return [{"capability": "mapped-ram", "state": True},
            {"capability": "multifd", "state": True}]


def mapped_ram_parameters(channels: int, direct: bool = False) -> dict[str, Any]:
    params: dict[str, Any] = {"multifd-channels": channels, "max-bandwidth": 64 << 30}
    if direct:
        params["direct-io"] = True
    return params


def file_sizes(path: Path) -> dict[str, int]:
    """Apparent size and the bytes the file occupies on disk (holes are
    free)."""
    st = path.stat()
    return {"apparent": st.st_size, "disk": st.st_blocks * 512}


def write_back_and_drop(path: Path) -> float:
    """fsync the file (its writeback time, in s, is returned) and drop it
    from the page cache, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        start = time.time()
        os.fsync(fd)
        took = time.time() - start
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return took


def tern_save_args(binary: Path, cfg: Config, artifacts: Artifacts, state: str, output: Path,
                   writers: int, direct: bool = False, no_sync: bool = False) -> list[str]:
    args = [str(binary), "vm", "save", "--memory", str(cfg.memory),
            "--working-set", str(cfg.working_set), "--image", str(artifacts.image),
            "--output", str(output), "--writers", str(writers), "--warmup", str(cfg.warmup),
            "--json", "--stop"]
    if state == "running":
        args.append("--live")
    if direct:
        args.append("--direct")
    if no_sync:
        args.append("--no-sync")
    return args


def tern_restore_args(binary: Path, snapshot: Path, lazy: bool, threads: int) -> list[str]:
    args = [str(binary), "vm", "restore", "--snapshot", str(snapshot), "--threads",
            str(threads), "--json", "--run-after", "500"]
    if lazy:
        args.append("--lazy")
    return args


def tern_save_metrics(report: dict[str, Any]) -> dict[str, Any]:
    return {"save_s": report["total-time-ms"] / 1000,
            "save_paused_ms": report.get("downtime-ms"),
            "file_bytes_reported": report.get("file-bytes"),
            "passes": report.get("passes")}


def tern_restore_metrics(report: dict[str, Any], prefix: str) -> dict[str, Any]:
    """eager: resumed after everything was read and verified; lazy: to
    running, to fully loaded, fault latency."""
    out = {f"{prefix}_running_ms": report.get("resumed-after-ms"),
           f"{prefix}_guest_ok": bool(report.get("guest-runs")
                                      and report.get("digest-verified"))}
    lazy = report.get("lazy")
    if lazy:
        faults = lazy.get("faults") or {}
        out |= {f"{prefix}_loaded_ms": lazy.get("loaded-after-ms"),
                f"{prefix}_faults": faults.get("faults"),
                f"{prefix}_fault_p50_us": faults.get("fault-latency-p50-us",
                                                     faults.get("latency-p50-us")),
                f"{prefix}_fault_p99_us": faults.get("fault-latency-p99-us",
                                                     faults.get("latency-p99-us"))}
    else:
        out[f"{prefix}_loaded_ms"] = report.get("resumed-after-ms")
    return out


# ------------------------------------------------------------------- runs


def _json_run(args: list[str], timeout: float) -> dict[str, Any]:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])}: exit {done.returncode}: "
                           f"{done.stderr[-800:]}")
    return json.loads(done.stdout)


def run_tern(binary: Path, cfg: Config, artifacts: Artifacts, state: str, path: Path,
             writers: int, direct: bool = False,
             no_sync: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    saved = _json_run(tern_save_args(binary, cfg, artifacts, state, path, writers, direct,
                                     no_sync), cfg.timeout)
    metrics = tern_save_metrics(saved)
    sizes = file_sizes(path)
    metrics |= {"file_apparent_mib": sizes["apparent"] / 2**20,
                "file_disk_mib": sizes["disk"] / 2**20,
                "fsync_s": write_back_and_drop(path)}
    eager = _json_run(tern_restore_args(binary, path, False, writers), cfg.timeout)
    metrics |= tern_restore_metrics(eager, "eager")
    write_back_and_drop(path)
    lazy = _json_run(tern_restore_args(binary, path, True, writers), cfg.timeout)
    metrics |= tern_restore_metrics(lazy, "lazy")
    metrics["guest_ok"] = bool(metrics["eager_guest_ok"] and metrics["lazy_guest_ok"])
    return metrics, {"save": saved, "eager": eager, "lazy": lazy}


def _wait_serial(path: Path, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and path.stat().st_size > 0:
            return
        time.sleep(0.02)
    raise RuntimeError("QEMU guest did not start (no serial output)")


def _poll(check, timeout: float, step: float = 0.005) -> float:
    """Polls `check()` until true; the seconds it took."""
    start = time.time()
    while not check():
        if time.time() - start > timeout:
            raise RuntimeError("timed out")
        time.sleep(step)
    return time.time() - start


def run_qemu(cfg: Config, artifacts: Artifacts, state: str, work: Path, path: Path,
             channels: int, direct: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """QEMU saves to a mapped-ram file, then a new QEMU restores it."""
    for f in work.glob("q*"):
        f.unlink()
    metrics: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    with ExitStack() as stack:
        src = subprocess.Popen(qemu.command(cfg, artifacts, work, "qsrc", True, "running"),
                               stdout=subprocess.DEVNULL,
                               stderr=stack.enter_context(open(work / "qsrc.err", "w")))
        stack.callback(kill, src)
        qs = stack.enter_context(closing(qemu.Qmp(work / "qsrc.qmp")))
        qs.cmd("migrate-set-capabilities", capabilities=mapped_ram_capabilities())
        qs.cmd("migrate-set-parameters", **mapped_ram_parameters(channels, direct))
        _wait_serial(work / "qsrc.serial")
        time.sleep(cfg.warmup / 1000)
        if state == "paused":
            qs.cmd("stop")
        saved_count = None
        qs.cmd("migrate", uri=f"file:{path}")
        info: dict[str, Any] = {}
        deadline = time.time() + cfg.timeout
        while time.time() < deadline:
            info = qs.cmd("query-migrate")
            if info.get("status") in ("completed", "failed", "cancelled"):
                break
            time.sleep(0.005)
        if info.get("status") != "completed":
            raise RuntimeError(f"QEMU save {info.get('status')}: {info.get('error-desc')}")
        saved_count = qs.counter()
        raw["save"] = info
        metrics |= {"save_s": info["total-time"] / 1000,
                    "save_paused_ms": (info["total-time"] if state == "paused"
                                       else info.get("downtime"))}
    sizes = file_sizes(path)
    metrics |= {"file_apparent_mib": sizes["apparent"] / 2**20,
                "file_disk_mib": sizes["disk"] / 2**20,
                "fsync_s": write_back_and_drop(path)}
    with ExitStack() as stack:
        dst = subprocess.Popen(qemu.command(cfg, artifacts, work, "qdst", False, "running"),
                               stdout=subprocess.DEVNULL,
                               stderr=stack.enter_context(open(work / "qdst.err", "w")))
        stack.callback(kill, dst)
        qd = stack.enter_context(closing(qemu.Qmp(work / "qdst.qmp")))
        qd.cmd("migrate-set-capabilities", capabilities=mapped_ram_capabilities())
        qd.cmd("migrate-set-parameters", **mapped_ram_parameters(channels, direct))
        start = time.time()
        qd.cmd("migrate-incoming", uri=f"file:{path}")

        def loaded() -> bool:
            return qd.cmd("query-status")["status"] not in ("inmigrate", "restore-vm")
        _poll(loaded, cfg.timeout)
        loaded_s = time.time() - start
        status = qd.cmd("query-status")["status"]
        if status != "running":
            # A guest saved stopped comes back stopped, as it was: resume it.
            qd.cmd("cont")
            _poll(lambda: qd.cmd("query-status")["status"] == "running", 10)
        running_s = time.time() - start
        raw["restore-status-when-loaded"] = status
        raw["restore-query-migrate"] = qd.cmd("query-migrate")
        c1 = qd.counter()
        _poll(lambda: qd.counter() > c1, 10, 0.05)
        metrics |= {"eager_loaded_ms": 1000 * loaded_s, "eager_running_ms": 1000 * running_s,
                    "guest_ok": saved_count is not None and c1 >= saved_count}
    return metrics, raw


def prefetch_restore_args(binary: Path, snapshot: Path, threads: int, record: Path | None,
                          working_set: Path | None, touch_spread_mib: int = 0) -> list[str]:
    """A lazy restore without prefetch that records the pages the guest
    faulted on (`record`), or one that prefetches that recorded set first
    (`working_set`): REAP's idea, Firecracker CI's 128 MiB case. With
    `touch_spread_mib`, the restore reads that much memory spread across the
    guest right after the resume (`--touch-spread`) and reports the time."""
    args = tern_restore_args(binary, snapshot, True, threads)
    if touch_spread_mib:
        args += ["--touch-spread", f"{touch_spread_mib}MiB"]
    if record is not None:
        args += ["--no-prefetch", "--record-working-set", str(record)]
    if working_set is not None:
        args += ["--working-set", str(working_set)]
    return args


def prefetch_metrics(report: dict[str, Any]) -> dict[str, Any]:
    """What the guest paid for its faults after a lazy restore."""
    lazy = report.get("lazy") or {}
    faults = lazy.get("faults") or {}
    touched = report.get("touched") or {}
    return {"running_ms": report.get("resumed-after-ms"),
            "touched_ms": touched.get("after-ms"), "touched_pages": touched.get("pages"),
            "loaded_ms": lazy.get("loaded-after-ms"),
            "faults": faults.get("faults"), "fault_pages": faults.get("fault-pages"),
            "blocktime_ms": faults.get("blocktime-ms"),
            "fault_p50_us": faults.get("fault-latency-p50-us"),
            "fault_p99_us": faults.get("fault-latency-p99-us"),
            "guest_ok": bool(report.get("guest-runs") and report.get("digest-verified"))}


PREFETCH_KEYS = ("running_ms", "touched_ms", "loaded_ms", "faults", "fault_pages",
                 "blocktime_ms", "fault_p50_us", "fault_p99_us")


def spread(values) -> str | None:
    """min-max of the values present, for the report."""
    have = [v for v in values if v is not None]
    return f"{min(have):.1f}-{max(have):.1f}" if have else None


def run_lazy_startup(binaries: dict[str, Path], cfg: Config, artifacts: Artifacts, work: Path,
                     threads: int, reps: int, out: Path, header: dict[str, Any]) -> None:
    """A/B of the lazy restore's time to a running guest: one paused save,
    then per repetition a lazy restore by each binary (order alternating),
    each from a cold page cache, with tern's breakdown of where the time
    went (`lazy.startup`)."""
    path = work / "snap-startup.snap"
    first = next(iter(binaries.values()))
    _json_run(tern_save_args(first, cfg, artifacts, "paused", path, threads, no_sync=True),
              cfg.timeout)
    runs: list[dict[str, Any]] = []
    names = list(binaries)
    for rep in range(reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            write_back_and_drop(path)
            load = float(Path("/proc/loadavg").read_text().split()[0])
            report = _json_run(tern_restore_args(binaries[name], path, True, threads),
                               cfg.timeout)
            startup = (report.get("lazy") or {}).get("startup") or {}
            metrics = {"running_ms": report.get("resumed-after-ms"), "loadavg": load,
                       "guest_ok": bool(report.get("guest-runs")
                                        and report.get("digest-verified"))}
            metrics |= {k.replace("-", "_"): v for k, v in startup.items()}
            runs.append({"rep": rep, "binary": name, "metrics": metrics})
            log(f"rep {rep} {name}: {metrics}")
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.json").write_text(json.dumps({**header, "runs": runs}, indent=1))
    keys = ("running_ms", "open_ms", "prepare_ms", "guest_ms", "register_ms", "state_ms",
            "resume_ms")
    lines = [f"# Lazy restore → running, A/B ({header['date']})", "",
             f"`{' '.join(header['argv'])}`", "",
             "| binary | n | → running ms (median) | spread | ≤ 10 ms | "
             + " | ".join(keys[1:]) + " | load | guest ok |", "|" + " --- |" * (len(keys) + 5)]
    for name in names:
        mine = [r["metrics"] for r in runs if r["binary"] == name]
        cells = [name, str(len(mine)), f"{median(m['running_ms'] for m in mine):.1f}",
                 spread(m["running_ms"] for m in mine) or "-",
                 f"{sum(m['running_ms'] <= 10 for m in mine)}/{len(mine)}"]
        for k in keys[1:]:
            have = [m.get(k) for m in mine if m.get(k) is not None]
            cells.append(f"{median(have):.1f}" if have else "-")
        cells += [spread(m["loadavg"] for m in mine) or "-",
                  str(all(m["guest_ok"] for m in mine))]
        lines.append("| " + " | ".join(cells) + " |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    path.unlink()


def run_prefetch(binary: Path, cfg: Config, artifacts: Artifacts, work: Path, threads: int,
                 reps: int, out: Path, header: dict[str, Any],
                 touch_spread_mib: int = 0) -> list[dict[str, Any]]:
    """The guest (working set `cfg.working_set`) saved paused once; then per
    repetition a lazy restore without prefetch that records its faulted
    pages, and one that prefetches them, the order alternating, each from a
    cold page cache."""
    path = work / "snap-prefetch.snap"
    ws = work / "prefetch.ws"
    _json_run(tern_save_args(binary, cfg, artifacts, "paused", path, threads), cfg.timeout)
    write_back_and_drop(path)
    # The recording run: faults only for its first 500 ms (`--load-after`),
    # so the set holds every page the guest touched then, not only those
    # the in-order loader had not reached yet (REAP records the same way).
    _json_run(prefetch_restore_args(binary, path, threads, ws, None, touch_spread_mib)
              + ["--load-after", "500"], cfg.timeout)
    runs: list[dict[str, Any]] = []
    for rep in range(reps):
        for prefetch in ((False, True) if rep % 2 == 0 else (True, False)):
            write_back_and_drop(path)
            args = prefetch_restore_args(binary, path, threads,
                                         None if prefetch else work / "again.ws",
                                         ws if prefetch else None, touch_spread_mib)
            report = _json_run(args, cfg.timeout)
            run = {"rep": rep, "prefetch": prefetch, "metrics": prefetch_metrics(report),
                   "raw": report}
            run["metrics"]["loadavg"] = float(Path("/proc/loadavg").read_text().split()[0])
            log(f"rep {rep} prefetch={prefetch}: {run['metrics']}")
            runs.append(run)
            out.mkdir(parents=True, exist_ok=True)
            (out / "results.json").write_text(json.dumps({**header, "runs": runs}, indent=1))
    rows = []
    for prefetch in (False, True):
        mine = [r["metrics"] for r in runs if r["prefetch"] == prefetch]
        rows.append({"prefetch": prefetch, "n": len(mine)} | {
            k: median(m.get(k) for m in mine)
            for k in PREFETCH_KEYS + ("loadavg",)})
        rows[-1]["spread"] = {k: spread(m.get(k) for m in mine) for k in PREFETCH_KEYS}
    lines = [f"# Lazy restore with and without prefetch ({header['date']})", "",
             f"`{' '.join(header['argv'])}`", "",
             "| prefetch | n | → running ms | working set read ms | → all loaded ms | faults "
             "| pages faulted | blocktime ms | fault p50 µs | fault p99 µs | load |",
             "|" + " --- |" * 11]
    for row in rows:
        lines.append("| " + " | ".join(
            [("recorded working set" if row["prefetch"] else "none"), str(row["n"])]
            + ["-" if row[k] is None else f"{row[k]:.1f}"
               for k in PREFETCH_KEYS + ("loadavg",)]) + " |")
    lines += ["", "Spread (min-max): " + "; ".join(
        f"{'prefetch' if row['prefetch'] else 'none'} {k} {row['spread'][k]}"
        for row in rows for k in ("touched_ms", "blocktime_ms") if row["spread"][k])]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    path.unlink()
    return rows


# ----------------------------------------------------------------- report


COLUMNS = (
    ("save_s", "save s", "{:.2f}"),
    ("save_paused_ms", "guest paused ms", "{:.0f}"),
    ("fsync_s", "fsync after s", "{:.2f}"),
    ("file_apparent_mib", "file MiB (apparent)", "{:.0f}"),
    ("file_disk_mib", "file MiB (on disk)", "{:.0f}"),
    ("eager_running_ms", "eager restore → running ms", "{:.0f}"),
    ("lazy_running_ms", "lazy → running ms", "{:.1f}"),
    ("lazy_loaded_ms", "lazy → all loaded ms", "{:.0f}"),
    ("lazy_fault_p50_us", "lazy fault p50 µs", "{:.0f}"),
    ("lazy_fault_p99_us", "lazy fault p99 µs", "{:.0f}"),
)


def summarize(runs: list[SnapshotRun]) -> list[dict[str, Any]]:
    rows = []
    for state in STATES:
        for name in NAMES:
            mine = [r for r in runs if r.state == state and r.contender == name]
            if not mine:
                continue
            done = [r for r in mine if r.error is None]
            row: dict[str, Any] = {"state": state, "contender": name, "n": len(done),
                                   "failed": len(mine) - len(done)}
            for key, _, _ in COLUMNS:
                row[key] = median(r.metrics.get(key) for r in done)
            row["guest_ok"] = all(r.metrics.get("guest_ok") for r in done)
            loads = [r.metrics["loadavg"] for r in mine if r.metrics.get("loadavg") is not None]
            row["load"] = (min(loads), max(loads)) if loads else None
            rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    out = [f"# Issue 25: snapshots, tern vs QEMU mapped-ram ({header['date']})", "",
           f"tern {header['tern']}; {header['qemu']}; {header['machine']}", "",
           f"`{' '.join(header['argv'])}`", ""]
    titles = ["state", "who", "n"] + [t for _, t, _ in COLUMNS] + ["guest ok", "load"]
    out.append("| " + " | ".join(titles) + " |")
    out.append("|" + " --- |" * len(titles))
    for row in rows:
        cells = [row["state"], row["contender"],
                 f"{row['n']}" + (f" ({row['failed']} failed)" if row["failed"] else "")]
        for key, _, fmt in COLUMNS:
            cells.append("-" if row[key] is None else fmt.format(row[key]))
        cells.append("yes" if row["guest_ok"] else "⚠ no")
        cells.append("-" if row["load"] is None else f"{row['load'][0]:.1f}-{row['load'][1]:.1f}")
        out.append("| " + " | ".join(cells) + " |")
    failed = [r for r in _all_runs(header) if r.error]
    if failed:
        out += ["", "## Failed runs", ""]
        out += [f"* {r.state} {r.contender} rep {r.rep}: {r.error[:400]}" for r in failed]
    return "\n".join(out) + "\n"


def _all_runs(header: dict[str, Any]) -> list[SnapshotRun]:
    return header.get("_runs", [])


def save(out: Path, header: dict[str, Any], runs: list[SnapshotRun]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {**header, "runs": [asdict(r) for r in runs]}, indent=1, default=str))
    (out / "results.md").write_text(markdown(summarize(runs), {**header, "_runs": runs}))


# ------------------------------------------------------------ diff sizes

DIFF_MODES = ("chunk", "page")


def diff_save_args(binary: Path, memory_mib: int, writers: int, base: Path, diff: Path,
                   percent: int, mode: str) -> list[str]:
    """The synthetic guest (it can dirty a known set of pages), no dirtier:
    a full save, then `percent` % of pages written spread across memory,
    then a diff. `chunk`: the diff compared by content (whole 16-page
    chunks); `page`: from the dirty log kept since the base
    (`--track-dirty-pages`, exactly the pages written)."""
    args = [str(binary), "save", "--memory", f"{memory_mib}MiB", "--dirty-rate", "0",
            "--output", str(base), "--diff-output", str(diff), "--diff-after", "0",
            "--diff-dirty-spread", str(percent), "--writers", str(writers), "--warmup", "0",
            "--json"]
    if mode == "page":
        args.append("--track-dirty-pages")
    return args


def diff_metrics(report: dict[str, Any], diff: Path) -> dict[str, Any]:
    stats = report["diffs"][0]
    return {"diff_save_ms": stats["total-time-ms"],
            "diff_pages_written": stats["normal"], "diff_zero_pages": stats["duplicate"],
            "pages_left_to_base": stats["unchanged-pages"],
            "pages_dirtied": stats.get("pages-dirtied"),
            "diff_disk_mib": file_sizes(diff)["disk"] / 2**20,
            "base_save_ms": report["total-time-ms"], "digest": stats["digest"]}


def run_diff(binary: Path, args: argparse.Namespace, work: Path, out: Path,
             header: dict[str, Any]) -> None:
    """Chunk- against page-granular diffs, interleaved, each restored
    eagerly on its base (the restore checks the digest)."""
    runs: list[SnapshotRun] = []
    for rep in range(args.reps):
        order = DIFF_MODES if rep % 2 == 0 else DIFF_MODES[::-1]
        for mode in order:
            run = SnapshotRun("diff", mode, rep)
            run.metrics["loadavg"] = float(Path("/proc/loadavg").read_text().split()[0])
            base, diff = work / f"diff-base-{mode}-{rep}.snap", work / f"diff-{mode}-{rep}.snap"
            try:
                saved = _json_run(diff_save_args(binary, args.memory_mib, args.writers, base,
                                                 diff, args.diff_percent, mode), args.timeout)
                run.metrics |= diff_metrics(saved, diff)
                restored = _json_run([str(binary), "restore", "--snapshot", str(diff), "--base",
                                      str(base), "--run-after", "0", "--json"], args.timeout)
                run.metrics["restore_digest_ok"] = restored.get("digest") == \
                    run.metrics["digest"]
                run.raw = {"save": saved, "restore": restored}
                log(f"rep {rep} diff {mode}: " + " ".join(
                    f"{k}={v}" for k, v in run.metrics.items() if k != "digest"))
            except Exception as error:  # noqa: BLE001 - recorded, run goes on
                run.error = f"{type(error).__name__}: {error}"
                log(f"rep {rep} diff {mode}: FAILED {run.error[:300]}")
            for path in (base, diff):
                path.unlink(missing_ok=True)
            runs.append(run)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {**header, "diff_percent": args.diff_percent, "runs": [asdict(r) for r in runs]},
        indent=1, default=str))
    keys = ("diff_save_ms", "diff_pages_written", "diff_disk_mib", "pages_dirtied",
            "base_save_ms", "loadavg")
    lines = [f"# Diff snapshots, chunk- vs page-granular ({args.memory_mib} MiB synthetic "
             f"guest, {args.diff_percent} % of pages dirtied spread across memory)", "",
             f"{header['date']}, {header['tern']}, medians of {args.reps} runs", "",
             "| diff | " + " | ".join(keys) + " | restored by digest |",
             "|---|" + "---|" * (len(keys) + 1)]
    for mode in DIFF_MODES:
        ok = [r for r in runs if r.contender == mode and not r.error]
        cells = [f"{median([r.metrics[k] for r in ok]):.2f}" if ok else "-" for k in keys]
        good = all(r.metrics.get("restore_digest_ok") for r in ok) and bool(ok)
        lines.append(f"| {mode} | " + " | ".join(cells) + f" | {good} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print((out / "results.md").read_text())


# -------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m bench.compare.snapshot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--states", default=",".join(STATES))
    ap.add_argument("--contenders", default=",".join(DEFAULT_NAMES),
                    help=f"from {','.join(NAMES)}")
    ap.add_argument("--memory-mib", type=int, default=1024)
    ap.add_argument("--working-set-mib", type=int, default=16)
    ap.add_argument("--writers", type=int, default=4,
                    help="tern's --writers/--threads and QEMU's multifd-channels")
    ap.add_argument("--warmup", type=int, default=1000, help="ms")
    ap.add_argument("--timeout", type=float, default=180, help="per step, s")
    ap.add_argument("--prefetch", action="store_true",
                    help="instead: tern's lazy restore of the guest (its working set "
                         "--working-set-mib) with and without prefetching the set a first "
                         "restore recorded")
    ap.add_argument("--touch-spread-mib", type=int, default=0,
                    help="with --prefetch: each restore reads this much memory spread across "
                         "the guest right after the resume (tern restore --touch-spread) and "
                         "reports the time: a working set the in-order loader does not reach "
                         "first")
    ap.add_argument("--lazy-startup", action="store_true",
                    help="instead: A/B of the lazy restore's time to running, this tree's "
                         "tern against --base-tern, alternating, cold page cache")
    ap.add_argument("--base-tern", help="with --lazy-startup: the other tern binary")
    ap.add_argument("--diff", action="store_true",
                    help="instead: diff snapshots chunk- vs page-granular (tern save of the "
                         "synthetic guest with and without --track-dirty-pages) after "
                         "--diff-percent of pages spread across memory were written")
    ap.add_argument("--diff-percent", type=int, default=1)
    ap.add_argument("--target-dir", default=os.environ.get("CARGO_TARGET_DIR",
                                                           str(ROOT / "target")))
    ap.add_argument("--work", default="/var/tmp/ternbench-snapshot")
    ap.add_argument("--out", default=str(BENCH / "results" / "snapshot25"))
    return ap


def log(*parts: object) -> None:
    print(time.strftime("%H:%M:%S"), *parts, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    states = [s for s in args.states.split(",") if s]
    wanted = [n for n in NAMES if n in args.contenders.split(",")]
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    binary = system.build_tern(args.target_dir, log)
    if args.diff:
        header = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  "argv": sys.argv[1:] if argv is None else argv,
                  "tern": subprocess.run([str(binary), "--version"], capture_output=True,
                                         text=True).stdout.strip(),
                  "machine": procfs.machine_info(), "memory_mib": args.memory_mib,
                  "writers": args.writers, "filesystem-of-work": _filesystem(work)}
        run_diff(binary, args, work, out, header)
        return 0
    cfg = Config(reps=args.reps, memory_mib=args.memory_mib,
                 working_set_mib=args.working_set_mib, warmup=args.warmup,
                 timeout=args.timeout, contenders=["qemu", "tern"], work=str(work))
    img = work / f"image-{cfg.memory_mib}M.bin"
    image.make(img, cfg.memory, kind="mixed")
    guest = work / f"guest-{cfg.working_set_mib}M.mb"
    subprocess.run([str(binary), "vm", "export-guest", "--working-set", str(cfg.working_set),
                    "--workload", "increment", "--multiboot", str(guest)], check=True)
    artifacts = Artifacts(tern=binary, image=img, guest=guest)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    tver = subprocess.run([str(binary), "--version"], capture_output=True,
                          text=True).stdout.strip()
    header = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "argv": sys.argv[1:] if argv is None else argv,
              "tern": f"{tver} (git {commit})", "qemu": qemu.version(),
              "machine": procfs.machine_info(), "memory_mib": cfg.memory_mib,
              "writers": args.writers, "filesystem-of-work": _filesystem(work)}
    if args.prefetch:
        run_prefetch(binary, cfg, artifacts, work, args.writers, args.reps, out, header,
                     args.touch_spread_mib)
        return 0
    if args.lazy_startup:
        if not args.base_tern:
            raise SystemExit("--lazy-startup needs --base-tern")
        run_lazy_startup({"base": Path(args.base_tern), "new": binary}, cfg, artifacts, work,
                         args.writers, args.reps, out, header)
        return 0
    runs: list[SnapshotRun] = []
    files: list[Path] = []
    # Files an interrupted run left: moved aside now (a rename is instant),
    # removed with this run's at the end.
    trash = work / "trash"
    trash.mkdir(exist_ok=True)
    for stale in work.glob("*.snap"):
        stale.rename(trash / f"{time.time_ns()}-{stale.name}")
    files += list(trash.iterdir())
    index = 0
    for rep in range(args.reps):
        for state in states:
            order = wanted if index % 2 == 0 else wanted[::-1]
            index += 1
            for name in order:
                run = SnapshotRun(state, name, rep)
                load = float(Path("/proc/loadavg").read_text().split()[0])
                # A new file each time, removed only at the end: here (ext4
                # mounted with discard) removing or replacing a 1 GiB file
                # takes minutes of discards, which would land in a save.
                # (Not named q*: run_qemu clears QEMU's files by that glob.)
                path = work / f"snap-{name}-{state}-{rep}.snap"
                files.append(path)
                try:
                    if name.startswith("tern"):
                        run.metrics, run.raw = run_tern(binary, cfg, artifacts, state, path,
                                                        args.writers, is_direct(name),
                                                        is_no_sync(name))
                    else:
                        run.metrics, run.raw = run_qemu(cfg, artifacts, state, work, path,
                                                        args.writers, is_direct(name))
                    log(f"rep {rep} {state} {name}: " + " ".join(
                        f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in run.metrics.items()))
                except Exception as error:  # noqa: BLE001 - recorded, run goes on
                    run.error = f"{type(error).__name__}: {error}"
                    log(f"rep {rep} {state} {name}: FAILED {run.error[:300]}")
                run.metrics["loadavg"] = load
                runs.append(run)
                save(out, header, runs)
    log(f"removing {len(files)} snapshot files")
    for path in files:
        path.unlink(missing_ok=True)
    return 0


def _filesystem(path: Path) -> str:
    done = subprocess.run(["df", "-T", str(path)], capture_output=True, text=True)
    lines = done.stdout.splitlines()
    return lines[-1] if len(lines) > 1 else ""


if __name__ == "__main__":
    sys.exit(main())
