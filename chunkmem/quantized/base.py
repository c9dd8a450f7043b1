"""``QuantizedBase``: a model's bitsandbytes 4-bit layers, found and checked at boost, their stored
tensors put in chunks, their forward replaced.

A ``Linear4bit`` weight is its packed bytes (a ``Params4bit``: two 4-bit values a byte) and, per block
of ``blocksize`` values, a scale (``absmax``: fp32, or with double quantization 8 bits with fp32
scales of their own per 256 blocks). Those tensors grow with the model; each becomes a frozen
parameter of a quantized chunk (``ShardKind.QUANTIZED``: kept and gathered in its own dtype), placed,
prefetched, evicted, sharded and put on disk like any chunk, counted in the ledger as
``MemoryKind.QUANTIZED``. What does not grow with the model stays as it is beside the chunks: each
weight's code book (16 values; with double quantization 256 more and an offset).

Two ways in:

* **loaded quantized** (``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))``):
  the packed bytes are the ``Params4bit`` itself (the same object, a plain parameter once boosted,
  still carrying its ``quant_state``), its scales parameters made over bitsandbytes' tensors;
* **quantized at boost**: a ``Linear4bit`` whose weight is not quantized yet (bitsandbytes quantizes
  when the module moves to a device; a model built on the meta device, its ``nn.Linear`` layers
  replaced by transformers' ``replace_with_bnb_linear``, holds its 16-bit weight there): each rank
  quantizes the pieces of its shards from the 16-bit weight, read a slice at a time from the
  checkpoint (``weights=``), the model's initialisation or memory (``QuantizingValues``), exactly
  as bitsandbytes quantizes the whole weight. Double quantization needs each weight's scales whole
  first: refused there (load such a base quantized instead).

Refused, naming the format and what to do: a 4-bit weight that requires grad, 8-bit bitsandbytes
(LLM.int8), bitsandbytes' 4-bit embeddings, weights repacked for bitsandbytes' CPU inference, a quant
storage other than uint8, and the other quantizers' layers and tensors (GPTQ, AWQ, HQQ, torchao, ...).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import NotSupportedError, UnmanageableParameter
from . import bnb4
from .linear import QuantizedForward

__all__ = ["QuantizedBase", "QuantizedLinear"]

# Other quantizers, by the top-level package of their layers' and tensors' classes.
_OTHER_QUANTIZERS = {
    "auto_gptq": "GPTQ (auto-gptq)",
    "gptqmodel": "GPTQ (GPTQModel)",
    "awq": "AWQ (AutoAWQ)",
    "hqq": "HQQ",
    "torchao": "torchao",
    "optimum": "optimum-quanto",
    "quanto": "optimum-quanto",
    "eetq": "EETQ",
    "aqlm": "AQLM",
    "compressed_tensors": "compressed-tensors",
    "fbgemm_gpu": "FBGEMM FP8",
    "vptq": "VPTQ",
    "bitnet": "BitNet",
}
_FIX = (
    "chunkmem keeps bitsandbytes 4-bit (NF4 / FP4) Linear4bit bases in chunks: load the base with "
    "quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4'), or in 16-bit without a "
    "quantization config (its chunks are sharded and offloaded as they are)"
)


def _quantizer_of(obj: object) -> str | None:
    root = type(obj).__module__.split(".")[0]
    return _OTHER_QUANTIZERS.get(root)


@dataclass(eq=False)
class QuantizedLinear:
    """One ``Linear4bit`` layer of a boosted model and the tensors chunkmem keeps for it."""

    name: str
    """The module's name in the model."""
    param_name: str
    """Its weight's name (as ``model.named_parameters()`` gives it)."""
    module: torch.nn.Module
    format: bnb4.Format4bit
    weight: torch.nn.Parameter
    """The packed bytes: the ``Params4bit`` loaded quantized, or a parameter made for them."""
    statistic_names: tuple[str, ...]
    """The per-block tensors' names after ``<weight>.`` (bitsandbytes' state dict names)."""
    statistics: tuple[torch.nn.Parameter, ...]
    at_boost: bool
    """Quantized at boost (else loaded quantized)."""
    source: torch.nn.Parameter | None
    """The 16-bit weight quantized at boost, until the chunks are closed (``None`` then, and for a
    weight loaded quantized)."""
    quant_state: Any
    """bitsandbytes' ``QuantState`` (made at ``install`` for a weight quantized at boost)."""
    forward: QuantizedForward | None = None

    def op_state(self, statistics: Sequence[torch.Tensor]) -> Any:
        """The ``QuantState`` of one op: this weight's, holding ``statistics`` (the chunked scales
        as the op reads them)."""
        return bnb4.with_statistics(self.quant_state, list(statistics))

    def named_tensors(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The packed weight and its scales, under their state-dict names."""
        return [
            (self.param_name, self.weight),
            *((f"{self.param_name}.{n}", t) for n, t in zip(self.statistic_names, self.statistics, strict=True)),
        ]


def _meta_parameter(numel: int, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.nn.Parameter:
    tensor = torch.empty(shape if shape is not None else (numel,), dtype=dtype, device="meta")
    return torch.nn.Parameter(tensor, requires_grad=False)


class QuantizedBase:
    """The 4-bit layers of one model being boosted (module docstring)."""

    def __init__(self, layers: list[QuantizedLinear]) -> None:
        self._layers = layers
        self._by_tensor = {id(t): layer for layer in layers for _, t in layer.named_tensors()}
        self._by_source = {id(layer.source): layer for layer in layers if layer.source is not None}
        self._installed = False

    # --- finding and refusing -----------------------------------------------------------------
    @staticmethod
    def find(model: torch.nn.Module) -> QuantizedBase | None:
        """The model's ``Linear4bit`` layers (``None``: it has none); refuse what cannot be kept
        (module docstring) before anything changes."""
        _refuse_quantization_config(model)
        names = {id(p): n for n, p in model.named_parameters()}
        layers: list[QuantizedLinear] = []
        for module_name, module in model.named_modules():
            refused = bnb4.refused_bnb(module) or _quantizer_of(module)
            if refused is not None:
                raise NotSupportedError(
                    f"layer '{module_name}' ({type(module).__name__}) is quantized with {refused}, which chunkmem "
                    f"cannot keep in chunks. {_FIX}"
                )
            if bnb4.is_linear4bit(module):
                layers.append(_layer(module_name, module, names))
        for name, param in model.named_parameters():
            quantizer = _quantizer_of(param)
            if quantizer is not None:
                raise UnmanageableParameter(
                    f"parameter '{name}' is a {type(param).__name__} quantized with {quantizer}, which chunkmem "
                    f"cannot keep in chunks. {_FIX}"
                )
        return QuantizedBase(layers) if layers else None

    @staticmethod
    def deepcopy_memo(model: torch.nn.Module) -> dict[int, Any]:
        """A ``copy.deepcopy`` memo holding a copy of each 4-bit weight of a model on the meta device
        (bitsandbytes cannot deep-copy one there)."""
        return {id(p): bnb4.meta_copy(p) for p in model.parameters() if p.is_meta and bnb4.is_params4bit(p)}

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer holding a weight to be quantized at boost: its packed bytes replace it.
        (A weight loaded quantized is frozen and stays itself: the optimizer skips it.)"""
        for group in optimizer.param_groups:
            for p in group["params"]:
                layer = self._by_source.get(id(p))
                if layer is not None:
                    raise UnmanageableParameter(
                        f"{type(optimizer).__name__} holds the 4-bit weight '{layer.param_name}', frozen and quantized "
                        "at boost (its packed bytes replace it): build the optimizer over the trainable parameters "
                        "only ([p for p in model.parameters() if p.requires_grad]), as PEFT and the Trainer do"
                    )

    # --- what goes in chunks --------------------------------------------------------------------
    @property
    def layers(self) -> tuple[QuantizedLinear, ...]:
        return tuple(self._layers)

    @property
    def tensors(self) -> list[torch.nn.Parameter]:
        """Every tensor kept in quantized chunks."""
        return [t for layer in self._layers for _, t in layer.named_tensors()]

    def registration(self, named: Sequence[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.nn.Parameter]]:
        """The model's parameters in their order, each 4-bit weight as its packed bytes followed by
        its scales (so a layer's tensors are neighbours in its chunks)."""
        out: list[tuple[str, torch.nn.Parameter]] = []
        for name, param in named:
            layer = self._by_tensor.get(id(param)) or self._by_source.get(id(param))
            out.extend(layer.named_tensors() if layer is not None else [(name, param)])
        return out

    def module_tensors(self, module: torch.nn.Module) -> list[torch.nn.Parameter]:
        """The chunked tensors a 4-bit layer's op reads: its packed weight and its scales (``[]`` for
        another module)."""
        return [t for layer in self._layers if layer.module is module for _, t in layer.named_tensors()]

    def constant_bytes(self) -> int:
        """Bytes kept beside the chunks: each weight's code books and offset (each storage once)."""
        seen: dict[int, int] = {}
        for layer in self._layers:
            if layer.quant_state is None:  # to be quantized at boost: one 16-value fp32 code book
                seen[id(layer)] = 16 * 4
                continue
            for tensor in bnb4.constants(layer.quant_state):
                seen[tensor.untyped_storage().data_ptr() or id(tensor)] = tensor.numel() * tensor.element_size()
        return sum(seen.values())

    # --- the model's layers -------------------------------------------------------------------
    def install(self, device: torch.device) -> None:
        """Make the layers chunkmem's (after every check of the boost passed, before the chunks are
        closed): each packed weight a plain parameter of its module (with its ``quant_state``), the
        scales in that state, the constants on the compute device, the forward replaced."""
        if self._installed:
            raise RuntimeError("QuantizedBase.install runs once, when the model is boosted")
        self._installed = True
        for layer in self._layers:
            if layer.at_boost:  # a fresh state over the chunked scales
                assert layer.source is not None, "install runs before the chunks are closed"
                layer.quant_state = bnb4.new_quant_state(layer.format, layer.statistics[0], device)
                bnb4.adopt_attributes(layer.weight, layer.source, layer.quant_state)
                layer.module.weight = layer.weight
            else:
                layer.weight.__class__ = torch.nn.Parameter  # the Params4bit object, its attributes kept
                bnb4.set_statistics(layer.quant_state, list(layer.statistics))
            layer.module.quant_state = layer.quant_state
            bnb4.move_constants(layer.quant_state, device)
            layer.forward = QuantizedForward(layer)
            layer.module.forward = layer.forward

    @contextmanager
    def detached(self) -> Iterator[None]:
        """Within the block the layers run bitsandbytes' own forward (a plain copy is being made)."""
        for layer in self._layers:
            if layer.forward is not None:
                del layer.module.forward
        try:
            yield
        finally:
            for layer in self._layers:
                if layer.forward is not None:
                    layer.module.forward = layer.forward

    def plain_weights(self, copies: dict[int, torch.nn.Parameter]) -> None:
        """In ``copies`` (plain parameters by the id of the boosted one they copy, what a plain
        copy of the module is made of), each packed weight as a ``Params4bit`` over its copied
        scales, as bitsandbytes holds it."""
        for layer in self._layers:
            statistics = [copies[id(t)].detach() for t in layer.statistics]
            for t, plain in zip(layer.statistics, statistics, strict=True):
                copies[id(t)] = plain  # type: ignore[assignment]
            state = layer.op_state(statistics)
            copies[id(layer.weight)] = bnb4.params4bit(copies[id(layer.weight)].detach(), layer.weight, state)


def _refuse_quantization_config(model: torch.nn.Module) -> None:
    """A transformers model loaded with another quantizer's config (its layers may be plain)."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None:
        return
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    method = getattr(method, "value", method)
    if method in (None, "bitsandbytes"):
        return
    raise NotSupportedError(
        f"the model was loaded with quantization_config quant_method={method!r}, whose layers chunkmem cannot keep "
        f"in chunks. {_FIX}"
    )


def _layer(module_name: str, module: torch.nn.Module, names: dict[int, str]) -> QuantizedLinear:
    parts = bnb4.describe(module)
    param_name = names.get(id(parts.weight), f"{module_name}.weight")
    where = f"4-bit weight '{param_name}'"
    if parts.weight.requires_grad:
        raise UnmanageableParameter(
            f"{where} requires grad: a quantized weight cannot train (bitsandbytes has no gradient for it). Freeze "
            "it (requires_grad_(False)) and train an adapter over it (peft.get_peft_model with a LoraConfig)"
        )
    if parts.quant_storage != torch.uint8:
        raise NotSupportedError(
            f"{where} packs its 4-bit values in {parts.quant_storage} (bnb_4bit_quant_storage): chunkmem keeps the "
            "packed bytes in uint8 chunks and shards them itself. Load with bnb_4bit_quant_storage=torch.uint8 (the "
            "default; another storage dtype exists for FSDP, which chunkmem replaces)"
        )
    if parts.packed_for_cpu:
        raise NotSupportedError(
            f"{where} was repacked by bitsandbytes for its CPU inference kernel (an eval forward ran before "
            "boosting): boost the model as it was loaded, before running it"
        )
    fmt = parts.format
    if parts.quantized:
        statistics = bnb4.statistics(parts.quant_state)
        return QuantizedLinear(
            name=module_name,
            param_name=param_name,
            module=module,
            format=fmt,
            weight=parts.weight,
            statistic_names=tuple(n for n, _ in statistics),
            statistics=tuple(torch.nn.Parameter(t, requires_grad=False) for _, t in statistics),
            at_boost=False,
            source=None,
            quant_state=parts.quant_state,
        )
    if fmt.nested:
        raise NotSupportedError(
            f"{where} is to be quantized at boost with double quantization (compress_statistics / "
            "bnb_4bit_use_double_quant=True), whose second-level scales need each weight's scales whole: not done "
            "piece by piece. Quantize at boost without it (bnb_4bit_use_double_quant=False), or load the base "
            "quantized (from_pretrained with the BitsAndBytesConfig) and boost that"
        )
    if fmt.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise NotSupportedError(f"{where} holds {fmt.dtype} values; bitsandbytes quantizes fp32, bf16 or fp16")
    return QuantizedLinear(
        name=module_name,
        param_name=param_name,
        module=module,
        format=fmt,
        weight=_meta_parameter(fmt.packed_numel, torch.uint8, (fmt.packed_numel, 1)),
        statistic_names=("absmax",),
        statistics=(_meta_parameter(fmt.blocks, torch.float32),),
        at_boost=True,
        source=parts.weight,
        quant_state=None,
    )
