"""results.json: what ran where, and every run."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import Config
from .contenders import Run

COMMAND = "python3 -m bench.compare"


@dataclass
class Results:
    argv: list[str]
    date: str
    machine: dict[str, Any]
    qemu_version: str | None
    tern_version: str
    image: dict[str, Any]
    config: Config
    runs: list[Run] = field(default_factory=list)
    elapsed_s: float | None = None
    # How the run was started, for the report's first line.
    command: str = COMMAND

    def to_json(self) -> dict[str, Any]:
        out = {"command": self.command, "argv": self.argv, "date": self.date,
               "machine": self.machine, "qemu_version": self.qemu_version,
               "tern_version": self.tern_version, "image": self.image,
               "config": self.config.to_json(), "runs": [r.to_json() for r in self.runs]}
        if self.elapsed_s is not None:
            out["elapsed_s"] = self.elapsed_s
        return out

    @classmethod
    def from_json(cls, stored: dict[str, Any]) -> Results:
        return cls(
            argv=stored["argv"], date=stored["date"], machine=stored["machine"],
            qemu_version=stored.get("qemu_version"), tern_version=stored["tern_version"],
            image=stored["image"], config=Config.from_json(stored["config"]),
            runs=[Run.from_json(r) for r in stored["runs"]],
            elapsed_s=stored.get("elapsed_s"),
            # Files from before the package was split have no command.
            command=stored.get("command", "python3 bench/compare.py"),
        )

    def save(self, out: Path) -> None:
        (out / "results.json").write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, out: Path) -> Results:
        return cls.from_json(json.loads((out / "results.json").read_text()))
