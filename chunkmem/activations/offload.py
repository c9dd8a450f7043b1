"""``ActivationOffload``: the saved-tensor hooks that move what autograd saves inside an offloaded
block to pinned host memory during the forward and back to the device before its backward.

* **Pack** (forward, inside the block): a saved tensor is kept as it is when it is chunk memory
  (a parameter, a view of one, or anything sharing the storage of the block's parameters or
  buffers: chunks are gathered and released by the runtime, never copied here), a tensor subclass,
  or smaller than ``min_offload_bytes``. Otherwise its whole storage is copied, once per block
  call and storage version (a tensor saved twice, or two views of one storage, share one copy),
  to a pinned host buffer from a pool, on the copy stream after the compute that made it
  (``HostTransfers.copy``: the source is recorded on the copy stream, so its memory is not reused
  before the copy read it). What autograd keeps is a handle: the copy, the view's offset, size and
  stride (so the tensor comes back with its own strides, bit for bit).
* **Unpack** (backward): the block call's copies are fetched on a fetch stream (after the host
  waited for the copies into the host buffers), the compute stream waits for the fetch, and the
  view is rebuilt on the device copy. The next ``max_prefetch`` block calls in backward order are
  fetched at the same time.
* Host buffers go back to the pool at the next forward, once the fetches that read them are done.

With a ``DeviceActivations`` (the blocks of ``ActivationPlacement(auto=...)``) what stays on the
device is accounted: small tensors it keeps, each storage until its copy to the host is done (the
host waits for the call's copies at the call's end, ``settle``), and the device copies from their
fetch until the call's last handle is gone.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..device.layer import Event
from ..tiers.transfers import Direction, HostTransfers
from .ledger import DeviceActivations, is_model_memory

__all__ = ["ActivationOffload", "BlockCall"]

_HOST = torch.device("cpu")


@dataclass(eq=False)
class _Copy:
    """One storage saved by a block call: its host copy, then its device copy."""

    host: torch.Tensor
    source: Any  # a StorageWeakRef to the storage copied: once it died, its address may be another's
    device: torch.Tensor | None = None


@dataclass(eq=False)
class BlockCall:
    """What one call of an offloaded block saved, and where it is now."""

    block: str
    module: torch.nn.Module
    copies: dict[tuple[int, int], _Copy] = field(default_factory=dict)  # (storage, version) -> copy
    fetched: bool = False
    ready: Event | None = None  # after the fetch, on the fetch stream
    saved_bytes: int = 0  # what the call saved apart from model memory, each storage once
    draining: int = 0  # accounted bytes of storages being copied to the host
    seen: set[int] = field(default_factory=set)  # storages counted in saved_bytes
    host_seconds: list[float] = field(default_factory=lambda: [0.0])  # host time in its hooks (shared box)


@dataclass(eq=False)
class _Saved:
    """What autograd keeps for an offloaded tensor."""

    call: BlockCall
    copy: _Copy
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


class ActivationOffload:
    """Saved-tensor hooks of the offloaded blocks of one model; see the module docstring."""

    def __init__(
        self,
        transfers: HostTransfers,
        device: torch.device,
        max_prefetch: int,
        min_bytes: int,
        account: DeviceActivations | None = None,
    ) -> None:
        self._account = account
        self._transfers = transfers
        self._layer = transfers.layer
        self._device = device
        self._max_prefetch = max_prefetch
        self._min_bytes = min_bytes
        self._fetch_stream = self._layer.new_stream()
        self._pending: list[weakref.ref[BlockCall]] = []  # calls not fetched yet, in forward order
        self._fetched_hosts: list[torch.Tensor] = []  # host buffers a fetch read, back to the pool next

    def waiting(self) -> int:
        """Calls whose saved tensors wait on the host for their backward (their graph lives)."""
        return sum(1 for ref in self._pending if (call := ref()) is not None and not call.fetched)

    def hooks(self, call: BlockCall) -> Any:
        """The saved-tensor hooks for one call of an offloaded block."""
        self._recycle()
        self._pending.append(weakref.ref(call))
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(call, t), self._unpack)

    # --- forward ------------------------------------------------------------------------------
    def _small(self, tensor: torch.Tensor) -> bool:
        nbytes = tensor.untyped_storage().nbytes()
        return nbytes < self._min_bytes or nbytes % tensor.element_size() != 0

    def _count(self, call: BlockCall, storage: Any) -> None:
        if storage._cdata not in call.seen:
            call.seen.add(storage._cdata)
            call.saved_bytes += storage.nbytes()

    def _pack(self, call: BlockCall, tensor: torch.Tensor) -> Any:
        # Chunk memory (a parameter, a view of one, a storage of the block's parameters or buffers:
        # gathered and released by the runtime) stays as it is, and so do small storages.
        if is_model_memory(call.module, tensor):
            return tensor
        storage = tensor.untyped_storage()
        self._count(call, storage)
        if self._small(tensor):
            return tensor if self._account is None else self._account.keep(tensor, f"block {call.block}")
        key = (storage._cdata, tensor._version)
        copy = call.copies.get(key)
        if copy is None or copy.source.expired():
            if copy is not None:  # another storage, at the address of one copied and freed since
                call.copies[(id(copy), -1)] = copy
            if self._account is not None:
                self._account.add(storage.nbytes(), f"block {call.block} (a saved tensor on its way to the host)")
                call.draining += storage.nbytes()
            began = time.perf_counter()
            copy = call.copies[key] = _Copy(self._to_host(tensor), StorageWeakRef(storage))
            call.host_seconds[0] += time.perf_counter() - began
        return _Saved(call, copy, tensor.storage_offset(), tensor.size(), tensor.stride())

    def settle(self, call: BlockCall) -> None:
        """The call's forward is done: with accounting, the host waits for its copies to the host,
        and their sources leave the ledger."""
        if self._account is None or not call.draining:
            return
        began = time.perf_counter()
        for copy in call.copies.values():
            self._transfers.before_host_read(copy.host)
        call.host_seconds[0] += time.perf_counter() - began
        self._account.remove(call.draining)
        call.draining = 0

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        numel = tensor.untyped_storage().nbytes() // tensor.element_size()
        with torch.no_grad():
            whole = tensor.detach().as_strided((numel,), (1,), 0)  # the whole storage, flat
            host = self._transfers.staging(numel, tensor.dtype, _HOST)
            self._transfers.copy(host, whole, Direction.TO_HOST)
        return host

    def _recycle(self) -> None:
        """Host buffers read by the last backward's fetches go back to the pool."""
        for host in self._fetched_hosts:
            self._transfers.before_host_write(host)
            self._transfers.give_back(host)
        self._fetched_hosts.clear()

    # --- backward -----------------------------------------------------------------------------
    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):  # stayed on the device: as it is, or in the ledger's handle
            return DeviceActivations.unpack(saved)
        call = saved.call
        if not call.fetched:
            self._fetch_around(call)
        self._layer.wait_event(call.ready)
        device = saved.copy.device
        assert device is not None, "a fetched call has device copies"
        self._layer.record_stream(device, self._layer.current_stream())
        return device.as_strided(saved.size, saved.stride, saved.offset)

    def _fetch_around(self, call: BlockCall) -> None:
        """Fetch ``call`` and the next ``max_prefetch`` unfetched calls in backward order (those
        before it in forward order)."""
        live = [c for c in (ref() for ref in self._pending) if c is not None and not c.fetched]
        position = next((i for i, c in enumerate(live) if c is call), len(live))
        ahead = live[max(0, position - self._max_prefetch) : position]
        for each in [call, *reversed(ahead)]:
            self._fetch(each)
        self._pending = [weakref.ref(c) for c in live if not c.fetched]

    def _fetch(self, call: BlockCall) -> None:
        began = time.perf_counter()
        self._fetch_now(call)
        call.host_seconds[0] += time.perf_counter() - began

    def _fetch_now(self, call: BlockCall) -> None:
        if self._account is not None:
            nbytes = sum(copy.host.numel() * copy.host.element_size() for copy in call.copies.values())
            self._account.add(nbytes, f"block {call.block} (its saved tensors fetched for its backward)")
            weakref.finalize(call, self._account.remove, nbytes)  # once the last handle is gone
        for copy in call.copies.values():
            self._transfers.before_host_read(copy.host)  # the copy into it is done
        with self._layer.on_stream(self._fetch_stream):
            for copy in call.copies.values():
                copy.device = torch.empty(copy.host.numel(), dtype=copy.host.dtype, device=self._device)
                self._transfers.copy(copy.device, copy.host, Direction.TO_DEVICE)
                self._fetched_hosts.append(copy.host)
            call.ready = self._layer.record_event(self._fetch_stream)
        call.fetched = True
