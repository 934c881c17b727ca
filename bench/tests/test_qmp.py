"""The QMP client against a scripted peer on a Unix socket (no QEMU)."""

import json
import socket
import sys
import tempfile
import threading
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.compare import qemu  # noqa: E402


class FakeQemu:
    """Greets, then answers each command with the next scripted reply
    (events are sent first, as QEMU may interleave them); records commands."""

    def __init__(self, path: Path, replies: list[list[dict]]):
        self.commands: list[dict] = []
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(1)
        self.thread = threading.Thread(target=self._serve, args=(replies,), daemon=True)
        self.thread.start()

    def _serve(self, replies: list[list[dict]]) -> None:
        conn, _ = self.server.accept()
        with conn, conn.makefile("rwb") as stream:
            stream.write(b'{"QMP": {"version": {}, "capabilities": []}}\n')
            stream.flush()
            for batch in replies:
                line = stream.readline()
                if not line:
                    return
                self.commands.append(json.loads(line))
                for reply in batch:
                    stream.write(json.dumps(reply).encode() + b"\n")
                stream.flush()

    def close(self) -> None:
        self.server.close()
        self.thread.join(30)


class QmpTest(unittest.TestCase):
    def test_commands_skip_events_and_read_the_counter(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "q.qmp"
            fake = FakeQemu(path, [
                [{"return": {}}],  # qmp_capabilities
                [{"event": "STOP", "timestamp": {}}, {"return": {"status": "completed"}}],
                [{"return": "0000000000002000: 0x00000102\r\n"}],
                [{"error": {"class": "GenericError", "desc": "no"}}],
            ])
            qmp = qemu.Qmp(path)
            try:
                self.assertEqual(qmp.cmd("query-migrate"), {"status": "completed"})
                self.assertEqual(qmp.counter(), 0x102)
                with self.assertRaisesRegex(RuntimeError, "QMP migrate: .*GenericError"):
                    qmp.cmd("migrate", uri="tcp:127.0.0.1:1")
            finally:
                qmp.close()
                fake.close()
        self.assertEqual(fake.commands[0], {"execute": "qmp_capabilities"})
        self.assertEqual(fake.commands[2]["arguments"], {"command-line": "xp /1wx 0x2000"})
        self.assertEqual(fake.commands[3]["arguments"], {"uri": "tcp:127.0.0.1:1"})


if __name__ == "__main__":
    unittest.main()
