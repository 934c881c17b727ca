"""The run: check the machine, build, prepare the guest, run the plan
interleaved, write the report after each repetition."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import time
from pathlib import Path

from . import config as config_mod
from . import image, netem, pki, procfs, qemu, report, system, tern
from .config import ROOT, Artifacts, Config
from .contenders import QemuContender, Run, plan, workload
from .results import Results


def log(*parts: object) -> None:
    print(time.strftime("%H:%M:%S"), *parts, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = config_mod.parser().parse_args(argv)
    charts = not args.no_charts
    out = Path(args.out)
    if args.report_only:
        missing = system.missing_for_charts(charts)
        if missing:
            sys.exit(system.missing_message(missing))
        results = Results.load(out)
        report.write(results, out, charts)
        return 0
    try:
        cfg = config_mod.from_args(args)
    except ValueError as error:
        sys.exit(f"bench.compare: {error}")
    missing = system.find_missing(cfg, charts)
    if missing and args.install:
        system.install(missing, log)
        missing = system.find_missing(cfg, charts)
    if missing:
        sys.exit(system.missing_message(missing))
    problems = system.permission_problems(cfg)
    if problems:
        sys.exit("cannot run:\n" + "\n".join(f"  - {p}" for p in problems))
    results, artifacts = prepare(cfg, argv if argv is not None else sys.argv[1:])
    run_plan(cfg, artifacts, results, charts)
    return 0


def prepare(cfg: Config, argv: list[str]) -> tuple[Results, Artifacts]:
    """Builds tern, writes the guest and the memory image: the results to
    fill, and what the runs start from."""
    binary = system.build_tern(cfg.target_dir, log)
    tver = subprocess.run([str(binary), "--version"], capture_output=True,
                          text=True).stdout.strip()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    work = Path(cfg.work)
    work.mkdir(parents=True, exist_ok=True)
    rewrite = "running-rewrite" in cfg.modes
    suffix = "" if cfg.image == "mixed" else f"-{cfg.image}"
    artifacts = Artifacts(tern=binary, image=work / f"image-{cfg.memory_mib}M{suffix}.bin",
                          guest=work / f"guest-{cfg.working_set_mib}M.mb",
                          tls=pki.make(work / "tls") if cfg.wants_tls() else None,
                          guest_rewrite=(work / f"guest-rewrite-{cfg.rewrite_working_set_mib}M.mb"
                                         if rewrite else None))
    image.make(artifacts.image, cfg.memory, kind=cfg.image)
    for mode, path in (("running", artifacts.guest), ("running-rewrite", artifacts.guest_rewrite)):
        if path is not None:
            subprocess.run([str(binary), "vm", "export-guest", "--working-set",
                            str(cfg.working_set_for(mode)), "--workload", workload(mode),
                            "--multiboot", str(path)], check=True)
    return Results(
        argv=argv,
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        machine=procfs.machine_info(),
        qemu_version=qemu.version() if cfg.wants_qemu() else None,
        tern_version=f"{tver} (git {commit})",
        image={"bytes": cfg.memory, "description": image.DESCRIPTIONS[cfg.image]},
        config=cfg,
    ), artifacts


def load_average() -> float | None:
    """The 1-minute load average (other jobs share the machine)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def run_plan(cfg: Config, artifacts: Artifacts, results: Results, charts: bool) -> None:
    work, out = Path(cfg.work), Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    shaped = netem.SHAPED in cfg.links
    if shaped:
        netem.setup(cfg.tbf_rate, cfg.tbf_burst, cfg.tbf_latency)
    cases = plan(cfg.modes, cfg.links, cfg.channels, cfg.compressions, cfg.contenders,
                 cfg.extras)
    started = time.time()
    try:
        for rep in range(cfg.reps):
            for index, (case, contenders) in enumerate(cases):
                # A B C, then C B A: neither side always runs first.
                order = contenders if (rep + index) % 2 == 0 else contenders[::-1]
                for who in order:
                    record = Run(case, who.name, rep)
                    load = load_average()
                    try:
                        if isinstance(who, QemuContender):
                            record.outcome = qemu.run(cfg, artifacts, case, who, work)
                        else:
                            record.outcome = tern.run(cfg, artifacts, case, who, work)
                        # The machine is shared: the load when the run started.
                        record.outcome.details["loadavg-1min"] = load
                        log(f"rep {rep} {case.key:28} {who.name:11} {record.outcome.line()}")
                    except Exception as error:  # noqa: BLE001 - recorded, run goes on
                        record.error = f"{type(error).__name__}: {error}"
                        log(f"rep {rep} {case.key} {who.name}: FAILED {record.error[:300]}")
                    results.runs.append(record)
            results.save(out)
            report.write(results, out, charts)
    finally:
        results.elapsed_s = time.time() - started
        results.save(out)
        report.write(results, out, charts)
        if shaped:
            netem.cleanup()
    log(f"done in {time.time() - started:.0f} s; report: {out / 'results.md'}")
