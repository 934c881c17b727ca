"""The switch-over's steps of every tern run in a results.json, both sides
on one clock (issue 31: where a downtime above the limit went).

    python3 -m bench.compare.timeline bench/results/NAME/results.json [--all]

Each run's source and destination timelines (`switch-over-timeline` in
the run's details) are laid on the source's pause: the destination's
origin (its reading of `Complete`) is placed by the two processes'
`CLOCK_MONOTONIC` origins, which one host shares. A step's `cpu` and `rq`
are the recording thread's CPU and run-queue milliseconds since its
previous step: a gap that is neither was spent blocked. Without `--all`
only runs over the downtime limit are shown, plus a one-line summary of
every run."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def merged_steps(timelines: dict[str, Any]) -> list[tuple[float, str, dict[str, Any]]]:
    """Every step of both sides, in ms after the source's pause."""
    source = timelines.get("source")
    destination = timelines.get("destination")
    steps: list[tuple[float, str, dict[str, Any]]] = []
    origin = source["origin-monotonic-ns"] if source else None
    for side, timeline in (("src", source), ("dst", destination)):
        if not timeline:
            continue
        shift = 0.0
        if origin is not None and timeline["origin-monotonic-ns"]:
            shift = (timeline["origin-monotonic-ns"] - origin) / 1e6
        for step in timeline["steps"]:
            steps.append((step["at-ms"] + shift, side, step))
    steps.sort(key=lambda item: item[0])
    return steps


def step_at(steps: list[tuple[float, str, dict[str, Any]]], side: str, name: str) -> float | None:
    for at, who, step in steps:
        if who == side and step["step"] == name:
            return at
    return None


def phases(steps: list[tuple[float, str, dict[str, Any]]]) -> dict[str, float | None]:
    """The destination's part cut at its steps, in ms (None when a step is
    missing): the source's last bytes to the destination's last landing,
    the rest of its work to `ready`, the commit's round trip, the resume."""
    def gap(a: tuple[str, str], b: tuple[str, str]) -> float | None:
        start, end = step_at(steps, *a), step_at(steps, *b)
        return None if start is None or end is None else round(end - start, 1)
    landed = [at for at, who, step in steps
              if who == "dst" and step["step"].endswith("-past-barrier")]
    last_landed = max(landed) if landed else None
    complete = step_at(steps, "src", "complete-sent")
    return {
        "pause": gap(("src", "pause-requested"), ("src", "dirty-log-synced")),
        "complete-to-read": gap(("src", "complete-sent"), ("dst", "complete-read")),
        "complete-to-landed": (None if complete is None or last_landed is None
                               else round(last_landed - complete, 1)),
        "read-to-ready": gap(("dst", "complete-read"), ("dst", "ready-sent")),
        "ready-to-commit": gap(("dst", "ready-sent"), ("dst", "commit-read")),
        "commit-to-outcome": gap(("dst", "commit-read"), ("src", "answer-read")),
    }


def show_run(run: dict[str, Any], verbose: bool) -> None:
    details = run.get("details") or {}
    downtime = round((run.get("downtime_s") or 0) * 1000)
    timelines = details.get("switch-over-timeline", {})
    steps = merged_steps(timelines) if timelines else []
    proof = details.get("guest-proof") or {}
    print(f"rep {run['rep']} {run['contender']:18} downtime {downtime:4} ms "
          f"expected {details.get('expected-downtime')} parts {details.get('downtime-parts')} "
          f"expected-parts {details.get('expected-downtime-parts')} "
          f"overrun {details.get('downtime-overrun')} load {details.get('loadavg-1min')} "
          f"first-pass-after-ms {proof.get('first-pass-after-ms')} "
          f"guest-ok {run.get('guest_ok')}")
    if steps:
        print("   phases:", phases(steps))
    if not verbose:
        return
    for at, side, step in steps:
        extra = ""
        if step.get("cpu-ms") is not None:
            extra = f" cpu {step['cpu-ms']:7.2f} rq {step['run-queue-ms']:7.2f}"
        print(f"   {at:9.2f} {side} {step['step']:34} {step['thread']:18}{extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--all", action="store_true", help="every run's steps, not only overruns")
    args = ap.parse_args()
    data = json.loads(args.results.read_text())
    limit = data.get("config", {}).get("downtime_limit", 300)
    for run in data["runs"]:
        if run.get("error") or run.get("downtime_s") is None:
            print(f"rep {run['rep']} {run['contender']}: {run.get('error')}")
            continue
        over = run["downtime_s"] * 1000 > limit
        show_run(run, args.all or over)


if __name__ == "__main__":
    main()
