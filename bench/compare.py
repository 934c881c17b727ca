#!/usr/bin/env python3
"""tern vs QEMU 10: side-by-side live-migration benchmark on the same guest.

One command:

    python3 bench/compare.py            # full default run
    python3 bench/compare.py --quick    # smoke run: 1 repetition, small guest

Both programs run the same test guest (tern-vmm's guest code, exported as a
multiboot image for QEMU's -kernel) over the same memory image, with the
same downtime limit, on the same link, interleaved A/B. Results go to
bench/results/ (results.json, results.md, *.png). See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
NETNS = "ternbench"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = 4096


def log(*parts):
    print(time.strftime("%H:%M:%S"), *parts, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Setup: QEMU 10, matplotlib, tern
# --------------------------------------------------------------------------


def qemu_version() -> str | None:
    exe = shutil.which("qemu-system-x86_64")
    if not exe:
        return None
    out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    return out.splitlines()[0] if out else None


def ensure_qemu():
    version = qemu_version()
    if version and " 10." in version:
        return version
    log("installing qemu-system-x86 from bookworm-backports")
    sources = ""
    for path in [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]:
        try:
            sources += path.read_text()
        except OSError:
            pass
    if "bookworm-backports" not in sources:
        # Backports come from the mirror the machine already uses.
        mirror = None
        for line in sources.splitlines():
            line = line.strip()
            if line.startswith("URIs:") and "security" not in line:
                mirror = line.split()[1]
                break
            if line.startswith("deb ") and "security" not in line:
                mirror = line.split()[1]
                break
        if mirror is None:
            sys.exit("no Debian mirror found in /etc/apt/sources.list*: add bookworm-backports yourself")
        Path("/etc/apt/sources.list.d/backports.list").write_text(
            f"deb {mirror} bookworm-backports main\n"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends",
         "-t", "bookworm-backports", "qemu-system-x86"],
        check=True, env=env,
    )
    version = qemu_version()
    if not version or " 10." not in version:
        sys.exit(f"QEMU 10 is required, found: {version}")
    return version


def ensure_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log("installing matplotlib")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "matplotlib"], check=True)


def build_tern(target_dir: str) -> Path:
    env = dict(os.environ, CARGO_TARGET_DIR=target_dir)
    log("building tern (release)")
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "tern"], cwd=ROOT, env=env,
                   check=True)
    return Path(target_dir) / "release" / "tern"


# --------------------------------------------------------------------------
# The memory image and the guest
# --------------------------------------------------------------------------


def make_image(path: Path, size: int, seed: int = 20260101):
    """Deterministic image: ~50% zero pages, ~25% random, ~25% text-like."""
    import numpy as np

    meta = path.with_suffix(".meta")
    want = f"{size} {seed} v1"
    if path.exists() and meta.exists() and meta.read_text() == want:
        return
    log(f"generating the memory image {path} ({size >> 20} MiB)")
    pages = size // PAGE
    rng = np.random.default_rng(seed)
    kinds = rng.integers(0, 4, pages)  # 0,1 zero; 2 random; 3 text
    words = ("migration page memory guest dirty channel zero stream kernel "
             "the of and to in is for on with as by at from this that "
             "buffer socket thread vcpu region bitmap digest codec").split()
    text_rng = np.random.default_rng(seed + 1)
    text = " ".join(words[i] for i in text_rng.integers(0, len(words), 40000)).encode()
    text = np.frombuffer(text[: 64 * 1024], dtype=np.uint8)
    chunk = 4096  # pages per write (16 MiB)
    with open(path, "wb") as out:
        for first in range(0, pages, chunk):
            n = min(chunk, pages - first)
            block = np.zeros((n, PAGE), dtype=np.uint8)
            k = kinds[first:first + n]
            rnd = np.nonzero(k == 2)[0]
            block[rnd] = rng.integers(0, 256, (len(rnd), PAGE), dtype=np.uint8)
            txt = np.nonzero(k == 3)[0]
            for row in txt:
                off = int(rng.integers(0, len(text) - PAGE))
                block[row] = text[off:off + PAGE]
                block[row, :8] = np.frombuffer(int(first + row).to_bytes(8, "little"),
                                               dtype=np.uint8)
            out.write(block.tobytes())
    meta.write_text(want)


# --------------------------------------------------------------------------
# Processes, /proc, network namespace
# --------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[0] is state (field 3); utime is field 14, stime field 15
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (threads of one name summed)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def thread_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 3) for k, v in sorted(after.items())
            if v - before.get(k, 0.0) > 0.005}


def netns_setup(rate: str, burst: str, latency: str):
    netns_cleanup()
    subprocess.run(["ip", "netns", "add", NETNS], check=True)
    subprocess.run(["ip", "-n", NETNS, "link", "set", "lo", "up"], check=True)
    subprocess.run(["ip", "netns", "exec", NETNS, "tc", "qdisc", "add", "dev", "lo", "root",
                    "tbf", "rate", rate, "burst", burst, "latency", latency], check=True)


def netns_cleanup():
    subprocess.run(["ip", "netns", "del", NETNS], stderr=subprocess.DEVNULL)


def wrap(cmd: list[str], link: str) -> list[str]:
    return (["ip", "netns", "exec", NETNS] + cmd) if link == "1gbit" else cmd


def kill(proc: subprocess.Popen | None):
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


_port = [47000]


def next_port() -> int:
    _port[0] += 1
    if _port[0] > 48900:
        _port[0] = 47001
    return _port[0]


# --------------------------------------------------------------------------
# QMP
# --------------------------------------------------------------------------


class Qmp:
    def __init__(self, path: Path, timeout: float = 20):
        deadline = time.time() + timeout
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.connect(str(path))
                break
            except OSError:
                self.sock.close()
                if time.time() > deadline:
                    raise
                time.sleep(0.05)
        self.sock.settimeout(60)
        self.buf = b""
        self._read()  # greeting
        self.cmd("qmp_capabilities")

    def _read(self) -> dict:
        while b"\n" not in self.buf:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("QMP closed")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def cmd(self, name: str, **args):
        msg = {"execute": name}
        if args:
            msg["arguments"] = args
        self.sock.sendall(json.dumps(msg).encode() + b"\n")
        while True:
            reply = self._read()
            if "event" in reply:
                continue
            if "error" in reply:
                raise RuntimeError(f"QMP {name}: {reply['error']}")
            return reply.get("return")

    def hmp(self, line: str) -> str:
        return self.cmd("human-monitor-command", **{"command-line": line})

    def counter(self) -> int:
        out = self.hmp("xp /1wx 0x2000")  # "0000000000002000: 0x0000abcd"
        return int(out.split(":")[1].split()[0], 16)

    def close(self):
        self.sock.close()


# --------------------------------------------------------------------------
# One QEMU migration
# --------------------------------------------------------------------------


def qemu_cmd(cfg, work: Path, name: str, source: bool) -> list[str]:
    mem = cfg.memory
    if source:
        backend = (f"memory-backend-file,id=ram,size={mem},mem-path={cfg.image},share=off")
    else:
        backend = f"memory-backend-ram,id=ram,size={mem}"
    cmd = [
        "qemu-system-x86_64", "-accel", "kvm", "-machine", "pc,memory-backend=ram",
        "-m", f"{mem >> 20}M", "-object", backend, "-smp", "1",
        "-nodefaults", "-no-user-config", "-display", "none",
        "-kernel", str(cfg.guest),
        "-serial", f"file:{work / (name + '.serial')}",
        "-qmp", f"unix:{work / (name + '.qmp')},server=on,wait=off",
    ]
    if not source:
        cmd += ["-incoming", "defer"]
    return cmd


def qemu_migration_settings(qmp: Qmp, case: dict, cfg):
    caps = [{"capability": "multifd", "state": True}]
    qmp.cmd("migrate-set-capabilities", capabilities=caps)
    params = {
        "multifd-channels": case["channels"],
        "multifd-compression": case["compression"],
        "zero-page-detection": "multifd",
        "downtime-limit": cfg.downtime_limit,
        "max-bandwidth": 64 << 30,  # uncapped (QEMU's default cap is 128 MiB/s)
    }
    if case["compression"] == "zstd":
        params["multifd-zstd-level"] = 1
    qmp.cmd("migrate-set-parameters", **params)


def no_thp():
    """In the child before exec: PR_SET_THP_DISABLE (inherited across exec),
    so QEMU's MADV_HUGEPAGE on guest RAM has no effect and the destination
    faults 4 KiB pages, like tern's VMM (which does not madvise)."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(41, 1, 0, 0, 0)


def run_qemu(cfg, case: dict, work: Path, variant: dict | None = None) -> dict:
    variant = variant or {}
    preexec = no_thp if variant.get("thp") is False else None
    for f in work.glob("q*"):
        f.unlink()
    port = next_port()
    src = dst = None
    qs = qd = None
    try:
        dst = subprocess.Popen(wrap(qemu_cmd(cfg, work, "qdst", False), case["link"]),
                               stdout=subprocess.DEVNULL, stderr=open(work / "qdst.err", "w"),
                               preexec_fn=preexec)
        src = subprocess.Popen(wrap(qemu_cmd(cfg, work, "qsrc", True), case["link"]),
                               stdout=subprocess.DEVNULL, stderr=open(work / "qsrc.err", "w"),
                               preexec_fn=preexec)
        qd = Qmp(work / "qdst.qmp")
        qs = Qmp(work / "qsrc.qmp")
        qemu_migration_settings(qd, case, cfg)
        qd.cmd("migrate-incoming", uri=f"tcp:127.0.0.1:{port}")
        qemu_migration_settings(qs, case, cfg)
        # Warm-up: let the guest boot and run (fault in its working set).
        serial = work / "qsrc.serial"
        deadline = time.time() + 30
        while time.time() < deadline:
            if serial.exists() and serial.stat().st_size > 0:
                break
            time.sleep(0.02)
        else:
            raise RuntimeError("QEMU guest did not start (no serial output)")
        time.sleep(cfg.warmup / 1000)
        c0 = qs.counter()
        if case["mode"] == "paused":
            qs.cmd("stop")
        src_cpu0, dst_cpu0 = cpu_seconds(src.pid), cpu_seconds(dst.pid)
        src_thr0, dst_thr0 = thread_cpu(src.pid), thread_cpu(dst.pid)
        t0 = time.time()
        qs.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        info = {}
        while time.time() - t0 < cfg.timeout:
            info = qs.cmd("query-migrate")
            status = info.get("status")
            if status in ("completed", "failed", "cancelled"):
                break
            time.sleep(0.01)
        wall = time.time() - t0
        src_cpu1, dst_cpu1 = cpu_seconds(src.pid), cpu_seconds(dst.pid)
        src_threads = thread_delta(src_thr0, thread_cpu(src.pid))
        dst_threads = thread_delta(dst_thr0, thread_cpu(dst.pid))
        if info.get("status") != "completed":
            if info.get("status") not in ("failed", "cancelled"):
                qs.cmd("migrate_cancel")
            raise RuntimeError(f"QEMU migration {info.get('status')}: {info.get('error-desc')}")
        ok = None
        if case["mode"] == "running":
            # The guest runs on the destination: its counter advances.
            deadline = time.time() + 5
            while time.time() < deadline and qd.cmd("query-status")["status"] != "running":
                time.sleep(0.02)
            d1 = qd.counter()
            time.sleep(0.3)
            d2 = qd.counter()
            ok = d2 > d1 >= c0
        ram = info.get("ram", {})
        return {
            "total_time_s": info["total-time"] / 1000,
            "downtime_s": info.get("downtime", 0) / 1000,
            "bytes": ram.get("transferred"),
            "src_cpu_s": src_cpu1 - src_cpu0,
            "dst_cpu_s": dst_cpu1 - dst_cpu0,
            "wall_s": wall,
            "guest_ok": ok,
            "extra": {"ram": ram, "setup-time": info.get("setup-time"),
                      "src-threads": src_threads, "dst-threads": dst_threads,
                      "expected-downtime": info.get("expected-downtime"),
                      "dirty-sync-count": ram.get("dirty-sync-count"),
                      "normal": ram.get("normal"), "duplicate": ram.get("duplicate")},
        }
    finally:
        for q in (qs, qd):
            if q:
                try:
                    q.close()
                except OSError:
                    pass
        kill(src)
        kill(dst)


# --------------------------------------------------------------------------
# One tern migration
# --------------------------------------------------------------------------


def wait_listening(proc: subprocess.Popen, err_path: Path, timeout: float) -> str:
    """The address from a tern receiver's ready event, the first line of its
    stdout (docs/cli.md, "Events")."""
    import selectors
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout)
    line = proc.stdout.readline() if ready else ""
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        event = {}
    if event.get("event") != "listening":
        raise RuntimeError(f"tern vm receive did not start (first line {line!r}): "
                           + err_path.read_text()[-2000:])
    return event["address"]


def run_tern(cfg, case: dict, variant: dict, work: Path) -> dict:
    recv = mig = None
    try:
        recv_err_path = work / "trecv.err"
        recv_err = open(recv_err_path, "w+")
        # Port 0: the receiver's ready event says which port it got.
        recv = subprocess.Popen(
            wrap([str(cfg.tern), "vm", "receive", "--listen", "127.0.0.1:0", "--json",
                  "--progress", "none",
                  "--run-after", "1000", "--accept-timeout", str(int(cfg.timeout))],
                 case["link"]),
            stdout=subprocess.PIPE, stderr=recv_err, text=True)
        addr = wait_listening(recv, recv_err_path, 20)
        args = [str(cfg.tern), "vm", "migrate", "--to", addr, "--json", "--progress", "none",
                "--memory", str(cfg.memory), "--working-set", str(cfg.working_set),
                "--image", str(cfg.image), "--warmup", str(cfg.warmup),
                "--downtime-limit", str(cfg.downtime_limit),
                "--channels", str(variant.get("channels", case["channels"])),
                "--compression", variant.get("compression", case["compression"]),
                "--verify", variant.get("verify", "none")]
        if variant.get("compression", case["compression"]) == "zstd":
            args += ["--compression-level", "1"]
        args += variant.get("extra", [])
        if case["mode"] == "paused":
            args.append("--paused")
        mig_err_path = work / "tmig.err"
        mig_err = open(mig_err_path, "w")
        mig_out_path = work / "tmig.out"
        mig_out = open(mig_out_path, "w")
        mig = subprocess.Popen(wrap(args, case["link"]), stdout=mig_out, stderr=mig_err)
        # Sample CPU when the migration starts (after the warm-up): tern
        # prints "migrating to" on stderr then.
        deadline = time.time() + 60
        while "migrating to" not in mig_err_path.read_text():
            if time.time() > deadline or mig.poll() is not None:
                raise RuntimeError("tern vm migrate did not start: "
                                   + mig_err_path.read_text()[-2000:])
            time.sleep(0.002)
        src_cpu0, dst_cpu0 = cpu_seconds(mig.pid), cpu_seconds(recv.pid)
        src_thr0, dst_thr0 = thread_cpu(mig.pid), thread_cpu(recv.pid)
        t0 = time.time()
        # The source exits right after completion: take its CPU from the
        # zombie before it is reaped (WNOWAIT keeps /proc/PID).
        while True:
            waited = os.waitid(os.P_PID, mig.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
            if waited is not None:
                break
            if time.time() - t0 > cfg.timeout:
                raise RuntimeError("tern migration timed out")
            time.sleep(0.002)
        src_cpu1 = cpu_seconds(mig.pid)
        dst_cpu1 = cpu_seconds(recv.pid)
        # A zombie has no threads left to list: per-thread source figures
        # come from tern's own --json; the destination's from /proc.
        dst_threads = thread_delta(dst_thr0, thread_cpu(recv.pid))
        wall = time.time() - t0
        mig.wait(30)
        out, err = mig_out_path.read_text(), mig_err_path.read_text()
        try:
            stats = json.loads(out)
        except json.JSONDecodeError:
            raise RuntimeError("tern vm migrate: no JSON: " + err[-2000:])
        # The ready line was read; the rest of stdout is the report.
        recv.wait(30)
        rout = recv.stdout.read()
        try:
            rstats = json.loads(rout)
        except json.JSONDecodeError:
            rstats = {}
        if mig.returncode != 0 or stats.get("status") not in (None, "completed"):
            raise RuntimeError(f"tern migration failed: {stats.get('status')} "
                               f"{stats.get('error-desc') or err[-1000:]}")
        ram = stats.get("ram", {})
        ok = rstats.get("guest-runs-on-destination") if case["mode"] == "running" else None
        if ok is not None:
            ok = ok and rstats.get("consistency-check", {}).get("passed", False)
        return {
            "total_time_s": stats["total-time"] / 1000,
            "downtime_s": stats.get("downtime", 0) / 1000,
            "bytes": ram.get("transferred"),
            "src_cpu_s": src_cpu1 - src_cpu0,
            "dst_cpu_s": dst_cpu1 - dst_cpu0,
            "wall_s": wall,
            "guest_ok": ok,
            "extra": {k: stats.get(k) for k in ("setup-time", "ram", "compression",
                                                "digest-verified", "cpu-seconds")
                      if k in stats} | {"dirty-sync-count": ram.get("dirty-sync-count"),
                                        "dst-threads": dst_threads},
        }
    finally:
        kill(mig)
        kill(recv)


# --------------------------------------------------------------------------
# The plan, the run, the report
# --------------------------------------------------------------------------


def case_key(case: dict) -> str:
    if case.get("extra"):
        return f"{case['mode']}/{case['link']}/extra"
    return f"{case['mode']}/{case['link']}/{case['channels']}ch/{case['compression']}"


def plan(cfg) -> list[tuple[dict, list[tuple[str, dict | None]]]]:
    """Cases, and per case the contenders run back to back (A/B order
    alternates by repetition)."""
    cases = []
    for mode in cfg.modes:
        for link in cfg.links:
            for channels in cfg.channels:
                for compression in cfg.compressions:
                    contenders = [("qemu", None), ("qemu-nothp", {"thp": False}),
                                  ("tern", {})]
                    cases.append(({"mode": mode, "link": link, "channels": channels,
                                   "compression": compression}, contenders))
            # Extra tern rows, once per mode x link.
            base = {"mode": mode, "link": link, "channels": max(cfg.channels),
                    "compression": "none"}
            extras = [("tern-best", {"channels": max(cfg.channels), "compression": "auto",
                                      "verify": "none"}),
                      ("tern-verify", {"channels": max(cfg.channels), "compression": "none",
                                        "verify": "full"})]
            cases.append((dict(base, extra=True), extras))
    return cases


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


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


def summarize(runs: list[dict]) -> dict:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        if r.get("error"):
            continue
        groups.setdefault((r["case"], r["contender"]), []).append(r)
    out = {}
    for (case, who), rs in groups.items():
        out.setdefault(case, {})[who] = {
            m: median([r[m] for r in rs])
            for m in ("total_time_s", "downtime_s", "bytes", "src_cpu_s", "dst_cpu_s")
        } | {"n": len(rs), "guest_ok": all(r["guest_ok"] in (True, None) for r in rs)}
    return out


def fmt(v, unit=""):
    if v is None:
        return "–"
    if unit == "MiB":
        return f"{v / 2**20:.0f}"
    if unit == "ms":
        return f"{v * 1000:.0f}"
    return f"{v:.2f}"


def ratio(a, b):
    if a is None or b is None or b == 0:
        return "–"
    return f"{a / b:.2f}"


def write_report(cfg, results: dict, out: Path):
    summary = summarize(results["runs"])
    m = results["machine"]
    lines = [
        "# tern vs QEMU 10: live-migration benchmark",
        "",
        f"Generated by `python3 bench/compare.py {' '.join(results['argv'])}` on "
        f"{results['date']}.",
        "",
        f"* Machine: {m['cpu']}, {m['nproc']} CPUs, "
        f"{m['mem_total_bytes'] / 2**30:.1f} GiB RAM, Linux {m['kernel']}, "
        f"KVM modules: {', '.join(m['kvm_modules'])}",
        f"* QEMU: {results['qemu_version']}",
        f"* tern: {results['tern_version']}",
        f"* Guest: tern-vmm test guest (same code for both), "
        f"{cfg.memory >> 20} MiB RAM from the same image "
        f"({results['image']['description']}), working set {cfg.working_set >> 20} MiB "
        f"(running cases), warm-up {cfg.warmup} ms",
        f"* Downtime limit {cfg.downtime_limit} ms on both; QEMU max-bandwidth uncapped; "
        f"destination memory: anonymous, not pre-allocated, on both (stock QEMU "
        f"madvises it MADV_HUGEPAGE; `qemu-nothp` runs QEMU with THP disabled, 4 KiB "
        f"pages as tern)",
        f"* Links: loopback; 1gbit = `tc tbf rate {cfg.tbf_rate} burst {cfg.tbf_burst} "
        f"latency {cfg.tbf_latency}` on the loopback of network namespace `{NETNS}`",
        f"* Repetitions: {cfg.reps}, interleaved (per case qemu, qemu-nothp, tern back to "
        "back, order reversed every other case and repetition); figures are medians",
        "* tern rows: same channels and codec as the QEMU row, `--verify none` "
        "(QEMU verifies nothing either); zstd at level 1 on both",
        "* CPU: utime+stime from /proc/PID/stat of the source and destination processes, "
        "from the start of the migration to its completion (includes the guest vCPU "
        "thread when running)",
        "",
        "## Medians per case",
        "",
        "Ratios are tern (or qemu-nothp) over stock `qemu` of the same case; the last "
        "two columns are tern over `qemu-nothp` (QEMU with 4 KiB destination pages, "
        "like tern). Below 1 means tern is faster / smaller / cheaper.",
        "",
        "| case | who | total s | downtime ms | MiB sent | src CPU s | dst CPU s | n | "
        "/QEMU total | /QEMU downtime | /QEMU bytes | /QEMU CPU | /nothp total | /nothp CPU |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: |",
    ]
    order = [case_key(c) for c, _ in plan(cfg)]
    for case in order:
        if case not in summary:
            continue
        rows = summary[case]
        q, qn = rows.get("qemu"), rows.get("qemu-nothp")
        if case.endswith("/extra"):
            # Extra tern rows are compared with QEMU at the same channel
            # count without compression.
            twin = case[: -len("extra")] + f"{max(cfg.channels)}ch/none"
            q = summary.get(twin, {}).get("qemu")
            qn = summary.get(twin, {}).get("qemu-nothp")
        for who in ("qemu", "qemu-nothp", "tern", "tern-best", "tern-verify"):
            s = rows.get(who)
            if not s:
                continue
            cpu = (s["src_cpu_s"] or 0) + (s["dst_cpu_s"] or 0)
            if q and who != "qemu":
                qcpu = (q["src_cpu_s"] or 0) + (q["dst_cpu_s"] or 0)
                rs = [ratio(s["total_time_s"], q["total_time_s"]),
                      ratio(s["downtime_s"], q["downtime_s"]),
                      ratio(s["bytes"], q["bytes"]), ratio(cpu, qcpu)]
            else:
                rs = ["", "", "", ""]
            if qn and who.startswith("tern"):
                qncpu = (qn["src_cpu_s"] or 0) + (qn["dst_cpu_s"] or 0)
                rs += [ratio(s["total_time_s"], qn["total_time_s"]), ratio(cpu, qncpu)]
            else:
                rs += ["", ""]
            flag = "" if s["guest_ok"] else " ⚠"
            lines.append(
                f"| {case} | {who}{flag} | {fmt(s['total_time_s'])} | "
                f"{fmt(s['downtime_s'], 'ms')} | {fmt(s['bytes'], 'MiB')} | "
                f"{fmt(s['src_cpu_s'])} | {fmt(s['dst_cpu_s'])} | {s['n']} | "
                + " | ".join(rs) + " |")
    # tern-best / tern-verify compared against the best QEMU row of that mode/link
    lines += ["", "`*/extra` cases hold tern's extra rows (max channels): "
              "`tern-best` = `--compression auto --verify none`, "
              "`tern-verify` = `--compression none --verify full` (the digest check "
              "at switch-over is inside tern's downtime). `qemu-nothp` = QEMU with "
              "transparent huge pages disabled for its processes (PR_SET_THP_DISABLE), "
              "so its destination faults 4 KiB pages as tern's does. Extra rows' ratios are against "
              f"QEMU's `{max(cfg.channels)}ch/none` row of the same mode and link.", ""]
    best_lines = ["## tern's best against QEMU's best, per mode and link", "",
                  "| mode/link | QEMU best (total s) | config | tern best (total s) | config | "
                  "ratio |", "| --- | ---: | --- | ---: | --- | ---: |"]
    for mode in cfg.modes:
        for link in cfg.links:
            prefix = f"{mode}/{link}/"
            qs = [(v[w]["total_time_s"], f"{k} {w}") for k, v in summary.items()
                  if k.startswith(prefix) for w in ("qemu", "qemu-nothp") if w in v]
            ts = [(v[w]["total_time_s"], f"{k} {w}") for k, v in summary.items()
                  if k.startswith(prefix) for w in ("tern", "tern-best", "tern-verify")
                  if w in v]
            if qs and ts:
                qb, tb = min(qs), min(ts)
                best_lines.append(f"| {mode}/{link} | {qb[0]:.2f} | {qb[1][len(prefix):]} | "
                                  f"{tb[0]:.2f} | {tb[1][len(prefix):]} | "
                                  f"{tb[0] / qb[0]:.2f} |")
    lines += best_lines
    errors = [r for r in results["runs"] if r.get("error")]
    lines += ["", f"## Failed runs: {len(errors)}", ""]
    for r in errors:
        lines.append(f"* {r['case']} {r['contender']} rep {r['rep']}: {r['error'][:300]}")
    if "elapsed_s" in results:
        lines += ["", f"Run time: {results['elapsed_s'] / 60:.1f} min."]
    lines += ["", "Charts: `total_time.png`, `downtime.png`, `cpu.png`, `bytes.png`. "
              "All runs: `results.json`.", ""]
    (out / "results.md").write_text("\n".join(lines))
    charts(summary, order, out)


def charts(summary: dict, order: list[str], out: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in order if c in summary]
    whos = ["qemu", "qemu-nothp", "tern", "tern-best", "tern-verify"]
    colors = {"qemu": "#d95f02", "qemu-nothp": "#e6ab02", "tern": "#1b9e77",
              "tern-best": "#7570b3", "tern-verify": "#66a61e"}
    metrics = [("total_time.png", "total time (s)", lambda s: s["total_time_s"]),
               ("downtime.png", "downtime (ms)", lambda s: (s["downtime_s"] or 0) * 1000),
               ("cpu.png", "source + destination CPU (s)",
                lambda s: (s["src_cpu_s"] or 0) + (s["dst_cpu_s"] or 0)),
               ("bytes.png", "MiB transferred", lambda s: (s["bytes"] or 0) / 2**20)]
    for name, label, get in metrics:
        fig, ax = plt.subplots(figsize=(max(8, len(cases) * 0.7), 5))
        for j, c in enumerate(cases):
            present = [w for w in whos if w in summary[c]]
            width = 0.8 / max(1, len(present))
            for i, who in enumerate(present):
                s = summary[c][who]
                ax.bar(j + (i - (len(present) - 1) / 2) * width, get(s) or 0, width,
                       color=colors[who], label=who)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(cases, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.set_title(f"{label}, median (tern vs QEMU 10)")
        ax.legend(unique.values(), unique.keys())
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 1 repetition, 256 MiB guest, 2 channels only")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--memory-mib", type=int, default=1024)
    ap.add_argument("--working-set-mib", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=1000, help="ms")
    ap.add_argument("--downtime-limit", type=int, default=300, help="ms")
    ap.add_argument("--modes", default="paused,running")
    ap.add_argument("--links", default="loopback,1gbit")
    ap.add_argument("--channels", default="2,4")
    ap.add_argument("--compressions", default="none,zstd")
    ap.add_argument("--no-extra", action="store_true", help="skip the tern-best rows")
    ap.add_argument("--timeout", type=float, default=120, help="per migration, s")
    ap.add_argument("--tbf-rate", default="1gbit")
    ap.add_argument("--tbf-burst", default="256kb")
    ap.add_argument("--tbf-latency", default="50ms")
    ap.add_argument("--target-dir", default=os.environ.get("CARGO_TARGET_DIR",
                                                           str(ROOT / "target")))
    ap.add_argument("--work", default="/var/tmp/ternbench")
    ap.add_argument("--out", default=str(BENCH / "results"))
    ap.add_argument("--report-only", action="store_true",
                    help="regenerate results.md and the charts from results.json")
    cfg = ap.parse_args()
    if cfg.quick:
        cfg.reps = 1
        cfg.memory_mib = 256
        cfg.channels = "2"
    cfg.memory = cfg.memory_mib << 20
    cfg.working_set = cfg.working_set_mib << 20
    cfg.modes = cfg.modes.split(",")
    cfg.links = cfg.links.split(",")
    cfg.channels = [int(c) for c in cfg.channels.split(",")]
    cfg.compressions = cfg.compressions.split(",")
    if cfg.report_only:
        results = json.loads((Path(cfg.out) / "results.json").read_text())
        for k, v in results["config"].items():
            if k not in ("report_only", "out"):
                setattr(cfg, k, v)
        write_report(cfg, results, Path(cfg.out))
        return
    if os.geteuid() != 0:
        sys.exit("run as root (network namespace, tc, /dev/kvm)")

    qver = ensure_qemu()
    ensure_matplotlib()
    cfg.tern = build_tern(cfg.target_dir)
    tver = subprocess.run([str(cfg.tern), "--version"], capture_output=True,
                          text=True).stdout.strip()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    work = Path(cfg.work)
    work.mkdir(parents=True, exist_ok=True)
    cfg.image = work / f"image-{cfg.memory_mib}M.bin"
    make_image(cfg.image, cfg.memory)
    cfg.guest = work / f"guest-{cfg.working_set_mib}M.mb"
    subprocess.run([str(cfg.tern), "vm", "export-guest", "--working-set",
                    str(cfg.working_set), "--multiboot", str(cfg.guest)], check=True)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if "1gbit" in cfg.links:
        netns_setup(cfg.tbf_rate, cfg.tbf_burst, cfg.tbf_latency)
    results = {
        "argv": sys.argv[1:], "date": dt.datetime.now(dt.timezone.utc).isoformat(
            timespec="seconds"),
        "machine": machine_info(), "qemu_version": qver,
        "tern_version": f"{tver} (git {commit})",
        "image": {"bytes": cfg.memory, "description":
                  "deterministic: ~50% zero pages, ~25% random, ~25% text-like"},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()},
        "runs": [],
    }
    cases = plan(cfg)
    if cfg.no_extra:
        cases = [c for c in cases if not c[0].get("extra")]
    started = time.time()
    try:
        for rep in range(cfg.reps):
            for index, (case, contenders) in enumerate(cases):
                order = contenders if (rep + index) % 2 == 0 else contenders[::-1]
                for who, variant in order:
                    key = case_key(case)
                    record = {"case": key, "contender": who, "rep": rep, **case}
                    try:
                        if who.startswith("qemu"):
                            r = run_qemu(cfg, case, work, variant)
                        else:
                            r = run_tern(cfg, case, variant, work)
                        record.update(r)
                        log(f"rep {rep} {key:28} {who:11} total {r['total_time_s']:.2f} s "
                            f"down {r['downtime_s'] * 1000:.0f} ms "
                            f"{(r['bytes'] or 0) / 2**20:.0f} MiB cpu "
                            f"{r['src_cpu_s']:.2f}+{r['dst_cpu_s']:.2f} ok={r['guest_ok']}")
                    except Exception as error:  # noqa: BLE001 - recorded, run goes on
                        record["error"] = f"{type(error).__name__}: {error}"
                        log(f"rep {rep} {key} {who}: FAILED {record['error'][:300]}")
                    results["runs"].append(record)
            (out / "results.json").write_text(json.dumps(results, indent=1))
            write_report(cfg, results, out)
    finally:
        results["elapsed_s"] = time.time() - started
        (out / "results.json").write_text(json.dumps(results, indent=1))
        write_report(cfg, results, out)
        if "1gbit" in cfg.links:
            netns_cleanup()
    log(f"done in {time.time() - started:.0f} s; report: {out / 'results.md'}")


if __name__ == "__main__":
    main()
