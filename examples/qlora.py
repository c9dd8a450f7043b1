"""QLoRA: a LoRA adapter trained over a frozen 4-bit (NF4) base whose packed bytes and scales live in
chunks on a local disk, beside plain PEFT QLoRA on the same base, adapter and data.

    python examples/qlora.py                              # a small LLaMA, a temporary directory, seconds on a CPU
    python examples/qlora.py --at-boost                   # the base quantized at boost from its 16-bit checkpoint
    python examples/qlora.py --disk-dir /nvme/scratch --layers 4 --hidden 256

The base is a LLaMA-shaped model saved in bf16 first (what a user downloads). By default it is loaded
as users load a QLoRA base, ``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4"))``; with ``--at-boost`` the model is built on the meta device, its linear
layers replaced by transformers' ``replace_with_bnb_linear``, and the boost quantizes each weight
from the checkpoint (``weights=``), a slice at a time. Either way, ``get_peft_model`` adds the
adapter and ``Booster.boost`` keeps each 4-bit weight as its packed bytes (uint8) and its scales
(fp32) in quantized chunks, here all on disk (``StaticPlacementConfig`` with every fraction 1.0);
each op reads its chunks and bitsandbytes dequantizes them. The adapter trains in chunks of its own.

Plain PEFT QLoRA trains the same model (``from_pretrained`` with the same config) with the same
recipe as chunkmem's ``precision="bf16"`` (bf16 compute, fp32 masters in AdamW): the losses are equal
bit for bit. ``model.save_pretrained`` writes PEFT's adapter files; plain PEFT loads them. Needs
``pip install 'chunkmem[qlora]' peft`` (bitsandbytes 0.50).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path
from typing import Any

import torch

from chunkmem import Booster, ChunkPlugin, StaticPlacementConfig

VOCAB = 256
LORA_TARGETS = ["q_proj", "v_proj"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--disk-dir", type=Path, default=None, help="a directory on a fast local disk (default: temp)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument(
        "--at-boost", action="store_true", help="build on the meta device and quantize at boost from the checkpoint"
    )
    return parser.parse_args(argv)


def nf4() -> Any:
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)


def save_base(directory: Path, args: argparse.Namespace) -> Path:
    """A LLaMA-shaped base in bf16, as a downloaded checkpoint would be."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64 or 64,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 32),
        num_key_value_heads=max(1, args.hidden // 64),
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def with_adapter(model: Any, args: argparse.Namespace) -> Any:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=LORA_TARGETS))


def quantized_base(base: Path) -> Any:
    """The base as users load a QLoRA base: quantized by bitsandbytes while loading."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, quantization_config=nf4(), device_map="cpu", dtype=torch.bfloat16)


def loaded_quantized(base: Path, args: argparse.Namespace) -> Any:
    model = quantized_base(base)
    torch.manual_seed(1)  # the adapter's init: the same draws for both systems
    return with_adapter(model, args)


def on_meta(base: Path, args: argparse.Namespace) -> Any:
    """The model on the meta device, its linear layers 4-bit but not quantized yet: the boost
    quantizes them from the checkpoint. The adapter is made inside the meta block too (its init is
    replayed at boost, drawing what it would have drawn after from_pretrained)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import replace_with_bnb_linear

    config = AutoConfig.from_pretrained(base)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # replace_with_bnb_linear makes its layers in the default dtype
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"], quantization_config=nf4())
            model.is_loaded_in_4bit = True  # as from_pretrained marks it: PEFT's 4-bit LoRA layers
            torch.manual_seed(1)
            return with_adapter(model, args)
    finally:
        torch.set_default_dtype(default)


def tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(step))


def plain_qlora(base: Path, args: argparse.Namespace) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PEFT QLoRA in chunkmem's bf16 recipe: the adapter computes in bf16, AdamW steps fp32
    masters of it (chunkmem also computes the rotary buffers in bf16). Returns the losses and the
    adapter's fp32 masters by name."""
    model = loaded_quantized(base, args)
    for module in model.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point():
                setattr(module, name, buffer.to(torch.bfloat16))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    trainable = [p for _, p in named]
    masters = [p.detach().float().clone().requires_grad_(True) for p in trainable]
    for p in trainable:
        p.data = p.data.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(masters, lr=1e-3)
    losses = []
    for step in range(args.steps):
        ids = tokens(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for p, master in zip(trainable, masters, strict=True):
            master.grad, p.grad = p.grad.float(), None
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for p, master in zip(trainable, masters, strict=True):
                p.copy_(master)
        losses.append(loss.item())
    return losses, {n: m.detach() for (n, _), m in zip(named, masters, strict=True)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # tiny matmuls: more threads cost more than they save
    with tempfile.TemporaryDirectory() as scratch:
        base = save_base(Path(scratch) / "base", args)
        disk_dir = args.disk_dir or Path(scratch)
        placement = StaticPlacementConfig(
            offload_optim_frac=1.0, offload_disk_frac=1.0, offload_param_frac=1.0, offload_param_disk_frac=1.0
        )
        booster = Booster(ChunkPlugin(placement=placement, precision="bf16", disk_dir=disk_dir))
        model = on_meta(base, args) if args.at_boost else loaded_quantized(base, args)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        model, optimizer, *_ = booster.boost(model, optimizer, weights=base if args.at_boost else None)
        losses, io = [], []
        for step in range(args.steps):
            before = model.stats()
            ids = tokens(step)
            loss = model(input_ids=ids, labels=ids).loss
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            after = model.stats()
            losses.append(loss.item())
            io.append(
                (after.disk_read_bytes - before.disk_read_bytes, after.disk_write_bytes - before.disk_write_bytes)
            )
        stats = model.stats()
        model.save_pretrained(Path(scratch) / "adapter")  # PEFT's adapter files
        del model, optimizer, booster, loss  # the scratch directory goes with the model ...
        gc.collect()  # ... once the reference cycles between its parts are collected
        plain, masters = plain_qlora(base, args)

        from peft import PeftModel

        reloaded = PeftModel.from_pretrained(quantized_base(base), Path(scratch) / "adapter")
        adapter = {n: p for n, p in reloaded.named_parameters() if "lora_" in n}
        same = adapter.keys() == masters.keys() and all(torch.equal(adapter[n], m) for n, m in masters.items())

    way = "quantized at boost from its 16-bit checkpoint" if args.at_boost else "loaded quantized (from_pretrained)"
    print(f"QLoRA over a {args.layers}x{args.hidden} LLaMA, NF4 base {way}, on disk in {disk_dir}")
    print("step  plain PEFT QLoRA  chunkmem  disk read  disk written")
    for step, (theirs, ours, (read, written)) in enumerate(zip(plain, losses, io, strict=True)):
        print(f"{step:>4}  {theirs:16.6f}  {ours:8.6f}  {read / 2**10:6.0f} KiB  {written / 2**10:9.0f} KiB")
    worst = max(abs(a - b) for a, b in zip(plain, losses, strict=True))
    print(f"largest loss difference from plain PEFT QLoRA: {worst:.2e}")
    print(
        f"quantized base: {stats.quantized_bytes:,} bytes in chunks (packed 4-bit weights and fp32 scales); "
        f"on disk in all: {stats.disk_bytes:,} bytes; in host memory between steps: {stats.host_bytes:,} bytes"
    )
    print(f"the saved adapter, loaded by plain PEFT: {len(adapter)} LoRA tensors, equal to plain PEFT QLoRA's: {same}")


if __name__ == "__main__":
    main()
