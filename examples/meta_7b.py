"""A 7B-shaped LLaMA built on the meta device (shapes only, no memory), planned with chunkmem's
planner for a device budget, then a small model of the same family boosted to a budget from the
meta device and trained, beside plain PyTorch on the same weights.

    python examples/meta_7b.py                # the 7B plan on one 24 GiB GPU, then the small run (seconds)
    python examples/meta_7b.py --device-budget 24GiB --device-memory 80GiB --world-size 8 --batch 1x2048
    python examples/meta_7b.py --boost-7b --steps 1              # boost and train the real 7B (a big host)

The plan is for ranks that compute on a GPU (``plan(..., device="cuda")``): what each rank keeps on
its device, in host memory and on disk, and what moves per step. Nothing of the 7B model is
allocated: planning builds it on the meta device and runs chunkmem's own chunk manager, placement
policy and optimizer over meta tensors.

The small run is what a training script does with a model too large to build on the CPU: build on
the meta device, build the optimizer over the meta parameters, and let ``booster.boost`` give the
parameters values one at a time (the model's own initialisation replayed exactly as a CPU build
would have drawn it), each rank keeping only its shard. Its losses equal plain PyTorch's on a CPU
build from the same seed.

``--boost-7b`` does that with the 7B shape itself: fp32 masters, gradients and AdamW's two moments
take 16 bytes a parameter (about 100 GiB for 6.7B parameters at one rank; divided by the world size
under torchrun), so it is refused unless this host has the memory the plan says a rank needs.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import psutil
import torch
from pydantic import ByteSize, TypeAdapter
from transformers import LlamaConfig, LlamaForCausalLM

from chunkmem import AutoPlacementConfig, Booster, ChunkPlugin, plan

# LLaMA-7B's published shape.
LLAMA_7B = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
}
# The same family scaled down: the width divided by 64, two layers, the MLP in the same ratio.
SMALL = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 172,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}


def _bytes(text: str) -> int:
    return int(TypeAdapter(ByteSize).validate_python(text))


def _batch(text: str) -> tuple[int, int]:
    batch, _, seq = text.lower().partition("x")
    return int(batch), int(seq)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device-budget", type=_bytes, default="10GiB", help="the 7B plan's chunk budget per GPU")
    parser.add_argument(
        "--device-memory", type=_bytes, default="24GiB", help="each GPU's memory (chunks and activations share it)"
    )
    parser.add_argument("--world-size", type=int, default=1, help="GPU ranks the 7B plan is for")
    parser.add_argument("--batch", type=_batch, default="1x1024", help="the 7B plan's batch per rank, BATCHxSEQ")
    parser.add_argument("--small-budget", type=_bytes, default="256KiB", help="the small run's device budget")
    parser.add_argument("--steps", type=int, default=2, help="training steps of the small run")
    parser.add_argument("--boost-7b", action="store_true", help="boost and train the 7B shape instead (big host)")
    return parser.parse_args(argv)


def llama(shape: dict[str, int], seq: int) -> torch.nn.Module:
    """A LLaMA of ``shape`` on the meta device; ``seed`` fixes the values boost will give it."""
    config = LlamaConfig(**shape, max_position_embeddings=max(seq, 64))
    torch.manual_seed(0)  # the same seed on every rank (and for the CPU build it is compared with)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def plugin_for(budget: int, precision: str | None = None, chunk_size: int | None = None) -> ChunkPlugin:
    """Left unset, the chunk size is searched (the one that wastes the least padding)."""
    placement = AutoPlacementConfig(device_budget=budget, max_prefetch=2)
    return ChunkPlugin(placement=placement, precision=precision, chunk_size=chunk_size)


def batch(vocab: int, size: int, seq: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, vocab, (size, seq), generator=g)


def print_7b_plan(args: argparse.Namespace) -> Any:
    size, seq = args.batch
    model = llama(LLAMA_7B, seq)
    ids = torch.zeros(size, seq, dtype=torch.long, device="meta")
    planned = plan(
        model,
        plugin_for(args.device_budget, "bf16"),
        {"input_ids": ids, "labels": ids},
        args.world_size,
        device_capacity=args.device_memory,
        device="cuda",
    )
    gib = args.device_memory / 2**30
    print(f"LLaMA-7B shape, bf16, batch {size}x{seq} per rank, {args.world_size} rank(s) on {gib:g} GiB GPUs:")
    print(planned.table())
    return planned


def train_small(
    args: argparse.Namespace,
    shape: dict[str, int],
    budget: int,
    seq: int = 32,
    chunk_size: int | None = None,
    compare: bool = True,
) -> None:
    """Build ``shape`` on meta, boost it to ``budget`` and train ``args.steps`` steps; with
    ``compare`` (and fp32), beside plain PyTorch on a CPU build of the same seed."""
    meta = llama(shape, seq)
    optimizer = torch.optim.AdamW(meta.parameters(), lr=1e-3)  # over the meta parameters, before boosting
    plugin = plugin_for(budget, chunk_size=chunk_size)
    ids = torch.zeros(2, seq, dtype=torch.long, device="meta")
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    predicted = plan(llama(shape, seq), plugin, {"input_ids": ids, "labels": ids}, device=device_type)
    booster = Booster(plugin)
    model, optimizer, *_ = booster.boost(meta, optimizer)  # values given here, one parameter at a time
    losses = []
    for step in range(args.steps):
        tokens = batch(shape["vocab_size"], 2, seq, step)
        loss = model(input_ids=tokens, labels=tokens).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    stats = model.stats()
    params = sum(p.numel() for p in meta.parameters())
    print(f"\nLLaMA ({shape['hidden_size']} wide, {shape['num_hidden_layers']} layers, {params:,} parameters)")
    print(f"built on meta, boosted to a {budget:,}-byte budget, {args.steps} steps on {model.compute_device}")
    print(f"planned peak device bytes {predicted.peak_device_bytes:,}; measured {stats.peak_device_bytes:,}")
    if stats.peak_device_bytes > budget:
        raise SystemExit(f"peak device bytes {stats.peak_device_bytes} above the budget {budget}")
    if compare and plugin.precision == "fp32":
        # Plain PyTorch on a CPU build from the same seed: boost replayed that build's values exactly.
        torch.manual_seed(0)
        reference = LlamaForCausalLM(LlamaConfig(**shape, max_position_embeddings=max(seq, 64)))
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        plain = []
        for step in range(args.steps):
            tokens = batch(shape["vocab_size"], 2, seq, step)
            loss = reference(input_ids=tokens, labels=tokens).loss
            loss.backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
            plain.append(loss.item())
        print("step  plain PyTorch (CPU build)  chunkmem (meta build)")
        for step, (theirs, ours) in enumerate(zip(plain, losses, strict=True)):
            print(f"{step:>4}  {theirs:25.6f}  {ours:21.6f}")
        print(f"largest loss difference: {max(abs(a - b) for a, b in zip(plain, losses, strict=True)):.2e}")
    else:
        print("losses: " + ", ".join(f"{loss:.4f}" for loss in losses))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(min(4, torch.get_num_threads()))
    planned = print_7b_plan(args)
    if not args.boost_7b:
        # Chunks as large as the largest parameter (the 256 x 64 embedding): the searched size would
        # put this small model in one chunk, and a budget below one chunk cannot train.
        train_small(args, SMALL, args.small_budget, chunk_size=256 * 64)
        return
    # One rank here (torchrun: WORLD_SIZE ranks, each with its share): what the plan says a rank keeps
    # on the host, with a 10% margin, must be available.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    here = plan(
        llama(LLAMA_7B, 64),
        plugin_for(args.device_budget, "bf16" if torch.cuda.is_available() else "fp32"),
        {"input_ids": torch.zeros(1, 64, dtype=torch.long, device="meta")},
        world,
        device="cuda" if torch.cuda.is_available() else "cpu",
    )
    need = int(1.1 * (here.host_bytes_per_rank + (0 if torch.cuda.is_available() else here.peak_device_bytes)))
    available = psutil.virtual_memory().available
    if need > available:
        raise SystemExit(
            f"--boost-7b: a rank needs about {need / 2**30:.0f} GiB of host memory at world size {world}, and "
            f"{available / 2**30:.0f} GiB is available; run it under torchrun on more ranks, or on a bigger host"
        )
    del planned
    train_small(args, LLAMA_7B, args.device_budget, seq=args.batch[1], compare=False)


if __name__ == "__main__":
    main()
