"""Exact byte accounting of chunk memory, per location and per kind of buffer.

Every allocation and free of chunk-owned memory goes through one ``MemoryLedger``; it is the number
the budget is enforced against and what ``Stats.peak_device_bytes`` reports. With
``ActivationPlacement(auto=...)`` it accounts the saved activations of those blocks too
(``MemoryKind.ACTIVATION``), and during ``ChunkedModel.generate`` the KV cache
(``MemoryKind.KV_CACHE``); other activations and temporaries are outside it.
"""

from __future__ import annotations

import enum
from collections import Counter

from ..placement.places import Location

__all__ = ["Location", "MemoryKind", "MemoryLedger"]


class MemoryKind(enum.Enum):
    """What a buffer holds; the ledger counts bytes per kind and location."""

    GATHERED = "gathered"
    """Full chunk buffers, in the dtype gathers read (the compute dtype; a quantized chunk's own)."""
    MASTER = "master"
    """fp32 master shards."""
    SHARD_COPY = "shard_copy"
    """Compute-dtype copies of a master shard (device copy, pinned host cast)."""
    GRAD_BUFFER = "grad_buffer"
    """Full flat fp32 gradient buffers while gradients accumulate."""
    GRAD_SHARD = "grad_shard"
    """Reduced fp32 gradient shards, waiting for the optimizer."""
    OPTIM_STATE = "optim_state"
    """Optimizer states of the master shards."""
    TRANSIENT = "transient"
    """Temporary buffers of a collective outside training (state dicts, checkpoints)."""
    STAGING = "staging"
    """Host buffers a chunk's optimizer side from disk is stepped in."""
    QUANTIZED = "quantized"
    """A quantized frozen base's stored bytes (packed 4-bit weights and their scales), in every tier
    they are placed in, as any chunk shard (``chunkmem.quantized``)."""
    ACTIVATION = "activation"
    """Saved activations of the blocks ``ActivationPlacement(auto=...)`` places under the device
    budget, while they are on the device (see ``chunkmem.activations.ledger``); with
    ``ActivationPlacement.host_budget``, the ``offload`` blocks' host copies and staging window (host)
    and what they wrote to the disk tier (disk; ``chunkmem.activations.disk``)."""
    KV_CACHE = "kv_cache"
    """The KV cache of a ``generate()`` under way on the device, non-model data under the device
    budget: its bytes at the longest sequence the call may reach, reserved from its start to its
    end (``chunkmem.boosted.generation``)."""


class MemoryLedger:
    """Bytes of chunk memory allocated per location and kind, with the peak of each location."""

    def __init__(self) -> None:
        self._bytes: Counter[tuple[Location, MemoryKind]] = Counter()
        self._totals: Counter[Location] = Counter()
        self._peaks: Counter[Location] = Counter()

    def alloc(self, location: Location, kind: MemoryKind, nbytes: int) -> None:
        """Record an allocation (updates the peak)."""
        if nbytes < 0:
            raise ValueError(f"MemoryLedger.alloc: negative byte count {nbytes} for {kind.value} on {location.value}")
        self._bytes[location, kind] += nbytes
        self._totals[location] += nbytes
        if self._totals[location] > self._peaks[location]:
            self._peaks[location] = self._totals[location]

    def free(self, location: Location, kind: MemoryKind, nbytes: int) -> None:
        """Record a free; freeing more than was allocated is a bug and raises."""
        if nbytes > self._bytes[location, kind]:
            raise RuntimeError(
                f"MemoryLedger.free: freeing {nbytes} bytes of {kind.value} on {location.value} but only "
                f"{self._bytes[location, kind]} are accounted; an allocation was not recorded"
            )
        self._bytes[location, kind] -= nbytes
        self._totals[location] -= nbytes

    def bytes(self, location: Location, kind: MemoryKind | None = None) -> int:
        """Bytes at ``location``, of one kind or in all."""
        if kind is None:
            return self._totals[location]
        return self._bytes[location, kind]

    @property
    def device_bytes(self) -> int:
        return self._totals[Location.DEVICE]

    @property
    def host_bytes(self) -> int:
        return self._totals[Location.HOST]

    @property
    def disk_bytes(self) -> int:
        return self._totals[Location.DISK]

    @property
    def peak_device_bytes(self) -> int:
        return self._peaks[Location.DEVICE]

    @property
    def peak_host_bytes(self) -> int:
        return self._peaks[Location.HOST]

    def reset_peak(self) -> None:
        """Start measuring the peaks again from what is allocated now."""
        for location in Location:
            self._peaks[location] = self._totals[location]
