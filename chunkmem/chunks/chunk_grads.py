"""``ChunkGrads``: a chunk's flat fp32 gradient buffer and its reduction into the gradient shard.

It holds tensors, not their state: whether the chunk has a buffer receiving gradients, a reduction
in flight, gradients on the host or reduced gradients in its shard is the gradient side of the
device residency's to know (``placement.GradientBuffers``, one owner, whose verbs check every
precondition and name the chunk), and its executor passes what a verb here needs to know (the
executor of ``chunkmem.execution``; a direct caller, as the tests are, passes it itself):

* ``prepare``: a buffer, ready to receive gradients (each parameter's first gradient is copied
  into its slice, nothing is zeroed); ``onto_reduced``: the shard already holds reduced
  gradients (accumulation across backward passes without ``no_sync``).
* ``start_reduce`` / ``finish_reduce``: the reduce-scatter over ranks is in flight
  (asynchronous), then this rank's slot, averaged over ranks, is in the fp32 gradient shard where
  the master lives (added to what an earlier reduction left there where ``onto_reduced``); the
  buffer is freed.
* ``zero`` drops everything.

Inside ``no_sync`` at world size > 1 a buffer cannot be reduced, and when the device needs its room
it is **moved to the host** instead (``spill``): the buffer is copied, in fp32, into a host buffer
of the whole chunk and freed; so is a buffer of such a chunk in the backward after ``no_sync``
until its gradients are complete, so that its sum is reduced once. The chunk's next device buffer
starts as a copy of the host one (``prepare(from_host=True)``; the host buffer is kept for the
next move), so the running sum of the chunk's gradients is in one buffer at a time and every
gradient autograd accumulates is added to it, in arrival order: the same additions, in the same
order, as plain PyTorch's ``.grad += new`` per parameter (bit-exact; adding a buffer that held
several micro-batches to a host sum would associate them differently).

At world size 1 with the master on the device the gradient shard is the whole chunk: gradients
accumulate straight into it and reducing moves nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ranks.comm import Communicator
from ..tiers.transfers import Direction, HostTransfers
from ..usage.accounting import Location, MemoryKind, MemoryLedger
from ..usage.stats import Stats
from .chunk_layout import ChunkLayout
from .shard import MASTER_DTYPE, ShardStore
from .tensor_state import TensorInfo

__all__ = ["ChunkGrads"]


class ChunkGrads:
    """The gradient tensors of one trainable chunk; see the module docstring."""

    def __init__(
        self,
        layout: ChunkLayout,
        comm: Communicator,
        ledger: MemoryLedger,
        stats: Stats,
        transfers: HostTransfers,
    ) -> None:
        self._layout = layout
        self._comm = comm
        self._ledger = ledger
        self._stats = stats
        self._transfers = transfers
        self._host: torch.Tensor | None = None  # the host buffer, from the first move until the reduction
        self._store: ShardStore | None = None
        self._buffer: torch.Tensor | None = None
        self._work: Any = None
        self._adds = False  # the reduction in flight adds to reduced gradients in the shard
        self._sent = False  # the reduced slot is already on its way to the gradient shard
        self._has_grad: list[bool] = []
        self._filled: list[bool] = []  # per parameter: its slice of the buffer holds data

    def close(self, store: ShardStore) -> None:
        """The chunk's parameters are final and its shard exists."""
        self._store = store
        n = len(self._layout.tensors)
        self._has_grad = [False] * n
        self._filled = [False] * n

    @property
    def _shard(self) -> ShardStore:
        assert self._store is not None, f"{self._layout.where}: gradients used before close()"
        return self._store

    def _require_trainable(self, verb: str) -> None:
        if not self._layout.trainable:
            raise RuntimeError(f"{self._layout.where}: cannot {verb}; its parameters do not require grad")

    def _require_buffer(self, verb: str) -> torch.Tensor:
        """The buffer a verb works on; the device residency allocates it first (``prepare``)."""
        buffer = self._buffer
        if buffer is None:
            raise RuntimeError(
                f"{self._layout.where}: cannot {verb} without a gradient buffer; the device residency allocates one "
                "first (placement.GradientBuffers.allocate, carried out as prepare_grad)"
            )
        return buffer

    @property
    def _what(self) -> str:
        return f"gradient reduction of chunk {self._layout.chunk_id}"

    @property
    def buffer_is_shard(self) -> bool:
        """World size 1 with the master on the device: gradients accumulate straight into the
        gradient shard and reducing is a no-op."""
        return self._comm.world_size == 1 and self._shard.master_location is Location.DEVICE

    @property
    def buffer_bytes(self) -> int:
        """Device bytes a gradient buffer allocates (0 when it is the gradient shard itself)."""
        return 0 if not self._layout.trainable or self.buffer_is_shard else self._layout.grad_bytes

    # --- verbs ----------------------------------------------------------------------------------
    def prepare(self, from_host: bool = False, onto_reduced: bool = False) -> None:
        """Make the flat buffer ready to receive gradients. Nothing is zeroed here: each
        parameter's first gradient is copied into its slice, and slices that got none are zeroed
        when the buffer is reduced. ``from_host``: the gradients moved to the host are copied back
        into it first: later gradients are added to their sum, as plain PyTorch adds them to
        ``.grad``. ``onto_reduced``: the shard holds reduced gradients (where the buffer is the
        shard, slices holding earlier gradients keep accumulating)."""
        self._require_trainable("allocate a gradient buffer")
        if self._buffer is not None:
            raise RuntimeError(
                f"{self._layout.where}: cannot allocate a gradient buffer, it has one; reduce it (start_reduce, "
                "finish_reduce) or drop it (zero_grad) first"
            )
        if self.buffer_is_shard:
            assert not from_host, (
                f"{self._layout.where}: a gradient shard that serves as the buffer never moves to the host"
            )
            self._buffer = self._shard.grad if onto_reduced else self._shard.allocate_grad()
            self._filled = [onto_reduced and has for has in self._has_grad]
        else:
            self._ledger.alloc(Location.DEVICE, MemoryKind.GRAD_BUFFER, self._layout.grad_bytes)
            self._buffer = torch.empty(self._layout.capacity, dtype=MASTER_DTYPE, device=self._comm.device)
            if from_host:
                self._load_host(self._buffer)
            self._filled = [from_host] * len(self._filled)

    def accumulate(self, info: TensorInfo, grad: torch.Tensor) -> None:
        """Add one parameter's gradient into its slice of the flat buffer."""
        self._require_trainable(f"accumulate '{info.name}'")
        buffer = self._require_buffer(f"accumulate '{info.name}'")
        # as_strided is the cheapest way to a shaped slot of the flat buffer (a slice and a view
        # cost three times as much); this runs for every gradient.
        target = buffer.as_strided(info.shape, info.strides, buffer.storage_offset() + info.offset)
        if self._filled[info.index]:
            target.add_(grad)
        else:
            target.copy_(grad)
            self._filled[info.index] = True
        self._has_grad[info.index] = True

    def _zero_unfilled(self, buffer: torch.Tensor) -> None:
        """Zero the slices of parameters that got no gradient in this buffer, and the padding."""
        for info, filled in zip(self._layout.tensors, self._filled, strict=True):
            if not filled:
                buffer[info.offset : info.offset + info.numel].zero_()
        buffer[self._layout.used :].zero_()

    def spill(self) -> None:
        """Where the buffer may not be reduced yet (inside ``no_sync``, or in the backward after it
        before the chunk's gradients are complete): copy it to the host buffer (allocated at the
        first move; it holds the chunk's whole sum, since the device buffer started from it) and
        free it."""
        self._require_trainable("move its gradients to the host")
        buffer = self._require_buffer("move its gradients to the host")
        assert not self.buffer_is_shard, f"{self._layout.where}: a gradient shard that serves as the buffer never moves"
        self._zero_unfilled(buffer)
        transfers = self._transfers
        host = self._host
        if host is None:
            host = transfers.staging(self._layout.capacity, MASTER_DTYPE, self._comm.host_device)
            self._ledger.alloc(Location.HOST, MemoryKind.GRAD_BUFFER, self._host_bytes)
            self._host = host
        # No wait for the copy that loaded the last device buffer from ``host``: it ran on the
        # compute stream, which the copy stream waits for before this copy writes (``copy``'s rule).
        transfers.copy(host, buffer, Direction.TO_HOST)
        self._ledger.free(Location.DEVICE, MemoryKind.GRAD_BUFFER, self._layout.grad_bytes)
        self._buffer = None

    def _load_host(self, buffer: torch.Tensor) -> None:
        """Copy the host buffer's gradients into a fresh device buffer, which continues their sum."""
        host = self._host
        assert host is not None, f"{self._layout.where}: host gradients without a host buffer"
        self._transfers.before_host_read(host)  # the copy of the last move may still be writing it
        self._transfers.copy(buffer, host, Direction.TO_DEVICE)

    @property
    def _host_bytes(self) -> int:
        """What the host buffer holds: the staging pool's (pinned) block."""
        return self._transfers.layer.host_held_bytes(self._layout.grad_bytes)

    def _drop_host(self) -> None:
        if self._host is not None:
            self._transfers.before_host_write(self._host)  # a copy out of it may still be reading it
            self._transfers.give_back(self._host)
            self._ledger.free(Location.HOST, MemoryKind.GRAD_BUFFER, self._host_bytes)
        self._host = None

    def start_reduce(self, onto_reduced: bool = False) -> None:
        """Start the reduction over ranks (asynchronous; ``finish_reduce`` completes it). The
        buffer holds every gradient since the last reduction (it started from the host's);
        ``onto_reduced``: the shard holds reduced gradients, to which this reduction adds."""
        self._require_trainable("reduce gradients")
        buffer = self._require_buffer("reduce gradients")
        self._zero_unfilled(buffer)
        self._adds = onto_reduced
        what = self._what
        if not self.buffer_is_shard and self._comm.world_size > 1:
            begin, end = self._layout.shard_range
            self._work = self._comm.reduce_scatter_sum(buffer[begin:end], buffer, async_op=True, what=what)
            self._stats.reduce_scatter_bytes += self._layout.grad_bytes
        if not self.buffer_is_shard and self._shard.receives_asynchronously:
            # To a host master on CUDA the slot leaves now, on the copy stream once the reduction
            # is done, while the backward goes on; finishing the reduction then only frees it.
            self._send(what)

    def _send(self, what: str) -> None:
        """This rank's averaged slot into the gradient shard, after the reduction in flight."""
        buffer = self._require_buffer("reduce gradients")
        begin, end = self._layout.shard_range
        work, self._work = self._work, None
        after = None if work is None else lambda: self._comm.wait(work, what)
        divide_by = self._comm.world_size if self._comm.world_size > 1 else None
        self._shard.receive_grad(buffer[begin:end], self._adds, after, divide_by)
        self._sent = True

    def finish_reduce(self) -> None:
        """Wait for the reduction ``start_reduce`` started, move this rank's averaged slot into the
        gradient shard (added to what an earlier reduction left there) and free the buffer."""
        self._require_buffer("finish reducing gradients")
        if not self.buffer_is_shard:
            if not self._sent:
                self._send(self._what)
            self._ledger.free(Location.DEVICE, MemoryKind.GRAD_BUFFER, self._layout.grad_bytes)
        self._buffer = None
        self._drop_host()  # its gradients are in what was reduced
        self._stats.grad_reductions += 1
        self._sent = False

    def zero(self) -> None:
        """Forget gradients: the buffer is dropped and the shard's content no longer counts (the
        device residency waits for a reduction in flight first: its buffer is in use)."""
        if not self._layout.trainable:
            return
        if self._buffer is not None and not self.buffer_is_shard:
            self._ledger.free(Location.DEVICE, MemoryKind.GRAD_BUFFER, self._layout.grad_bytes)
        self._buffer = None
        self._drop_host()
        self._shard.free_grad()
        self._has_grad = [False] * len(self._has_grad)

    @property
    def shard(self) -> torch.Tensor:
        """The reduced fp32 gradient shard (``ShardStore.grad`` waits for the copies into it). When
        it holds reduced gradients is the device residency's to know (``grads_reduced``); a slot
        already sent to a host shard (an asynchronous device) is read while the reduction finishes
        on the device (an early host step)."""
        return self._shard.grad

    @property
    def params_with_grad(self) -> tuple[bool, ...]:
        """Per parameter: received a gradient since the last zero_grad (on this rank)."""
        return tuple(self._has_grad)

    def set_params_with_grad(self, flags: tuple[bool, ...]) -> None:
        """Adopt the flags agreed over ranks (a parameter with a gradient on any rank has one)."""
        if len(flags) != len(self._has_grad):
            raise ValueError(f"{self._layout.where}: {len(flags)} flags for {len(self._has_grad)} parameters")
        self._has_grad = list(flags)
