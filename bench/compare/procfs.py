"""CPU time of processes and threads from /proc, and the machine's description."""

from __future__ import annotations

import os
import platform
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def stat_cpu_seconds(stat: str, clk_tck: int = CLK_TCK) -> float:
    """utime + stime of a /proc/PID/stat line, in seconds. The command name
    (field 2) may hold spaces and parentheses, so fields count from the last
    ')': state is field 3, utime field 14, stime field 15."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / clk_tck


def cpu_seconds(pid: int) -> float:
    return stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (threads of one name summed)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            seconds = stat_cpu_seconds((task / "stat").read_text())
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + seconds
    return out


def thread_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per thread name spent between two samples (threads that
    did next to nothing left out)."""
    return {k: round(v - before.get(k, 0.0), 3) for k, v in sorted(after.items())
            if v - before.get(k, 0.0) > 0.005}


def machine_info() -> dict:
    model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    kvm = ""
    try:
        kvm = Path("/sys/module/kvm/version").read_text().strip()
    except OSError:
        pass
    return {"cpu": model, "nproc": os.cpu_count(), "mem_total_bytes": mem,
            "kernel": platform.release(),
            "kvm_modules": sorted(m for m in os.listdir("/sys/module") if m.startswith("kvm")),
            "kvm_version": kvm}
