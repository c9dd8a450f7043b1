"""``ChunkResidency``: whether a chunk's full buffer is on the device, and the verbs that change it.

States (``ChunkState``) and the verbs between them, in one transition table:

* ``OPEN`` --close--> ``RELEASED``: the chunk has its shard; parameters point at placeholders.
* ``RELEASED`` --gather--> ``GATHERED`` (or --start an asynchronous gather--> ``GATHERING``
  --wait for its gather--> ``GATHERED``): the full buffer holds every rank's shard and the
  parameters are views into it.
* ``GATHERED`` --release--> ``RELEASED``; ``GATHERED`` --refresh--> ``GATHERED`` after the master
  changed.

The gathered buffer is one tensor object for the chunk's whole life; releasing it only resizes its
storage to zero. Parameter views into it, including those autograd saved for backward, therefore
stay valid objects and see the data again as soon as the chunk is gathered once more. At world
size 1 a compute-dtype shard that stays on the device serves as the gathered chunk itself.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable

import torch

from hooks import unhooked

from ..ranks.comm import Communicator, PendingGather
from ..usage.accounting import Location, MemoryKind, MemoryLedger
from ..usage.stats import Stats
from .chunk_layout import ChunkLayout
from .shard import ShardStore
from .state_machine import StateMachine, Transition

__all__ = ["ChunkResidency", "ChunkState"]

_DEBUG = os.environ.get("CHUNKMEM_DEBUG", "") not in ("", "0")


class ChunkState(enum.Enum):
    """Residency of a chunk's full buffer; the local shard always exists once closed."""

    OPEN = "open"
    """Accepting parameters; no data yet."""
    RELEASED = "released"
    """Only the local shard exists; parameters point at placeholders."""
    GATHERING = "gathering"
    """An asynchronous gather into the full buffer is in flight."""
    GATHERED = "gathered"
    """The full buffer holds every rank's shard; parameters are views into it."""


_S = ChunkState
_ALREADY = "It is already gathered or being gathered: use it as it is, or release it first."
_TABLE: dict[str, Transition[ChunkState]] = {
    "append": Transition({_S.OPEN: _S.OPEN}, "Parameters are added before the chunk is closed."),
    "close": Transition({_S.OPEN: _S.RELEASED}, "A chunk is closed once, after its parameters are added."),
    "gather": Transition({_S.RELEASED: _S.GATHERED}, _ALREADY),
    "start an asynchronous gather": Transition({_S.RELEASED: _S.GATHERING}, _ALREADY),
    "report its pending gather": Transition(
        {_S.GATHERING: _S.GATHERING}, "Only a chunk whose gather was started asynchronously has one."
    ),
    "wait for its gather": Transition(
        {_S.GATHERING: _S.GATHERED}, "Only a chunk whose gather was started asynchronously has one to wait for."
    ),
    "refresh": Transition({_S.GATHERED: _S.GATHERED}, "Only a gathered chunk is refreshed; others gather anew."),
    "release": Transition({_S.GATHERED: _S.RELEASED}, "Wait for a gather in flight before releasing."),
    "move its master shard": Transition({_S.RELEASED: _S.RELEASED}, "Release the chunk first."),
    "move its parameter shard": Transition({_S.RELEASED: _S.RELEASED}, "Release the chunk first."),
}


class ChunkResidency:
    """The full buffer of one chunk and where its parameters point; see the module docstring."""

    def __init__(
        self,
        layout: ChunkLayout,
        comm: Communicator,
        ledger: MemoryLedger,
        stats: Stats,
        owner: Callable[[], str],
    ) -> None:
        self._layout = layout
        self._comm = comm
        self._ledger = ledger
        self._stats = stats
        self._machine = StateMachine(ChunkState.OPEN, _TABLE, owner)
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
    def state(self) -> ChunkState:
        return self._machine.state

    def require(self, verb: str, subject: str = "") -> None:
        self._machine.require(verb, subject)

    @property
    def _shard(self) -> ShardStore:
        assert self._store is not None, "ChunkResidency: used before close()"
        return self._store

    def close(self, store: ShardStore) -> None:
        """The shard exists: parameters point at placeholders until the first gather."""
        self._machine.move("close")
        self._store = store
        nan = torch.full((), float("nan"), dtype=self._layout.compute_dtype, device=self._comm.device)
        self._placeholders = [nan.expand(info.shape) for info in self._layout.tensors]
        for info in self._layout.tensors:
            # (A plan's chunks are on the meta device too: there the parameter stays as it is.)
            if info.param.is_meta and self._buffer.device.type != "meta":
                # ``.data`` cannot move a tensor off the meta device; swapping keeps the parameter
                # object itself, which the model and the user's optimizer hold.
                real = torch.nn.Parameter(torch.empty((), dtype=info.param.dtype).expand(info.shape))
                real.requires_grad_(info.param.requires_grad)
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
        self._machine.require("start an asynchronous gather" if async_op else "gather")
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
            self._machine.move("start an asynchronous gather")
            return self._pending
        self._point_params_at(full)
        self._machine.move("gather")
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
        self._machine.require("report its pending gather")
        assert self._pending is not None, "ChunkResidency: gathering without a pending handle"
        return self._pending

    def wait(self) -> None:
        """Finish an asynchronous gather."""
        pending = self.pending
        pending.wait()
        self._pending = None
        self._point_params_at(self._full)
        self._machine.move("wait for its gather")

    def refresh(self) -> None:
        """Re-gather in place after the master changed (a chunk kept gathered across a step)."""
        self._machine.require("refresh")
        self._fill(self._full, async_op=False)  # the parameters are views of it already

    def release(self) -> None:
        """Drop the full buffer; keep only the local shard."""
        self._machine.require("release")
        self._set_param_data(self._placeholders)
        if self._full is self._buffer:
            if _DEBUG:
                self._buffer.fill_(float("nan"))
            self._buffer.untyped_storage().resize_(0)
            self._ledger.free(Location.DEVICE, MemoryKind.GATHERED, self._layout.gathered_bytes)
        self._machine.move("release")

    def forget_resident_views(self, verb: str) -> None:
        """Before the shard moves (``verb``): a resident shard that served as the gathered chunk
        (world size 1) may be dropped or moved, so hold no reference to it and its memory is
        really freed."""
        self._machine.require(verb)
        if self._full is not self._buffer:
            self._full = self._buffer
            self._view_source = None
            self._views = []

    def _point_params_at(self, full: torch.Tensor) -> None:
        if self._view_source is not full:
            self._views = [full[t.offset : t.offset + t.numel].view(t.shape) for t in self._layout.tensors]
            self._view_source = full
        self._set_param_data(self._views)

    def _set_param_data(self, tensors: list[torch.Tensor]) -> None:
        with unhooked():
            for info, tensor in zip(self._layout.tensors, tensors, strict=True):
                info.param.data = tensor
