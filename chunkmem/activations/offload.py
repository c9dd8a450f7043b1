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
  view is rebuilt on the device copy. When a call's backward begins (its first unpack), the next
  ``max_prefetch`` block calls in backward order are fetched too, those not fetched yet: the window
  slides by one call per backward, so each call is fetched ``max_prefetch`` calls ahead of its own.
* Host buffers go back to the pool at the next forward, once the fetches that read them are done;
  the device copies go with their call (its backward ran, or its graph was dropped).
* With ``ActivationPlacement.host_budget`` (an ``ActivationDisk``), a storage whose copy does not fit
  the budget goes to the disk tier instead (``placement.HostRoom`` decides, in the order saved) and
  is read back by the fetch; the call's writes are waited for, and agreed over ranks, at its end
  (``finish``). A disk failure inside the call leaves the rest of the call's tensors as they are
  (the call raises at its end, on every rank).

What a call saves is counted by ``counting.SavedCount`` (the planner's rule too). With a
``DeviceActivations`` (the blocks of ``ActivationPlacement(auto=...)``) small storages stay on the
device in the ledger's handle, and a call's ``CallHold`` holds the rank-agreed bytes the ledger
accounts for it (see ``ledger``): what it gives back when its copies to the host are done
(``settle``: the host waits for them at the call's end) and what it takes at the fetch.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..compat.torch import storage_id, version
from ..device.layer import Event
from ..errors import DiskTierError
from ..tiers.transfers import Direction, HostTransfers
from ..usage.saved import unlinked
from .counting import Saved, SavedCount
from .disk import ActivationDisk, DiskCopy
from .ledger import CallBytes, CallHold, DeviceActivations
from .meter import SavedMeter

__all__ = ["ActivationOffload", "BlockCall"]

_HOST = torch.device("cpu")


@dataclass(eq=False)
class _Copy:
    """One storage saved by a block call: its host copy (or its bytes on disk), then its device copy."""

    host: torch.Tensor | None
    numel: int
    dtype: torch.dtype
    disk: DiskCopy | None = None
    device: torch.Tensor | None = None
    held: weakref.finalize | None = None  # lets go of its host bytes in the host budget (once)


@dataclass(eq=False)
class BlockCall:
    """What one call of a placed block saved, and where it is now."""

    block: str
    module: torch.nn.Module
    count: SavedCount
    hold: CallHold | None = None  # its bytes in the ledger (auto calls)
    agreed: CallBytes | None = None  # the figures it is accounted by (None while measured)
    drained: int = 0  # what the hold gives back once the copies to the host are done
    fetch_bytes: int = 0  # what the hold takes when the copies are fetched back
    copies: dict[tuple[int, int], _Copy] = field(default_factory=dict)  # (storage, version) -> its latest copy
    made: list[_Copy] = field(default_factory=list)  # every copy, in the order made
    fetched: bool = False
    began: bool = False  # its backward began (its first saved tensor was unpacked)
    ready: Event | None = None  # after the fetch, on the fetch stream
    failure: BaseException | None = None  # a disk failure in its forward (raised at its end, agreed)
    host_seconds: list[float] = field(default_factory=lambda: [0.0])  # host time in its hooks (shared box)
    stretch: int = -1  # a stretch outside the blocks (offload_outside): its index among the auto calls


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
        disk: ActivationDisk | None = None,
        meter: SavedMeter | None = None,
    ) -> None:
        """``account``: where what the calls leave on the device and fetch back is accounted (the
        ``auto`` blocks' ledger), else ``meter``: where it is measured."""
        self._account = account
        self._meter = meter
        self._disk = disk
        self._transfers = transfers
        self._layer = transfers.layer
        self._device = device
        self._max_prefetch = max_prefetch
        self._min_bytes = min_bytes
        self._fetch_stream = self._layer.new_stream()
        self._pending: list[weakref.ref[BlockCall]] = []  # calls whose backward has not begun, in forward order
        # What the fetches read (a host buffer, and what gives back its room in the host budget), back
        # to the pool next: the copies themselves (their device copies) go with their calls.
        self._fetched: list[tuple[torch.Tensor | None, Any]] = []

    def set_prefetch(self, calls: int) -> None:
        """Fetch ``calls`` calls ahead from now on (the ``auto`` plan's depth)."""
        if calls < 0:
            raise ValueError(f"set_prefetch: a negative depth {calls}")
        self._max_prefetch = calls

    def waiting(self) -> int:
        """Calls whose saved tensors wait on the host for their backward (their graph lives)."""
        return sum(1 for ref in self._pending if (call := ref()) is not None and not call.fetched)

    def hooks(self, call: BlockCall) -> Any:
        """The saved-tensor hooks for one call of an offloaded block."""
        self.begin(call)
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self.pack(call, t), self._unpack)

    def begin(self, call: BlockCall) -> None:
        """``call`` starts (its tensors go through ``pack``): it is fetched in backward order."""
        self.recycle()
        # The calls of forwards dropped without a backward are gone: their references go too.
        self._pending = [ref for ref in self._pending if ref() is not None]
        self._pending.append(weakref.ref(call))

    def unpack(self, saved: Any) -> torch.Tensor:
        """The tensor ``pack`` kept, on the device (fetching its call and those ahead)."""
        return self._unpack(saved)

    def call(self, block: str, module: torch.nn.Module, hold: CallHold | None = None) -> BlockCall:
        """A new call of a placed block (``hold``: its bytes in the ledger)."""
        return BlockCall(block, module, SavedCount(module, self._min_bytes), hold)

    @staticmethod
    def count(call: BlockCall, tensor: torch.Tensor) -> Saved:
        """Count a tensor the call saves. On the meta device (the planner's run of the runtime,
        whose figures ``forecast`` makes) nothing is placed: it stays as it is, uncounted."""
        return Saved.MODEL if tensor.is_meta else call.count.add(tensor)

    # --- forward ------------------------------------------------------------------------------
    def pack(self, call: BlockCall, tensor: torch.Tensor) -> Any:
        """What autograd keeps for ``tensor``, saved in ``call`` (begun)."""
        verdict = self.count(call, tensor)
        if verdict is Saved.MODEL:  # gathered and released by the runtime, never copied here
            return unlinked(tensor)
        if call.failure is not None:  # the call raises at its end, on every rank
            return self._left(tensor, call)
        if verdict is Saved.SMALL:
            return self._left(tensor, call)
        key = (storage_id(tensor.untyped_storage()), version(tensor))
        if verdict is Saved.COPY:  # the first save of this storage version in the call
            began = time.perf_counter()
            try:
                copy = call.copies[key] = self._copy_out(tensor, call.block)
            except DiskTierError as error:
                call.failure = error
                return self._left(tensor, call)
            finally:
                call.host_seconds[0] += time.perf_counter() - began
            call.made.append(copy)
        else:
            copy = call.copies[key]
        return _Saved(call, copy, tensor.storage_offset(), tensor.size(), tensor.stride())

    def _left(self, tensor: torch.Tensor, call: BlockCall) -> Any:
        """The handle of a tensor ``call`` leaves on the device: in the ledger's hold or counted by
        the meter (see ``__init__``)."""
        if self._account is not None:
            return self._account.keep(tensor, call)
        return self._meter.keep(tensor) if self._meter is not None else unlinked(tensor)

    def settle(self, call: BlockCall) -> None:
        """The call's forward is done: with accounting, the host waits for its copies to the host,
        and the call's hold gives back what they drained (also when the wait failed: the call is
        over either way)."""
        if self._account is None:
            return
        began = time.perf_counter()
        try:
            for copy in call.made:
                if copy.host is not None:  # a copy to disk was waited for piece by piece
                    self._transfers.before_host_read(copy.host)
        finally:
            call.host_seconds[0] += time.perf_counter() - began
            if call.hold is not None:
                call.hold.give(call.drained)
            call.drained = 0

    def finish(self, call: BlockCall) -> None:
        """The call's forward is done: with a host budget, its writes to disk are waited for and
        agreed over ranks (raising on every rank when one failed anywhere); the offload's host time."""
        if self._disk is None:
            return
        began = time.perf_counter()
        try:
            self._disk.settle([c.disk for c in call.made if c.disk is not None], call.block, call.failure)
        finally:
            call.host_seconds[0] += time.perf_counter() - began

    def _copy_out(self, tensor: torch.Tensor, block: str) -> _Copy:
        """The whole storage of ``tensor`` copied to host memory, or, beyond the host budget, to disk."""
        nbytes = tensor.untyped_storage().nbytes()
        numel = nbytes // tensor.element_size()
        with torch.no_grad():
            whole = tensor.detach().as_strided((numel,), (1,), 0)  # the whole storage, flat
            held = self._transfers.layer.host_held_bytes(nbytes)  # on a GPU, a pinned block
            if self._disk is not None and not self._disk.take_host(held):
                return _Copy(None, numel, tensor.dtype, disk=self._disk.write(whole.view(torch.uint8), block))
            host = self._transfers.staging(numel, tensor.dtype, _HOST)
            self._transfers.copy(host, whole, Direction.TO_HOST)
        copy = _Copy(host, numel, tensor.dtype)
        if self._disk is not None:
            copy.held = weakref.finalize(copy, self._disk.give_host, held)
        return copy

    def recycle(self) -> None:
        """Host buffers read by the last backward's fetches go back to the pool (and out of the
        host budget)."""
        for host, held in self._fetched:
            if host is not None:
                self._transfers.before_host_write(host)
                self._transfers.give_back(host)
            if held is not None:
                _, give, args, _ = held
                give(*args)
        self._fetched.clear()

    # --- backward -----------------------------------------------------------------------------
    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):  # stayed on the device: as it is, or in the ledger's handle
            return DeviceActivations.unpack(saved)
        call = saved.call
        if not call.began:
            self._begin_backward(call)
        self._layer.wait_event(call.ready)
        device = saved.copy.device
        assert device is not None, "a fetched call has device copies"
        self._layer.record_stream(device, self._layer.current_stream())
        return device.as_strided(saved.size, saved.stride, saved.offset)

    def _begin_backward(self, call: BlockCall) -> None:
        """``call``'s backward begins: it is fetched if it was not, and so are the ``max_prefetch``
        calls next in backward order (those before it in forward order whose backward has not
        begun), each once: a window that slides by one call per backward."""
        call.began = True
        live = [c for c in (ref() for ref in self._pending) if c is not None]
        position = next((i for i, c in enumerate(live) if c is call), len(live))
        ahead = live[max(0, position - self._max_prefetch) : position]
        for each in [call, *reversed(ahead)]:
            if not each.fetched:
                self._fetch(each)
        self._pending = [weakref.ref(c) for c in live if not c.began]

    def _fetch(self, call: BlockCall) -> None:
        began = time.perf_counter()
        self._fetch_now(call)
        call.host_seconds[0] += time.perf_counter() - began

    def _fetch_now(self, call: BlockCall) -> None:
        if call.hold is not None:
            what = call.block if call.stretch >= 0 else f"block {call.block}"  # a stretch outside the blocks, or not
            call.hold.take(call.fetch_bytes, f"{what} (its saved tensors fetched for its backward)")
        for copy in call.made:
            if copy.host is not None:
                self._transfers.before_host_read(copy.host)  # the copy into it is done
        with self._layer.on_stream(self._fetch_stream):
            for copy in call.made:
                copy.device = torch.empty(copy.numel, dtype=copy.dtype, device=self._device)
                if self._account is None and self._meter is not None:
                    self._meter.hold(copy, copy.device.untyped_storage().nbytes())
                if copy.host is not None:
                    self._transfers.copy(copy.device, copy.host, Direction.TO_DEVICE)
                else:
                    assert self._disk is not None and copy.disk is not None, "a copy is on the host or on disk"
                    self._disk.read(copy.disk, copy.device.view(torch.uint8), call.block)
                # Held here until the fetch read them, not with the copy: its call may go first.
                self._fetched.append((copy.host, copy.held.detach() if copy.held is not None else None))
                copy.host, copy.held = None, None
            call.ready = self._layer.record_event(self._fetch_stream)
        call.fetched = True
