"""Cases, the contenders run in each, and the record of one run.

A case is a mode (paused or running guest), a link, a channel count and a
codec; per case the contenders run back to back. Records are stored in
results.json in the form earlier versions wrote, so `--report-only` reads
old results too.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any, Union

MODES = ("paused", "running", "running-rewrite")
LINKS = ("loopback", "1gbit")


def is_running(mode: str) -> bool:
    """Whether the guest runs during the migration."""
    return mode.startswith("running")


def workload(mode: str) -> str:
    """The test guest's `--workload`: `running-rewrite` rewrites whole pages
    with new random words every pass (deltas cannot help); the others add
    one to each page's first byte."""
    return "rewrite" if mode == "running-rewrite" else "increment"


@dataclass(frozen=True)
class Case:
    mode: str
    link: str
    channels: int
    compression: str
    # The per mode x link case that holds tern's extra rows.
    extra: bool = False

    @property
    def key(self) -> str:
        if self.extra:
            return f"{self.mode}/{self.link}/extra"
        return f"{self.mode}/{self.link}/{self.channels}ch/{self.compression}"


@dataclass(frozen=True)
class QemuContender:
    name: str
    # False: QEMU runs with PR_SET_THP_DISABLE, so its destination faults
    # 4 KiB pages as tern's VMM does.
    thp: bool = True
    # TLS on every channel (tls-creds-x509, mutual).
    tls: bool = False
    # True: the xbzrle capability with multifd off (xbzrle does not work
    # with multifd), the cache as large as tern's delta cache.
    xbzrle: bool = False


@dataclass(frozen=True)
class TernContender:
    name: str
    verify: str = "none"
    # None: the case's own.
    channels: int | None = None
    compression: str | None = None
    # Mutual TLS on every channel (--tls-dir).
    tls: bool = False
    # With `--delta-cache-size` (the config's delta cache).
    delta: bool = False
    # More `tern vm migrate` options (a zstd dictionary, packet frames).
    options: tuple[str, ...] = ()
    # tern as it comes: no channel, codec or verification option (auto
    # decides codec, level, dictionary and delta cache; verify full).
    defaults: bool = False
    # Another tern binary for both ends (None: the one built here).
    binary: str | None = None

    def channels_for(self, case: Case) -> int:
        return self.channels if self.channels is not None else case.channels

    def compression_for(self, case: Case) -> str:
        return self.compression if self.compression is not None else case.compression


Contender = Union[QemuContender, TernContender]

QEMU = QemuContender("qemu")
QEMU_NOTHP = QemuContender("qemu-nothp", thp=False)
QEMU_XBZRLE = QemuContender("qemu-xbzrle", xbzrle=True)
TERN = TernContender("tern")
# TLS rows: QEMU with tls-creds-x509 on its multifd channels, tern with
# --tls-dir; both mutual, certificates from one CA (bench/compare/pki.py).
QEMU_TLS = QemuContender("qemu-tls", tls=True)
TERN_TLS = TernContender("tern-tls", tls=True)
# Rows of the zstd cases: zstd against a dictionary trained on the guest's
# pages, and zstd in packet frames with that dictionary.
DICTIONARY = ("--compression-dictionary", "64KiB")
TERN_DICT = TernContender("tern-dict", options=DICTIONARY)
TERN_PACKET = TernContender("tern-packet", options=("--packet-frames", *DICTIONARY))
ZSTD_ROWS = (TERN_DICT, TERN_PACKET)


def tern_best(channels: int) -> TernContender:
    return TernContender("tern-best", verify="none", channels=channels, compression="auto",
                         options=DICTIONARY)


def tern_verify(channels: int) -> TernContender:
    return TernContender("tern-verify", verify="full", channels=channels, compression="none")


def tern_delta(channels: int) -> TernContender:
    # tern-best with the delta cache: the two rows differ by deltas only.
    return TernContender("tern-delta", verify="none", channels=channels, compression="auto",
                         options=DICTIONARY, delta=True)


# tern with no option beyond the guest and the downtime limit: what a user
# gets. A row of every case (issue 31: tern's defaults in every row).
TERN_DEFAULT = TernContender("tern-default", verify="full", defaults=True)
# tern-default with another build (a before/after series, interleaved):
# the binary named by TERNBENCH_BASE_TERN, e.g. the commit before a change.
BASE_TERN_ENV = "TERNBENCH_BASE_TERN"
TERN_DEFAULT_BASE = TernContender("tern-default-base", verify="full", defaults=True,
                                  binary=os.environ.get(BASE_TERN_ENV))

# Every contender, in the order of the report's rows; the TLS pair runs
# only when asked for (--contenders).
NAMES = ("qemu", "qemu-nothp", "tern", "tern-default", "tern-dict", "tern-packet", "tern-best",
         "tern-verify", "qemu-xbzrle", "tern-delta", "qemu-tls", "tern-tls", "tern-default-base")
DEFAULT_NAMES = ("qemu", "qemu-nothp", "tern", "tern-default", "tern-dict", "tern-packet",
                 "tern-best", "tern-verify", "qemu-xbzrle", "tern-delta")
TLS_NAMES = ("qemu-tls", "tern-tls")
EXTRA_NAMES = ("tern-best", "tern-verify", "qemu-xbzrle", "tern-delta")
# Contenders only running cases have: deltas need pages sent twice.
RUNNING_ONLY = ("qemu-xbzrle", "tern-delta")


def plan(modes: list[str], links: list[str], channels: list[int], compressions: list[str],
         contenders: list[str], extras: bool = True) -> list[tuple[Case, list[Contender]]]:
    """Cases, and per case the contenders run back to back (the caller
    alternates their order by repetition). `contenders` names those wanted;
    a case with none of them is left out."""
    wanted = set(contenders)
    cases: list[tuple[Case, list[Contender]]] = []
    for mode in modes:
        for link in links:
            for count in channels:
                for compression in compressions:
                    rows = ((QEMU, QEMU_NOTHP, TERN, TERN_DEFAULT, QEMU_TLS, TERN_TLS,
                             TERN_DEFAULT_BASE)
                            + (ZSTD_ROWS if compression == "zstd" else ()))
                    chosen = [c for c in rows if c.name in wanted]
                    if chosen:
                        cases.append((Case(mode, link, count, compression), chosen))
            if not extras:
                continue
            # Extra tern rows, once per mode x link, at the largest channel
            # count; compared with QEMU's row of that count without codec.
            most = max(channels)
            extra = [tern_best(most), tern_verify(most)]
            if is_running(mode):
                extra += [QEMU_XBZRLE, tern_delta(most)]
            chosen = [c for c in extra if c.name in wanted]
            if chosen:
                cases.append((Case(mode, link, most, "none", extra=True), chosen))
    return cases


def parse_contenders(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in NAMES]
    if unknown or not names:
        raise ValueError(f"unknown contender {', '.join(unknown) or '(none)'}: "
                         f"choose from {', '.join(NAMES)}")
    if TERN_DEFAULT_BASE.name in names and not TERN_DEFAULT_BASE.binary:
        raise ValueError(f"{TERN_DEFAULT_BASE.name} runs the tern binary named by {BASE_TERN_ENV}")
    return names


@dataclass
class Outcome:
    """One completed migration, as measured."""
    total_time_s: float
    downtime_s: float
    bytes: int | None
    src_cpu_s: float
    dst_cpu_s: float
    wall_s: float
    # Running cases: the guest runs on at the destination. None: not checked.
    guest_ok: bool | None
    # Each tool's raw statistics and per-thread CPU.
    details: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        return (f"total {self.total_time_s:.2f} s down {self.downtime_s * 1000:.0f} ms "
                f"{(self.bytes or 0) / 2**20:.0f} MiB cpu "
                f"{self.src_cpu_s:.2f}+{self.dst_cpu_s:.2f} ok={self.guest_ok}")


_OUTCOME_FIELDS = ("total_time_s", "downtime_s", "bytes", "src_cpu_s", "dst_cpu_s", "wall_s",
                   "guest_ok")


@dataclass
class Run:
    """One contender in one case in one repetition: an outcome or an error."""
    case: Case
    contender: str
    rep: int
    outcome: Outcome | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "case": self.case.key, "contender": self.contender, "rep": self.rep,
            "mode": self.case.mode, "link": self.case.link, "channels": self.case.channels,
            "compression": self.case.compression,
        }
        if self.outcome is not None:
            values = asdict(self.outcome)
            record |= {k: values[k] for k in _OUTCOME_FIELDS}
            record["details"] = values["details"]
        if self.error is not None:
            record["error"] = self.error
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> Run:
        case = Case(record["mode"], record["link"], int(record["channels"]),
                    record["compression"], extra=record["case"].endswith("/extra"))
        outcome = None
        if "total_time_s" in record:
            # Earlier versions kept the details under "extra".
            details = record.get("details", record.get("extra"))
            outcome = Outcome(**{k: record.get(k) for k in _OUTCOME_FIELDS},
                              details=details if isinstance(details, dict) else {})
        return cls(case, record["contender"], int(record["rep"]), outcome,
                   record.get("error"))
