"""The disk tier: a model whose parameter shards and optimizer states live in files on a local disk
between steps (nothing of it in host memory), trained a few steps under a device budget, beside
plain PyTorch on the same weights and data.

    python examples/disk_tier.py                         # a temporary directory, seconds on a CPU
    python examples/disk_tier.py --disk-dir /nvme/scratch --steps 4
    python examples/disk_tier.py --lora                  # a frozen base on disk, a LoRA adapter trained (peft)

``ChunkPlugin(disk_dir=...)`` names the directory (a fast local disk; chunkmem makes its own scratch
directory in it and removes it when the run ends). ``StaticPlacementConfig`` puts every chunk's
optimizer side on disk (``offload_disk_frac``: the fp32 master, gradient shard and AdamW moments)
and what gathers read as well (``offload_param_disk_frac``). Each step reads every shard for its
gathers, steps each chunk's optimizer side from disk and writes it back; ``model.stats()`` counts
the bytes. With ``--lora`` the base is frozen: its shards are written once, at boost, and only read
afterwards.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from chunkmem import Booster, ChunkPlugin, StaticPlacementConfig


def on_disk(budget: str) -> StaticPlacementConfig:
    return StaticPlacementConfig(
        offload_optim_frac=1.0,  # every optimizer side off the device ...
        offload_disk_frac=1.0,  # ... and on disk
        offload_param_frac=1.0,  # every parameter shard off the device between uses ...
        offload_param_disk_frac=1.0,  # ... and on disk
        device_budget=budget,
        max_prefetch=1,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--disk-dir", type=Path, default=None, help="a directory on a fast local disk (default: temp)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter over a frozen base on disk (peft)")
    parser.add_argument("--budget", default="256KiB", help="device budget (chunk bytes on the device)")
    return parser.parse_args(argv)


def gpt2(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256, n_positions=32, n_embd=args.width, n_layer=args.layers, n_head=4, bos_token_id=0, eos_token_id=0
    )
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0  # no dropout: the runs compare exactly
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # the loss transformers falls back to for GPT-2, named (no warning)
    if not args.lora:
        return model
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
    return get_peft_model(model, lora)


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def tokens(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 256, (4, 32), generator=g)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # tiny matmuls: more threads cost more than they save
    with tempfile.TemporaryDirectory() as scratch:
        disk_dir = args.disk_dir or Path(scratch)
        # The chunk size is the largest parameter's (the 256 x width embedding): equal chunks.
        plugin = ChunkPlugin(placement=on_disk(args.budget), chunk_size=256 * args.width, disk_dir=disk_dir)
        booster = Booster(plugin)
        model = gpt2(args)
        model, optimizer, *_ = booster.boost(model, optimizer_for(model))
        losses, steps = [], []
        for step in range(args.steps):
            before = model.stats()
            ids = tokens(step)
            loss = model(input_ids=ids, labels=ids).loss
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            after = model.stats()
            losses.append(loss.item())
            steps.append(
                (after.disk_read_bytes - before.disk_read_bytes, after.disk_write_bytes - before.disk_write_bytes)
            )
        stats = model.stats()
        scratch_dirs = sorted(p.name for p in disk_dir.iterdir() if p.name.startswith(".chunkmem-scratch-"))
        del model, optimizer, booster, loss  # the scratch directory goes with the model ...
        gc.collect()  # ... once the reference cycles between its parts are collected

        plain = gpt2(args)
        plain_optimizer = optimizer_for(plain)
        plain_losses = []
        for step in range(args.steps):
            ids = tokens(step)
            loss = plain(input_ids=ids, labels=ids).loss
            loss.backward()
            plain_optimizer.step()
            plain_optimizer.zero_grad()
            plain_losses.append(loss.item())
        left = sorted(p.name for p in disk_dir.iterdir() if p.name.startswith(".chunkmem-scratch-"))

    what = "LoRA adapter over a frozen GPT-2 base" if args.lora else "GPT-2, every parameter trained"
    print(f"{what} ({args.layers}x{args.width}); parameters and optimizer states on disk in {disk_dir}")
    print("step  plain PyTorch  chunkmem  disk read  disk written")
    for step, (theirs, ours, (read, written)) in enumerate(zip(plain_losses, losses, steps, strict=True)):
        print(f"{step:>4}  {theirs:13.6f}  {ours:8.6f}  {read / 2**10:6.0f} KiB  {written / 2**10:9.0f} KiB")
    worst = max(abs(a - b) for a, b in zip(plain_losses, losses, strict=True))
    print(f"largest loss difference from plain PyTorch: {worst:.2e}")
    print(
        f"on disk: {stats.disk_bytes:,} bytes; in host memory between steps: {stats.host_bytes:,} bytes; "
        f"peak device bytes {stats.peak_device_bytes:,}"
    )
    print(f"scratch directories while training: {len(scratch_dirs)}; left after the run: {len(left)}")


if __name__ == "__main__":
    main()
