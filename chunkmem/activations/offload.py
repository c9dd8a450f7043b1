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
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..device.layer import Event
from ..transfers import Direction, HostTransfers

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

    def __init__(self, transfers: HostTransfers, device: torch.device, max_prefetch: int, min_bytes: int) -> None:
        self._transfers = transfers
        self._layer = transfers.layer
        self._device = device
        self._max_prefetch = max_prefetch
        self._min_bytes = min_bytes
        self._fetch_stream = self._layer.new_stream()
        self._pending: list[weakref.ref[BlockCall]] = []  # calls not fetched yet, in forward order
        self._fetched_hosts: list[torch.Tensor] = []  # host buffers a fetch read, back to the pool next

    def hooks(self, call: BlockCall) -> Any:
        """The saved-tensor hooks for one call of an offloaded block."""
        self._recycle()
        self._pending.append(weakref.ref(call))
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(call, t), self._unpack)

    # --- forward ------------------------------------------------------------------------------
    def _keeps(self, call: BlockCall, tensor: torch.Tensor) -> bool:
        if type(tensor) is not torch.Tensor or tensor.layout is not torch.strided or tensor.is_meta:
            return True  # a parameter (chunk memory), a copy of one the hooks made, or no plain tensor
        if isinstance(tensor._base, torch.nn.Parameter):
            return True
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes < self._min_bytes or nbytes % tensor.element_size():
            return True
        # Chunk memory the runtime gathered for this op (a parameter's data is a view into its chunk
        # while gathered), or a buffer of the block.
        pointer = storage.data_ptr()
        return any(
            t.untyped_storage().data_ptr() == pointer for t in (*call.module.parameters(), *call.module.buffers())
        )

    def _pack(self, call: BlockCall, tensor: torch.Tensor) -> torch.Tensor | _Saved:
        if self._keeps(call, tensor):
            return tensor
        storage = tensor.untyped_storage()
        key = (storage._cdata, tensor._version)
        copy = call.copies.get(key)
        if copy is None or copy.source.expired():
            if copy is not None:  # another storage, at the address of one copied and freed since
                call.copies[(id(copy), -1)] = copy
            copy = call.copies[key] = _Copy(self._to_host(tensor), StorageWeakRef(storage))
        return _Saved(call, copy, tensor.storage_offset(), tensor.size(), tensor.stride())

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
    def _unpack(self, saved: torch.Tensor | _Saved) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
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
        for copy in call.copies.values():
            self._transfers.before_host_read(copy.host)  # the copy into it is done
        with self._layer.on_stream(self._fetch_stream):
            for copy in call.copies.values():
                copy.device = torch.empty(copy.host.numel(), dtype=copy.host.dtype, device=self._device)
                self._transfers.copy(copy.device, copy.host, Direction.TO_DEVICE)
                self._fetched_hosts.append(copy.host)
            call.ready = self._layer.record_event(self._fetch_stream)
        call.fetched = True
