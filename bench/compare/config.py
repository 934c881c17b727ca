"""The benchmark's options: the command line, and the copy in results.json."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from .contenders import DEFAULT_NAMES, LINKS, MODES, NAMES, TLS_NAMES, parse_contenders

ROOT = Path(__file__).resolve().parent.parent.parent
BENCH = ROOT / "bench"


@dataclass
class Config:
    reps: int = 3
    memory_mib: int = 1024
    working_set_mib: int = 16
    # The running-rewrite mode's working set: the rewriting guest copies a
    # page with one `rep movsd`, which KVM on PVM emulates word by word (about
    # 500 pages/s here), so a pass over the usual working set would take
    # minutes.
    rewrite_working_set_mib: int = 1
    # Delta cache of tern-delta and xbzrle cache of qemu-xbzrle; 0: the
    # working set's size.
    delta_cache_mib: int = 0
    warmup: int = 1000  # ms
    downtime_limit: int = 300  # ms
    modes: list[str] | None = None
    links: list[str] | None = None
    channels: list[int] | None = None
    compressions: list[str] | None = None
    contenders: list[str] | None = None
    extras: bool = True
    # The memory image: "mixed" (kinds drawn per page) or "runs" (per 2 MiB).
    image: str = "mixed"
    timeout: float = 120  # per migration, s
    tbf_rate: str = "1gbit"
    tbf_burst: str = "256kb"
    tbf_latency: str = "50ms"
    target_dir: str = str(ROOT / "target")
    work: str = "/var/tmp/ternbench"
    out: str = str(BENCH / "results")

    def __post_init__(self) -> None:
        self.modes = self.modes or list(MODES)
        self.links = self.links or list(LINKS)
        self.channels = self.channels or [2, 4]
        self.compressions = self.compressions or ["none", "zstd"]
        self.contenders = self.contenders or list(DEFAULT_NAMES)

    @property
    def memory(self) -> int:
        return self.memory_mib << 20

    @property
    def working_set(self) -> int:
        return self.working_set_mib << 20

    def working_set_for(self, mode: str) -> int:
        mib = self.rewrite_working_set_mib if mode == "running-rewrite" else self.working_set_mib
        return mib << 20

    @property
    def delta_cache(self) -> int:
        return (self.delta_cache_mib or self.working_set_mib) << 20

    def wants_qemu(self) -> bool:
        return any(name.startswith("qemu") for name in self.contenders)

    def wants_tls(self) -> bool:
        return any(name in TLS_NAMES for name in self.contenders)

    def to_json(self) -> dict[str, Any]:
        # memory and working_set in bytes too, as earlier versions stored them.
        return asdict(self) | {"memory": self.memory, "working_set": self.working_set}

    @classmethod
    def from_json(cls, stored: dict[str, Any]) -> Config:
        """The config of a results.json, from this version or an earlier one
        (which had `no_extra` and no `contenders`)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in stored.items() if k in known}
        if "no_extra" in stored and "extras" not in stored:
            values["extras"] = not stored["no_extra"]
        return cls(**values)


@dataclass(frozen=True)
class Artifacts:
    """What the runs start from: the tern binary, the memory image both
    VMMs map, and the test guest as a multiboot image for QEMU."""
    tern: Path
    image: Path
    guest: Path
    # Certificates for the TLS rows (pki.make), when they run.
    tls: Path | None = None
    # The guest rewriting whole pages (mode running-rewrite), when needed.
    guest_rewrite: Path | None = None

    def guest_for(self, mode: str) -> Path:
        if mode == "running-rewrite" and self.guest_rewrite is not None:
            return self.guest_rewrite
        return self.guest


def parser() -> argparse.ArgumentParser:
    from . import __doc__ as package_doc

    ap = argparse.ArgumentParser(prog="python3 -m bench.compare", description=package_doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="short run: 1 repetition, 256 MiB guest, 2 channels only")
    ap.add_argument("--smoke", action="store_true",
                    help="the smallest run: 1 repetition, 256 MiB guest, one case "
                         "(paused, loopback, 2 channels, no compression), no extra rows")
    ap.add_argument("--install", action="store_true",
                    help="install what is missing (QEMU 10 from bookworm-backports, "
                         "matplotlib, iproute2) with apt-get; without it nothing is "
                         "installed and what is missing is named")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--memory-mib", type=int, default=1024)
    ap.add_argument("--working-set-mib", type=int, default=16)
    ap.add_argument("--rewrite-working-set-mib", type=int, default=1)
    ap.add_argument("--delta-cache-mib", type=int, default=0,
                    help="tern-delta's delta cache and qemu-xbzrle's xbzrle cache "
                         "(default: the working set's size)")
    ap.add_argument("--warmup", type=int, default=1000, help="ms")
    ap.add_argument("--downtime-limit", type=int, default=300, help="ms")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--links", default=",".join(LINKS))
    ap.add_argument("--channels", default="2,4")
    ap.add_argument("--compressions", default="none,zstd")
    ap.add_argument("--contenders", default=",".join(DEFAULT_NAMES),
                    help=f"who runs, comma-separated, from {','.join(NAMES)} "
                         "(e.g. tern alone where QEMU is not installed; the TLS rows "
                         "qemu-tls and tern-tls only when named)")
    ap.add_argument("--image", default="mixed", choices=("mixed", "runs"),
                    help="the memory image: page kinds drawn per page (mixed) or per "
                         "2 MiB run (runs)")
    ap.add_argument("--no-extra", action="store_true",
                    help="skip the tern-best and tern-verify rows")
    ap.add_argument("--no-charts", action="store_true",
                    help="write results.md without the charts (no matplotlib needed)")
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
    return ap


def split(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise ValueError(f"unknown {what} {', '.join(bad) or '(none)'}: "
                         f"choose from {', '.join(allowed)}")
    return values


def from_args(args: argparse.Namespace) -> Config:
    """The config the command line asks for (ValueError on a bad list)."""
    cfg = Config(
        reps=args.reps, memory_mib=args.memory_mib, working_set_mib=args.working_set_mib,
        delta_cache_mib=args.delta_cache_mib,
        rewrite_working_set_mib=args.rewrite_working_set_mib,
        warmup=args.warmup, downtime_limit=args.downtime_limit,
        modes=split(args.modes, MODES, "mode"), links=split(args.links, LINKS, "link"),
        channels=[int(c) for c in args.channels.split(",")],
        compressions=[c.strip() for c in args.compressions.split(",") if c.strip()],
        contenders=parse_contenders(args.contenders), extras=not args.no_extra,
        image=args.image,
        timeout=args.timeout, tbf_rate=args.tbf_rate, tbf_burst=args.tbf_burst,
        tbf_latency=args.tbf_latency, target_dir=args.target_dir, work=args.work,
        out=args.out,
    )
    if args.quick or args.smoke:
        cfg.reps = 1
        cfg.memory_mib = 256
        cfg.channels = [2]
    if args.smoke:
        cfg.modes = ["paused"]
        cfg.links = ["loopback"]
        cfg.compressions = ["none"]
        cfg.extras = False
    return cfg
