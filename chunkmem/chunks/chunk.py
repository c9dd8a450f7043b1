"""``Chunk``: one flat buffer of ``capacity`` elements holding several parameters as views, sharded
over the process group.

A chunk is three concerns, each its own class, tied together here:

* :class:`~chunkmem.chunks.chunk_layout.ChunkLayout`: which parameters, where, and this rank's piece;
* :class:`~chunkmem.chunks.chunk_residency.ChunkResidency`: the full buffer on the device and
  where the parameters point (whether it is gathered is the device residency's to know,
  ``placement.DeviceResidency``);
* :class:`~chunkmem.chunks.chunk_grads.ChunkGrads`: the flat gradient buffer and its reduction
  (what it is doing is the device residency's to know, ``placement.GradientBuffers``: the chunk
  holds the tensors, and is told what a verb needs, such as whether its shard holds reduced
  gradients);

plus the per-parameter states (``TensorState``) that say when a chunk may be released (no op uses
it). When its gradients are complete is the placement's rule (``placement.DeviceResidency``), read
from the ops of the trace, not from its parameters. Its shard data lives in a :class:`ShardStore`. Every verb
checks its precondition and names the chunk, the rank and the state when it is violated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..ranks.comm import Communicator, PendingGather
from ..ranks.local_failures import LocalFailures
from ..tiers.transfers import HostTransfers
from ..usage.accounting import MemoryLedger
from ..usage.stats import Stats
from .chunk_grads import ChunkGrads
from .chunk_layout import ChunkLayout, ShardPiece
from .chunk_residency import ChunkResidency
from .param_values import LiveValues, ParamValues
from .shard import ShardStore
from .tensor_state import TensorInfo, TensorState

if TYPE_CHECKING:
    from ..placement import ChunkPlacement
    from ..tiers.disk import SidesFile
    from .values_in_place import InPlaceShard

__all__ = ["Chunk"]


class Chunk:
    """One chunk; see the module docstring."""

    def __init__(
        self,
        chunk_id: int,
        capacity: int,
        compute_dtype: torch.dtype,
        trainable: bool,
        comm: Communicator,
        ledger: MemoryLedger,
        stats: Stats,
        transfers: HostTransfers | None = None,
        failures: LocalFailures | None = None,
        quantized: bool = False,
    ) -> None:
        self.layout = ChunkLayout(chunk_id, capacity, comm.world_size, comm.rank, compute_dtype, trainable, quantized)
        self._comm = comm
        self._failures = failures  # where a read of its shard from disk that failed waits (None: raised)
        self._ledger = ledger
        self._stats = stats
        self._transfers = transfers if transfers is not None else HostTransfers(stats, comm.layer)
        self._residency = ChunkResidency(self.layout, comm, ledger, stats, self._where)
        self._grads = ChunkGrads(self.layout, comm, ledger, stats, self._where, self._transfers)
        self._store: ShardStore | None = None

    # --- identity and layout ----------------------------------------------------------------
    @property
    def chunk_id(self) -> int:
        return self.layout.chunk_id

    @property
    def capacity(self) -> int:
        return self.layout.capacity

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype gathers read: the model's compute dtype, or a quantized chunk's own."""
        return self.layout.compute_dtype

    @property
    def quantized(self) -> bool:
        """It holds a quantized base's stored tensors (``ShardKind.QUANTIZED``)."""
        return self.layout.quantized

    @property
    def trainable(self) -> bool:
        return self.layout.trainable

    def __repr__(self) -> str:
        return f"Chunk({self.chunk_id}, rank {self._comm.rank})"

    def _where(self) -> str:
        return f"chunk {self.chunk_id} (rank {self._comm.rank})"

    @property
    def closed(self) -> bool:
        """The parameters are final and the chunk has its shard (``close``)."""
        return self.layout.closed

    @property
    def tensors(self) -> tuple[TensorInfo, ...]:
        return self.layout.tensors

    @property
    def used(self) -> int:
        """Elements holding parameters (the rest is padding)."""
        return self.layout.used

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    @property
    def shard_range(self) -> tuple[int, int]:
        """This rank's ``[begin, end)`` in chunk elements."""
        return self.layout.shard_range

    def piece(self, info: TensorInfo) -> ShardPiece | None:
        """The part of a parameter in this rank's shard (see ``ChunkLayout.piece``)."""
        return self.layout.piece(info)

    @property
    def gathered_bytes(self) -> int:
        return self.layout.gathered_bytes

    @property
    def grad_bytes(self) -> int:
        return self.layout.grad_bytes

    @property
    def store(self) -> ShardStore:
        if self._store is None:
            raise RuntimeError(f"{self._where()}: has no shard yet; close() it first")
        return self._store

    def fits(self, numel: int) -> bool:
        """Whether a parameter of ``numel`` elements still fits."""
        return self.layout.fits(numel)

    def append(self, info: TensorInfo) -> None:
        """Add a parameter after the ones already in the chunk."""
        self.layout.append(info, self._where())

    def close(
        self,
        placement: ChunkPlacement,
        values: ParamValues | None = None,
        disk: SidesFile | None = None,
        in_place: InPlaceShard | None = None,
    ) -> None:
        """Copy this rank's slice of every parameter into a master shard placed as ``placement``
        says (``disk``: the disk tier's file, for a placement on disk) and point the parameters at
        placeholders: their original storage can be freed. The slices are
        read from ``values`` (default: the parameters' own data, on any device), one parameter at
        a time; parameters with no element in this rank's shard are not read at all. A shard read
        ``in_place`` from the weights files copies nothing."""
        source = values if values is not None else LiveValues()
        self.layout.require_open("close", self._where())
        store = ShardStore(
            f"chunk {self.chunk_id} (rank {self._comm.rank})",
            self.shard_numel,
            self.compute_dtype,
            self._comm.device,
            self._ledger,
            self._transfers,
            placement,
            self.layout.shard_kind,
            host_device=self._comm.host_device,
            disk=disk,
            in_place=in_place,
            failures=self._failures,
        )
        if in_place is None:
            master_tensor = store.master
            master_tensor.zero_()
            with torch.no_grad():
                for info in self.layout.tensors:
                    piece = self.layout.piece(info)
                    if piece is not None:
                        master_tensor[piece.shard].copy_(source.read(info, piece))
        store.mark_updated()
        if store.master_on_disk:
            store.move_master_to_disk()
        self._store = store
        self.layout.close(self._where())
        self._grads.close(store)
        self._residency.close(store)

    # --- residency --------------------------------------------------------------------------
    @property
    def gather_bytes(self) -> int:
        """Device bytes a gather would allocate now (0 when a resident shard serves as the chunk)."""
        return self._residency.gather_bytes

    def gather(self, async_op: bool) -> PendingGather | None:
        """Bring the full chunk onto the device; with ``async_op`` the returned handle must be
        waited on (``wait``) before any op reads the parameters."""
        return self._residency.gather(async_op)

    @property
    def pending(self) -> PendingGather:
        return self._residency.pending

    def wait(self) -> None:
        """Finish an asynchronous gather."""
        self._residency.wait()

    def refresh(self) -> None:
        """Re-gather in place after the master changed (a chunk kept gathered across a step)."""
        self._residency.refresh()

    def release(self) -> None:
        """Drop the full buffer; keep only the local shard. Whether an op still uses it is the
        device residency's to know (``placement.DeviceResidency`` counts the ops holding each chunk
        and refuses to release one they hold), not a second count here."""
        self._residency.release()

    # --- tensor states ----------------------------------------------------------------------
    def _set_state(self, info: TensorInfo, target: TensorState) -> None:
        info.transition(target, self._comm.rank)

    def enter_compute(self, info: TensorInfo) -> None:
        """An op starts using the parameter (ops may overlap in backward; they are counted)."""
        if info.compute_depth == 0:
            self._set_state(info, TensorState.COMPUTE)
        info.compute_depth += 1

    def leave_compute(self, info: TensorInfo, target: TensorState) -> None:
        """An op stopped using the parameter; the last one moves it to ``target``."""
        if info.compute_depth == 0:
            raise RuntimeError(f"parameter '{info.name}' ({self._where()}): leaving compute without having entered it")
        info.compute_depth -= 1
        if info.compute_depth == 0:
            self._set_state(info, target)

    def reset_states(self) -> None:
        """Back to HOLD after an iteration (optimizer step or zero_grad)."""
        for info in self.layout.tensors:
            if info.state is TensorState.COMPUTE:
                raise RuntimeError(f"parameter '{info.name}' ({self._where()}): still in use by an op at reset")
            if info.state is not TensorState.HOLD:
                self._set_state(info, TensorState.HOLD)

    # --- gradients --------------------------------------------------------------------------
    @property
    def grad_buffer_bytes(self) -> int:
        """Device bytes a gradient buffer allocates (0 when it is the gradient shard itself)."""
        return self._grads.buffer_bytes

    def prepare_grad(self, from_host: bool = False, onto_reduced: bool = False) -> None:
        """Make the flat fp32 gradient buffer ready to receive gradients; ``from_host``: it starts
        from the gradients an earlier buffer moved to the host; ``onto_reduced``: the gradient
        shard holds reduced gradients (the residency knows both)."""
        self._grads.prepare(from_host, onto_reduced)

    def accumulate_grad(self, info: TensorInfo, grad: torch.Tensor) -> None:
        """Add one parameter's gradient into its slice of the flat buffer and mark it ready."""
        self._grads.accumulate(info, grad)
        self._set_state(info, TensorState.READY_FOR_REDUCE)

    def spill_grad(self) -> None:
        """Move the gradient buffer's sum to the host and free it (where it may not be reduced
        yet); the chunk's next buffer starts from it."""
        self._grads.spill()

    def start_reduce(self, onto_reduced: bool = False) -> None:
        """Start reducing the buffer over ranks (asynchronously), added to the reduced gradients in
        the shard where ``onto_reduced``; parameters go back to HOLD."""
        self._grads.start_reduce(onto_reduced)
        for info in self.layout.tensors:
            if info.state is not TensorState.COMPUTE and info.state is not TensorState.HOLD:
                self._set_state(info, TensorState.HOLD)

    def finish_reduce(self) -> None:
        """Wait for the reduction and move the result into the fp32 gradient shard."""
        self._grads.finish_reduce()

    def reduce_grad(self, onto_reduced: bool = False) -> None:
        """Reduce the buffer over ranks (mean) into the fp32 gradient shard where the master lives
        (added to what an earlier reduction left there where ``onto_reduced``), then free the buffer."""
        self.start_reduce(onto_reduced)
        self.finish_reduce()

    @property
    def grad_shard(self) -> torch.Tensor:
        return self._grads.shard

    @property
    def params_with_grad(self) -> tuple[bool, ...]:
        """Per parameter: received a gradient since the last zero_grad (on this rank)."""
        return self._grads.params_with_grad

    def set_params_with_grad(self, flags: tuple[bool, ...]) -> None:
        """Adopt the flags agreed over ranks (a parameter with a gradient on any rank has one)."""
        self._grads.set_params_with_grad(flags)

    def zero_grad(self) -> None:
        """Forget gradients: the buffer is dropped and the shard's content no longer counts."""
        self._grads.zero()
