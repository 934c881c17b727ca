"""Child processes: stopping them, waiting for their exit, ports."""

from __future__ import annotations

import os
import select
import signal
import subprocess

_FIRST_PORT, _LAST_PORT = 47001, 48900
_port = [_FIRST_PORT - 1]


def next_port() -> int:
    """A port for QEMU's incoming migration, a new one each run (a closed
    one may linger in TIME_WAIT)."""
    _port[0] = _port[0] + 1 if _port[0] < _LAST_PORT else _FIRST_PORT
    return _port[0]


def kill(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_exit_unreaped(proc: subprocess.Popen, timeout: float) -> bool:
    """Waits until `proc` has exited, without reaping it, so its /proc/PID
    (the zombie's CPU times) can still be read. False on timeout."""
    fd = os.pidfd_open(proc.pid)
    try:
        # A pidfd turns readable when the process exits.
        readable, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    if not readable:
        return False
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    return True
