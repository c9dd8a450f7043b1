"""``MasterSideBuffer``: a shard-sized buffer that lives where a chunk's master lives (the master
itself, or its gradient shard), on the device or in host memory: fp32, or the compute dtype for the
values of a frozen chunk that has no master (``ShardKind.FROZEN_VALUES``)."""

from __future__ import annotations

import torch

from ..device import DeviceLayer
from ..usage.accounting import Location, MemoryKind, MemoryLedger

__all__ = ["MASTER_DTYPE", "MasterSideBuffer"]

MASTER_DTYPE = torch.float32
_CPU = torch.device("cpu")


class MasterSideBuffer:
    """A shard-sized buffer (fp32 unless ``dtype`` says) that lives where the master lives. With an
    asynchronous device its host buffer is pinned, allocated once for the store's life (pinning is
    slow) and reused by every buffer taken there (a gradient shard freed and allocated again each
    step); without one it is an ordinary allocation, freed
    when the buffer leaves."""

    def __init__(
        self,
        kind: MemoryKind,
        numel: int,
        device: torch.device,
        ledger: MemoryLedger,
        pin: bool,
        layer: DeviceLayer,
        accounted: bool = True,
        host_device: torch.device = _CPU,
        dtype: torch.dtype = MASTER_DTYPE,
    ) -> None:
        self._kind = kind
        self._dtype = dtype
        self._numel = numel
        self._device = device
        self._host_device = host_device
        # Without ``accounted`` the owner reserves the bytes in the ledger itself, for as long as
        # the buffer may exist, not only while it does.
        self._ledger = ledger if accounted else None
        self._pin = pin
        self._layer = layer
        self._host: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self._numel * self._dtype.itemsize

    @property
    def host_bytes(self) -> int:
        """What its host buffer holds: a pinned one its allocator's whole block."""
        return self._layer.host_held_bytes(self.nbytes, self._pin)

    def held_bytes(self, location: Location) -> int:
        """What the buffer taken at ``location`` holds there (what the ledger charges)."""
        return self.host_bytes if location is Location.HOST else self.nbytes

    def take(self, location: Location) -> torch.Tensor:
        """An uninitialized buffer at ``location`` (the kept pinned one on the host, with CUDA)."""
        if location is Location.DEVICE:
            if self._ledger is not None:
                self._ledger.alloc(Location.DEVICE, self._kind, self.nbytes)
            return torch.empty(self._numel, dtype=self._dtype, device=self._device)
        if self._host is not None:
            return self._host
        if self._ledger is not None:
            self._ledger.alloc(Location.HOST, self._kind, self.host_bytes)
        host = self._layer.host_empty(self._numel, self._dtype, self._host_device, pinned=self._pin)
        if self._pin:
            self._host = host
        return host

    def give_back(self, location: Location) -> None:
        """The buffer taken at ``location`` is no longer used (a pinned host one stays allocated)."""
        if self._ledger is not None and (location is Location.DEVICE or self._host is None):
            self._ledger.free(location, self._kind, self.held_bytes(location))
