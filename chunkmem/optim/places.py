"""``SidePlaces``: where each chunk's optimizer side lives between steps, decided once.

A chunk's optimizer side is its fp32 master shard, its gradient shard and its optimizer states.
The placement's layout puts them on the device, on the host, or (a host side under the disk tier)
partly on disk: there the states and the gradient shard live on disk between steps, and with 16-bit
compute the master too (``ShardStore`` moves that one; what gathers read stays in host memory
unless the layout puts the parameter shard on disk as well, ``param_on_disk``).

The plugin builds this once from the layout; the chunk manager places each chunk's master and
parameter shard by it (``placement``, ``disk_file``), and the optimizer, its state dict, its
memory accounting and the disk pipeline ask it. Nothing else answers these questions.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from chunkmem.placement import Layout

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
        self._master = tuple(Location.DEVICE if p.optim_on_device else Location.HOST for p in places)
        self._shard = tuple(
            Location.DEVICE
            if p.shard_on_device
            else Location.DISK
            if p.param_on_disk and file is not None
            else Location.HOST
            for p in places
        )
        self._disk = frozenset(i for i, p in enumerate(places) if p.optim_on_disk) if file is not None else frozenset()
        self._file = file

    # --- what the chunk manager places by -----------------------------------------------------
    def placement(self, chunk: Chunk) -> tuple[Location, Location]:
        """Where ``chunk``'s master (in memory) and its compute-dtype parameter shard live."""
        return self._master[chunk.chunk_id], self._shard[chunk.chunk_id]

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
        return chunk.trainable and chunk.chunk_id in self._disk

    def on_disk_of(self, chunks: Iterable[Chunk]) -> list[Chunk]:
        """The chunks of ``chunks`` whose states live on disk, in order."""
        return [chunk for chunk in chunks if self.on_disk(chunk)]

    def states(self, chunk: Chunk) -> Location:
        """Where ``chunk``'s optimizer states (and its reduced gradient shard) live between steps:
        what the ledger accounts them on."""
        return Location.DISK if self.on_disk(chunk) else self._master[chunk.chunk_id]
