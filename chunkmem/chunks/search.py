"""Chunk-size search: the size that wastes the least padding for a given set of parameters.

Packing is the manager's: parameters in registration order, one open chunk per group (dtype,
requires_grad), a new chunk when the next parameter does not fit, and a chunk of its own (rounded
up to a multiple of the world size) for a parameter larger than the chunk size. Every candidate
size is evaluated at once, vectorized over candidates.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "CANDIDATE_BLOCK",
    "MIN_EFFICIENT_CHUNK_BYTES",
    "ChunkSizeSearch",
    "default_search_range",
    "group_key",
    "search_chunk_size",
    "trainable_chunk_range",
]


@dataclass(frozen=True)
class ChunkSizeSearch:
    """The chosen chunk size and the padding it wastes."""

    chunk_size: int
    """Elements per chunk (a multiple of the world size)."""
    num_chunks: int
    param_elements: int
    """Elements holding parameters."""
    waste_elements: int
    """Padding elements over all chunks."""
    waste_bytes: int
    """Padding bytes in the compute dtype."""

    @property
    def waste_percent(self) -> float:
        total = self.param_elements + self.waste_elements
        return 100.0 * self.waste_elements / total if total else 0.0

    def describe(self) -> str:
        """One line for logs and reports."""
        return (
            f"chunk_size={self.chunk_size} elements: {self.num_chunks} chunks, padding "
            f"{self.waste_elements} elements ({self.waste_bytes} bytes, {self.waste_percent:.2f}%)"
        )


def group_key(param: torch.Tensor) -> tuple[torch.dtype, bool]:
    """Parameters share chunks only within a group: same dtype and same ``requires_grad``."""
    return param.dtype, param.requires_grad


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


MIN_EFFICIENT_CHUNK_BYTES = 4 * 2**20
"""Below about this many bytes a chunk's collectives are dominated by their fixed cost. Measured
with ``benchmarks/collectives.py`` (gloo, W=2, 2-core CPU): an all-gather moves 0.85 GB/s at 0.8 MB,
1.26 GB/s at 3.2 MB and 1.43 GB/s at 32 MB (at W=4: 0.23, 0.50 and 0.77 GB/s); NCCL's fixed
cost, tens of microseconds at hundreds of GB/s, is worth megabytes too."""


def default_search_range(total_elements: int, granularity: int = 1024, element_size: int = 2) -> tuple[int, int]:
    """Between 1/64 and 1/4 of the model, capped at 2**26 elements: several chunks per model, so
    placement has something to choose, and not so many that per-chunk overheads dominate. The low
    end is raised to ``MIN_EFFICIENT_CHUNK_BYTES`` of ``element_size``-byte elements (but not above
    the high end): for a small model, chunks of 1/64 of it would spend most of every collective on
    its fixed cost."""
    high = min(2**26, max(granularity, total_elements // 4))
    efficient = MIN_EFFICIENT_CHUNK_BYTES // element_size
    low = min(high, max(granularity, high // 16, efficient))
    return low, high


def trainable_chunk_range(
    trainable_elements: int, chunk_size: int, granularity: int = 1024, element_size: int = 2
) -> tuple[int, int]:
    """Sizes to search for trainable parameters that are a small part of a frozen model: from
    ``MIN_EFFICIENT_CHUNK_BYTES`` up to what holds them all in one chunk (each bounded by the
    frozen ``chunk_size``): their chunks are as small as their collectives stay efficient, and no
    larger than they need."""
    high = min(chunk_size, max(granularity, _round_up(trainable_elements, granularity)))
    low = min(high, max(granularity, MIN_EFFICIENT_CHUNK_BYTES // element_size))
    return low, high


CANDIDATE_BLOCK = 16384
"""Candidate sizes evaluated together: below PyTorch's intra-op parallel grain (32768 elements)."""


def _pack(groups: Iterable[Sequence[int]], sizes: torch.Tensor, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padding elements and chunk count of the manager's packing at each of ``sizes`` (ascending).
    A parameter larger than a size gets a chunk of its own there and leaves the open chunk as it
    is: as ``sizes`` ascend, that is a prefix, updated by a slice, and the rest of the ops run on
    the sizes the parameter fits (fewer elementwise ops: a search runs a few per parameter)."""
    waste = torch.zeros_like(sizes)
    chunks = torch.zeros_like(sizes)
    ascending = sizes.tolist()
    for numels in groups:
        # No chunk open yet: as if a full one were (nothing fits in it, closing it wastes nothing).
        fill = sizes.clone()
        opened = len(ascending)  # sizes[opened:] have a real chunk open
        for n in numels:
            own = bisect.bisect_left(ascending, n)  # sizes[:own] < n
            if own:
                waste[:own] += _round_up(n, world_size) - n
                chunks[:own] += 1
            if own == len(ascending):
                continue
            open_fill, size = fill[own:], sizes[own:]
            grown = open_fill + n
            starts = grown > size
            # An empty parameter fits a full chunk but not the one that is not there: it opens one.
            if n == 0:
                starts[: max(opened - own, 0)] = True
            opened = min(opened, own)
            # Starting a new chunk closes the open one and wastes what is left in it.
            waste[own:] += (size - open_fill).mul_(starts)
            chunks[own:] += starts
            fill[own:] = torch.where(starts, n, grown)
        waste += sizes - fill
    return waste, chunks


def search_chunk_size(
    params: Iterable[torch.Tensor],
    min_size: int,
    max_size: int,
    granularity: int = 1024,
    world_size: int = 1,
    element_size: int = 2,
) -> ChunkSizeSearch:
    """Try every size from ``min_size`` to ``max_size`` in steps of ``granularity`` (each rounded up
    to a multiple of ``world_size``) and return the one with the least padding; ties go to the
    smaller size (finer placement). ``params`` may be meta tensors; only sizes are read."""
    if not 0 < min_size <= max_size:
        raise ValueError(f"search_chunk_size: need 0 < min_size <= max_size, got {min_size} and {max_size}")
    if granularity <= 0 or world_size <= 0:
        raise ValueError(f"search_chunk_size: granularity ({granularity}) and world_size ({world_size}) must be > 0")
    groups: dict[tuple[torch.dtype, bool], list[int]] = {}
    for p in params:
        groups.setdefault(group_key(p), []).append(p.numel())
    if not groups:
        raise ValueError("search_chunk_size: no parameters")

    packed = tuple((key, tuple(numels)) for key, numels in groups.items())
    return _search(packed, min_size, max_size, granularity, world_size, element_size)


# The same model is searched again by every boost of it (a plan boosts it for each budget it tries):
# the answer depends only on the sizes, so the last few are kept.
@functools.lru_cache(maxsize=16)
def _search(
    groups: tuple[tuple[tuple[torch.dtype, bool], tuple[int, ...]], ...],
    min_size: int,
    max_size: int,
    granularity: int,
    world_size: int,
    element_size: int,
) -> ChunkSizeSearch:
    sizes = torch.arange(min_size, max_size + 1, granularity, dtype=torch.int64)
    sizes = (sizes + world_size - 1) // world_size * world_size
    # Thousands of elementwise ops (several a parameter) on tensors of one element a candidate:
    # in blocks below PyTorch's parallel grain (32768 elements) each op runs on this thread. Above it
    # every op starts a parallel region on all intra-op threads, which on a busy machine costs far
    # more than the op (llama-7b, 61440 candidates, 2 cores under load: 0.7 s on one thread, 40 s on
    # two; the planner CLI timed out at 200 s beside 10 pytest workers on 16 cores).
    blocks = [_pack([numels for _, numels in groups], block, world_size) for block in sizes.split(CANDIDATE_BLOCK)]
    waste = torch.cat([block_waste for block_waste, _ in blocks])
    chunks = torch.cat([block_chunks for _, block_chunks in blocks])
    best = int(torch.argmin(waste))  # first minimum: the smallest size
    total = sum(sum(numels) for _, numels in groups)
    return ChunkSizeSearch(
        chunk_size=int(sizes[best]),
        num_chunks=int(chunks[best]),
        param_elements=total,
        waste_elements=int(waste[best]),
        waste_bytes=int(waste[best]) * element_size,
    )
