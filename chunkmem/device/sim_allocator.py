"""The memory of the simulated asynchronous device as CUDA's allocators hand it out: what a GPU
user would read from ``torch.cuda.max_memory_reserved`` / ``max_memory_allocated``, and what the
pinned host allocator holds.

* :class:`CachingAllocator` models PyTorch's CUDA caching allocator at the level of blocks: a
  request is rounded up to a multiple of 512 bytes; a freed block is cached in the pool of the
  stream that allocated it (a small pool for blocks up to 1 MiB, a large one above) and handed to a
  later request of that stream that fits (the smallest that does, split when what is left is at
  least 512 bytes in the small pool, more than 1 MiB in the large one); a block freed while
  ``record_stream``-ed to other streams is held until those streams pass the point of the free (an
  event the simulated device completes once the host has waited for that point). Memory is only
  reserved when no cached block fits, and never given back (no ``empty_cache``). CUDA reserves
  whole segments (2 MiB for the small pool; 20 MiB for requests up to 10 MiB, else the request
  rounded to 2 MiB) and merges neighbouring free blocks: the model leaves both out, so
  ``reserved`` is what the blocks hold, and a GPU adds at most one partly used segment per stream
  and pool on top.
* :class:`PinnedAllocator` models the pinned host allocator: every request is rounded up to the
  next power of two, and a freed block is cached for a later request of the same rounded size once
  the copies that used it are done.

Both only count; the simulated device decides when blocks are allocated and freed.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

from .layer import pinned_block_bytes

__all__ = ["Block", "CachingAllocator", "MemoryFigures", "PinnedAllocator", "cuda_block_size", "pinned_block_size"]

_MIN_BLOCK = 512
_SMALL = 2**20  # blocks up to this size come from the small pool

Clock = dict[str, int]


def cuda_block_size(nbytes: int) -> int:
    """The block the CUDA caching allocator gives a request of ``nbytes``."""
    return _MIN_BLOCK if nbytes < _MIN_BLOCK else -(-nbytes // _MIN_BLOCK) * _MIN_BLOCK


def pinned_block_size(nbytes: int) -> int:
    """The block the pinned host allocator gives a request of ``nbytes`` (the next power of two)."""
    return pinned_block_bytes(nbytes)


@dataclass(frozen=True)
class MemoryFigures:
    """What an allocator holds now and at most (bytes)."""

    allocated: int
    peak_allocated: int
    reserved: int
    peak_reserved: int
    requested: int
    """Bytes the live blocks were asked for (before rounding)."""
    peak_requested: int


@dataclass(eq=False)
class Block:
    """One allocation: its rounded size, the request, and the stream whose pool it belongs to."""

    size: int
    requested: int
    stream: str
    live: bool = True


@dataclass(eq=False)
class _Held:
    """A freed block waiting for streams to pass the free (``record_stream``, or copies of pinned memory)."""

    block: Block
    waits: Clock = field(default_factory=dict)


class _Counts:
    def __init__(self) -> None:
        self.allocated = self.peak_allocated = 0
        self.reserved = self.peak_reserved = 0
        self.requested = self.peak_requested = 0

    def take(self, block: Block, new: bool) -> None:
        self.allocated += block.size
        self.requested += block.requested
        if new:
            self.reserved += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.peak_requested = max(self.peak_requested, self.requested)

    def give(self, block: Block) -> None:
        self.allocated -= block.size
        self.requested -= block.requested

    def figures(self) -> MemoryFigures:
        return MemoryFigures(
            self.allocated, self.peak_allocated, self.reserved, self.peak_reserved, self.requested, self.peak_requested
        )

    def reset_peaks(self) -> None:
        self.peak_allocated, self.peak_reserved, self.peak_requested = self.allocated, self.reserved, self.requested


class _Allocator:
    """What both allocators do with a freed block: cache it for reuse at once, or hold it until
    the streams it waits for pass their points; and count."""

    def __init__(self) -> None:
        self._held: list[_Held] = []
        self._counts = _Counts()

    def _cache(self, block: Block) -> None:
        raise NotImplementedError

    def free(self, block: Block, waits: Clock) -> None:
        """``block`` is freed; with ``waits`` (stream -> its point at the free: ``record_stream``,
        or the copies that used pinned memory, after each of which CUDA records an event) it is
        held until those streams pass them."""
        if not block.live:
            return
        block.live = False
        self._counts.give(block)
        if waits:
            self._held.append(_Held(block, dict(waits)))
        else:
            self._cache(block)

    def _release_held(self, passed: Callable[[Clock], bool]) -> None:
        if self._held:
            waiting = []
            for held in self._held:
                if passed(held.waits):
                    self._cache(held.block)
                else:
                    waiting.append(held)
            self._held = waiting

    def figures(self) -> MemoryFigures:
        return self._counts.figures()

    def reset_peaks(self) -> None:
        """Peaks from now on (``torch.cuda.reset_peak_memory_stats``)."""
        self._counts.reset_peaks()


class CachingAllocator(_Allocator):
    """Device blocks by stream; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self._pools: dict[tuple[str, bool], list[int]] = {}  # (stream, small) -> cached block sizes, sorted

    def allocate(self, nbytes: int, stream: str, passed: Callable[[Clock], bool]) -> Block:
        """A block for ``nbytes`` on ``stream``; ``passed`` says whether the streams a held block
        waits for have passed their points (those blocks return to their pools first)."""
        self._release_held(passed)
        size = cuda_block_size(nbytes)
        small = size <= _SMALL
        pool = self._pools.setdefault((stream, small), [])
        found = bisect.bisect_left(pool, size)
        if found < len(pool):
            cached = pool.pop(found)
            rest = cached - size
            if rest >= _MIN_BLOCK if small else rest > _SMALL:
                bisect.insort(pool, rest)
            else:
                size = cached
            block = Block(size, nbytes, stream)
            self._counts.take(block, new=False)
            return block
        block = Block(size, nbytes, stream)
        self._counts.take(block, new=True)
        return block

    def _cache(self, block: Block) -> None:
        bisect.insort(self._pools.setdefault((block.stream, block.size <= _SMALL), []), block.size)


class PinnedAllocator(_Allocator):
    """Pinned host blocks, by power-of-two size; see the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self._cached: dict[int, int] = {}  # size -> cached blocks of it

    def _cache(self, block: Block) -> None:
        self._cached[block.size] = self._cached.get(block.size, 0) + 1

    def allocate(self, nbytes: int, passed: Callable[[Clock], bool]) -> Block:
        self._release_held(passed)
        size = pinned_block_size(nbytes)
        block = Block(size, nbytes, "host")
        if self._cached.get(size, 0):
            self._cached[size] -= 1
            self._counts.take(block, new=False)
        else:
            self._counts.take(block, new=True)
        return block
