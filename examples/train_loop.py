"""A plain PyTorch training loop with chunkmem's ``Booster``: a small LLaMA (or GPT-2) built from a
config, or a causal LM of plain ``torch.nn`` layers (``--model torch``: no transformers needed),
trained under a device budget below what the model needs, with gradient accumulation,
norm clipping, an LR schedule and a checkpoint that a fresh model loads; beside it, the same loop
in plain PyTorch on the same weights and data.

    python examples/train_loop.py                          # a few seconds on a CPU
    python examples/train_loop.py --model gpt2 --steps 12 --budget 256KiB
    python examples/train_loop.py --model torch            # torch.nn layers only
    torchrun --nproc-per-node 2 examples/train_loop.py     # two ranks (gloo on a CPU, NCCL on GPUs)

The lines that differ from plain PyTorch are marked ``# chunkmem``. The data is token rows that
count up from a random start, a pattern the model learns, so the loss falls within a few steps.
With several ranks each rank trains on its own share of every batch, and the plain comparison is
DistributedDataParallel on the same shares. ``--json PATH`` writes both runs' losses and the
largest difference between their final weights (tests/integration/docs/test_examples.py and the two-node launch of
tests/system/ranks/test_several_machines.py read it).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from chunkmem import AutoPlacementConfig, Booster, ChunkPlugin


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["llama", "gpt2", "torch"], default="llama")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=32, help="tokens per row")
    parser.add_argument("--batch", type=int, default=4, help="rows per rank per micro-batch")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--budget", default="160KiB", help="device budget per rank (chunk bytes on the device), e.g. 160KiB, 20GiB"
    )
    parser.add_argument("--chunk-size", type=int, default=8192, help="elements per chunk")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None, help="default: the device's")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain PyTorch comparison")
    parser.add_argument("--save-dir", type=Path, default=None, help="where the checkpoint goes (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="write the losses and weight differences here (rank 0)")
    return parser.parse_args(argv)


class TorchCausalLM(torch.nn.Module):
    """A causal language model of plain ``torch.nn`` layers: learned positions, pre-norm blocks of
    causal self-attention and a GELU MLP, no biases. Both choices keep gradients away from exact
    cancellation, where AdamW blows up the rounding of two runs that sum gradients in a different
    order: a key projection's bias has an exact gradient of zero, and ReLU's units at their kink
    gave final weights 3.5e-4 apart from DDP's at four ranks on an AVX-512 CPU (GELU: 2.4e-7).
    Called as a transformers model is: ``model(input_ids=..., labels=...).loss``."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, positions: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Embedding(positions, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(
                width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True, bias=False
            )
            for _ in range(layers)
        )
        self.norm = torch.nn.LayerNorm(width, bias=False)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> SimpleNamespace:
        length = input_ids.shape[1]
        x = self.embed(input_ids) + self.position(torch.arange(length, device=input_ids.device))
        causal = torch.nn.Transformer.generate_square_subsequent_mask(length, device=x.device, dtype=x.dtype)
        for block in self.blocks:
            x = block(x, src_mask=causal, is_causal=True)
        logits = self.head(self.norm(x))
        loss = None
        if labels is not None:  # each position predicts the next token, as transformers' causal LMs do
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return SimpleNamespace(logits=logits, loss=loss)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank and in both runs
    if args.model == "torch":
        return TorchCausalLM(args.vocab, args.width, args.layers, heads=4, positions=args.seq)
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if args.model == "gpt2":
        config = GPT2Config(
            vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width, n_layer=args.layers, n_head=4
        )
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0  # no dropout: the runs compare exactly
        return GPT2LMHeadModel(config)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.width,
        intermediate_size=args.width * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
    )
    return LlamaForCausalLM(config)


def micro_batches(args: argparse.Namespace, step: int, rank: int, world: int) -> list[torch.Tensor]:
    """This rank's micro-batches of global batch ``step``: rows that count up from a random start."""
    g = torch.Generator().manual_seed(1000 + step)
    rows = world * args.batch * args.accumulate
    starts = torch.randint(0, args.vocab, (rows, 1), generator=g)
    tokens = (starts + torch.arange(args.seq)) % args.vocab
    mine = tokens.view(args.accumulate, world, args.batch, args.seq)[:, rank]
    return list(mine.unbind(0))


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)


def make_schedule(optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps)


def train_chunkmem(
    args: argparse.Namespace, rank: int, world: int
) -> tuple[list[float], dict[str, float], dict[str, torch.Tensor]]:
    model = build_model(args)
    optimizer = make_optimizer(model, args)  # built before boosting, handed to boost
    plugin = ChunkPlugin(  # chunkmem
        placement=AutoPlacementConfig(device_budget=args.budget, max_prefetch=1),
        precision=args.precision,
        chunk_size=args.chunk_size,
        gradient_accumulation=args.accumulate > 1,
    )
    booster = Booster(plugin)  # chunkmem
    model, optimizer, *_ = booster.boost(model, optimizer)  # chunkmem: use these two from now on
    schedule = make_schedule(optimizer, args)
    losses = []
    for step in range(args.steps):
        micro = micro_batches(args, step, rank, world)
        total = torch.zeros(())
        with booster.no_sync(model, optimizer):  # chunkmem: accumulate without communicating
            for ids in micro[:-1]:
                loss = model(input_ids=ids, labels=ids).loss / args.accumulate
                booster.backward(loss, optimizer)  # chunkmem: loss.backward() with fp16 loss scaling
                total += loss.detach().float().cpu()
        loss = model(input_ids=micro[-1], labels=micro[-1]).loss / args.accumulate
        booster.backward(loss, optimizer)  # chunkmem
        total += loss.detach().float().cpu()
        optimizer.clip_grad_norm(1.0)  # chunkmem: not torch.nn.utils.clip_grad_norm_ (gradients are sharded)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        if world > 1:
            dist.all_reduce(total, op=dist.ReduceOp.AVG)  # the mean over ranks, to print on rank 0
        losses.append(total.item())

    stats = model.stats()
    weights = model.state_dict()  # the full fp32 weights (a collective: every rank calls it)
    # A checkpoint in plain PyTorch's formats (every rank calls; rank 0 writes), loaded by a fresh model.
    run = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getpid()))  # one directory for every rank
    save_dir = args.save_dir or Path(tempfile.gettempdir()) / f"chunkmem-train-loop-{run}"
    booster.save_model(model, save_dir / "model.pt")
    booster.save_optimizer(optimizer, save_dir / "optimizer.pt")
    fresh_booster = Booster(copy.copy(plugin))
    fresh = build_model(args)
    fresh, fresh_optimizer, *_ = fresh_booster.boost(fresh, make_optimizer(fresh, args))
    fresh_booster.load_model(fresh, save_dir / "model.pt")
    fresh_booster.load_optimizer(fresh_optimizer, save_dir / "optimizer.pt")
    probe = micro_batches(args, args.steps, rank, world)[0]
    with torch.no_grad():  # on every rank: a forward is collective
        trained, reloaded = (m(input_ids=probe, labels=probe).loss.float().cpu() for m in (model, fresh))
    if world > 1:
        dist.barrier()
    if rank == 0 and args.save_dir is None:
        shutil.rmtree(save_dir)
    figures = {
        "peak_device_bytes": stats.peak_device_bytes,
        "budget": int(plugin.placement.device_budget),
        "evictions": stats.evictions,
        "h2d_bytes": stats.h2d_bytes,
        "trained_loss": trained.item(),
        "reloaded_loss": reloaded.item(),
    }
    return losses, figures, weights


def train_plain(args: argparse.Namespace, rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same loop in plain PyTorch (DistributedDataParallel with several ranks) on the compute
    device chunkmem picked: its losses (the mean over ranks) and final weights."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = build_model(args).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else None
    forward = ddp or model
    optimizer = make_optimizer(model, args)
    schedule = make_schedule(optimizer, args)
    losses = []
    for step in range(args.steps):
        micro = [ids.to(device) for ids in micro_batches(args, step, rank, world)]
        total = torch.zeros((), device=device)
        for index, ids in enumerate(micro):
            last = index == len(micro) - 1
            with ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext():
                loss = forward(input_ids=ids, labels=ids).loss / args.accumulate
                loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        if world > 1:
            dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())
    return losses, {name: value.detach().float().cpu() for name, value in model.state_dict().items()}


def where_ranks_run(world: int) -> list[dict[str, str | int | None]]:
    """Every rank's place as torchrun set it: its global rank, its node (torchrun's GROUP_RANK) and
    its rank on that node, the host, and the torchrun agent that started it."""
    mine = {
        "rank": int(os.environ.get("RANK", "0")),
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "host": socket.gethostname(),
        "agent_pid": os.getppid(),
    }
    everyone: list[dict[str, str | int | None]] = [mine] * world
    if world > 1:
        dist.all_gather_object(everyone, mine)
    return everyone


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)  # tiny matmuls: more threads cost more than they save
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    ranks = where_ranks_run(world)
    losses, figures, weights = train_chunkmem(args, rank, world)
    plain, plain_weights = train_plain(args, rank, world) if not args.no_plain else (None, None)
    weight_difference = (
        max((weights[name].float().cpu() - value).abs().max().item() for name, value in plain_weights.items())
        if plain_weights is not None
        else None
    )
    if rank == 0:
        params = sum(p.numel() for p in build_model(args).parameters())
        print(f"{args.model} {args.layers}x{args.width}, {params:,} parameters, world size {world}")
        if world > 1:
            print("ranks: " + ", ".join(f"{r['rank']} on node {r['node']} (local {r['local_rank']})" for r in ranks))
        reference = "plain PyTorch" if world == 1 else "PyTorch DDP"
        print(f"step  {reference:>13}  chunkmem")
        for step, ours in enumerate(losses):
            theirs = f"{plain[step]:13.6f}" if plain else "            -"
            print(f"{step:>4}  {theirs}  {ours:8.6f}")
        if plain:
            worst = max(abs(a - b) for a, b in zip(plain, losses, strict=True))
            print(f"largest loss difference from {reference}: {worst:.2e}; final weights: {weight_difference:.2e}")
        print(
            f"peak device bytes {figures['peak_device_bytes']} <= budget {figures['budget']}; "
            f"{figures['evictions']} evictions, {figures['h2d_bytes'] / 2**20:.1f} MiB host-to-device (rank 0)"
        )
        print(
            f"checkpoint reloaded into a fresh model: loss {figures['reloaded_loss']:.6f} "
            f"(trained model: {figures['trained_loss']:.6f})"
        )
        if args.json is not None:
            result = {"world_size": world, "ranks": ranks, "losses": losses, "plain_losses": plain, **figures}
            args.json.write_text(json.dumps({**result, "weight_difference": weight_difference}, indent=2))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
