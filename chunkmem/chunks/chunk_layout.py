"""``ChunkLayout``: which parameters a chunk holds, where, and which part of it is this rank's.

The chunk is ``capacity`` elements, split into ``world_size`` equal shards; rank ``r`` owns elements
``[r * shard_numel, (r + 1) * shard_numel)``. A parameter occupies ``[offset, offset + numel)`` and
may straddle shards. :meth:`ChunkLayout.piece` is the one place that cuts a parameter to this rank's
shard: closing a chunk, loading weights and building optimizer pieces all use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .master_buffer import MASTER_DTYPE
from .shard_kind import ShardKind
from .tensor_state import TensorInfo

__all__ = ["ChunkLayout", "ShardPiece"]


@dataclass(frozen=True, slots=True)
class ShardPiece:
    """The part of one parameter that lies in this rank's shard."""

    param: slice
    """Its elements in the flattened parameter."""
    shard: slice
    """The same elements' place in this rank's shard."""

    @property
    def numel(self) -> int:
        return self.param.stop - self.param.start


class ChunkLayout:
    """The parameters of one chunk, in order, and this rank's shard of it."""

    def __init__(
        self,
        chunk_id: int,
        capacity: int,
        world_size: int,
        rank: int,
        compute_dtype: torch.dtype,
        trainable: bool,
        quantized: bool = False,
    ) -> None:
        if capacity <= 0 or capacity % world_size:
            raise ValueError(
                f"chunk {chunk_id}: capacity {capacity} must be a positive multiple of the world size {world_size}"
            )
        self.chunk_id = chunk_id
        self.capacity = capacity
        self.world_size = world_size
        self.rank = rank
        self.compute_dtype = compute_dtype
        self.trainable = trainable
        self.quantized = quantized
        """It holds a quantized base's stored tensors, gathered in their own dtype: ``compute_dtype``."""
        self._tensors: list[TensorInfo] = []
        self._used = 0
        self._closed = False  # parameters are appended until the chunk is closed, once
        self._param_dtypes: set[torch.dtype] = set()  # the parameters' own dtypes (one, from group_key)

    @property
    def tensors(self) -> tuple[TensorInfo, ...]:
        return tuple(self._tensors)

    @property
    def used(self) -> int:
        """Elements holding parameters (the rest is padding)."""
        return self._used

    @property
    def shard_numel(self) -> int:
        return self.capacity // self.world_size

    @property
    def shard_range(self) -> tuple[int, int]:
        """This rank's ``[begin, end)`` in chunk elements."""
        begin = self.rank * self.shard_numel
        return begin, begin + self.shard_numel

    @property
    def gathered_bytes(self) -> int:
        """Bytes of the full chunk in the dtype gathers read (``compute_dtype``)."""
        return self.capacity * self.compute_dtype.itemsize

    @property
    def grad_bytes(self) -> int:
        """Bytes of the full flat fp32 gradient buffer (0 for a frozen chunk)."""
        return self.capacity * MASTER_DTYPE.itemsize if self.trainable else 0

    @property
    def where(self) -> str:
        """The chunk and the rank, as every error about this chunk names them."""
        return f"chunk {self.chunk_id} (rank {self.rank})"

    @property
    def closed(self) -> bool:
        """The parameters are final (the chunk has its shard)."""
        return self._closed

    def require_open(self, verb: str) -> None:
        """Raise unless parameters may still be added."""
        if self._closed:
            raise RuntimeError(
                f"{self.where}: cannot {verb}; the chunk is closed. "
                "Parameters are added before the chunk is closed, once"
            )

    def close(self) -> None:
        """The parameters are final."""
        self.require_open("close")
        self._closed = True

    @property
    def shard_kind(self) -> ShardKind:
        """What the shard stores (see ``ShardKind``), from the parameters appended so far."""
        # Mixed dtypes (chunks built by hand) keep a master: one dtype other than compute's suffices.
        dtype = next(iter(self._param_dtypes)) if len(self._param_dtypes) == 1 else MASTER_DTYPE
        return ShardKind.of(
            self.trainable, dtype if self._param_dtypes else self.compute_dtype, self.compute_dtype, self.quantized
        )

    def fits(self, numel: int) -> bool:
        """Whether a parameter of ``numel`` elements still fits."""
        return self._used + numel <= self.capacity

    def append(self, info: TensorInfo) -> None:
        """Add a parameter after the ones already in the chunk."""
        where = self.where
        self.require_open(f"append parameter '{info.name}'")
        if not self.fits(info.numel):
            raise ValueError(
                f"{where}: parameter '{info.name}' ({info.numel} elements) does not fit in the "
                f"{self.capacity - self._used} elements left"
            )
        if info.offset != self._used or info.chunk_id != self.chunk_id or info.index != len(self._tensors):
            raise ValueError(f"{where}: parameter '{info.name}' has a layout for another position")
        if self.quantized and info.param.dtype != self.compute_dtype:
            raise ValueError(
                f"{where}: a quantized chunk of {self.compute_dtype} holds tensors of that dtype, not parameter "
                f"'{info.name}' ({info.param.dtype})"
            )
        self._param_dtypes.add(info.param.dtype)
        self._tensors.append(info)
        self._used += info.numel

    def piece(self, info: TensorInfo) -> ShardPiece | None:
        """The part of ``info`` in this rank's shard, or ``None`` when none of it is here."""
        begin, end = self.shard_range
        lo, hi = max(begin, info.offset), min(end, info.offset + info.numel)
        if lo >= hi:
            return None
        return ShardPiece(param=slice(lo - info.offset, hi - info.offset), shard=slice(lo - begin, hi - begin))
