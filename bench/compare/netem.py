"""The emulated 1 Gbit/s link: a token bucket (tc tbf) on the loopback of a
network namespace, both ends of both programs run inside it."""

from __future__ import annotations

import os
import subprocess

# Another name lets two harnesses shape their own links side by side.
NETNS = os.environ.get("TERNBENCH_NETNS", "ternbench")
SHAPED = "1gbit"


def setup(rate: str, burst: str, latency: str) -> None:
    cleanup()
    subprocess.run(["ip", "netns", "add", NETNS], check=True)
    subprocess.run(["ip", "-n", NETNS, "link", "set", "lo", "up"], check=True)
    subprocess.run(["ip", "netns", "exec", NETNS, "tc", "qdisc", "add", "dev", "lo", "root",
                    "tbf", "rate", rate, "burst", burst, "latency", latency], check=True)


def cleanup() -> None:
    subprocess.run(["ip", "netns", "del", NETNS], stderr=subprocess.DEVNULL)


def wrap(cmd: list[str], link: str) -> list[str]:
    """`cmd` as run on `link`: inside the namespace for the shaped link."""
    return (["ip", "netns", "exec", NETNS] + cmd) if link == SHAPED else cmd
