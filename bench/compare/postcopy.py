"""Issue 24's benchmark: a running guest whose working set does not converge
at 1 Gbit/s, moved by postcopy and by each tool's best precopy.

    python3 -m bench.compare.postcopy --links 1gbit,loopback --working-sets 512 \\
        --reps 3 --out bench/results/postcopy24

Contenders (interleaved, order reversed each case and repetition):

* `tern-postcopy`: tern with its defaults and `--postcopy auto` (postcopy
  instead of any throttle, docs/postcopy.md);
* `tern-default`: tern with its defaults (precopy, auto-converge on);
* `qemu-postcopy`: QEMU 10, `postcopy-ram` on both sides, the precopy pass
  as QEMU's best precopy runs it where QEMU allows, `migrate-start-postcopy`
  once the first pass is over (ram `dirty-sync-count` reaches 2: libvirt's
  `--postcopy-after-precopy`);
* `qemu-postcopy-preempt`: the same with `postcopy-preempt` on both sides;
* `qemu-zstd-ac`: QEMU's best precopy, multifd zstd-1 on 2 channels with
  auto-converge.

The guest, memory image, link and QMP client are bench/compare's
(bench/README.md); the rows and what each column means are in
docs/benchmarks-qemu.md ("Issue 24").
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

from . import image, netem, procfs, qemu, system, tern
from .config import BENCH, ROOT, Artifacts, Config
from .contenders import Case, TernContender
from .processes import kill, next_port
from .stats import median

LINKS = ("1gbit", "loopback")


@dataclass(frozen=True)
class PostcopyContender:
    name: str
    tool: str  # "tern" or "qemu"
    # tern: options beyond its defaults.
    tern_options: tuple[str, ...] = ()
    # QEMU: postcopy-ram after the first pass, and postcopy-preempt.
    postcopy: bool = False
    preempt: bool = False


CONTENDERS = (
    PostcopyContender("tern-postcopy", "tern", tern_options=("--postcopy", "auto")),
    PostcopyContender("tern-default", "tern"),
    PostcopyContender("qemu-postcopy", "qemu", postcopy=True),
    PostcopyContender("qemu-postcopy-preempt", "qemu", postcopy=True, preempt=True),
    PostcopyContender("qemu-zstd-ac", "qemu"),
)
NAMES = tuple(c.name for c in CONTENDERS)


@dataclass
class PostcopyRun:
    """One contender, one case (link, working set), one repetition."""
    link: str
    working_set_mib: int
    contender: str
    rep: int
    metrics: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


# ---------------------------------------------------------------- pure parts


def qemu_capabilities(who: PostcopyContender, multifd: bool,
                      destination: bool) -> list[dict[str, Any]]:
    """`migrate-set-capabilities` for a QEMU contender on one side:
    auto-converge for precopy only (QEMU throttles only in precopy, and
    the postcopy rows must hand over, not throttle); postcopy-ram and
    postcopy-preempt on both sides; postcopy-blocktime on the destination,
    which measures it."""
    caps = {"multifd": multifd}
    if who.postcopy:
        caps["postcopy-ram"] = True
        if who.preempt:
            caps["postcopy-preempt"] = True
        if destination:
            caps["postcopy-blocktime"] = True
    else:
        caps["auto-converge"] = True
    return [{"capability": k, "state": v} for k, v in caps.items()]


def qemu_parameters(downtime_limit: int, multifd: bool) -> dict[str, Any]:
    """QEMU's best precopy settings here (docs/benchmarks-qemu.md): multifd
    zstd-1 on 2 channels, zero pages found by the multifd threads; without
    multifd, QEMU compresses nothing."""
    params: dict[str, Any] = {"downtime-limit": downtime_limit,
                              "max-bandwidth": 64 << 30}
    if multifd:
        params |= {"multifd-channels": 2, "multifd-compression": "zstd",
                   "multifd-zstd-level": 1, "zero-page-detection": "multifd"}
    return params


def first_pass_done(info: dict[str, Any]) -> bool:
    """QEMU's first pass over memory is over: the dirty log was synced a
    second time (the first sync is at the start)."""
    return (info.get("ram") or {}).get("dirty-sync-count", 0) >= 2


def histogram_percentile(counts: list[int], fraction: float) -> float | None:
    """The `fraction` percentile (0.5, 0.99) of tern's power-of-two fault
    latency histogram (entry i counts faults answered in [2^i, 2^(i+1))
    µs), as the upper bound of the bucket that holds it: an upper bound,
    never an underestimate. None without faults."""
    total = sum(counts)
    if total == 0:
        return None
    seen = 0
    for i, count in enumerate(counts):
        seen += count
        if seen >= fraction * total:
            return float(2 ** (i + 1))
    return float(2 ** len(counts))


def work_pct(passes: int | None, rate: float | None, seconds: float) -> float | None:
    """The guest's passes during the migration as a share of what it did
    per second before it (100: not slowed at all)."""
    if passes is None or not rate or seconds <= 0:
        return None
    return 100 * passes / (rate * seconds)


def tern_metrics(stats: dict[str, Any], rstats: dict[str, Any]) -> dict[str, Any]:
    """The table's figures from `tern vm migrate --json` and `tern vm
    receive --json`."""
    ram = stats.get("ram", {})
    post = stats.get("postcopy") or {}
    total = stats["total-time"] / 1000
    rate = (stats.get("guest-before-migration") or {}).get("passes-per-second")
    start = stats.get("source-pass-count-at-start")
    # The destination's counter where the received guest was first checked:
    # after the last page arrived (postcopy) or just after the resume.
    end = rstats.get("pass-count-before")
    passes = end - start if end is not None and start is not None else None
    after = post.get("delivered-after-ms")
    histogram = post.get("fault-latency-histogram-us") or []
    return {
        "total_s": total,
        "downtime_ms": stats.get("downtime"),
        # tern completes once every page is placed and the digests compared:
        # the guest resumed on the destination `delivered-after` before that.
        "switch_s": total - after / 1000 if after is not None else None,
        "delivered_after_switch_s": after / 1000 if after is not None else None,
        "peak_throttle": stats.get("cpu-throttle-percentage", 0),
        "guest_passes": passes,
        "rate_before": rate,
        "guest_work_pct": work_pct(passes, rate, total),
        "blocktime_ms": post.get("postcopy-blocktime"),
        "fault_avg_us": post.get("fault-latency-avg-us"),
        "fault_p50_us": histogram_percentile(histogram, 0.5),
        "fault_p99_us": histogram_percentile(histogram, 0.99),
        "faults": post.get("faults"),
        "postcopy_requests": post.get("postcopy-requests"),
        "mib": (ram.get("transferred") or 0) / 2**20,
        "postcopy_mib": (post.get("postcopy-bytes") or 0) / 2**20 if post else None,
        "trigger": post.get("trigger"),
        "digest_verified": stats.get("digest-verified"),
        "guest_ok": bool(rstats.get("guest-runs-on-destination")
                         and rstats.get("consistency-check", {}).get("passed", False)),
    }


def qemu_metrics(info: dict[str, Any], dst_info: dict[str, Any], timeline: dict[str, float],
                 counters: dict[str, int], rate: float | None,
                 peak_throttle: int) -> dict[str, Any]:
    """The table's figures from QEMU's `query-migrate` on both sides and
    the harness's own timeline (seconds since `migrate`)."""
    ram = info.get("ram", {})
    total = info["total-time"] / 1000
    passes = counters.get("end", 0) - counters.get("start", 0) if "end" in counters else None
    switch = timeline.get("postcopy-active")
    return {
        "total_s": total,
        # QEMU's own downtime; in postcopy it ends when the source has sent
        # the device state, before the destination runs: the harness's
        # `dst_running_after_switch_ms` is the pause-to-running bound.
        "downtime_ms": info.get("downtime"),
        "switch_s": switch,
        "delivered_after_switch_s": (timeline["completed"] - switch
                                     if switch is not None and "completed" in timeline
                                     else None),
        "dst_running_after_switch_ms": (1000 * (timeline["dst-running"] - timeline["switch"])
                                        if "dst-running" in timeline and "switch" in timeline
                                        else None),
        "peak_throttle": peak_throttle,
        "guest_passes": passes,
        "rate_before": rate,
        "guest_work_pct": work_pct(passes, rate, total),
        "blocktime_ms": dst_info.get("postcopy-blocktime"),
        "fault_avg_us": None,
        "fault_p50_us": None,
        "fault_p99_us": None,
        "faults": None,
        "postcopy_requests": info.get("postcopy-requests") or ram.get("postcopy-requests"),
        "mib": (ram.get("transferred") or 0) / 2**20,
        "postcopy_mib": ((ram.get("postcopy-bytes") or 0) / 2**20
                         if switch is not None else None),
        "digest_verified": None,
        "guest_ok": counters.get("end", 0) > counters.get("start", 0) if "end" in counters
        else False,
    }


# ------------------------------------------------------------------- runs


def _wait_serial(path: Path, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and path.stat().st_size > 0:
            return
        time.sleep(0.02)
    raise RuntimeError("QEMU guest did not start (no serial output)")


def run_qemu(cfg: Config, artifacts: Artifacts, link: str, who: PostcopyContender,
             work: Path, multifd: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """One QEMU migration of the running guest; (metrics, raw replies)."""
    for f in work.glob("q*"):
        f.unlink()
    port = next_port()
    with ExitStack() as stack:
        dst_err = stack.enter_context(open(work / "qdst.err", "w"))
        src_err = stack.enter_context(open(work / "qsrc.err", "w"))
        dst = subprocess.Popen(netem.wrap(qemu.command(cfg, artifacts, work, "qdst", False,
                                                       "running"), link),
                               stdout=subprocess.DEVNULL, stderr=dst_err)
        stack.callback(kill, dst)
        src = subprocess.Popen(netem.wrap(qemu.command(cfg, artifacts, work, "qsrc", True,
                                                       "running"), link),
                               stdout=subprocess.DEVNULL, stderr=src_err)
        stack.callback(kill, src)
        qd = stack.enter_context(closing(qemu.Qmp(work / "qdst.qmp")))
        qs = stack.enter_context(closing(qemu.Qmp(work / "qsrc.qmp")))
        for q, destination in ((qd, True), (qs, False)):
            q.cmd("migrate-set-capabilities",
                  capabilities=qemu_capabilities(who, multifd, destination))
            q.cmd("migrate-set-parameters", **qemu_parameters(cfg.downtime_limit, multifd))
        qd.cmd("migrate-incoming", uri=f"tcp:127.0.0.1:{port}")
        _wait_serial(work / "qsrc.serial")
        warm0 = qs.counter()
        time.sleep(cfg.warmup / 1000)
        counters = {"start": qs.counter()}
        rate = (counters["start"] - warm0) / (cfg.warmup / 1000)
        timeline: dict[str, float] = {}
        t0 = time.time()
        qs.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        info: dict[str, Any] = {}
        dst_info: dict[str, Any] = {}
        peak = 0
        while time.time() - t0 < cfg.timeout:
            info = qs.cmd("query-migrate")
            now = time.time() - t0
            peak = max(peak, info.get("cpu-throttle-percentage", 0))
            status = info.get("status")
            if who.postcopy and "switch" not in timeline and first_pass_done(info):
                qs.cmd("migrate-start-postcopy")
                timeline["switch"] = time.time() - t0
            if status == "postcopy-active":
                timeline.setdefault("postcopy-active", now)
                if "dst-running" not in timeline:
                    if qd.cmd("query-status")["status"] == "running":
                        timeline["dst-running"] = time.time() - t0
                # Blocktime is the destination's; it may go with its state.
                dst_info = qd.cmd("query-migrate") or dst_info
            if status in ("completed", "failed", "cancelled"):
                timeline["completed"] = now
                break
            time.sleep(0.01)
        if info.get("status") != "completed":
            if info.get("status") not in ("failed", "cancelled"):
                qs.cmd("migrate_cancel")
            raise RuntimeError(f"QEMU migration {info.get('status')}: "
                               f"{info.get('error-desc')}")
        try:
            last = qd.cmd("query-migrate")
            if last and "postcopy-blocktime" in last:
                dst_info = last
        except (RuntimeError, OSError):
            pass
        deadline = time.time() + 5
        while time.time() < deadline and qd.cmd("query-status")["status"] != "running":
            time.sleep(0.02)
        counters["end"] = qd.counter()
        metrics = qemu_metrics(info, dst_info, timeline, counters, rate, peak)
        return metrics, {"query-migrate": info, "destination": dst_info,
                         "timeline": timeline, "counters": counters, "rate": rate,
                         "multifd": multifd}


def run_tern(cfg: Config, artifacts: Artifacts, link: str, who: PostcopyContender,
             work: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """One tern migration of the running guest with tern's defaults and
    the contender's options; (metrics, both JSON reports)."""
    case = Case("running", link, 2, "none")
    contender = TernContender(who.name, verify="full", defaults=True,
                              options=who.tern_options)
    raw: dict[str, Any] = {}
    # One pass over a 1 GiB working set takes seconds on a fresh
    # destination (every page faulted in): long enough to see one.
    run_after = max(1000, cfg.working_set_mib * 10)
    tern.run(cfg, artifacts, case, contender, work, raw=raw, run_after_ms=run_after)
    stats, rstats = raw["source"], raw["destination"]
    return tern_metrics(stats, rstats), {"source": stats, "destination": rstats}


# ----------------------------------------------------------------- report


COLUMNS = (
    ("total_s", "total s", "{:.2f}"),
    ("downtime_ms", "downtime ms", "{:.0f}"),
    ("dst_running_after_switch_ms", "QEMU: start-postcopy → dst running ms", "{:.0f}"),
    ("switch_s", "switch at s", "{:.2f}"),
    ("delivered_after_switch_s", "switch → all memory s", "{:.2f}"),
    ("peak_throttle", "peak throttle %", "{:.0f}"),
    ("guest_passes", "guest passes", "{:.0f}"),
    ("passes_per_s", "guest passes/s", "{:.2f}"),
    ("blocktime_ms", "blocktime ms", "{:.0f}"),
    ("fault_p50_us", "fault p50 µs", "{:.0f}"),
    ("fault_p99_us", "fault p99 µs", "{:.0f}"),
    ("mib", "MiB sent", "{:.0f}"),
    ("postcopy_mib", "MiB after switch", "{:.0f}"),
)


def summarize(runs: list[PostcopyRun]) -> list[dict[str, Any]]:
    """Medians per (link, working set, contender), in run order."""
    rows: list[dict[str, Any]] = []
    keys: list[tuple[str, int, str]] = []
    for run in runs:
        key = (run.link, run.working_set_mib, run.contender)
        if key not in keys:
            keys.append(key)
    for link, ws, name in keys:
        mine = [r for r in runs if (r.link, r.working_set_mib, r.contender) == (link, ws, name)]
        done = [r for r in mine if r.error is None]
        row: dict[str, Any] = {"link": link, "working_set_mib": ws, "contender": name,
                               "n": len(done), "failed": len(mine) - len(done)}
        for key, _, _ in COLUMNS:
            row[key] = median(derived(r.metrics).get(key) for r in done)
        row["guest_ok"] = all(r.metrics.get("guest_ok") for r in done)
        # Runs that handed over to postcopy (tern's auto may converge
        # without): the postcopy columns are medians over these only.
        row["switched"] = sum(1 for r in done if r.metrics.get("switch_s") is not None)
        loads = [r.metrics.get("loadavg") for r in mine if r.metrics.get("loadavg") is not None]
        row["load"] = (min(loads), median(loads), max(loads)) if loads else None
        rows.append(row)
    return rows


def derived(metrics: dict[str, Any]) -> dict[str, Any]:
    """A run's figures with the ones computed from others: the guest's
    passes per second of migration (its work while the migration ran, on
    either host: the counter travels with memory). The rate measured in
    the warm-up is not the yardstick: the first pass over the working set
    faults it in from the image and is several times slower."""
    passes, total = metrics.get("guest_passes"), metrics.get("total_s")
    extra = {"passes_per_s": passes / total if passes is not None and total else None}
    return {**metrics, **extra}


def markdown(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    out = [f"# Issue 24: postcopy vs precopy, tern vs QEMU ({header['date']})", "",
           f"tern {header['tern']}; {header['qemu']}; {header['machine']}", "",
           f"`{' '.join(header['argv'])}`", ""]
    titles = (["link", "working set", "who", "n", "postcopy in"] + [t for _, t, _ in COLUMNS]
              + ["guest ok", "load"])
    out.append("| " + " | ".join(titles) + " |")
    out.append("|" + " --- |" * len(titles))
    for row in rows:
        cells = [row["link"], f"{row['working_set_mib']} MiB", row["contender"],
                 f"{row['n']}" + (f" ({row['failed']} failed)" if row["failed"] else ""),
                 f"{row['switched']}/{row['n']}"]
        for key, _, fmt in COLUMNS:
            value = row[key]
            cells.append("-" if value is None else fmt.format(value))
        cells.append("yes" if row["guest_ok"] else "⚠ no")
        load = row["load"]
        cells.append("-" if load is None else f"{load[0]:.1f}-{load[2]:.1f}")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def save(out: Path, header: dict[str, Any], runs: list[PostcopyRun]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {**header, "runs": [asdict(r) for r in runs]}, indent=1, default=str))
    (out / "results.md").write_text(markdown(summarize(runs), header) + _failures(runs))


def _failures(runs: list[PostcopyRun]) -> str:
    failed = [r for r in runs if r.error]
    if not failed:
        return ""
    lines = ["", "## Failed runs", ""]
    lines += [f"* {r.link} {r.working_set_mib} MiB {r.contender} rep {r.rep}: {r.error[:400]}"
              for r in failed]
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m bench.compare.postcopy",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--links", default="1gbit,loopback")
    ap.add_argument("--working-sets", default="512", help="MiB, comma-separated")
    ap.add_argument("--memory-mib", type=int, default=1024)
    ap.add_argument("--contenders", default=",".join(NAMES))
    ap.add_argument("--qemu-postcopy-multifd", choices=("auto", "on", "off"), default="auto",
                    help="multifd (zstd-1, 2 channels) in the QEMU postcopy rows' precopy "
                         "pass; auto: on where QEMU accepts it with postcopy-ram")
    ap.add_argument("--timeout", type=float, default=180, help="per migration, s")
    ap.add_argument("--warmup", type=int, default=1000, help="ms")
    ap.add_argument("--target-dir", default=os.environ.get("CARGO_TARGET_DIR",
                                                           str(ROOT / "target")))
    ap.add_argument("--work", default="/var/tmp/ternbench-postcopy")
    ap.add_argument("--out", default=str(BENCH / "results" / "postcopy24"))
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite results.md from results.json")
    return ap


def log(*parts: object) -> None:
    print(time.strftime("%H:%M:%S"), *parts, file=sys.stderr, flush=True)


def qemu_accepts_postcopy_with_multifd(cfg: Config, artifacts: Artifacts, work: Path) -> bool:
    """Whether this QEMU takes multifd and postcopy-ram together (QEMU
    refused the pair before 10.1)."""
    with ExitStack() as stack:
        proc = subprocess.Popen(qemu.command(cfg, artifacts, work, "qprobe", False, "running"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(kill, proc)
        q = stack.enter_context(closing(qemu.Qmp(work / "qprobe.qmp")))
        try:
            q.cmd("migrate-set-capabilities", capabilities=[
                {"capability": "multifd", "state": True},
                {"capability": "postcopy-ram", "state": True}])
            return True
        except RuntimeError as error:
            log(f"QEMU refuses multifd with postcopy-ram: {error}")
            return False


def report_only(out: Path) -> None:
    """results.md again from results.json."""
    stored = json.loads((out / "results.json").read_text())
    runs = [PostcopyRun(**r) for r in stored.pop("runs")]
    save(out, stored, runs)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.report_only:
        report_only(Path(args.out))
        return 0
    links = [x for x in args.links.split(",") if x]
    sets = [int(x) for x in args.working_sets.split(",") if x]
    wanted = [c for c in CONTENDERS if c.name in args.contenders.split(",")]
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    binary = system.build_tern(args.target_dir, log)
    cfg = Config(reps=args.reps, memory_mib=args.memory_mib, warmup=args.warmup,
                 timeout=args.timeout, links=links, modes=["running"],
                 contenders=["qemu", "tern"], target_dir=args.target_dir, work=str(work),
                 out=str(out))
    img = work / f"image-{cfg.memory_mib}M.bin"
    image.make(img, cfg.memory, kind="mixed")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    tver = subprocess.run([str(binary), "--version"], capture_output=True,
                          text=True).stdout.strip()
    header = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "argv": sys.argv[1:] if argv is None else argv,
              "tern": f"{tver} (git {commit})", "qemu": qemu.version(),
              "machine": procfs.machine_info(), "memory_mib": cfg.memory_mib}
    guests = {}
    for ws in sets:
        guests[ws] = work / f"guest-{ws}M.mb"
        subprocess.run([str(binary), "vm", "export-guest", "--working-set", str(ws << 20),
                        "--workload", "increment", "--multiboot", str(guests[ws])], check=True)
    multifd = {"on": True, "off": False}.get(args.qemu_postcopy_multifd)
    if multifd is None and any(c.postcopy for c in wanted):
        probe = Artifacts(tern=binary, image=img, guest=guests[sets[0]])
        multifd = qemu_accepts_postcopy_with_multifd(cfg, probe, work)
    header["qemu-postcopy-multifd"] = multifd
    runs: list[PostcopyRun] = []
    shaped = netem.SHAPED in links
    if shaped:
        netem.setup(cfg.tbf_rate, cfg.tbf_burst, cfg.tbf_latency)
    try:
        for rep in range(args.reps):
            index = 0
            for link in links:
                for ws in sets:
                    cfg.working_set_mib = ws
                    artifacts = Artifacts(tern=binary, image=img, guest=guests[ws])
                    order = wanted if (rep + index) % 2 == 0 else wanted[::-1]
                    index += 1
                    for who in order:
                        run = PostcopyRun(link, ws, who.name, rep)
                        load = float(Path("/proc/loadavg").read_text().split()[0])
                        try:
                            if who.tool == "tern":
                                run.metrics, run.raw = run_tern(cfg, artifacts, link, who, work)
                            else:
                                run.metrics, run.raw = run_qemu(
                                    cfg, artifacts, link, who, work,
                                    multifd=(not who.postcopy) or bool(multifd))
                            m = run.metrics
                            log(f"rep {rep} {link} {ws}M {who.name:22} total {m['total_s']:.2f} "
                                f"down {m['downtime_ms']} switch {m['switch_s']} "
                                f"thr {m['peak_throttle']} work {m['guest_work_pct']} "
                                f"MiB {m['mib']:.0f} ok {m['guest_ok']}")
                        except Exception as error:  # noqa: BLE001 - recorded, run goes on
                            run.error = f"{type(error).__name__}: {error}"
                            log(f"rep {rep} {link} {ws}M {who.name}: FAILED {run.error[:300]}")
                        run.metrics["loadavg"] = load
                        runs.append(run)
                        save(out, header, runs)
    finally:
        save(out, header, runs)
        if shaped:
            netem.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
