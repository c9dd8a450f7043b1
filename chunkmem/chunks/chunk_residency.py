"""``ChunkResidency``: a chunk's full buffer on the device, and the verbs that fill and drop it.

It holds tensors, not their state: whether the full buffer is released, being gathered (an
asynchronous gather in flight) or gathered is the device residency's to know
(``placement.DeviceResidency``, whose ``Held`` is the one record, changed through verbs that check
their precondition and name the chunk and the rank); its executor calls the verbs here in the order
it yields them: ``gather`` (or an asynchronous gather, then ``wait``), ``refresh`` after the master
changed, ``release``. The chunk's own lifecycle is its layout's: parameters are appended, then it
is closed once (``ChunkLayout.close``), after which it has its shard.

The gathered buffer is one tensor object for the chunk's whole life; releasing it only resizes its
storage to zero. Parameter views into it, including those autograd saved for backward, therefore
stay valid objects and see the data again as soon as the chunk is gathered once more. At world
size 1 a compute-dtype shard that stays on the device serves as the gathered chunk itself.
"""

from __future__ import annotations

import os

import torch

from chunkmem.hooks import unhooked

from ..ranks.comm import Communicator, PendingGather
from ..usage.accounting import Location, MemoryKind, MemoryLedger
from ..usage.stats import Stats
from .chunk_layout import ChunkLayout
from .shard import ShardStore

__all__ = ["ChunkResidency"]

_DEBUG = os.environ.get("CHUNKMEM_DEBUG", "") not in ("", "0")


def _poison(dtype: torch.dtype) -> float:
    """What a parameter reads while its chunk is not gathered: NaN, or for a quantized chunk's
    integer bytes their largest value."""
    return float("nan") if dtype.is_floating_point else float(torch.iinfo(dtype).max)


class ChunkResidency:
    """The full buffer of one chunk and where its parameters point; see the module docstring."""

    def __init__(
        self,
        layout: ChunkLayout,
        comm: Communicator,
        ledger: MemoryLedger,
        stats: Stats,
    ) -> None:
        self._layout = layout
        self._comm = comm
        self._ledger = ledger
        self._stats = stats
        self._store: ShardStore | None = None
        # Shape (capacity,) for the chunk's life; only its storage is allocated and freed.
        self._buffer = torch.empty(layout.capacity, dtype=layout.compute_dtype, device=comm.device)
        self._buffer.untyped_storage().resize_(0)
        self._full = self._buffer
        self._views: list[torch.Tensor] = []
        self._view_source: torch.Tensor | None = None
        self._placeholders: list[torch.Tensor] = []
        self._pending: PendingGather | None = None

    @property
    def _shard(self) -> ShardStore:
        if self._store is None:
            raise RuntimeError(f"{self._layout.where}: has no shard yet; close() it first")
        return self._store

    def close(self, store: ShardStore) -> None:
        """The shard exists: parameters point at placeholders until the first gather."""
        self._store = store
        poison = torch.full(
            (), _poison(self._layout.compute_dtype), dtype=self._layout.compute_dtype, device=self._comm.device
        )
        self._placeholders = [poison.expand(info.shape) for info in self._layout.tensors]
        for info in self._layout.tensors:
            # (A plan's chunks are on the meta device too: there the parameter stays as it is.)
            if info.param.is_meta and self._buffer.device.type != "meta":
                # ``.data`` cannot move a tensor off the meta device; swapping keeps the parameter
                # object itself, which the model and the user's optimizer hold.
                empty = torch.empty((), dtype=info.param.dtype).expand(info.shape)
                real = torch.nn.Parameter(empty, requires_grad=info.param.requires_grad)  # (integer: never)
                real.__dict__.update(info.param.__dict__)  # the swap exchanges them: its attributes stay its own
                torch.utils.swap_tensors(info.param, real)
        self._set_param_data(self._placeholders)

    @property
    def gather_bytes(self) -> int:
        """Device bytes a gather would allocate now (0 when a resident shard serves as the chunk)."""
        if self._comm.world_size == 1 and self._shard.keeps_compute_on_device:
            return 0
        return self._layout.gathered_bytes

    def gather(self, async_op: bool) -> PendingGather | None:
        """Bring the full chunk onto the device. With ``async_op`` the copy and the all-gather run
        on the side stream / asynchronously and the returned handle must be waited on (``wait``)
        before any op reads the parameters."""
        full = self._gathered_source()
        self._full = full
        if full is self._buffer:
            self._ledger.alloc(Location.DEVICE, MemoryKind.GATHERED, self._layout.gathered_bytes)
            self._buffer.untyped_storage().resize_(self._layout.gathered_bytes)
        with self._comm.maybe_side_stream(async_op):
            work = self._fill(full, async_op)
            event = self._comm.record_side_event() if async_op else None
        if async_op:
            self._pending = PendingGather(work, event, self._comm)
            return self._pending
        self._point_params_at(full)
        return None

    def _gathered_source(self) -> torch.Tensor:
        """The tensor serving as the gathered chunk: a resident compute-dtype shard at world size 1
        (nothing to allocate or copy), else the chunk's own buffer."""
        if self._comm.world_size == 1:
            resident = self._shard.resident_compute()
            if resident is not None:
                return resident
        return self._buffer

    def _fill(self, full: torch.Tensor, async_op: bool) -> object | None:
        if self._comm.world_size == 1:
            self._shard.copy_into(full)
            return None
        begin, end = self._layout.shard_range
        slot = full[begin:end]
        self._shard.copy_into(slot)
        self._stats.allgather_bytes += self._layout.gathered_bytes
        return self._comm.all_gather(full, slot, async_op=async_op, what=f"gather of chunk {self._layout.chunk_id}")

    @property
    def pending(self) -> PendingGather:
        """The handle of the gather in flight."""
        if self._pending is None:
            raise RuntimeError(
                f"{self._layout.where}: has no gather in flight; only a chunk whose gather was started asynchronously "
                "has one to wait for (the device residency knows which: DeviceResidency.held is FETCHING)"
            )
        return self._pending

    def wait(self) -> None:
        """Finish an asynchronous gather."""
        pending = self.pending
        pending.wait()
        self._pending = None
        self._point_params_at(self._full)

    def refresh(self) -> None:
        """Re-gather in place after the master changed (a chunk kept gathered across a step)."""
        self._fill(self._full, async_op=False)  # the parameters are views of it already

    def release(self) -> None:
        """Drop the full buffer; keep only the local shard."""
        self._set_param_data(self._placeholders)
        if self._full is self._buffer:
            if _DEBUG:
                self._buffer.fill_(_poison(self._layout.compute_dtype))
            self._buffer.untyped_storage().resize_(0)
            self._ledger.free(Location.DEVICE, MemoryKind.GATHERED, self._layout.gathered_bytes)

    def _point_params_at(self, full: torch.Tensor) -> None:
        if self._view_source is not full:
            self._views = [full[t.offset : t.offset + t.numel].view(t.shape) for t in self._layout.tensors]
            self._view_source = full
        self._set_param_data(self._views)

    def _set_param_data(self, tensors: list[torch.Tensor]) -> None:
        with unhooked():
            for info, tensor in zip(self._layout.tensors, tensors, strict=True):
                info.param.data = tensor
