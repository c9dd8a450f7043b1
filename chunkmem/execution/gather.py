"""Full values from sharded chunks, one chunk at a time.

A full state (model weights, optimizer state) is assembled chunk by chunk: each rank contributes
its shard, the chunk is all-gathered into one transient device buffer, and the ranks that receive
it copy it to the CPU; the buffer is freed before the next chunk. Where the device budget has no
room for a whole chunk, it is gathered in slices of every rank's shard. With
``Destination.FIRST_RANK`` (what checkpoint saves use) only rank 0 keeps anything: the other ranks
never hold more than one chunk. With ``Destination.EVERY_RANK`` (``model.state_dict()``, for
DDP-like code that expects a full state dict on every rank) every rank keeps a CPU copy.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from ..chunks.chunk import Chunk
from ..device.moves import to_device, to_host

if TYPE_CHECKING:
    from ..ranks.comm import Communicator
    from .runtime import ChunkRuntime

__all__ = ["Destination", "gather_full"]


class Destination(enum.Enum):
    """Which ranks receive a gathered full state."""

    FIRST_RANK = "first_rank"
    """Rank 0 only; the others return nothing (checkpoint saves)."""
    EVERY_RANK = "every_rank"
    """Every rank receives the full state (``state_dict()``)."""

    def receives(self, rank: int) -> bool:
        return self is Destination.EVERY_RANK or rank == 0


def gather_full(
    runtime: ChunkRuntime,
    comm: Communicator,
    chunk: Chunk,
    shard: torch.Tensor,
    destination: Destination,
    what: str,
) -> torch.Tensor | None:
    """``chunk``'s full ``capacity`` elements, from each rank's ``shard`` (this rank's part, on any
    device), on the CPU on receiving ranks, ``None`` elsewhere. The result may share memory with
    ``shard`` (world size 1): clone what you keep. A collective: every rank calls it for the same
    chunks in the same order."""
    receives = destination.receives(comm.rank)
    if comm.world_size == 1:
        return to_host(shard.detach()) if receives else None
    staged = shard.device != comm.device
    # Device bytes per element of this rank's shard: one from every rank, plus the staged copy.
    per_element = (comm.world_size + (1 if staged else 0)) * shard.element_size()
    numel = shard.numel()
    room = runtime.transient_room(numel * per_element)
    # Under a device budget that holds less than the whole chunk in the master's dtype (16-bit
    # training gathers half of it), the chunk is gathered in slices of every rank's shard.
    step = numel if room is None else max(1, min(numel, room // per_element))
    if step == numel:
        with runtime.transient(numel * per_element, f"{what} (chunk {chunk.chunk_id})"):
            whole = torch.empty(chunk.layout.capacity, dtype=shard.dtype, device=comm.device)
            comm.all_gather(whole, to_device(shard.detach(), comm.device), async_op=False)
            return to_host(whole) if receives else None
    out = torch.empty(comm.world_size, numel, dtype=shard.dtype) if receives else None
    for begin in range(0, numel, step):
        end = min(numel, begin + step)
        with runtime.transient((end - begin) * per_element, f"{what} (chunk {chunk.chunk_id})"):
            gathered = torch.empty(comm.world_size, end - begin, dtype=shard.dtype, device=comm.device)
            comm.all_gather(gathered.view(-1), to_device(shard.detach()[begin:end], comm.device), async_op=False)
            if out is not None:
                out[:, begin:end].copy_(gathered)
            del gathered
    return out.view(-1) if out is not None else None
