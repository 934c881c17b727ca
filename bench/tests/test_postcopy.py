"""Issue 24's benchmark (bench/compare/postcopy.py): the QEMU settings per
contender, the first-pass trigger, and the figures read from each tool's
reports (no QEMU, no tern run)."""

import sys
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.compare import postcopy  # noqa: E402

BY_NAME = {c.name: c for c in postcopy.CONTENDERS}


def caps(who, multifd=False, destination=False):
    return {c["capability"]: c["state"]
            for c in postcopy.qemu_capabilities(who, multifd, destination)}


class QemuSettingsTest(unittest.TestCase):
    def test_postcopy_rows_enable_postcopy_on_both_sides_and_never_throttle(self):
        for side in (False, True):
            got = caps(BY_NAME["qemu-postcopy"], destination=side)
            self.assertTrue(got["postcopy-ram"])
            self.assertNotIn("postcopy-preempt", got)
            self.assertNotIn("auto-converge", got)
            self.assertTrue(caps(BY_NAME["qemu-postcopy-preempt"],
                                 destination=side)["postcopy-preempt"])

    def test_blocktime_is_asked_of_the_destination_only(self):
        self.assertTrue(caps(BY_NAME["qemu-postcopy"], destination=True)["postcopy-blocktime"])
        self.assertNotIn("postcopy-blocktime", caps(BY_NAME["qemu-postcopy"]))

    def test_best_precopy_is_multifd_zstd_1_with_auto_converge(self):
        got = caps(BY_NAME["qemu-zstd-ac"], multifd=True)
        self.assertEqual(got, {"multifd": True, "auto-converge": True})
        params = postcopy.qemu_parameters(300, multifd=True)
        self.assertEqual((params["multifd-compression"], params["multifd-zstd-level"],
                          params["multifd-channels"]), ("zstd", 1, 2))
        self.assertEqual(params["downtime-limit"], 300)

    def test_without_multifd_no_multifd_parameter_is_sent(self):
        params = postcopy.qemu_parameters(300, multifd=False)
        self.assertFalse(any(k.startswith("multifd") for k in params))

    def test_the_switch_waits_for_the_second_dirty_sync(self):
        self.assertFalse(postcopy.first_pass_done({}))
        self.assertFalse(postcopy.first_pass_done({"ram": {"dirty-sync-count": 1}}))
        self.assertTrue(postcopy.first_pass_done({"ram": {"dirty-sync-count": 2}}))


class FiguresTest(unittest.TestCase):
    def test_percentiles_are_bucket_upper_bounds(self):
        # Entry i counts faults in [2^i, 2^(i+1)) µs.
        counts = [0, 0, 0, 0, 0, 0, 0, 4, 1, 1, 0, 3, 2, 1, 1]  # 13 faults
        self.assertEqual(postcopy.histogram_percentile(counts, 0.5), 2**12)
        self.assertEqual(postcopy.histogram_percentile(counts, 0.99), 2**15)
        self.assertEqual(postcopy.histogram_percentile([5], 0.99), 2.0)
        self.assertIsNone(postcopy.histogram_percentile([], 0.5))
        self.assertIsNone(postcopy.histogram_percentile([0, 0], 0.5))

    def test_tern_reports(self):
        stats = {"total-time": 10600, "downtime": 455, "cpu-throttle-percentage": 0,
                 "digest-verified": True, "ram": {"transferred": 1 << 30},
                 "guest-before-migration": {"passes-per-second": 2.0},
                 "source-pass-count-at-start": 2,
                 "postcopy": {"trigger": "throttle", "postcopy-bytes": 512 << 20,
                              "postcopy-requests": 12, "faults": 13,
                              "fault-latency-histogram-us": [1, 1],
                              "postcopy-blocktime": 50.5, "delivered-after-ms": 1250.0}}
        rstats = {"pass-count-before": 12, "guest-runs-on-destination": True,
                  "consistency-check": {"passed": True}}
        got = postcopy.tern_metrics(stats, rstats)
        self.assertEqual(got["total_s"], 10.6)
        self.assertAlmostEqual(got["switch_s"], 9.35)
        self.assertEqual(got["delivered_after_switch_s"], 1.25)
        self.assertEqual(got["guest_passes"], 10)
        self.assertAlmostEqual(got["guest_work_pct"], 100 * 10 / (2.0 * 10.6))
        self.assertEqual((got["mib"], got["postcopy_mib"]), (1024, 512))
        self.assertEqual((got["fault_p50_us"], got["fault_p99_us"]), (2.0, 4.0))
        self.assertTrue(got["guest_ok"])

    def test_tern_precopy_has_no_postcopy_figures(self):
        got = postcopy.tern_metrics({"total-time": 5000, "cpu-throttle-percentage": 30,
                                     "ram": {"transferred": 5}}, {})
        self.assertIsNone(got["switch_s"])
        self.assertIsNone(got["postcopy_mib"])
        self.assertIsNone(got["fault_p99_us"])
        self.assertEqual(got["peak_throttle"], 30)
        self.assertFalse(got["guest_ok"])

    def test_qemu_reports_and_the_harness_timeline(self):
        info = {"status": "completed", "total-time": 5860, "downtime": 8,
                "ram": {"transferred": 2 << 20, "postcopy-bytes": 1 << 20,
                        "postcopy-requests": 7}}
        timeline = {"switch": 4.3, "postcopy-active": 4.4, "dst-running": 4.45,
                    "completed": 5.9}
        got = postcopy.qemu_metrics(info, {"postcopy-blocktime": 646}, timeline,
                                    {"start": 2, "end": 6}, 1.0, 0)
        self.assertEqual(got["switch_s"], 4.4)
        self.assertAlmostEqual(got["delivered_after_switch_s"], 1.5)
        self.assertAlmostEqual(got["dst_running_after_switch_ms"], 150)
        self.assertEqual((got["blocktime_ms"], got["postcopy_requests"]), (646, 7))
        self.assertEqual((got["mib"], got["postcopy_mib"]), (2, 1))
        self.assertEqual(got["guest_passes"], 4)
        self.assertTrue(got["guest_ok"])

    def test_qemu_precopy_has_no_switch(self):
        got = postcopy.qemu_metrics({"total-time": 1000, "ram": {}}, {}, {"completed": 1.0},
                                    {"start": 3, "end": 3}, 2.0, 40)
        self.assertIsNone(got["switch_s"])
        self.assertIsNone(got["postcopy_mib"])
        self.assertEqual(got["peak_throttle"], 40)
        self.assertFalse(got["guest_ok"])  # the counter did not advance


class ReportTest(unittest.TestCase):
    def test_passes_per_second_of_migration(self):
        self.assertEqual(postcopy.derived({"guest_passes": 5, "total_s": 10.0})["passes_per_s"],
                         0.5)
        self.assertIsNone(postcopy.derived({"total_s": 10.0})["passes_per_s"])

    def test_medians_per_case_and_failures_listed(self):
        runs = [postcopy.PostcopyRun("1gbit", 512, "tern-postcopy", rep,
                                     metrics={"total_s": t, "guest_ok": True, "loadavg": 3.0})
                for rep, t in enumerate((3.0, 1.0, 2.0))]
        runs.append(postcopy.PostcopyRun("1gbit", 512, "qemu-postcopy", 0, error="boom",
                                         metrics={"loadavg": 5.0}))
        rows = postcopy.summarize(runs)
        self.assertEqual([r["contender"] for r in rows], ["tern-postcopy", "qemu-postcopy"])
        self.assertEqual(rows[0]["total_s"], 2.0)
        self.assertEqual((rows[1]["n"], rows[1]["failed"]), (0, 1))
        text = postcopy.markdown(rows, {"date": "d", "tern": "t", "qemu": "q",
                                        "machine": "m", "argv": []})
        self.assertIn("| 1gbit | 512 MiB | tern-postcopy | 3 | 0/3 | 2.00 |", text)
        self.assertIn("0 (1 failed)", text)


if __name__ == "__main__":
    unittest.main()
