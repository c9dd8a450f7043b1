"""``HostRoom``: which offloaded storages stay in host memory under ``ActivationPlacement.host_budget``
and which go on to the disk tier, one rule for the runtime (``chunkmem.activations.offload``) and
the planner (``chunkmem.activations.forecast``), so that a plan's disk figures are a run's.

The budget holds two things: the host copies of whole storages (each at what host memory holds for
it: on a GPU a pinned block, up to twice its bytes), and the disk tier's staging window,
two pieces through which what goes to disk is written in the forward and read back before the
backward (one piece is filled while the other is on its way: a copy overlaps a disk transfer). A
storage is copied to host memory when its copy fits under the budget less the window, next to the
copies held already; otherwise it goes to disk, whatever its size (the window is a fixed size, so a
storage larger than the budget goes through it piece by piece). Greedy in the order storages are
saved: within one training forward the first blocks' storages fill host memory, the later ones go to
disk. Host copies are held until the next forward begins (the offload's pool gets them back then).
One budget holds the copies of every offloaded call of a forward: the ``offload`` blocks' and the
``auto`` blocks' calls that are offloaded, in the order saved.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["MIN_HOST_BUDGET", "HostRoom", "disk_bytes_per_call"]

MIN_HOST_BUDGET = 4096
"""The smallest ``host_budget`` (its window is then two pieces of 512 bytes)."""
_MAX_PIECE = 32 * 2**20


class HostRoom:
    """The host budget of offloaded activations, and what of it is held; see the module docstring."""

    def __init__(self, budget: int) -> None:
        if budget < MIN_HOST_BUDGET:
            raise ValueError(f"a host budget of {budget} bytes is below the minimum of {MIN_HOST_BUDGET}")
        self.budget = budget
        self.piece = 1 << (min(budget // 8, _MAX_PIECE).bit_length() - 1)
        """Bytes of one staging piece (the window is two): a power of two, so that a pinned piece
        holds no more than its bytes (``chunkmem.device.layer.pinned_block_bytes``)."""
        self.held = 0
        """Bytes of the host copies held now."""

    @property
    def window(self) -> int:
        """The staging window's bytes."""
        return 2 * self.piece

    def take(self, nbytes: int) -> bool:
        """Whether a storage of ``nbytes`` is copied to host memory (then held until ``give``)
        rather than written to disk."""
        if self.held + nbytes > self.budget - self.window:
            return False
        self.held += nbytes
        return True

    def give(self, nbytes: int) -> None:
        """A host copy of ``nbytes`` is let go."""
        if nbytes > self.held:
            raise RuntimeError(f"HostRoom.give: {nbytes} bytes let go, but only {self.held} are held")
        self.held -= nbytes


def disk_bytes_per_call(
    storages: Sequence[Sequence[int]], budget: int, held: Sequence[Sequence[int]] | None = None
) -> list[int]:
    """The bytes each offloaded call of one forward writes to disk under a host ``budget``: its
    copied storages' sizes (``storages``, per call in forward order, each in the order saved), the
    room empty when the forward begins. ``held``: what host memory holds for each copy, as
    ``storages`` (on a GPU a pinned block; default: the sizes themselves), which the budget counts."""
    room = HostRoom(budget)
    held = storages if held is None else held
    return [
        sum(n for n, h in zip(call, holds, strict=True) if not room.take(h))
        for call, holds in zip(storages, held, strict=True)
    ]
