"""Before/after for the tern-postcopy row only: bench.compare.postcopy with
the tern binary named by argv[1] instead of a fresh build."""
import sys
from pathlib import Path
sys.path.insert(0, "/work/wt-pcfix")
import bench.compare.system as system
binary = Path(sys.argv[1])
system.build_tern = lambda target_dir, log: binary
import bench.compare.postcopy as postcopy
sys.exit(postcopy.main(sys.argv[2:]))
