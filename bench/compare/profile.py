"""Where each side's CPU goes in one migration: `perf record` of the whole
machine around one run per contender, cut to the harness's own CPU window
(from the moment it samples the processes' CPU at the start to the sample
at the end) and to each process.

    python3 -m bench.compare.profile --modes paused --links loopback \\
        --channels 4 --compressions none --memory-mib 3072 \\
        --contenders qemu-nothp,tern-default --out bench/results/NAME

It takes the harness's options (bench/compare/config.py) and runs every
contender of the plan once. Per contender and side it writes
`perf-CONTENDER-SIDE.txt` (symbols, self time) and prints the CPU seconds
per category of `CATEGORIES`: samples come at `--freq` per second of CPU,
so samples / freq is CPU seconds. perf must be installed; samples use
CLOCK_MONOTONIC so the window's times, taken with time.monotonic(), cut
them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from . import cli, procfs, qemu, tern
from . import config as config_mod
from .contenders import QemuContender, plan

# Categories of a sample by its leaf symbol and call chain, first match
# wins; what matches none is "other".
CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    ("uffd copy (alloc, copy, map)", re.compile(r"mfill_atomic|userfaultfd_copy|uffdio_copy")),
    ("first-touch faults", re.compile(r"exc_page_fault|do_user_addr_fault|handle_mm_fault|"
                                      r"do_anonymous_page|asm_exc_page_fault")),
    ("populate (madvise)", re.compile(r"madvise_populate|faultin_page|do_madvise")),
    ("softirq / loopback delivery", re.compile(r"net_rx_action|__do_softirq|handle_softirqs|"
                                               r"do_softirq|process_backlog")),
    ("socket send", re.compile(r"tcp_sendmsg|sock_sendmsg|__sys_sendto|do_writev|sock_write_iter"
                               r"|__x64_sys_sendmsg|__sys_sendmsg")),
    ("socket receive", re.compile(r"tcp_recvmsg|sock_recvmsg|do_readv|__sys_recvfrom|"
                                  r"sock_read_iter|__sys_recvmsg")),
    ("zero-page check", re.compile(r"is_zero|zero_page|all_zero|find_nonzero|tern_page::zero",
                                    re.I)),
    ("hash (xxh3) / digest", re.compile(r"xxh|XXH|digest|blake|sha", re.I)),
    ("compress", re.compile(r"zstd|ZSTD|lz4|LZ4|deflate|libdeflate|dictionary|ZDICT|COVER",
                            re.I)),
    ("kvm / vcpu", re.compile(r"kvm|vcpu|pvm", re.I)),
    ("memcpy (user)", re.compile(r"memcpy|memmove")),
    ("munmap / exit", re.compile(r"unmap|exit_mmap|do_exit|free_pgtables|release_pages")),
    ("mmap / page tables / setup", re.compile(r"mmap|mprotect|do_mlock|clone|execve")),
    ("wait: poll, futex, scheduler", re.compile(r"futex|poll|epoll|schedule|nanosleep|"
                                                r"finish_task_switch|sched_yield")),
]


class Window:
    """The harness's CPU window: the times it sampled the two processes'
    CPU (the first pair at the start, the second at the end)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []

    def wrap(self, real):
        def sampled(pid: int) -> float:
            self.samples.append((time.monotonic(), pid))
            return real(pid)
        return sampled

    def bounds(self) -> tuple[float, float, int, int]:
        """Start, end, source pid, destination pid."""
        if len(self.samples) < 4:
            raise RuntimeError(f"CPU sampled {len(self.samples)} times, expected 4")
        (start, src), (_, dst) = self.samples[0], self.samples[1]
        end = self.samples[3][0]
        return start, end, src, dst


def categorise(script: str, freq: int) -> dict[str, float]:
    """CPU seconds per category from `perf script` output (one sample: a
    header line, then its call chain, then a blank line)."""
    seconds: dict[str, float] = defaultdict(float)
    for block in script.split("\n\n"):
        lines = [line for line in block.splitlines() if line.strip()]
        if len(lines) < 2:
            continue
        chain = " ".join(lines[1:])
        for name, pattern in CATEGORIES:
            if pattern.search(chain):
                seconds[name] += 1 / freq
                break
        else:
            seconds["other"] += 1 / freq
    return dict(seconds)


def perf_text(data: Path, start: float, end: float, pid: int, *args: str) -> str:
    return subprocess.run(["perf", *args, "-i", str(data), "--time", f"{start:.6f},{end:.6f}",
                           "--pid", str(pid)], capture_output=True, text=True).stdout


def main(argv: list[str] | None = None) -> int:
    ap = config_mod.parser()
    ap.add_argument("--freq", type=int, default=1999, help="perf samples per CPU second")
    args = ap.parse_args(argv)
    cfg = config_mod.from_args(args)
    results, artifacts = cli.prepare(cfg, argv if argv is not None else sys.argv[1:])
    out, work = Path(cfg.out), Path(cfg.work)
    out.mkdir(parents=True, exist_ok=True)
    for case, contenders in plan(cfg.modes, cfg.links, cfg.channels, cfg.compressions,
                                 cfg.contenders, cfg.extras):
        for who in contenders:
            window = Window()
            real = procfs.cpu_seconds
            procfs.cpu_seconds = window.wrap(real)
            data = work / f"perf-{who.name}.data"
            recorder = subprocess.Popen(["perf", "record", "-a", "-g", "-k", "mono", "-F",
                                         str(args.freq), "-o", str(data)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            load = cli.load_average()
            try:
                if isinstance(who, QemuContender):
                    outcome = qemu.run(cfg, artifacts, case, who, work)
                else:
                    outcome = tern.run(cfg, artifacts, case, who, work)
            finally:
                procfs.cpu_seconds = real
                recorder.send_signal(2)
                recorder.wait(120)
            start, end, src, dst = window.bounds()
            (out / f"perf-{who.name}-window.json").write_text(json.dumps(
                {"start": start, "end": end, "src": src, "dst": dst, "data": str(data),
                 "load": load, "outcome": outcome.line()}))
            cli.log(f"{case.key} {who.name} load {load} {outcome.line()} "
                    f"window {end - start:.2f} s")
            for side, pid in (("src", src), ("dst", dst)):
                report = perf_text(data, start, end, pid, "report", "--stdio", "--no-children",
                                   "--sort", "comm,dso,sym", "-g", "none",
                                   "--percentage", "relative",
                                   "--percent-limit", "0.3")
                (out / f"perf-{who.name}-{side}.txt").write_text(report)
                script = perf_text(data, start, end, pid, "script", "-F", "comm,tid,ip,sym")
                seconds = categorise(script, args.freq)
                total = sum(seconds.values())
                print(f"{who.name} {side}: {total:.2f} CPU s sampled")
                for name, value in sorted(seconds.items(), key=lambda kv: -kv[1]):
                    print(f"    {name:34} {value:6.3f} s {100 * value / max(total, 1e-9):5.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
