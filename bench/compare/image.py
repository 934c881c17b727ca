"""The guest's starting memory: one deterministic file both VMMs map."""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path

PAGE = 4096
SEED = 20260101
# Bump when the content changes, so a stale image is regenerated.
VERSION = "v2"
DESCRIPTION = "deterministic: ~50% zero pages, ~25% random, ~25% text-like"
# The second image: the same mix, in runs of 2 MiB of pages of one kind.
KINDS = ("mixed", "runs")
RUN_PAGES = 512
DESCRIPTIONS = {"mixed": DESCRIPTION,
                "runs": "deterministic: runs of 2 MiB of one kind, ~50% zero, ~25% random, "
                        "~25% text-like"}

_WORDS = ("migration page memory guest dirty channel zero stream kernel "
          "the of and to in is for on with as by at from this that "
          "buffer socket thread vcpu region bitmap digest codec").split()


def _text(seed: int) -> bytes:
    rng = random.Random(seed + 1)
    return " ".join(rng.choice(_WORDS) for _ in range(40000)).encode()[: 64 * 1024]


def chunks(size: int, seed: int = SEED, pages_per_chunk: int = 4096,
           kind: str = "mixed") -> Iterator[bytes]:
    """The image's bytes, `pages_per_chunk` pages at a time: per page, with
    a seeded generator, a zero page (1 in 2), random bytes (1 in 4, which no
    codec shrinks) or a slice of word text (1 in 4, which compresses), the
    text stamped with its page number so no two pages are equal. With
    `kind` "runs", the kind is drawn once per run of RUN_PAGES pages."""
    rng = random.Random(seed)
    text = _text(seed)
    pages = size // PAGE
    run_kind = 0
    for first in range(0, pages, pages_per_chunk):
        count = min(pages_per_chunk, pages - first)
        block = bytearray(count * PAGE)
        for row in range(count):
            if kind == "runs":
                if (first + row) % RUN_PAGES == 0:
                    run_kind = rng.randrange(4)
                page_kind = run_kind
            else:
                page_kind = rng.randrange(4)
            at = row * PAGE
            if page_kind == 2:
                block[at:at + PAGE] = rng.randbytes(PAGE)
            elif page_kind == 3:
                offset = rng.randrange(len(text) - PAGE)
                block[at:at + PAGE] = text[offset:offset + PAGE]
                block[at:at + 8] = (first + row).to_bytes(8, "little")
        yield bytes(block)


def make(path: Path, size: int, seed: int = SEED, kind: str = "mixed") -> None:
    """Writes the image to `path` unless a file of this size, seed, kind
    and version is already there."""
    meta = path.with_suffix(".meta")
    want = f"{size} {seed} {VERSION}" + ("" if kind == "mixed" else f" {kind}")
    if path.exists() and meta.exists() and meta.read_text() == want:
        return
    print(time.strftime("%H:%M:%S"), f"generating the memory image {path} ({size >> 20} MiB)",
          file=sys.stderr, flush=True)
    with open(path, "wb") as out:
        for chunk in chunks(size, seed, kind=kind):
            out.write(chunk)
    meta.write_text(want)
