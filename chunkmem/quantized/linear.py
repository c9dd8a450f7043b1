"""The op a quantized linear layer runs: ``x @ W.T + b`` with ``W`` dequantized from its packed bytes
and scales for this op only, the packed tensors in chunks like any parameter.

``linear_4bit`` takes the packed weight and its per-block scales as arguments, so the chunk hooks
(``chunkmem.hooks``, through ``__torch_function__``) see every chunked tensor the op reads: they
gather those chunks before the op and again before its backward, and release them after, under
the budget and the placement like any other. Inside, the arithmetic is bitsandbytes': its 4-bit
matmul's forward, and for the backward the same dequantization and matmul bitsandbytes' autograd
function runs (``bnb4``). What is kept for the backward is the parameters themselves, never a
dequantized weight: the only full-precision weight is the one transient each op (and each
backward) dequantizes, as bitsandbytes does.

``QuantizedForward`` is what a ``Linear4bit`` module runs instead of its own forward once boosted:
the same dtype handling (its ``compute_dtype``), without what its forward writes into its
parameters (a cast of the bias into the compute dtype, the weight repacked for CPU inference), which
chunkmem's parameters refuse: the bias is cast for each call instead, the weight is left as stored.
Where bitsandbytes computes an eval forward with its CPU inference kernel (an AVX-512 BF16 CPU:
``bnb4.takes_cpu_inference_kernel``), so does the op, from a copy of the weight repacked for that op,
so that an eval forward (a frozen reference model's, generation's) equals plain bitsandbytes' on
every CPU. Unlike plain bitsandbytes, a layer that once ran an eval forward still trains through
the dequantizing kernel afterwards: plain bitsandbytes keeps the repacked weight and computes every
later forward with the inference kernel, for which bitsandbytes 0.50.2 registers no backward (read, not run).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch.overrides import handle_torch_function, has_torch_function

from chunkmem.hooks import unhooked

from . import bnb4

__all__ = ["FourBitLayer", "QuantizedForward", "linear_4bit"]


class FourBitLayer(Protocol):
    """What the op needs of a 4-bit layer (``base.QuantizedLinear``)."""

    @property
    def module(self) -> torch.nn.Module: ...

    @property
    def statistics(self) -> tuple[torch.nn.Parameter, ...]: ...

    def op_state(self, statistics: Sequence[torch.Tensor]) -> Any:
        """bitsandbytes' ``QuantState`` of one op, holding ``statistics``."""
        ...


class _Linear4bit(torch.autograd.Function):
    """bitsandbytes' 4-bit matmul with the chunked tensors as arguments (module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        layer: FourBitLayer,
        inference: bool,
        *statistics: torch.Tensor,
    ) -> torch.Tensor:
        state = layer.op_state(statistics)
        # With bitsandbytes' CPU inference kernel where its own forward takes it (module docstring).
        matmul = bnb4.cpu_inference_matmul if inference else bnb4.matmul
        out = matmul(x, weight, state, bias)
        # The parameters themselves, not saved tensors: no version check and no saved-tensor
        # hooks (activation offload) see them, and in the backward they point wherever their
        # chunks were gathered again.
        ctx.tensors = (weight, statistics)
        ctx.layer = layer
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        weight, statistics = ctx.tensors
        grad_x = grad_bias = None
        with unhooked():  # the chunks were gathered for this backward (pre_backward): read them as they are
            if ctx.needs_input_grad[2]:  # bitsandbytes sums dimension 0 only (a 2-D input); every leading one here
                grad_bias = grad.sum(dim=tuple(range(grad.dim() - 1)), dtype=ctx.bias_dtype)
            if ctx.needs_input_grad[0]:
                dequantized = bnb4.dequantize(weight, ctx.layer.op_state(statistics))
                grad_x = torch.matmul(grad, dequantized.to(grad.dtype))
        return (grad_x, None, grad_bias, None, None, *(None for _ in statistics))


def linear_4bit(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    layer: FourBitLayer,
    statistics: tuple[torch.Tensor, ...],
    inference: bool = False,
) -> torch.Tensor:
    """``x @ W.T + bias`` for the quantized weight ``layer`` describes, ``weight`` its packed bytes and
    ``statistics`` its per-block scales; ``inference``: with bitsandbytes' CPU inference kernel
    (module docstring). Hooked parameters among them get their hooks (the op is overridable with
    ``__torch_function__``, as torch's own functions are)."""
    tensors = (x, weight, *statistics) if bias is None else (x, weight, bias, *statistics)
    if has_torch_function(tensors):
        return handle_torch_function(linear_4bit, tensors, x, weight, bias, layer, statistics, inference)
    return _Linear4bit.apply(x, weight, bias, layer, inference, *statistics)


class QuantizedForward:
    """The forward of a boosted ``Linear4bit`` (module docstring). Set as the module's ``forward``
    attribute; ``QuantizedBase.detached`` takes it away while a plain copy is made."""

    def __init__(self, layer: FourBitLayer) -> None:
        self._layer = layer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self._layer
        module = layer.module
        compute = bnb4.forward_dtypes(module, x)
        inference = bnb4.takes_cpu_inference_kernel(module, x)  # decided on the input as given, as bitsandbytes does
        input_dtype = x.dtype
        if compute is not None:
            x = x.to(compute)
        bias = module.bias
        if bias is not None:
            bias = bias.to(x.dtype if compute is None else compute)
        return linear_4bit(x, module.weight, bias, layer, layer.statistics, inference).to(input_dtype)
