"""bitsandbytes' 4-bit format (NF4 / FP4, ``Linear4bit`` modules holding ``Params4bit`` weights): the
one module of chunkmem that names bitsandbytes or its internals (``tests/integration/peft/test_qlora.py`` checks).

What chunkmem needs of it: to recognise its modules and parameters (and the formats it refuses:
LLM.int8, 4-bit embeddings, weights packed for CPU inference, another quant storage), the tensors a
quantized weight consists of (the packed bytes, the per-block scales ``absmax`` and, with double
quantization, their own scales; the 16- or 256-value code books and the offset are per-weight
constants), its public kernels (``bnb.matmul_4bit``'s forward without autograd,
``functional.dequantize_4bit`` for the backward, ``functional.quantize_4bit``), and to build a
``QuantState`` or a ``Params4bit`` again. bitsandbytes is imported only when a model holds its modules
(which imports it already): ``import chunkmem`` needs none of it.

Tested with bitsandbytes 0.50.2 (CPU and CUDA wheels from PyPI; CPU here).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..compat.bitsandbytes import defined_in_bitsandbytes, repacked_for_cpu_inference
from ..device.moves import to_device

__all__ = [
    "Format4bit",
    "Linear4bitParts",
    "adopt_attributes",
    "constants",
    "cpu_inference_matmul",
    "dequantize",
    "describe",
    "forward_dtypes",
    "is_linear4bit",
    "is_params4bit",
    "matmul",
    "meta_copy",
    "move_constants",
    "new_quant_state",
    "params4bit",
    "quantize",
    "refused_bnb",
    "scales",
    "set_statistics",
    "statistics",
    "takes_cpu_inference_kernel",
    "version",
    "with_statistics",
]

_PACKED_FOR_CPU = "packing_format_for_cpu"
# The rows bitsandbytes' CPU inference layout packs together (its ``block_n``).
_CPU_KERNEL_ROWS = 32


def _bnb() -> Any | None:
    """bitsandbytes, where something imported it (a model holding its modules did)."""
    return sys.modules.get("bitsandbytes")


def version() -> str | None:
    bnb = _bnb()
    return None if bnb is None else str(getattr(bnb, "__version__", "unknown"))


@dataclass(frozen=True)
class Format4bit:
    """How one weight is quantized (chunkmem's own record; no bitsandbytes type in it)."""

    shape: tuple[int, int]
    """The dequantized weight's ``(out_features, in_features)``."""
    dtype: torch.dtype
    """The dtype it was quantized from (what ``dequantize`` gives back)."""
    blocksize: int
    quant_type: str
    """``"nf4"`` or ``"fp4"``."""
    nested: bool
    """Double quantization: the per-block scales are themselves 8-bit, with scales per 256 blocks."""

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def packed_numel(self) -> int:
        """Bytes of the packed weight: two 4-bit values a byte."""
        return (self.numel + 1) // 2

    @property
    def blocks(self) -> int:
        return -(-self.numel // self.blocksize)


@dataclass(frozen=True)
class Linear4bitParts:
    """What a ``Linear4bit`` module holds, read without changing it."""

    weight: torch.nn.Parameter
    """Its ``Params4bit``: packed bytes (``quantized``), or the 16-bit weight bitsandbytes quantizes
    when the module is moved to a device (on the meta device for a model built there)."""
    quantized: bool
    format: Format4bit
    quant_state: Any
    """bitsandbytes' ``QuantState`` (``None`` before quantization)."""
    quant_storage: torch.dtype
    packed_for_cpu: bool
    """Its weight was repacked for bitsandbytes' CPU inference kernel (an eval forward on an AVX-512 BF16 CPU)."""


def _linear4bit_class() -> type | None:
    bnb = _bnb()
    return None if bnb is None else bnb.nn.Linear4bit


def is_linear4bit(module: torch.nn.Module) -> bool:
    cls = _linear4bit_class()
    return cls is not None and isinstance(module, cls)


def is_params4bit(tensor: torch.Tensor) -> bool:
    bnb = _bnb()
    return bnb is not None and isinstance(tensor, bnb.nn.Params4bit)


def refused_bnb(module: torch.nn.Module) -> str | None:
    """The bitsandbytes format of ``module`` that chunkmem refuses (``None``: none, or not one of
    bitsandbytes'), named for the error."""
    bnb = _bnb()
    if bnb is None or not defined_in_bitsandbytes(module):
        return None
    if isinstance(module, bnb.nn.Linear8bitLt) or any(
        isinstance(p, bnb.nn.Int8Params) for p in module.parameters(recurse=False)
    ):
        return "bitsandbytes 8-bit (LLM.int8, Linear8bitLt / Int8Params)"
    if not isinstance(module, bnb.nn.Linear4bit) and any(
        isinstance(p, bnb.nn.Params4bit) for p in module.parameters(recurse=False)
    ):
        return f"bitsandbytes 4-bit {type(module).__name__} (only Linear4bit layers are supported)"
    return None


def describe(module: torch.nn.Module) -> Linear4bitParts:
    """The parts of a ``Linear4bit`` (``is_linear4bit``)."""
    weight = module.weight
    state = getattr(weight, "quant_state", None)
    if state is None:
        state = getattr(module, "quant_state", None)
    quantized = bool(getattr(weight, "bnb_quantized", False)) and state is not None
    out_features, in_features = module.out_features, module.in_features
    if quantized:
        shape = tuple(state.shape)
        fmt = Format4bit(
            (int(shape[0]), int(shape[1])), state.dtype, int(state.blocksize), str(state.quant_type), bool(state.nested)
        )
    else:
        fmt = Format4bit(
            (out_features, in_features),
            weight.dtype,
            int(weight.blocksize),
            str(weight.quant_type),
            bool(weight.compress_statistics),
        )
    return Linear4bitParts(
        weight=weight,
        quantized=quantized,
        format=fmt,
        quant_state=state if quantized else None,
        quant_storage=getattr(weight, "quant_storage", torch.uint8),
        packed_for_cpu=quantized and bool(getattr(state, _PACKED_FOR_CPU, False)),
    )


def statistics(quant_state: Any) -> list[tuple[str, torch.Tensor]]:
    """The per-block tensors of a quantized weight, under the names bitsandbytes' state dict gives
    them (after ``<weight>.``): the scales, and with double quantization their scales."""
    out = [("absmax", quant_state.absmax)]
    if quant_state.nested:
        out.append(("nested_absmax", quant_state.state2.absmax))
    return out


def set_statistics(quant_state: Any, tensors: list[torch.Tensor]) -> None:
    """Make ``quant_state`` hold ``tensors`` as its per-block tensors (``statistics``' order)."""
    quant_state.absmax = tensors[0]
    if quant_state.nested:
        quant_state.state2.absmax = tensors[1]


def with_statistics(quant_state: Any, tensors: list[torch.Tensor]) -> Any:
    """A shallow copy of ``quant_state`` holding ``tensors`` as its per-block tensors (for one op)."""
    state = copy.copy(quant_state)
    if state.nested:
        state.state2 = copy.copy(state.state2)
    set_statistics(state, tensors)
    return state


def constants(quant_state: Any) -> list[torch.Tensor]:
    """The per-weight constants kept as they are beside the chunks: the code book(s) and the offset."""
    out = [quant_state.code]
    if quant_state.nested:
        out += [quant_state.state2.code, quant_state.offset]
    return out


def move_constants(quant_state: Any, device: torch.device) -> None:
    quant_state.code = to_device(quant_state.code, device)
    if quant_state.nested:
        quant_state.state2.code = to_device(quant_state.state2.code, device)
        quant_state.offset = to_device(quant_state.offset, device)


def new_quant_state(fmt: Format4bit, absmax: torch.Tensor, device: torch.device) -> Any:
    """The ``QuantState`` bitsandbytes would have made quantizing a weight of ``fmt`` (single
    quantization), holding ``absmax``."""
    bnb = _bnb()
    assert bnb is not None, "a Linear4bit was found, so bitsandbytes is imported"
    functional = bnb.functional
    return functional.QuantState(
        absmax=absmax,
        shape=torch.Size(fmt.shape),
        code=functional.get_4bit_type(fmt.quant_type, device=device),
        blocksize=fmt.blocksize,
        quant_type=fmt.quant_type,
        dtype=fmt.dtype,
    )


def adopt_attributes(packed: torch.nn.Parameter, source: torch.nn.Parameter, quant_state: Any) -> None:
    """Give a parameter made to hold a weight's packed bytes the attributes its ``Params4bit`` has
    (what bitsandbytes and PEFT read off ``module.weight``), and its ``quant_state``."""
    for name in ("blocksize", "compress_statistics", "quant_type", "quant_storage", "module"):
        setattr(packed, name, getattr(source, name))
    packed.bnb_quantized = True
    packed.quant_state = quant_state


def params4bit(data: torch.Tensor, like: torch.nn.Parameter, quant_state: Any) -> torch.nn.Parameter:
    """A ``Params4bit`` over ``data`` (packed bytes), with the attributes of ``like``."""
    bnb = _bnb()
    assert bnb is not None, "a Linear4bit was found, so bitsandbytes is imported"
    return bnb.nn.Params4bit(
        data,
        requires_grad=False,
        quant_state=quant_state,
        blocksize=like.blocksize,
        compress_statistics=like.compress_statistics,
        quant_type=like.quant_type,
        quant_storage=like.quant_storage,
        bnb_quantized=True,
    )


def meta_copy(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """A copy of a ``Params4bit`` on the meta device (its own ``__deepcopy__`` cannot make one: it
    assigns meta data to a new CPU parameter)."""
    bnb = _bnb()
    assert bnb is not None, "a Params4bit was found, so bitsandbytes is imported"
    return bnb.nn.Params4bit(
        torch.empty_like(param, device="meta"),
        requires_grad=param.requires_grad,
        quant_state=None,
        blocksize=param.blocksize,
        compress_statistics=param.compress_statistics,
        quant_type=param.quant_type,
        quant_storage=param.quant_storage,
        bnb_quantized=param.bnb_quantized,
    )


def quantize(values: torch.Tensor, fmt: Format4bit) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (a run of whole blocks of a weight, flat, in ``fmt.dtype``) quantized as
    bitsandbytes quantizes the weight: the packed bytes (flat uint8) and the scales of those blocks.
    Blocks are quantized independently, so a run's result is that part of the whole weight's."""
    bnb = _bnb()
    assert bnb is not None, "a Linear4bit was found, so bitsandbytes is imported"
    packed, state = bnb.functional.quantize_4bit(
        values.reshape(-1, 1), blocksize=fmt.blocksize, compress_statistics=False, quant_type=fmt.quant_type
    )
    return packed.reshape(-1), state.absmax


def scales(values: torch.Tensor, fmt: Format4bit) -> torch.Tensor:
    """The scales ``quantize`` gives ``values`` (whole blocks of a weight, the last one possibly
    short), without quantizing them: each block's largest magnitude in fp32, the short last block's
    at least 1e-38, as bitsandbytes' 4-bit quantization computes them (``tests/integration/peft/test_qlora.py``
    checks them against it). A sixth of the time: a weight quantized at boost is read twice, for
    its packed bytes and, in another chunk, for its scales."""
    flat = values.reshape(-1).float()
    full = flat.numel() // fmt.blocksize * fmt.blocksize
    out = flat[:full].view(-1, fmt.blocksize).abs().amax(dim=1)
    if full < flat.numel():
        out = torch.cat([out, flat[full:].abs().max().clamp(min=1e-38).unsqueeze(0)])
    return out


def forward_dtypes(module: torch.nn.Module, x: torch.Tensor) -> torch.dtype | None:
    """What ``Linear4bit.forward`` computes in for input ``x``: its ``compute_dtype``, set from the
    first input where not given (``None``: the input's own)."""
    if not module.compute_type_is_set:
        module.set_compute_type(x)
        module.compute_type_is_set = True
    return module.compute_dtype


def matmul(x: torch.Tensor, packed: torch.Tensor, quant_state: Any, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for the quantized weight, as ``Linear4bit`` runs it (without autograd:
    the caller is inside its own autograd function)."""
    bnb = _bnb()
    assert bnb is not None, "a Linear4bit was found, so bitsandbytes is imported"
    with torch.no_grad():
        return bnb.matmul_4bit(x, packed, quant_state=quant_state, bias=bias)


def takes_cpu_inference_kernel(module: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether ``Linear4bit.forward`` would compute ``x`` with bitsandbytes' CPU inference kernel:
    an eval forward (the module not training, ``x`` not requiring grad) on a CPU with AVX-512 BF16,
    where bitsandbytes repacks the weight (in place, for good) and runs its bf16 kernel instead of
    dequantizing. A weight bitsandbytes cannot repack (out_features not a multiple of 32, or odd
    in_features: plain bitsandbytes fails with an ``AssertionError`` there) takes the dequantizing
    kernel, as in training."""
    if x.device.type != "cpu" or module.training or x.requires_grad:
        return False
    if not getattr(module, "support_avx512bf16_for_cpu", False):
        return False
    return module.out_features % _CPU_KERNEL_ROWS == 0 and module.in_features % 2 == 0


def cpu_inference_matmul(
    x: torch.Tensor, packed: torch.Tensor, quant_state: Any, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ W.T + bias`` as ``Linear4bit`` computes it with bitsandbytes' CPU inference kernel
    (``takes_cpu_inference_kernel``), from a repacked copy of the weight made for this op only: the
    stored bytes keep bitsandbytes' usual layout, on every tier. ``quant_state`` is this op's own
    (``with_statistics``): the repacking rewrites its fields."""
    bnb = _bnb()
    assert bnb is not None, "a Linear4bit was found, so bitsandbytes is imported"
    weight, state = repacked_for_cpu_inference(packed, quant_state)
    with torch.no_grad():
        return bnb.matmul_4bit(x, weight, quant_state=state, bias=bias)


def dequantize(packed: torch.Tensor, quant_state: Any) -> torch.Tensor:
    """The weight, ``(out_features, in_features)`` in the dtype it was quantized from, as
    bitsandbytes' 4-bit matmul dequantizes it for its backward."""
    bnb = _bnb()
    assert bnb is not None, "a Linear4bit was found, so bitsandbytes is imported"
    return bnb.functional.dequantize_4bit(packed.view(-1, 1), quant_state)
