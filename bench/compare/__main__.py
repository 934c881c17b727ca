"""Entry point: `python3 -m bench.compare` or `python3 bench/compare`."""

import sys
from pathlib import Path

if not __package__:
    # Run as `python3 bench/compare`: make the package importable by name.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from bench.compare.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
