"""QLoRA models for the tests: a small LLaMA whose linear layers are bitsandbytes 4-bit (NF4), with a
PEFT LoRA adapter, built the ways users build one, and plain PEFT QLoRA training to compare against.

* ``quantized_llama``: the base quantized with bitsandbytes' own API (each ``nn.Linear`` but the
  head replaced by a ``Linear4bit`` holding its weights, quantized when moved to the CPU: what
  transformers' integration does when loading), in memory;
* ``pretrained_qlora``: ``from_pretrained(dir, quantization_config=BitsAndBytesConfig(load_in_4bit=True))``
  from a saved 16-bit checkpoint;
* ``meta_qlora``: the model built on the meta device, its linear layers replaced by transformers'
  ``replace_with_bnb_linear`` (4-bit layers holding their 16-bit weights, not quantized yet): what
  chunkmem quantizes at boost from the checkpoint (``weights=``).

``plain_qlora`` trains a model as plain PEFT does, in chunkmem's mixed-precision recipe: the adapter
computes in bf16 (as every parameter of a bf16 boost does) from fp32 masters that AdamW steps, each
rank's share of a batch through the same model, the fp32 gradients summed and divided by the world
size (as DDP does).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from support.models import llama

RANK = 4
TARGETS = ["q_proj", "v_proj", "down_proj"]
COMPUTE = torch.bfloat16


def nf4_config(double_quant: bool = False, compute_dtype: torch.dtype | None = COMPUTE) -> Any:
    """``BitsAndBytesConfig`` for NF4; ``compute_dtype=None``: transformers' default (fp32)."""
    from transformers import BitsAndBytesConfig

    compute = {} if compute_dtype is None else {"bnb_4bit_compute_dtype": compute_dtype}
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant, **compute
    )


def base_16bit(seed: int = 0, hidden: int = 64, layers: int = 2) -> torch.nn.Module:
    return llama(n_layer=layers, hidden=hidden, seed=seed).to(COMPUTE)


def quantize_linears(
    model: torch.nn.Module, double_quant: bool = False, quant_storage: torch.dtype = torch.uint8
) -> torch.nn.Module:
    """Every ``nn.Linear`` but ``lm_head`` replaced, in place, by a ``Linear4bit`` (NF4) quantizing
    its weights as they are (bf16): bitsandbytes' own API, as transformers' integration uses it (the
    layer made on the meta device, drawing no random numbers, then given the weights)."""
    import bitsandbytes as bnb

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and name != "lm_head":
                with torch.device("meta"):
                    layer = bnb.nn.Linear4bit(
                        child.in_features,
                        child.out_features,
                        child.bias is not None,
                        compute_dtype=COMPUTE,
                        compress_statistics=double_quant,
                        quant_type="nf4",
                        quant_storage=quant_storage,
                    )
                layer.weight = bnb.nn.Params4bit(
                    child.weight.data,
                    requires_grad=False,
                    compress_statistics=double_quant,
                    quant_type="nf4",
                    quant_storage=quant_storage,
                    module=layer,
                )
                if child.bias is not None:
                    layer.bias = child.bias
                setattr(parent, name, layer.to("cpu"))  # bitsandbytes quantizes here
    return model


def with_adapter(model: torch.nn.Module, seed: int = 0, draw_b: bool = True) -> Any:
    """A LoRA adapter over the attention's q/v and the MLP's down projection; with ``draw_b``,
    ``lora_B`` drawn from ``seed`` (PEFT starts it at zero) so that every adapter weight matters
    from the first step (a model on the meta device keeps PEFT's own init: what a boost replays)."""
    import peft

    config = peft.LoraConfig(r=RANK, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    wrapped = peft.get_peft_model(model, config)
    if draw_b:
        torch.manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in wrapped.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    return wrapped


def quantized_llama(seed: int = 0, double_quant: bool = False) -> Any:
    return with_adapter(quantize_linears(base_16bit(seed), double_quant), seed)


def save_16bit(directory: Path, seed: int = 0) -> Path:
    base_16bit(seed).save_pretrained(directory)
    return directory


def pretrained_qlora(
    directory: Path,
    seed: int = 0,
    double_quant: bool = False,
    draw_b: bool = True,
    compute_dtype: torch.dtype | None = COMPUTE,
) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)  # PEFT's init draws after from_pretrained (what a boost from meta replays)
    base = AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=nf4_config(double_quant, compute_dtype), device_map="cpu", dtype=COMPUTE
    )
    return with_adapter(base, seed, draw_b)


def meta_qlora(directory: Path, seed: int = 0, compute_dtype: torch.dtype | None = COMPUTE) -> Any:
    """The model of ``directory``'s config on the meta device, its linear layers 4-bit but not
    quantized (built in bf16, the dtype they are quantized from), with the adapter: everything
    built inside the meta device's context, PEFT's adapter too (its init is replayed at boost)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import replace_with_bnb_linear

    config = AutoConfig.from_pretrained(directory)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(COMPUTE)  # replace_with_bnb_linear makes its layers in the default dtype
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=COMPUTE)
            config_4bit = nf4_config(compute_dtype=compute_dtype)
            replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"], quantization_config=config_4bit)
            model.is_loaded_in_4bit = True  # what from_pretrained marks: PEFT wraps the layers in its 4-bit LoRA layer
            # In eval mode, as from_pretrained returns a model: the run that loads it is the reference
            # (on an AVX-512 BF16 CPU an eval forward computes with bitsandbytes' inference kernel).
            return with_adapter(model.eval(), seed, draw_b=False)
    finally:
        torch.set_default_dtype(default)


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def in_compute_dtype(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (in place) as a bf16 boost computes it: its floating buffers (rotary frequencies)
    and its trainable parameters (the adapter) in the compute dtype."""
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point():
                setattr(module, name, buffer.to(COMPUTE))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(COMPUTE)
    return model


def plain_qlora(
    build: Callable[[], Any], data: Sequence[torch.Tensor], world_size: int = 1
) -> tuple[list[list[float]], Any, dict[str, torch.Tensor]]:
    """Plain PEFT QLoRA in chunkmem's recipe (module docstring). Returns each step's per-rank
    losses, the model (its adapter in bf16) and the adapter's fp32 masters by name."""
    model = build()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    masters = {n: p.detach().float().clone().requires_grad_(True) for n, p in trainable.items()}
    in_compute_dtype(model)
    optimizer = torch.optim.AdamW(list(masters.values()), lr=1e-2, weight_decay=0.1)
    losses = []
    for ids in data:
        step = []
        grads: dict[str, torch.Tensor] = {}
        for share in ids.chunk(world_size):
            loss = model(input_ids=share, labels=share).loss
            loss.backward()
            step.append(loss.item())
            for name, p in trainable.items():
                g = p.grad.float()
                grads[name] = g if name not in grads else grads[name] + g
                p.grad = None
        for name, master in masters.items():
            master.grad = grads[name] / world_size
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for name, p in trainable.items():
                p.copy_(masters[name])
        losses.append(step)
    return losses, model, masters


def train(
    chunked: Any, optimizer: Any, booster: Any, data: Sequence[torch.Tensor], rank: int = 0, world: int = 1
) -> list[float]:
    losses = []
    for ids in data:
        share = ids.chunk(world)[rank]
        loss = chunked(input_ids=share, labels=share).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def quantized_entries(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict's entries of the 4-bit layers (packed weights, scales, code books, packed
    quant-state blobs), under the base model's names (PEFT's prefix and ``base_layer`` taken off)."""
    out = {}
    for name, value in state.items():
        base = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if any(part in base for part in (".absmax", ".quant_map", ".quant_state.", "nested_")) or (
            value.dtype == torch.uint8 and base.endswith(".weight")
        ):
            out[base] = value
    return out


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """One SHA-256 over tensors' names and bytes."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def analytic_quantized_bytes(model: torch.nn.Module) -> int:
    """What a 4-bit base stores, from its layers' shapes alone: half a byte a weight (two 4-bit
    values a byte) and a 4-byte fp32 scale per block of 64."""
    total = 0
    for module in model.modules():
        if type(module).__name__ == "Linear4bit":
            n = module.in_features * module.out_features
            total += (n + 1) // 2 + 4 * -(-n // 64)
    return total
