"""What the harness reads: tern's events and reports, QEMU's replies,
/proc, apt sources; and the memory image it writes."""

import io
import os
import sys
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.compare import image, procfs, qemu, system, tern  # noqa: E402
from bench.compare.config import Artifacts, Config  # noqa: E402
from bench.compare.contenders import TERN, Case, tern_best, tern_delta, tern_verify  # noqa: E402

ARTIFACTS = Artifacts(Path("/t/tern"), Path("/w/image.bin"), Path("/w/guest.mb"))


class TernEventTest(unittest.TestCase):
    def test_the_events_the_cli_prints(self):
        # docs/cli.md, "Events".
        listening = tern.parse_event(
            '{"event":"listening","address":"127.0.0.1:4444","transport":"tcp","port":4444}\n',
            "listening")
        self.assertEqual(listening["address"], "127.0.0.1:4444")
        migrating = tern.parse_event(
            '{"event":"migrating","address":"unix:/run/t.sock","transport":"unix"}\n',
            "migrating")
        self.assertEqual(migrating["transport"], "unix")

    def test_anything_else_is_an_error_naming_the_line(self):
        for line in ["", "tern vm migrate: migrating to 127.0.0.1:4444...\n", "[1]\n",
                     '{"event":"listening","address":"x"}\n']:
            with self.subTest(line=line):
                with self.assertRaisesRegex(tern.EventError, "expected a 'migrating' event"):
                    tern.parse_event(line, "migrating")

    def test_read_event_from_a_pipe(self):
        read_fd, write_fd = os.pipe()
        with os.fdopen(read_fd) as reader, os.fdopen(write_fd, "w") as writer:
            writer.write('{"event":"migrating","address":"h:1","transport":"tcp","port":1}\n'
                         '{\n "status": "completed"\n}\n')
            writer.flush()
            self.assertEqual(tern.read_event(reader, "migrating", 30)["port"], 1)
            writer.close()
            self.assertEqual(reader.read(), '{\n "status": "completed"\n}\n')

    def test_read_event_gives_up_on_a_silent_child(self):
        read_fd, write_fd = os.pipe()
        with os.fdopen(read_fd) as reader, os.fdopen(write_fd, "w"):
            with self.assertRaisesRegex(tern.EventError, "no 'listening' event within 0 s"):
                tern.read_event(reader, "listening", 0)


class TernCommandTest(unittest.TestCase):
    def test_source_asks_for_events_and_matches_qemu_settings(self):
        cfg = Config(memory_mib=256, working_set_mib=16, warmup=1000)
        args = tern.source_args(cfg, ARTIFACTS, Case("paused", "loopback", 2, "zstd"), TERN,
                                "127.0.0.1:4444")
        self.assertEqual(args[:5], ["/t/tern", "vm", "migrate", "--to", "127.0.0.1:4444"])
        self.assertIn("--events", args)
        self.assertIn("--json", args)
        self.assertIn("--paused", args)
        pairs = dict(zip(args, args[1:]))
        self.assertEqual(pairs["--memory"], str(256 << 20))
        self.assertEqual(pairs["--image"], "/w/image.bin")
        self.assertEqual(pairs["--compression-level"], "1")
        self.assertEqual(pairs["--verify"], "none")

    def test_extra_contenders_bring_their_own_settings(self):
        args = tern.source_args(Config(), ARTIFACTS, Case("running", "1gbit", 4, "none", True),
                                tern_best(4), "h:1")
        pairs = dict(zip(args, args[1:]))
        self.assertEqual((pairs["--channels"], pairs["--compression"]), ("4", "auto"))
        self.assertNotIn("--paused", args)
        self.assertNotIn("--compression-level", args)

    def test_tern_delta_and_the_rewrite_workload(self):
        cfg = Config(working_set_mib=512)
        args = tern.source_args(cfg, ARTIFACTS, Case("running-rewrite", "1gbit", 4, "none", True),
                                tern_delta(4), "h:1")
        pairs = dict(zip(args, args[1:]))
        self.assertEqual(pairs["--delta-cache-size"], str(512 << 20))
        self.assertEqual(pairs["--workload"], "rewrite")
        self.assertEqual(pairs["--compression"], "auto")
        # tern-best's options, so that the two rows differ by deltas only.
        self.assertEqual(pairs["--compression-dictionary"], "64KiB")
        plain = dict(zip(*[tern.source_args(cfg, ARTIFACTS, Case("running", "1gbit", 4, "none"),
                                            TERN, "h:1")] * 2))
        self.assertNotIn("--delta-cache-size", plain)

    def test_zstd_cases_add_the_dictionary_and_packet_frame_rows(self):
        from bench.compare.contenders import TERN_DICT, TERN_PACKET, plan
        cases = plan(["paused"], ["1gbit"], [2], ["none", "zstd"],
                     ["qemu", "tern", "tern-dict", "tern-packet"], extras=False)
        names = {case.compression: [c.name for c in who] for case, who in cases}
        self.assertEqual(names["none"], ["qemu", "tern"])
        self.assertEqual(names["zstd"], ["qemu", "tern", "tern-dict", "tern-packet"])
        case = Case("paused", "1gbit", 2, "zstd")
        dictionary = tern.source_args(Config(), ARTIFACTS, case, TERN_DICT, "h:1")
        self.assertEqual(dict(zip(dictionary, dictionary[1:]))["--compression-dictionary"],
                         "64KiB")
        self.assertNotIn("--packet-frames", dictionary)
        self.assertIn("--packet-frames", tern.source_args(Config(), ARTIFACTS, case,
                                                          TERN_PACKET, "h:1"))

    def test_receiver_listens_on_a_port_the_system_picks(self):
        args = tern.receiver_args(Config(timeout=60), ARTIFACTS, TERN)
        self.assertEqual(dict(zip(args, args[1:]))["--listen"], "127.0.0.1:0")
        # The tern rows run --verify none, which a receiver must allow.
        self.assertIn("--allow-unverified", args)

    def test_receiver_allows_an_unverified_source_only_when_the_contender_skips_the_digest(self):
        self.assertEqual(TERN.verify, "none")
        self.assertIn("--allow-unverified", tern.receiver_args(Config(), ARTIFACTS, TERN))
        verified = tern_verify(2)
        self.assertNotIn("--allow-unverified", tern.receiver_args(Config(), ARTIFACTS, verified))

    def test_outcome_of_the_reports(self):
        source = {"status": "completed", "total-time": 1500, "downtime": 20,
                  "ram": {"transferred": 1 << 20, "dirty-sync-count": 3}, "setup-time": 5}
        destination = {"guest-runs-on-destination": True,
                       "consistency-check": {"passed": False}}
        running = tern.outcome(Case("running", "loopback", 2, "none"), source, destination,
                               0.5, 0.7, 1.6, {"tern-ch0": 0.1})
        self.assertEqual((running.total_time_s, running.downtime_s, running.bytes),
                         (1.5, 0.02, 1 << 20))
        self.assertFalse(running.guest_ok, "a failed consistency check fails the run's check")
        self.assertEqual(running.details["dirty-sync-count"], 3)
        paused = tern.outcome(Case("paused", "loopback", 2, "none"), source, {}, 0.5, 0.7,
                              1.6, {})
        self.assertIsNone(paused.guest_ok)


class QemuTest(unittest.TestCase):
    def test_counter_from_hmp_xp(self):
        self.assertEqual(qemu.parse_xp_word("0000000000002000: 0x0000abcd\r\n"), 0xABCD)

    def test_major_version(self):
        self.assertEqual(qemu.major_version(
            "QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)"), 10)
        self.assertEqual(qemu.major_version("QEMU emulator version 7.2.15"), 7)
        self.assertIsNone(qemu.major_version(None))
        self.assertIsNone(qemu.major_version("something else"))

    def test_parameters_match_terns(self):
        params = qemu.migration_parameters(Case("paused", "loopback", 4, "zstd"), 300)
        self.assertEqual(params["multifd-channels"], 4)
        self.assertEqual(params["multifd-zstd-level"], 1)
        self.assertEqual(params["downtime-limit"], 300)
        self.assertNotIn("multifd-zstd-level",
                         qemu.migration_parameters(Case("paused", "loopback", 4, "none"), 300))

    def test_xbzrle_runs_without_multifd_and_running_cases_auto_converge(self):
        case = Case("running", "1gbit", 4, "none", True)
        params = qemu.migration_parameters(case, 300, 64 << 20)
        self.assertEqual(params["xbzrle-cache-size"], 64 << 20)
        self.assertNotIn("multifd-channels", params)
        self.assertEqual([c["capability"] for c in qemu.capabilities(case, True)],
                         ["xbzrle", "auto-converge"])
        paused = Case("paused", "1gbit", 4, "none")
        self.assertEqual([c["capability"] for c in qemu.capabilities(paused, False)],
                         ["multifd"])

    def test_outcome_of_query_migrate(self):
        info = {"status": "completed", "total-time": 2000, "downtime": 150,
                "ram": {"transferred": 42, "normal": 7, "duplicate": 9}}
        result = qemu.outcome(info, 1.0, 2.0, 2.1, None, {}, {})
        self.assertEqual((result.total_time_s, result.downtime_s, result.bytes), (2.0, 0.15, 42))
        self.assertEqual(result.details["duplicate"], 9)


class ProcTest(unittest.TestCase):
    def test_cpu_seconds_of_a_stat_line_with_a_tricky_name(self):
        stat = "1234 (a) b (c) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0"
        self.assertEqual(procfs.stat_cpu_seconds(stat, clk_tck=100), 3.0)

    def test_cpu_seconds_of_this_process(self):
        self.assertGreaterEqual(procfs.cpu_seconds(os.getpid()), 0.0)

    def test_thread_delta_leaves_idle_threads_out(self):
        self.assertEqual(procfs.thread_delta({"a": 1.0, "b": 2.0},
                                             {"a": 1.001, "b": 2.5, "c": 0.25}),
                         {"b": 0.5, "c": 0.25})


class ImageTest(unittest.TestCase):
    def test_deterministic_mix_of_zero_random_and_text_pages(self):
        size = 2048 * image.PAGE
        data = b"".join(image.chunks(size, seed=7, pages_per_chunk=500))
        self.assertEqual(len(data), size)
        self.assertEqual(data, b"".join(image.chunks(size, seed=7)))
        self.assertNotEqual(data, b"".join(image.chunks(size, seed=8)))
        pages = [data[i:i + image.PAGE] for i in range(0, size, image.PAGE)]
        zero = sum(p == bytes(image.PAGE) for p in pages)
        text = sum(p[8:].isascii() and p != bytes(image.PAGE) for p in pages)
        self.assertTrue(900 < zero < 1150, zero)
        self.assertTrue(400 < text < 640, text)
        self.assertEqual(len(set(pages)), len(pages) - zero + 1, "no two data pages alike")


class SystemTest(unittest.TestCase):
    def test_mirror_from_either_apt_format(self):
        deb822 = ("Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm\n\n"
                  "Types: deb\nURIs: http://deb.debian.org/debian-security\n")
        self.assertEqual(system.debian_mirror(deb822), "http://deb.debian.org/debian")
        one_line = ("deb http://security.debian.org/debian-security bookworm-security main\n"
                    "deb http://mirror.example/debian bookworm main\n")
        self.assertEqual(system.debian_mirror(one_line), "http://mirror.example/debian")
        self.assertIsNone(system.debian_mirror("# nothing\n"))

    def test_mirror_skips_repositories_without_the_debian_suite(self):
        # Seen on a machine: a vendor repository listed before Debian's.
        sources = ("Types: deb\nURIs: https://deb.nodesource.com/node_20.x\nSuites: nodistro\n\n"
                   "deb https://packages.cloud.google.com/apt cloud-sdk-bookworm main\n\n"
                   "Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\n")
        self.assertEqual(system.debian_mirror(sources), "http://deb.debian.org/debian")

    def test_message_names_each_missing_piece_and_the_flag(self):
        text = system.missing_message([system.Missing("qemu-system-x86_64 10.x", "apt-get ..."),
                                       system.Missing("matplotlib", "pip ...")])
        self.assertIn("qemu-system-x86_64 10.x", text)
        self.assertIn("matplotlib", text)
        self.assertIn("--install", text)

    def test_nothing_is_missing_for_tern_alone_without_charts(self):
        cfg = Config(links=["loopback"], contenders=["tern"])
        self.assertEqual(system.find_missing(cfg, charts=False), [])


if __name__ == "__main__":
    unittest.main()
