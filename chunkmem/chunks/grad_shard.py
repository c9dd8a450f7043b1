"""``GradShard``: this rank's reduced fp32 gradient shard of one chunk, kept where the chunk's master
lives (device or host memory) or, with the disk tier, on disk (``GradOnDisk``).

It is reserved in the ledger where the master lives (the placement counts it), but allocated only
when the first reduced gradients arrive and freed by ``zero_grad``, as plain PyTorch allocates
``.grad`` in backward and frees it with ``zero_grad(set_to_none=True)``: after boosting, the process
holds one copy of the weights. A reduction into a host shard crosses the bus asynchronously; what an
accumulating one sends waits in a host buffer of ``HostTransfers`` and is added when the shard is
next read, so the CPU does not wait for the copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..tiers.transfers import Direction, HostTransfers
from ..usage.accounting import Location, MemoryKind, MemoryLedger
from .grad_on_disk import GradOnDisk
from .master_buffer import MASTER_DTYPE, MasterSideBuffer

if TYPE_CHECKING:
    from ..ranks.local_failures import LocalFailures
    from ..tiers.disk import SidesFile

__all__ = ["GradShard"]


class GradShard:
    """See the module docstring. ``location`` is where the master lives (it follows the master's
    moves, ``move``); ``disk`` puts the shard on disk instead."""

    def __init__(
        self,
        label: str,
        numel: int,
        device: torch.device,
        ledger: MemoryLedger,
        transfers: HostTransfers,
        location: Location,
        pin: bool,
        host_device: torch.device,
        disk: SidesFile | None = None,
        failures: LocalFailures | None = None,
    ) -> None:
        self._label = label
        self._ledger = ledger
        self._transfers = transfers
        self._host_device = host_device
        self._location = location
        self._nbytes = numel * MASTER_DTYPE.itemsize
        self._disk = (
            GradOnDisk(label, numel, disk, ledger, transfers, host_device, failures) if disk is not None else None
        )
        self._buffers = MasterSideBuffer(
            MemoryKind.GRAD_SHARD, numel, device, ledger, pin, transfers.layer, False, host_device
        )
        self._grad: torch.Tensor | None = None
        self._pending_adds: list[torch.Tensor] = []  # staged gradients to add to the shard when read
        where = Location.DISK if self._disk else location
        ledger.alloc(where, MemoryKind.GRAD_SHARD, self._nbytes if self._disk else self._buffers.held_bytes(where))

    @property
    def values(self) -> torch.Tensor:
        """The shard, with every copy into it landed."""
        if self._disk is not None:
            return self._disk.resident()
        if self._grad is None:
            raise RuntimeError(f"{self._label}: its gradient shard is not allocated; reduce gradients into it first")
        self._settle()
        return self._grad

    @property
    def allocated(self) -> bool:
        if self._disk is not None:
            return self._disk.present
        return self._grad is not None

    @property
    def on_disk(self) -> GradOnDisk | None:
        """The shard's disk residency, when it lives on disk (else ``None``)."""
        return self._disk

    def allocate(self) -> torch.Tensor:
        """Allocate the (uninitialised) shard where the master lives."""
        if self._grad is not None:
            raise RuntimeError(f"{self._label}: its gradient shard is already allocated")
        self._grad = self._buffers.take(self._location)
        return self._grad

    def free(self) -> None:
        """Drop the shard (its values no longer count); nothing to do when absent."""
        if self._disk is not None:
            self._disk.drop()
            return
        if self._grad is not None:
            self._settle()  # copies into it land before the buffer is reused
            self._grad = None
            self._buffers.give_back(self._location)

    def receive(
        self,
        reduced: torch.Tensor,
        accumulate: bool,
        after: Callable[[], None] | None = None,
        divide_by: int | None = None,
    ) -> None:
        """See ``ShardStore.receive_grad``."""
        if self._disk is not None:
            self._disk.receive(reduced, accumulate, after, divide_by)
            return
        if self._location is not Location.HOST:
            if after is not None:
                after()
            if divide_by is not None:
                reduced.div_(divide_by)
            if accumulate:
                self.values.add_(reduced)
            else:
                self.allocate().copy_(reduced)
            return
        if not accumulate:
            target = self.allocate()
            self._transfers.copy(target, reduced, Direction.TO_HOST, after, divide_by)
            return
        # Into a staging buffer, added to the shard when it is next read: adding now would make
        # the CPU wait for the copy.
        staged = self._transfers.staging(reduced.numel(), reduced.dtype, self._host_device)
        self._transfers.copy(staged, reduced, Direction.TO_HOST, after, divide_by)
        self._pending_adds.append(staged)

    def _settle(self) -> None:
        """Wait for copies into the shard, then add the staged ones to it."""
        assert self._grad is not None, f"{self._label}: settling a gradient shard that is not allocated"
        self._transfers.before_host_read(self._grad)
        while self._pending_adds:
            staged = self._pending_adds.pop(0)
            self._transfers.before_host_read(staged)
            self._grad.add_(staged)
            self._transfers.give_back(staged)
