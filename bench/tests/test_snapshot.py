"""Issue 25's benchmark (bench/compare/snapshot.py): the command lines, the
QEMU settings, file sizes and page-cache dropping, and the figures read
from tern's reports (no QEMU, no tern run)."""

import sys
import tempfile
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.compare import snapshot  # noqa: E402
from bench.compare.config import Artifacts, Config  # noqa: E402

ARTIFACTS = Artifacts(Path("/t/tern"), Path("/w/image.bin"), Path("/w/guest.mb"))


class CommandLineTest(unittest.TestCase):
    def test_save_paused_and_live(self):
        cfg = Config(memory_mib=1024, working_set_mib=16, warmup=1000)
        paused = snapshot.tern_save_args(Path("/t/tern"), cfg, ARTIFACTS, "paused",
                                         Path("/w/s"), 4)
        self.assertEqual(paused[:3], ["/t/tern", "vm", "save"])
        for flag, value in (("--memory", str(1 << 30)), ("--working-set", str(16 << 20)),
                            ("--image", "/w/image.bin"), ("--writers", "4"),
                            ("--output", "/w/s")):
            self.assertEqual(paused[paused.index(flag) + 1], value)
        self.assertNotIn("--live", paused)
        # QEMU's migration to a file leaves its guest stopped: so does tern's.
        self.assertIn("--stop", paused)
        live = snapshot.tern_save_args(Path("/t/tern"), cfg, ARTIFACTS, "running",
                                       Path("/w/s"), 4)
        self.assertIn("--live", live)
        self.assertNotIn("--direct", live)
        self.assertIn("--direct", snapshot.tern_save_args(Path("/t/tern"), cfg, ARTIFACTS,
                                                          "paused", Path("/w/s"), 4, True))
        self.assertNotIn("--no-sync", live)
        self.assertIn("--no-sync", snapshot.tern_save_args(Path("/t/tern"), cfg, ARTIFACTS,
                                                           "paused", Path("/w/s"), 4,
                                                           no_sync=True))
        self.assertTrue(snapshot.is_no_sync("tern-nosync"))
        self.assertFalse(snapshot.is_no_sync("tern"))

    def test_restore_eager_and_lazy(self):
        eager = snapshot.tern_restore_args(Path("/t/tern"), Path("/w/s"), False, 2)
        self.assertEqual(eager[:3], ["/t/tern", "vm", "restore"])
        self.assertNotIn("--lazy", eager)
        self.assertIn("--lazy", snapshot.tern_restore_args(Path("/t/tern"), Path("/w/s"),
                                                           True, 2))

    def test_qemu_mapped_ram_with_multifd(self):
        caps = {c["capability"]: c["state"] for c in snapshot.mapped_ram_capabilities()}
        self.assertEqual(caps, {"mapped-ram": True, "multifd": True})
        self.assertEqual(snapshot.mapped_ram_parameters(4)["multifd-channels"], 4)
        self.assertNotIn("direct-io", snapshot.mapped_ram_parameters(4))
        self.assertTrue(snapshot.mapped_ram_parameters(4, direct=True)["direct-io"])

    def test_direct_rows(self):
        self.assertEqual([n for n in snapshot.NAMES if snapshot.is_direct(n)],
                         ["qemu-mapped-ram-direct", "tern-direct"])


class PrefetchTest(unittest.TestCase):
    def test_recording_run_has_no_prefetch_and_the_next_prefetches_the_record(self):
        record = snapshot.prefetch_restore_args(Path("/t/tern"), Path("/w/s"), 4,
                                                Path("/w/ws"), None)
        self.assertIn("--lazy", record)
        self.assertIn("--no-prefetch", record)
        self.assertEqual(record[record.index("--record-working-set") + 1], "/w/ws")
        self.assertNotIn("--working-set", record)
        prefetch = snapshot.prefetch_restore_args(Path("/t/tern"), Path("/w/s"), 4, None,
                                                  Path("/w/ws"))
        self.assertNotIn("--no-prefetch", prefetch)
        self.assertEqual(prefetch[prefetch.index("--working-set") + 1], "/w/ws")

    def test_metrics(self):
        got = snapshot.prefetch_metrics({
            "resumed-after-ms": 9.0, "guest-runs": True, "digest-verified": True,
            "lazy": {"loaded-after-ms": 1700.0,
                     "faults": {"faults": 62, "fault-pages": 976, "blocktime-ms": 36.2,
                                "fault-latency-p50-us": 34.0,
                                "fault-latency-p99-us": 12610.0}}})
        self.assertEqual((got["running_ms"], got["loaded_ms"], got["blocktime_ms"]),
                         (9.0, 1700.0, 36.2))
        self.assertEqual((got["faults"], got["fault_pages"]), (62, 976))
        self.assertTrue(got["guest_ok"])
        self.assertIsNone(got["touched_ms"])

    def test_spread_working_set_is_read_and_timed(self):
        args = snapshot.prefetch_restore_args(Path("/t/tern"), Path("/w/s"), 4, None,
                                              Path("/w/ws"), 128)
        self.assertEqual(args[args.index("--touch-spread") + 1], "128MiB")
        self.assertNotIn("--touch-spread",
                         snapshot.prefetch_restore_args(Path("/t/tern"), Path("/w/s"), 4,
                                                        None, Path("/w/ws")))
        got = snapshot.prefetch_metrics({"resumed-after-ms": 9.0,
                                         "touched": {"pages": 32768, "after-ms": 310.5}})
        self.assertEqual((got["touched_ms"], got["touched_pages"]), (310.5, 32768))
        self.assertEqual(snapshot.spread([3.0, None, 1.5]), "1.5-3.0")
        self.assertIsNone(snapshot.spread([None]))


class FilesTest(unittest.TestCase):
    def test_holes_are_not_counted_on_disk(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "sparse"
            with open(path, "wb") as f:
                f.truncate(64 << 20)
                f.write(b"x" * 4096)
            sizes = snapshot.file_sizes(path)
            self.assertEqual(sizes["apparent"], 64 << 20)
            self.assertLess(sizes["disk"], 1 << 20)
            self.assertGreaterEqual(snapshot.write_back_and_drop(path), 0)


class FiguresTest(unittest.TestCase):
    def test_save_report(self):
        got = snapshot.tern_save_metrics({"total-time-ms": 1500.0, "downtime-ms": 20.0,
                                          "file-bytes": 5, "passes": 3})
        self.assertEqual((got["save_s"], got["save_paused_ms"], got["passes"]), (1.5, 20.0, 3))

    def test_eager_restore_is_loaded_when_it_runs(self):
        got = snapshot.tern_restore_metrics({"resumed-after-ms": 800.0, "guest-runs": True,
                                             "digest-verified": True}, "eager")
        self.assertEqual((got["eager_running_ms"], got["eager_loaded_ms"]), (800.0, 800.0))
        self.assertTrue(got["eager_guest_ok"])

    def test_lazy_restore(self):
        report = {"resumed-after-ms": 3.5, "guest-runs": True, "digest-verified": True,
                  "lazy": {"loaded-after-ms": 900.0,
                           "faults": {"faults": 10, "fault-latency-p50-us": 40.0,
                                      "fault-latency-p99-us": 900.0}}}
        got = snapshot.tern_restore_metrics(report, "lazy")
        self.assertEqual((got["lazy_running_ms"], got["lazy_loaded_ms"]), (3.5, 900.0))
        self.assertEqual((got["lazy_fault_p50_us"], got["lazy_fault_p99_us"]), (40.0, 900.0))
        self.assertFalse(snapshot.tern_restore_metrics({"guest-runs": False}, "lazy")
                         ["lazy_guest_ok"])


class ReportTest(unittest.TestCase):
    def test_medians_and_failures(self):
        runs = [snapshot.SnapshotRun("paused", "tern", rep,
                                     metrics={"save_s": s, "guest_ok": True, "loadavg": 2.0})
                for rep, s in enumerate((1.0, 3.0, 2.0))]
        runs.append(snapshot.SnapshotRun("paused", "qemu-mapped-ram", 0, error="boom"))
        rows = snapshot.summarize(runs)
        self.assertEqual([r["contender"] for r in rows], ["qemu-mapped-ram", "tern"])
        self.assertEqual(rows[1]["save_s"], 2.0)
        text = snapshot.markdown(rows, {"date": "d", "tern": "t", "qemu": "q", "machine": "m",
                                        "argv": [], "_runs": runs})
        self.assertIn("| paused | tern | 3 | 2.00 |", text)
        self.assertIn("paused qemu-mapped-ram rep 0: boom", text)


if __name__ == "__main__":
    unittest.main()
