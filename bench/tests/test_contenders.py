"""Cases, contenders, run records and the stored config."""

import sys
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.compare import config  # noqa: E402
from bench.compare.contenders import (  # noqa: E402
    DEFAULT_NAMES, NAMES, Case, Outcome, QemuContender, Run, TernContender, parse_contenders,
    plan)


class PlanTest(unittest.TestCase):
    def test_every_contender_in_every_case_and_extras_per_mode_and_link(self):
        cases = plan(["paused", "running"], ["loopback", "1gbit"], [2, 4], ["none", "zstd"],
                     list(DEFAULT_NAMES))
        # 2 modes x 2 links x (2 channels x 2 codecs + 1 extra case)
        self.assertEqual(len(cases), 20)
        first, contenders = cases[0]
        self.assertEqual(first.key, "paused/loopback/2ch/none")
        self.assertEqual([c.name for c in contenders], ["qemu", "qemu-nothp", "tern", "tern-default"])
        self.assertIsInstance(contenders[1], QemuContender)
        self.assertFalse(contenders[1].thp)
        extra, extras = cases[4]
        self.assertEqual(extra.key, "paused/loopback/extra")
        self.assertEqual([c.name for c in extras], ["tern-best", "tern-verify"])
        self.assertEqual(extras[0].channels_for(extra), 4)
        self.assertEqual(extras[0].compression_for(extra), "auto")
        self.assertEqual(extras[1].verify, "full")

    def test_running_modes_add_xbzrle_and_tern_delta_to_their_extra_rows(self):
        cases = dict((c.key, [w.name for w in ws]) for c, ws in plan(
            ["paused", "running", "running-rewrite"], ["1gbit"], [4], ["zstd"], list(NAMES)))
        self.assertEqual(cases["paused/1gbit/extra"], ["tern-best", "tern-verify"])
        for mode in ("running", "running-rewrite"):
            self.assertEqual(cases[f"{mode}/1gbit/extra"],
                             ["tern-best", "tern-verify", "qemu-xbzrle", "tern-delta"])

    def test_chosen_contenders_only(self):
        cases = plan(["paused"], ["loopback"], [2], ["none"], ["tern"], extras=True)
        self.assertEqual([(c.key, [w.name for w in ws]) for c, ws in cases],
                         [("paused/loopback/2ch/none", ["tern"])])
        self.assertEqual(plan(["paused"], ["loopback"], [2], ["none"], ["qemu"],
                              extras=False)[0][1][0].name, "qemu")

    def test_tls_rows_run_beside_the_plain_ones_when_named(self):
        cases = plan(["paused"], ["1gbit"], [2], ["none"], list(NAMES), extras=False)
        names = [w.name for w in cases[0][1]]
        self.assertEqual(names, ["qemu", "qemu-nothp", "tern", "tern-default", "qemu-tls", "tern-tls",
                                 "tern-default-base"])
        self.assertTrue(cases[0][1][4].tls and cases[0][1][5].tls)
        self.assertFalse(config.Config().wants_tls())
        self.assertTrue(config.Config(contenders=["tern-tls"]).wants_tls())

    def test_tern_takes_the_case_settings_unless_it_has_its_own(self):
        case = Case("running", "1gbit", 2, "zstd")
        self.assertEqual(TernContender("tern").channels_for(case), 2)
        self.assertEqual(TernContender("tern").compression_for(case), "zstd")

    def test_unknown_contender_is_refused_with_the_choices(self):
        self.assertEqual(parse_contenders("tern, qemu"), ["tern", "qemu"])
        with self.assertRaisesRegex(ValueError, "unknown contender kvmtool.*tern-best"):
            parse_contenders("tern,kvmtool")


class RunRecordTest(unittest.TestCase):
    def test_round_trip(self):
        run = Run(Case("paused", "loopback", 4, "none", extra=True), "tern-best", 2,
                  Outcome(0.5, 0.01, 1 << 20, 0.2, 0.3, 0.6, None, {"ram": {"total": 1}}))
        stored = run.to_json()
        self.assertEqual(stored["case"], "paused/loopback/extra")
        self.assertEqual(stored["details"], {"ram": {"total": 1}})
        self.assertEqual(Run.from_json(stored), run)

    def test_failed_run(self):
        run = Run(Case("running", "1gbit", 2, "zstd"), "qemu", 0, error="RuntimeError: x")
        stored = run.to_json()
        self.assertNotIn("total_time_s", stored)
        self.assertEqual(Run.from_json(stored), run)

    def test_reads_the_format_of_earlier_versions(self):
        # Earlier versions put the details under "extra", which hid the
        # extra flag of the case; the key still says it.
        old = {"case": "running/1gbit/extra", "contender": "tern-verify", "rep": 1,
               "mode": "running", "link": "1gbit", "channels": 4, "compression": "none",
               "total_time_s": 9.2, "downtime_s": 0.3, "bytes": 123, "src_cpu_s": 1.0,
               "dst_cpu_s": 2.0, "wall_s": 9.3, "guest_ok": True,
               "extra": {"dirty-sync-count": 5}}
        run = Run.from_json(old)
        self.assertTrue(run.case.extra)
        self.assertEqual(run.outcome.details, {"dirty-sync-count": 5})
        self.assertTrue(run.outcome.guest_ok)


class ConfigTest(unittest.TestCase):
    def test_smoke_is_one_case(self):
        cfg = config.from_args(config.parser().parse_args(["--smoke", "--contenders", "tern"]))
        cases = plan(cfg.modes, cfg.links, cfg.channels, cfg.compressions, cfg.contenders,
                     cfg.extras)
        self.assertEqual(len(cases), 1)
        self.assertEqual((cfg.reps, cfg.memory), (1, 256 << 20))
        self.assertFalse(cfg.wants_qemu())

    def test_bad_link_is_refused(self):
        with self.assertRaisesRegex(ValueError, "unknown link 10gbit"):
            config.from_args(config.parser().parse_args(["--links", "10gbit"]))

    def test_config_of_an_earlier_results_file(self):
        stored = {"quick": False, "reps": 3, "memory_mib": 1024, "no_extra": True,
                  "modes": ["paused"], "channels": [2, 4], "tern": "/x/tern",
                  "memory": 1 << 30, "report_only": False}
        cfg = config.Config.from_json(stored)
        self.assertFalse(cfg.extras)
        self.assertEqual(cfg.memory, 1 << 30)
        self.assertEqual(cfg.contenders, list(DEFAULT_NAMES))
        self.assertEqual(config.Config.from_json(cfg.to_json()), cfg)


if __name__ == "__main__":
    unittest.main()
