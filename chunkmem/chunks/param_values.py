"""Where the values of parameters come from when their chunks are closed.

Closing a chunk copies this rank's piece of each of its parameters into the fp32 master shard.
:class:`ParamValues` is what it copies from: the parameters' own data (:class:`LiveValues`, a model
built on a real device), or a source that computes or reads pieces on demand for a model built on
the meta device (``chunkmem.materialize``: the model's own initialisation replayed, or a
checkpoint read slice by slice). Asking for pieces one parameter at a time is what keeps a rank
from ever holding the whole model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from ..errors import UnmanageableParameter
from .chunk_layout import ShardPiece
from .tensor_state import TensorInfo

__all__ = ["LiveValues", "ParamValues"]


class ParamValues(Protocol):
    """Values for parameters, one piece at a time."""

    def check(self, param: torch.nn.Parameter, where: str) -> None:
        """Raise ``UnmanageableParameter`` (naming ``where``) if this source cannot give ``param``
        values; called when the parameter is registered, before any chunk is built."""
        ...

    def read(self, info: TensorInfo, piece: ShardPiece) -> torch.Tensor:
        """The elements ``piece.param`` of the flattened parameter, in the parameter's dtype, as a
        1-D tensor on any device."""
        ...

    def location(self, info: TensorInfo, piece: ShardPiece) -> tuple[Path, int] | None:
        """The file and byte offset where ``piece``'s elements lie as they are, in the parameter's
        dtype, one after the other (a frozen chunk may read them in place); ``None``: nowhere."""
        ...

    def prepare_buffers(self, model: torch.nn.Module) -> None:
        """Give values to the model's buffers that have none (on the meta device) before they are
        placed; raise, naming the buffer, where that is impossible."""
        ...

    def release(self) -> None:
        """Every chunk is closed: drop whatever the source holds (recordings, scratch memory)."""
        ...


class LiveValues:
    """The parameters' own data: a model built on a real device."""

    def check(self, param: torch.nn.Parameter, where: str) -> None:
        if param.device.type == "meta":
            raise UnmanageableParameter(
                f"{where} is on the meta device; materialize the model (to_empty() and initialize it) first, or "
                "boost it with Booster.boost, which initialises a model built on the meta device"
            )

    def read(self, info: TensorInfo, piece: ShardPiece) -> torch.Tensor:
        return info.param.data.reshape(-1)[piece.param]

    def location(self, info: TensorInfo, piece: ShardPiece) -> tuple[Path, int] | None:
        return None  # in memory: closing the chunk copies them

    def prepare_buffers(self, model: torch.nn.Module) -> None:
        return None

    def release(self) -> None:
        return None
