"""``SidePlaces``: where each chunk's optimizer side lives between steps, decided once.

A chunk's optimizer side is its fp32 master shard, its gradient shard and its optimizer states.
The placement's layout puts them on the device, on the host, or (a host side under the disk tier)
partly on disk: there the states and the gradient shard live on disk between steps, and with 16-bit
compute the master too (``ShardStore`` moves that one; what gathers read stays in host memory
unless the layout puts the parameter shard on disk as well, ``Location.DISK``).

The plugin builds this once from the layout; the chunk manager places each chunk's master and
parameter shard by it (``placement``, ``disk_file``), and the optimizer, its state dict, its
memory accounting and the disk pipeline ask it. Nothing else answers these questions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from chunkmem.placement import ChunkPlacement, Layout

from ..usage.accounting import Location

if TYPE_CHECKING:
    from ..chunks.chunk import Chunk
    from ..tiers.disk import SidesFile

__all__ = ["SidePlaces"]


class SidePlaces:
    """See the module docstring. ``file`` is the disk tier's file of this rank (``None`` when the
    layout puts nothing on disk)."""

    def __init__(self, layout: Layout, file: SidesFile | None) -> None:
        places = layout.placements
        # No file: the sides placed on disk have no bytes to put there (frozen chunks whose values
        # gathers read in memory), so they stay in host memory, and their shards where placed (one
        # placed on disk in host memory too).
        self._placements = tuple(
            p
            if file is not None or p.optim is not Location.DISK
            else ChunkPlacement(Location.HOST, Location.HOST if p.shard is Location.DISK else p.shard)
            for p in places
        )
        self._master = tuple(Location.DEVICE if p.optim is Location.DEVICE else Location.HOST for p in self._placements)
        self._disk = frozenset(i for i, p in enumerate(self._placements) if p.optim is Location.DISK)
        self._file = file

    # --- what the chunk manager places by -----------------------------------------------------
    def placement(self, chunk: Chunk) -> ChunkPlacement:
        """Where ``chunk``'s optimizer side and its compute-dtype parameter shard live."""
        return self._placements[chunk.chunk_id]

    def disk_file(self, chunk: Chunk) -> SidesFile | None:
        """The file ``chunk``'s side goes to between steps (``None``: it stays in memory)."""
        return self._file if chunk.chunk_id in self._disk else None

    # --- what the optimizer side asks -----------------------------------------------------------
    @property
    def file(self) -> SidesFile | None:
        return self._file

    def on_disk(self, chunk: Chunk) -> bool:
        """Whether ``chunk``'s optimizer states live on disk between steps (the same on every rank):
        they are stepped in the disk pipeline, and reading them can fail."""
        return chunk.layout.trainable and chunk.chunk_id in self._disk

    def on_disk_of(self, chunks: Iterable[Chunk]) -> list[Chunk]:
        """The chunks of ``chunks`` whose states live on disk, in order."""
        return [chunk for chunk in chunks if self.on_disk(chunk)]

    def states(self, chunk: Chunk) -> Location:
        """Where ``chunk``'s optimizer states (and its reduced gradient shard) live between steps:
        what the ledger accounts them on."""
        return Location.DISK if self.on_disk(chunk) else self._master[chunk.chunk_id]
