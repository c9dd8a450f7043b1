"""``Piece``: the part of one parameter in this rank's shard of its chunk, and the rule that says
which optimizer state values are elementwise (shaped like the flat tensor they belong to)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..chunks.chunk import Chunk
from ..chunks.chunk_layout import ShardPiece
from ..chunks.tensor_state import TensorInfo

__all__ = ["Piece", "is_elementwise"]


@dataclass(frozen=True)
class Piece:
    """The part of one parameter in this rank's shard of its chunk."""

    tensor: torch.Tensor
    """View of the master shard: what the inner optimizer steps."""
    chunk: Chunk
    info: TensorInfo
    part: ShardPiece
    """Which elements of the flattened parameter it holds, and where they sit in the shard."""

    @property
    def shard_slice(self) -> slice:
        """Where the piece sits in this rank's shard of the chunk."""
        return self.part.shard

    @property
    def param_slice(self) -> slice:
        """The elements of the flattened parameter it holds."""
        return self.part.param


def is_elementwise(value: Any, flat: torch.Tensor | int) -> bool:
    """Whether an optimizer state value of the flat tensor ``flat`` (a run or a piece; or its
    number of elements) is elementwise: a 1-D tensor with one value per element. The rest, such as
    a step count, is per parameter and shared by the pieces of a run."""
    numel = flat if isinstance(flat, int) else flat.numel()
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel
