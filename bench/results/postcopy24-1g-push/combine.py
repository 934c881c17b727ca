"""Medians over this series and its re-run of the two failed QEMU rows
(postcopy24-1g-push-b), with the harness's own summary: writes
combined.md next to this file."""
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
from bench.compare.postcopy import PostcopyRun, markdown, summarize  # noqa: E402

runs = []
header = None
for series in (HERE, HERE.parent / "postcopy24-1g-push-b"):
    stored = json.loads((series / "results.json").read_text())
    runs += [PostcopyRun(**run) for run in stored.pop("runs")]
    header = header or stored
header = dict(header, argv=["(postcopy24-1g-push and postcopy24-1g-push-b together)"])
(HERE / "combined.md").write_text(markdown(summarize(runs), header))
