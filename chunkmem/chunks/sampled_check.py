"""``ContentSample``: a cheap check that a piece of a user's file still holds what it held at boost.

A frozen chunk read in place from the user's weights files (``values_in_place``) is refused when a
file's size or modification time changed; a file overwritten in place with both kept (a copy that
preserves them, ``os.utime``, a clock of coarse ticks) would otherwise train on other weights,
silently. At boost, a few pages of each piece this rank reads are read and their CRC-32 kept: the
whole piece where it is at most ``SAMPLES`` pages, else its first and last page and ``SAMPLES - 2``
pages spread between them, each at a position drawn at boost within its stretch. Every later read
of the piece checks the same pages of what it read, in memory: no more I/O, and ``SAMPLES`` pages
of CRC a piece (a few microseconds against the read of the piece).

What it sees: a file overwritten by another checkpoint (every page differs), a piece truncated or
zeroed, a change covering a sampled page. What it does not: a change that misses every sampled page
of a piece larger than ``SAMPLES`` pages (one tensor edited in a few places). A full checksum of
every piece read, at every gather, costs a CRC over all the bytes read (about 1.7 GB/s on one core
of the machine it was measured on, in the order of the disk's own rate), and a full read of the
shard at boost: not taken.
"""

from __future__ import annotations

import itertools
import os
import random
import zlib
from dataclasses import dataclass

__all__ = ["PAGE", "SAMPLES", "ContentSample"]

PAGE = 4096
SAMPLES = 8


@dataclass(frozen=True, slots=True)
class ContentSample:
    """Which spans of a piece are checked (offsets into the piece), and their CRC-32 at boost."""

    spans: tuple[tuple[int, int], ...]
    crc: int

    @classmethod
    def take(cls, fd: int, file_offset: int, nbytes: int, rng: random.Random) -> ContentSample:
        """Read the sampled pages of the ``nbytes`` at ``file_offset`` of ``fd`` and keep their CRC;
        raises ``OSError`` where the file ends before the piece does."""
        spans = _spans(nbytes, rng)
        crc = 0
        for start, end in spans:
            page = os.pread(fd, end - start, file_offset + start)
            if len(page) != end - start:
                raise OSError(f"the file ends within bytes {file_offset + start}..{file_offset + end}")
            crc = zlib.crc32(page, crc)
        return cls(spans, crc)

    def of(self, piece: memoryview) -> int:
        """The CRC-32 of the sampled spans of ``piece`` (the piece's bytes as read)."""
        crc = 0
        for start, end in self.spans:
            crc = zlib.crc32(piece[start:end], crc)
        return crc


def _spans(nbytes: int, rng: random.Random) -> tuple[tuple[int, int], ...]:
    if nbytes <= SAMPLES * PAGE:
        return ((0, nbytes),)
    last = nbytes - PAGE
    # The stretch between the first page and the last, cut in SAMPLES - 2 parts: a page in each.
    inner = last - PAGE
    starts = [PAGE + (inner * i) // (SAMPLES - 2) for i in range(SAMPLES - 1)]
    picked = [rng.randrange(a, max(a + 1, b - PAGE + 1)) for a, b in itertools.pairwise(starts)]
    return ((0, PAGE), *((s, s + PAGE) for s in picked), (last, nbytes))
