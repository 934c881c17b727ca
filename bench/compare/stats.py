"""Medians per case and contender, ratios, and each side's best."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from .contenders import Run

# Each side's contenders its best is taken from: all but the TLS rows
# (their own comparison) and tern-default-base (another build).
QEMU_NAMES = ("qemu", "qemu-nothp", "qemu-xbzrle")
TERN_NAMES = ("tern", "tern-default", "tern-dict", "tern-packet", "tern-best", "tern-verify",
              "tern-delta")


@dataclass
class Summary:
    """Medians of one contender's successful runs in one case."""
    total_time_s: float | None
    downtime_s: float | None
    bytes: float | None
    src_cpu_s: float | None
    dst_cpu_s: float | None
    n: int
    # No run's guest check failed (runs without a check count as passed).
    guest_ok: bool

    @property
    def cpu_s(self) -> float:
        """Source and destination CPU seconds together."""
        return (self.src_cpu_s or 0) + (self.dst_cpu_s or 0)


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are there, or None if none is."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


Summaries = dict[str, dict[str, Summary]]


def summarize(runs: Iterable[Run]) -> Summaries:
    """Per case key, per contender: the medians of the runs that completed."""
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        if run.error is None and run.outcome is not None:
            groups.setdefault((run.case.key, run.contender), []).append(run)
    out: Summaries = {}
    for (case, who), group in groups.items():
        outcomes = [r.outcome for r in group if r.outcome is not None]
        out.setdefault(case, {})[who] = Summary(
            total_time_s=median(o.total_time_s for o in outcomes),
            downtime_s=median(o.downtime_s for o in outcomes),
            bytes=median(o.bytes for o in outcomes),
            src_cpu_s=median(o.src_cpu_s for o in outcomes),
            dst_cpu_s=median(o.dst_cpu_s for o in outcomes),
            n=len(outcomes),
            guest_ok=all(o.guest_ok in (True, None) for o in outcomes),
        )
    return out


def baseline_key(case_key: str, max_channels: int) -> str:
    """The case QEMU's rows are taken from for `case_key`: itself, or for
    the extra tern rows of a mode and link, QEMU's row at the largest
    channel count without compression."""
    if case_key.endswith("/extra"):
        return case_key[: -len("extra")] + f"{max_channels}ch/none"
    return case_key


def best(summary: Summaries, mode: str, link: str,
         names: tuple[str, ...]) -> tuple[float, str] | None:
    """The lowest median total time among `names` in a mode and link, and
    the case and contender that reached it ("2ch/none qemu-nothp")."""
    prefix = f"{mode}/{link}/"
    candidates = [(rows[who].total_time_s, f"{key[len(prefix):]} {who}")
                  for key, rows in summary.items() if key.startswith(prefix)
                  for who in names if who in rows and rows[who].total_time_s is not None]
    return min(candidates) if candidates else None
