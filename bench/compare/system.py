"""What a run needs from the machine, and installing it (only with --install).

Without --install nothing on the system changes: a run that lacks
something stops before it starts, naming each missing piece and how to get
it."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from . import qemu
from .config import ROOT, Config

QEMU_MAJOR = 10
BACKPORTS = "bookworm-backports"


@dataclass(frozen=True)
class Missing:
    what: str
    # How to get it, for the message.
    how: str
    # Debian packages --install adds (from `release`, when given).
    packages: tuple[str, ...] = ()
    release: str | None = None
    # Python packages --install adds to this interpreter with pip.
    pip: tuple[str, ...] = ()


def find_missing(cfg: Config, charts: bool) -> list[Missing]:
    missing: list[Missing] = []
    if cfg.wants_qemu():
        line = qemu.version()
        if qemu.major_version(line) != QEMU_MAJOR:
            found = f"found {line}" if line else "not installed"
            missing.append(Missing(
                f"qemu-system-x86_64 {QEMU_MAJOR}.x ({found})",
                f"apt-get install -t {BACKPORTS} qemu-system-x86, or leave QEMU out with "
                "--contenders tern,tern-best,tern-verify",
                ("qemu-system-x86",), BACKPORTS))
    missing += missing_for_charts(charts)
    if "1gbit" in cfg.links:
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                missing.append(Missing(f"`{tool}` (for the 1gbit link)",
                                       "apt-get install iproute2, or --links loopback",
                                       ("iproute2",)))
                break
    return missing


def missing_for_charts(charts: bool) -> list[Missing]:
    if charts and importlib.util.find_spec("matplotlib") is None:
        return [Missing("matplotlib (for the charts)",
                        f"{sys.executable} -m pip install matplotlib, or --no-charts",
                        pip=("matplotlib",))]
    return []


def permission_problems(cfg: Config) -> list[str]:
    """What --install cannot fix: who runs the benchmark."""
    problems = []
    if "1gbit" in cfg.links and os.geteuid() != 0:
        problems.append("the 1gbit link needs root (network namespace, tc): run as root, "
                        "or --links loopback")
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        problems.append("/dev/kvm is missing or not read-writable by this user")
    return problems


def missing_message(missing: list[Missing]) -> str:
    lines = ["missing:"]
    lines += [f"  - {m.what}: {m.how}" for m in missing]
    lines.append("Run again with --install to install them (apt-get as root, QEMU from "
                 f"{BACKPORTS}, added to the apt sources if absent; pip for Python "
                 "packages), or install them yourself.")
    return "\n".join(lines)


def install(missing: list[Missing], log) -> None:
    """Installs what `missing` names (--install only)."""
    pip = sorted({p for m in missing for p in m.pip})
    if pip:
        log(f"installing {' '.join(pip)} with pip")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *pip], check=True)
    if not any(m.packages for m in missing):
        return
    if os.geteuid() != 0:
        sys.exit("--install needs root (apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if any(m.release == BACKPORTS for m in missing):
        _add_backports(log)
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    for release in {m.release for m in missing}:
        packages = sorted({p for m in missing if m.release == release for p in m.packages})
        if not packages:
            continue
        log(f"installing {' '.join(packages)}" + (f" from {release}" if release else ""))
        cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends"]
        if release:
            cmd += ["-t", release]
        subprocess.run(cmd + packages, check=True, env=env)


def debian_mirror(sources: str) -> str | None:
    """The mirror of the first Debian `bookworm` suite in apt sources text
    (one-line `deb` entries or deb822 stanzas). Other repositories a machine
    lists (a vendor's, security) carry no backports and are skipped."""
    for line in sources.splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[0] == "deb" and parts[2] in ("bookworm", "bookworm-updates"):
            return parts[1]
    for stanza in sources.split("\n\n"):
        fields = {}
        for line in stanza.splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.split()
        if "bookworm" in fields.get("Suites", []) and fields.get("URIs"):
            return fields["URIs"][0]
    return None


def _add_backports(log) -> None:
    sources = ""
    for path in [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]:
        try:
            sources += path.read_text() + "\n"
        except OSError:
            pass
    if BACKPORTS in sources:
        return
    # Backports come from the mirror the machine already uses.
    mirror = debian_mirror(sources)
    if mirror is None:
        sys.exit(f"no Debian mirror found in /etc/apt/sources.list*: add {BACKPORTS} yourself")
    log(f"adding {BACKPORTS} from {mirror} to /etc/apt/sources.list.d/backports.list")
    Path("/etc/apt/sources.list.d/backports.list").write_text(
        f"deb {mirror} {BACKPORTS} main\n")


def build_tern(target_dir: str, log) -> Path:
    # A series that must not change binary mid-way (the tree is being
    # built again meanwhile) names a copy instead.
    given = os.environ.get("TERNBENCH_TERN")
    if given:
        log(f"using tern {given} (TERNBENCH_TERN), not building")
        return Path(given)
    env = dict(os.environ, CARGO_TARGET_DIR=target_dir)
    log("building tern (release)")
    # Niced: on a shared machine the build must not slow the runs of others.
    subprocess.run(["nice", "-n", "10", "cargo", "build", "--release", "-q", "-p", "tern"],
                   cwd=ROOT, env=env, check=True)
    return Path(target_dir) / "release" / "tern"
