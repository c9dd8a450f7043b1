"""PEFT's cast of a new adapter to its base layer's dtype, done on the meta device as on the CPU.

``get_peft_model`` over a CPU model creates each adapter layer in the default dtype, initialises it,
then casts it to its base layer's dtype (``_move_adapter_to_device_of_base_layer``); a bf16 base
therefore gets a LoRA A rounded to bf16 (upcast to fp32 again afterwards by ``PeftModel``'s
``autocast_adapter_dtype``); over a base layer with a ``compute_dtype`` (a bitsandbytes 4-bit layer,
its weight packed bytes) PEFT casts to that dtype instead. On the meta device PEFT skips that cast
(an adapter on meta is not moved), so a recorded injection would replay unrounded values: while
recording, the cast is done for meta adapters too, as the CPU construction the replay reproduces
did it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..compat.peft import after_adapter_moves

__all__ = ["adapters_cast_as_on_the_cpu"]


def _base_dtype(layer: Any) -> torch.dtype | None:
    base = layer.get_base_layer()
    if isinstance(base, torch.nn.MultiheadAttention):
        base = base.out_proj
    weight = getattr(base, "weight", None)
    dtype = None if weight is None else weight.dtype
    if hasattr(base, "compute_dtype"):
        dtype = base.compute_dtype
    if dtype is None or not (dtype.is_floating_point or dtype.is_complex):
        return None
    return dtype


def _is_meta(item: Any) -> bool:
    if isinstance(item, torch.nn.Module):
        return any(p.is_meta for p in item.parameters())
    return isinstance(item, torch.Tensor) and item.is_meta


@contextmanager
def adapters_cast_as_on_the_cpu() -> Iterator[None]:
    """Within the block, PEFT casts a new adapter on the meta device to its base layer's dtype."""

    def cast(layer: Any, adapter_name: str) -> None:
        dtype = _base_dtype(layer)
        if dtype is None:
            return
        for attribute in (*layer.adapter_layer_names, *layer.other_param_names):
            container = getattr(layer, attribute, None)
            if not isinstance(container, torch.nn.ModuleDict | torch.nn.ParameterDict) or adapter_name not in container:
                continue
            item = container[adapter_name]
            floating = isinstance(item, torch.nn.Module) or item.dtype.is_floating_point or item.dtype.is_complex
            if _is_meta(item) and floating:
                container[adapter_name] = item.to(dtype=dtype)

    with after_adapter_moves(cast):
        yield
