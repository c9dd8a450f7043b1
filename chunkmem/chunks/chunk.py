"""``Chunk``: one flat buffer of ``capacity`` elements holding several parameters as views, sharded
over the process group.

A chunk is three concerns, each its own class, held here as public parts that their callers drive
directly (the executor drives ``residency`` and ``grads``, the optimizer reads ``layout`` and
``store``); the chunk forwards nothing:

* :class:`~chunkmem.chunks.chunk_layout.ChunkLayout`: which parameters, where, and this rank's piece;
* :class:`~chunkmem.chunks.chunk_residency.ChunkResidency`: the full buffer on the device and
  where the parameters point (whether it is gathered is the device residency's to know,
  ``placement.DeviceResidency``);
* :class:`~chunkmem.chunks.chunk_grads.ChunkGrads`: the flat gradient buffer and its reduction
  (what it is doing is the device residency's to know, ``placement.GradientBuffers``: the chunk
  holds the tensors, and is told what a verb needs, such as whether its shard holds reduced
  gradients);

plus the per-parameter states (``TensorState``) that say when a chunk may be released (no op uses
it): the verbs here are the ones that change those states, alone or with the gradients'. When its
gradients are complete is the placement's rule (``placement.DeviceResidency``), read from the ops
of the trace, not from its parameters. Its shard data lives in a :class:`ShardStore`. Every verb
checks its precondition and names the chunk, the rank and the state when it is violated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..ranks.comm import Communicator
from ..ranks.local_failures import LocalFailures
from ..tiers.transfers import HostTransfers
from ..usage.accounting import MemoryLedger
from ..usage.stats import Stats
from .chunk_grads import ChunkGrads
from .chunk_layout import ChunkLayout
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
        self.chunk_id = chunk_id
        self.layout = ChunkLayout(chunk_id, capacity, comm.world_size, comm.rank, compute_dtype, trainable, quantized)
        self._comm = comm
        self._failures = failures  # where a read of its shard from disk that failed waits (None: raised)
        self._ledger = ledger
        self._transfers = transfers if transfers is not None else HostTransfers(stats, comm.layer)
        self.residency = ChunkResidency(self.layout, comm, ledger, stats)
        """The full buffer on the device: gathered, waited for, refreshed and released through it."""
        self.grads = ChunkGrads(self.layout, comm, ledger, stats, self._transfers)
        """The flat gradient buffer and its reduction into the gradient shard."""
        self._store: ShardStore | None = None

    def __repr__(self) -> str:
        return f"Chunk({self.chunk_id}, rank {self._comm.rank})"

    @property
    def store(self) -> ShardStore:
        """This rank's shard data (the master, the gradient shard, their places)."""
        if self._store is None:
            raise RuntimeError(f"{self.layout.where}: has no shard yet; close() it first")
        return self._store

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
        layout = self.layout
        layout.require_open("close")
        store = ShardStore(
            layout.where,
            layout.shard_numel,
            layout.compute_dtype,
            self._comm.device,
            self._ledger,
            self._transfers,
            placement,
            layout.shard_kind,
            host_device=self._comm.host_device,
            disk=disk,
            in_place=in_place,
            failures=self._failures,
        )
        if in_place is None:
            master_tensor = store.master
            master_tensor.zero_()
            with torch.no_grad():
                for info in layout.tensors:
                    piece = layout.piece(info)
                    if piece is not None:
                        master_tensor[piece.shard].copy_(source.read(info, piece))
        store.mark_updated()
        if store.master_on_disk:
            store.move_master_to_disk()
        self._store = store
        layout.close()
        self.grads.close(store)
        self.residency.close(store)

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
            raise RuntimeError(
                f"parameter '{info.name}' ({self.layout.where}): leaving compute without having entered it"
            )
        info.compute_depth -= 1
        if info.compute_depth == 0:
            self._set_state(info, target)

    def reset_states(self) -> None:
        """Back to HOLD after an iteration (optimizer step or zero_grad)."""
        for info in self.layout.tensors:
            if info.state is TensorState.COMPUTE:
                raise RuntimeError(f"parameter '{info.name}' ({self.layout.where}): still in use by an op at reset")
            if info.state is not TensorState.HOLD:
                self._set_state(info, TensorState.HOLD)

    def accumulate_grad(self, info: TensorInfo, grad: torch.Tensor) -> None:
        """Add one parameter's gradient into its slice of the flat buffer and mark it ready."""
        self.grads.accumulate(info, grad)
        self._set_state(info, TensorState.READY_FOR_REDUCE)

    def start_reduce(self, onto_reduced: bool = False) -> None:
        """Start reducing the buffer over ranks (asynchronously), added to the reduced gradients in
        the shard where ``onto_reduced``; parameters go back to HOLD."""
        self.grads.start_reduce(onto_reduced)
        for info in self.layout.tensors:
            if info.state is not TensorState.COMPUTE and info.state is not TensorState.HOLD:
                self._set_state(info, TensorState.HOLD)

    def reduce_grad(self, onto_reduced: bool = False) -> None:
        """Reduce the buffer over ranks (mean) into the fp32 gradient shard where the master lives
        (added to what an earlier reduction left there where ``onto_reduced``), then free the buffer."""
        self.start_reduce(onto_reduced)
        self.grads.finish_reduce()
