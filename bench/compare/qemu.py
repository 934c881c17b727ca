"""QEMU's side: its command line, QMP, and one migration between two QEMUs."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

from . import netem, procfs
from .config import Artifacts, Config
from .contenders import Case, Outcome, QemuContender, is_running
from .processes import kill, next_port

# The pass counter the test guest keeps (tern-vmm's guest code).
COUNTER_ADDRESS = 0x2000


def version() -> str | None:
    """The first line of `qemu-system-x86_64 --version`, or None."""
    exe = shutil.which("qemu-system-x86_64")
    if not exe:
        return None
    out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    return out.splitlines()[0] if out else None


def major_version(line: str | None) -> int | None:
    """10 from "QEMU emulator version 10.0.2 (Debian ...)"."""
    if not line or "version " not in line:
        return None
    number = line.split("version ", 1)[1].split()[0]
    try:
        return int(number.split(".")[0])
    except ValueError:
        return None


def parse_xp_word(reply: str) -> int:
    """The word of an HMP `xp /1wx ADDR` reply, "0000000000002000: 0x0000abcd"."""
    return int(reply.split(":")[1].split()[0], 16)


class Qmp:
    """A QMP connection: one JSON object per line, events skipped."""

    def __init__(self, path: Path, timeout: float = 20):
        deadline = time.time() + timeout
        while True:
            # QEMU creates the socket after it starts: retry until it is there.
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.sock.connect(str(path))
                break
            except OSError:
                self.sock.close()
                if time.time() > deadline:
                    raise
                time.sleep(0.05)
        self.sock.settimeout(60)
        self.buf = b""
        self._read()  # the greeting
        self.cmd("qmp_capabilities")

    def _read(self) -> dict[str, Any]:
        while b"\n" not in self.buf:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("QMP closed")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def cmd(self, name: str, **args: Any) -> Any:
        msg: dict[str, Any] = {"execute": name}
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
        return parse_xp_word(self.hmp(f"xp /1wx {COUNTER_ADDRESS:#x}"))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def command(cfg: Config, artifacts: Artifacts, work: Path, name: str,
            source: bool, mode: str = "paused", tls: bool = False) -> list[str]:
    mem = cfg.memory
    if source:
        backend = f"memory-backend-file,id=ram,size={mem},mem-path={artifacts.image},share=off"
    else:
        backend = f"memory-backend-ram,id=ram,size={mem}"
    cmd = [
        "qemu-system-x86_64", "-accel", "kvm", "-machine", "pc,memory-backend=ram",
        "-m", f"{mem >> 20}M", "-object", backend, "-smp", "1",
        "-nodefaults", "-no-user-config", "-display", "none",
        "-kernel", str(artifacts.guest_for(mode)),
        "-serial", f"file:{work / (name + '.serial')}",
        "-qmp", f"unix:{work / (name + '.qmp')},server=on,wait=off",
    ]
    if tls:
        # Mutual: the destination (server) requires the source's certificate.
        role = "client" if source else "server"
        assert artifacts.tls is not None, "certificates are made when a TLS row runs"
        cmd += ["-object", f"tls-creds-x509,id={TLS_ID},dir={artifacts.tls / ('qemu-' + role)},"
                           f"endpoint={role},verify-peer=on"]
    if not source:
        cmd += ["-incoming", "defer"]
    return cmd


# The id of the tls-creds-x509 object, named by the tls-creds parameter.
TLS_ID = "tls0"


def migration_parameters(case: Case, downtime_limit: int, xbzrle_cache: int | None = None,
                         tls: bool = False) -> dict[str, Any]:
    """`migrate-set-parameters` for a case; with `xbzrle_cache`, QEMU's
    xbzrle without multifd (the two do not combine); with `tls`, TLS on
    every channel."""
    params: dict[str, Any] = {
        "downtime-limit": downtime_limit,
        "max-bandwidth": 64 << 30,  # uncapped (QEMU's default cap is 128 MiB/s)
    }
    if xbzrle_cache is not None:
        params["xbzrle-cache-size"] = xbzrle_cache
        return params
    params |= {
        "multifd-channels": case.channels,
        "multifd-compression": case.compression,
        "zero-page-detection": "multifd",
    }
    if case.compression == "zstd":
        params["multifd-zstd-level"] = 1
    if tls:
        # Every channel, main and multifd, runs TLS with these credentials.
        params["tls-creds"] = TLS_ID
        params["tls-hostname"] = "127.0.0.1"
    return params


def capabilities(case: Case, xbzrle: bool) -> list[dict[str, Any]]:
    """multifd, or xbzrle; auto-converge in running cases, as tern's default
    (both throttle 20 % first, then 10 % more)."""
    caps = [{"capability": "xbzrle" if xbzrle else "multifd", "state": True}]
    if is_running(case.mode):
        caps.append({"capability": "auto-converge", "state": True})
    return caps


def _configure(qmp: Qmp, case: Case, cfg: Config, who: QemuContender) -> None:
    qmp.cmd("migrate-set-capabilities", capabilities=capabilities(case, who.xbzrle))
    qmp.cmd("migrate-set-parameters", **migration_parameters(
        case, cfg.downtime_limit, cfg.delta_cache if who.xbzrle else None, who.tls))


def _no_thp() -> None:
    """In the child before exec: PR_SET_THP_DISABLE (inherited across exec),
    so QEMU's MADV_HUGEPAGE on guest RAM has no effect and the destination
    faults 4 KiB pages, like tern's VMM (which does not madvise)."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(41, 1, 0, 0, 0)


def run(cfg: Config, artifacts: Artifacts, case: Case, who: QemuContender,
        work: Path) -> Outcome:
    """One migration between two QEMUs on this machine."""
    preexec = None if who.thp else _no_thp
    for f in work.glob("q*"):
        f.unlink()
    port = next_port()
    with ExitStack() as stack:
        # Unwound in reverse: QMP closed, the QEMUs stopped, the files.
        dst_err = stack.enter_context(open(work / "qdst.err", "w"))
        src_err = stack.enter_context(open(work / "qsrc.err", "w"))
        dst = subprocess.Popen(netem.wrap(command(cfg, artifacts, work, "qdst", False, case.mode, who.tls), case.link),
                               stdout=subprocess.DEVNULL, stderr=dst_err, preexec_fn=preexec)
        stack.callback(kill, dst)
        src = subprocess.Popen(netem.wrap(command(cfg, artifacts, work, "qsrc", True, case.mode, who.tls), case.link),
                               stdout=subprocess.DEVNULL, stderr=src_err, preexec_fn=preexec)
        stack.callback(kill, src)
        qd = stack.enter_context(closing(Qmp(work / "qdst.qmp")))
        qs = stack.enter_context(closing(Qmp(work / "qsrc.qmp")))
        _configure(qd, case, cfg, who)
        qd.cmd("migrate-incoming", uri=f"tcp:127.0.0.1:{port}")
        _configure(qs, case, cfg, who)
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
        if case.mode == "paused":
            qs.cmd("stop")
        src_cpu0, dst_cpu0 = procfs.cpu_seconds(src.pid), procfs.cpu_seconds(dst.pid)
        src_thr0, dst_thr0 = procfs.thread_cpu(src.pid), procfs.thread_cpu(dst.pid)
        t0 = time.time()
        qs.cmd("migrate", uri=f"tcp:127.0.0.1:{port}")
        info: dict[str, Any] = {}
        peak_throttle = 0
        while time.time() - t0 < cfg.timeout:
            info = qs.cmd("query-migrate")
            # Reported only while throttling: sampled as it goes.
            peak_throttle = max(peak_throttle, info.get("cpu-throttle-percentage", 0))
            if info.get("status") in ("completed", "failed", "cancelled"):
                break
            time.sleep(0.01)
        wall = time.time() - t0
        src_cpu1, dst_cpu1 = procfs.cpu_seconds(src.pid), procfs.cpu_seconds(dst.pid)
        src_threads = procfs.thread_delta(src_thr0, procfs.thread_cpu(src.pid))
        dst_threads = procfs.thread_delta(dst_thr0, procfs.thread_cpu(dst.pid))
        if info.get("status") != "completed":
            if info.get("status") not in ("failed", "cancelled"):
                qs.cmd("migrate_cancel")
            raise RuntimeError(f"QEMU migration {info.get('status')}: {info.get('error-desc')}")
        ok = None
        if is_running(case.mode):
            # The guest runs on the destination: its counter advances.
            deadline = time.time() + 5
            while time.time() < deadline and qd.cmd("query-status")["status"] != "running":
                time.sleep(0.02)
            d1 = d2 = qd.counter()
            # A pass over a large working set, or of the rewriting guest,
            # can take longer than a fixed wait: poll for the next one.
            deadline = time.time() + 10
            while d2 <= d1 and time.time() < deadline:
                time.sleep(0.05)
                d2 = qd.counter()
            ok = d2 > d1 >= c0
        result = outcome(info, src_cpu1 - src_cpu0, dst_cpu1 - dst_cpu0, wall, ok,
                         src_threads, dst_threads)
        result.details["peak-throttle"] = peak_throttle
        return result


def outcome(info: dict[str, Any], src_cpu: float, dst_cpu: float, wall: float,
            ok: bool | None, src_threads: dict[str, float],
            dst_threads: dict[str, float]) -> Outcome:
    """A completed `query-migrate` reply and the CPU samples as an outcome."""
    ram = info.get("ram", {})
    return Outcome(
        total_time_s=info["total-time"] / 1000,
        downtime_s=info.get("downtime", 0) / 1000,
        bytes=ram.get("transferred"),
        src_cpu_s=src_cpu, dst_cpu_s=dst_cpu, wall_s=wall, guest_ok=ok,
        details={"ram": ram, "setup-time": info.get("setup-time"),
                 "src-threads": src_threads, "dst-threads": dst_threads,
                 "expected-downtime": info.get("expected-downtime"),
                 "dirty-sync-count": ram.get("dirty-sync-count"),
                 "normal": ram.get("normal"), "duplicate": ram.get("duplicate"),
                 "xbzrle-cache": info.get("xbzrle-cache")},
    )
