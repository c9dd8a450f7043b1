"""``QuantizingValues``: the values of a weight quantized at boost, one piece of a shard at a time.

Closing a chunk asks for this rank's piece of each tensor in it. For a 4-bit weight quantized at
boost, a piece of its packed bytes or of its scales is a run of its blocks: the 16-bit values of
those blocks are read from the weight's own source (the checkpoint, the model's initialisation
replayed, or memory: the source the boost reads every other parameter from) and quantized by
bitsandbytes, a bounded run at a time (the scales alone, where only they are asked for). Blocks are
quantized independently, so the bytes are those bitsandbytes gives quantizing the whole weight,
while no rank holds more in 16 bits than its piece of one weight, nor reads more of the checkpoint
than its own shards' blocks (twice: the packed bytes and the scales are in different chunks).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..chunks.chunk_layout import ShardPiece
from ..chunks.param_values import ParamValues
from ..chunks.tensor_state import TensorInfo
from . import bnb4
from .base import QuantizedLinear

__all__ = ["QuantizingValues"]

_RUN = 1 << 24
"""Elements of a weight quantized at once: bitsandbytes' quantization allocates several fp32 and
int32 temporaries of its input's size (the 16-bit piece itself is read whole)."""


class QuantizingValues:
    """``ParamValues`` for a model whose 4-bit weights are quantized at boost (module docstring)."""

    def __init__(self, inner: ParamValues, layers: Sequence[QuantizedLinear]) -> None:
        self._inner = inner
        at_boost = [layer for layer in layers if layer.at_boost]
        self._at_boost = at_boost
        self._packed = {id(layer.weight): layer for layer in at_boost}
        self._scales = {id(layer.statistics[0]): layer for layer in at_boost}
        self._sources: dict[int, TensorInfo] = {}
        for layer in at_boost:
            assert layer.source is not None, "a weight quantized at boost has its 16-bit source"
            self._sources[id(layer)] = TensorInfo(
                name=layer.param_name,
                param=layer.source,
                chunk_id=-1,
                index=0,
                offset=0,
                numel=layer.format.numel,
                shape=layer.source.shape,
                trainable=False,
            )

    def _layer(self, param: torch.nn.Parameter) -> QuantizedLinear | None:
        return self._packed.get(id(param)) or self._scales.get(id(param))

    def check(self, param: torch.nn.Parameter, where: str) -> None:
        layer = self._layer(param)
        if layer is None:
            self._inner.check(param, where)
            return
        source = self._sources[id(layer)]
        self._inner.check(source.param, f"{where}: its 16-bit weight '{layer.param_name}', quantized at boost,")

    def read(self, info: TensorInfo, piece: ShardPiece) -> torch.Tensor:
        layer = self._packed.get(id(info.param))
        if layer is not None:
            return self._packed_piece(layer, piece)
        layer = self._scales.get(id(info.param))
        if layer is not None:
            return self._scales_piece(layer, piece)
        return self._inner.read(info, piece)

    def _packed_piece(self, layer: QuantizedLinear, piece: ShardPiece) -> torch.Tensor:
        """Bytes ``piece.param`` of the packed weight: two values a byte, from the blocks holding them."""
        fmt = layer.format
        first, last = 2 * piece.param.start, min(2 * piece.param.stop, fmt.numel)
        start = first // fmt.blocksize * fmt.blocksize  # the blocks holding them, whole: their scales
        stop = min(-(-last // fmt.blocksize) * fmt.blocksize, fmt.numel)
        values = self._values(layer, start, stop)
        if values.is_meta:  # a plan: no values, only sizes
            return torch.empty(piece.numel, dtype=torch.uint8, device="meta")
        run = max(fmt.blocksize, _RUN // fmt.blocksize * fmt.blocksize)
        packed = torch.cat([bnb4.quantize(values[i : i + run], fmt)[0] for i in range(0, values.numel(), run)])
        skip = (first - start) // 2
        return packed[skip : skip + piece.numel]

    def _scales_piece(self, layer: QuantizedLinear, piece: ShardPiece) -> torch.Tensor:
        """Scales ``piece.param``: one a block."""
        fmt = layer.format
        start, stop = piece.param.start * fmt.blocksize, min(piece.param.stop * fmt.blocksize, fmt.numel)
        values = self._values(layer, start, stop)
        if values.is_meta:
            return torch.empty(piece.numel, dtype=torch.float32, device="meta")
        run = max(fmt.blocksize, _RUN // fmt.blocksize * fmt.blocksize)
        return torch.cat([bnb4.scales(values[i : i + run], fmt) for i in range(0, values.numel(), run)])

    def _values(self, layer: QuantizedLinear, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the 16-bit weight, in the dtype it is quantized from: one
        read (a weight replayed from its init is computed whole for each read)."""
        values = self._inner.read(
            self._sources[id(layer)], ShardPiece(param=slice(start, stop), shard=slice(0, stop - start))
        )
        return values if values.is_meta else values.to(layer.format.dtype)

    def location(self, info: TensorInfo, piece: ShardPiece) -> tuple[Path, int] | None:
        if self._layer(info.param) is not None:
            return None  # computed here: nowhere in a file as they are
        return self._inner.location(info, piece)

    def prepare_buffers(self, model: torch.nn.Module) -> None:
        self._inner.prepare_buffers(model)

    def release(self) -> None:
        self._sources.clear()  # the 16-bit weights (on the meta device, or the user's in memory)
        for layer in self._at_boost:
            layer.source = None
        self._inner.release()
