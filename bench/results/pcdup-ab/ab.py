"""A/B for the tern-postcopy row in ONE interleaved run: bench.compare.postcopy
with two tern contenders, `tern-postcopy-before` (the binary named by
argv[1]) and `tern-postcopy-after` (argv[2]), both `--postcopy auto`; the
order alternates each repetition as the harness does. Usage:

    python3 bench/results/pcdup-ab/ab.py BEFORE AFTER --links 1gbit \\
        --working-sets 512 --reps 5 --out bench/results/pcdup-ab [--tern-mode after-first-pass]
"""
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
import bench.compare.postcopy as postcopy  # noqa: E402
import bench.compare.system as system  # noqa: E402

binaries = {"tern-postcopy-before": Path(sys.argv[1]), "tern-postcopy-after": Path(sys.argv[2])}
argv = sys.argv[3:]
# `--tern-mode MODE` (ours, not the harness's): the `--postcopy` mode of
# both tern contenders, `auto` unless given.
mode = "auto"
if "--tern-mode" in argv:
    at = argv.index("--tern-mode")
    mode = argv[at + 1]
    del argv[at:at + 2]
system.build_tern = lambda target_dir, log: binaries["tern-postcopy-after"]
postcopy.CONTENDERS = tuple(
    postcopy.PostcopyContender(name, "tern", tern_options=("--postcopy", mode))
    for name in binaries)
postcopy.NAMES = tuple(binaries)
_run_tern = postcopy.run_tern


def run_tern(cfg, artifacts, link, who, work):
    return _run_tern(cfg, dataclasses.replace(artifacts, tern=binaries[who.name]), link, who,
                     work)


postcopy.run_tern = run_tern
if "--contenders" not in argv:
    argv += ["--contenders", ",".join(binaries)]
sys.exit(postcopy.main(argv))
