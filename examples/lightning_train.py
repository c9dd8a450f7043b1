"""Train a small GPT-2 with Lightning under chunkmem's ``ChunkStrategy`` on the CPU, beside plain
Lightning on the same module and data: gradient accumulation, norm clipping, a cosine LR schedule,
a device budget below what the model needs, and a checkpoint after the first epoch from which a new
``Trainer`` resumes.

    python examples/lightning_train.py                  # seconds on a CPU
    python examples/lightning_train.py --epochs 4 --budget 1000000

Under ``torchrun --nproc-per-node N`` every rank runs it and ``Trainer(devices=N)`` shards the data
(the comparison with plain Lightning is then skipped; checkpoints are sharded directories)."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from chunkmem import AutoPlacementConfig
from chunkmem.integrations.lightning import ChunkStrategy

EPOCHS = 2  # the default; --epochs
BATCHES = 8  # per epoch (the default; --batches)
ACCUMULATE = 2
BUDGET = 1_500_000  # bytes (the default; --budget): the model, its gradients and AdamW's states take 1.6 MB


class TinyGPT(L.LightningModule):
    def __init__(self, epochs: int, batches: int) -> None:
        super().__init__()
        self.steps = epochs * batches // ACCUMULATE  # of the whole run, for the LR schedule
        torch.manual_seed(0)
        config = GPT2Config(
            vocab_size=256, n_positions=16, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0
        )
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0  # deterministic, to compare runs
        self.model = GPT2LMHeadModel(config)
        self.model.loss_type = "ForCausalLM"  # the loss transformers falls back to for GPT-2, named (no warning)
        self.losses: list[float] = []

    def training_step(self, ids: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def loader(batches: int) -> DataLoader:
    """Arithmetic progressions of tokens mod 256: a pattern the model learns within a few steps."""
    g = torch.Generator().manual_seed(1)
    start = torch.randint(0, 256, (batches * 8, 1), generator=g)
    stride = torch.randint(1, 5, (batches * 8, 1), generator=g)
    return DataLoader((start + stride * torch.arange(16)) % 256, batch_size=8)


def fit(
    strategy: Any, epochs: int, args: argparse.Namespace, ckpt_path: Path | None = None
) -> tuple[TinyGPT, L.Trainer]:
    """Train until epoch ``epochs`` of a run of ``args.epochs`` (resuming from ``ckpt_path``)."""
    module = TinyGPT(args.epochs, args.batches)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1 if strategy == "auto" else "auto",
        max_epochs=epochs,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader(args.batches), ckpt_path=ckpt_path)
    return module, trainer


def epoch_means(losses: list[float], epochs: int) -> str:
    """This rank's micro-batch losses averaged per epoch (with torchrun a rank sees 1/N of the batches)."""
    per_epoch = len(losses) // epochs
    return ", ".join(f"{sum(losses[i : i + per_epoch]) / per_epoch:.4f}" for i in range(0, len(losses), per_epoch))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=EPOCHS, help="epochs (a checkpoint after the first; at least 2)")
    parser.add_argument("--batches", type=int, default=BATCHES, help="batches of 8 rows per epoch (even)")
    parser.add_argument("--budget", type=int, default=BUDGET, help="device budget in bytes (chunk bytes on the device)")
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error("--epochs must be at least 2: the run resumes from the checkpoint of epoch 1")
    if args.batches < ACCUMULATE or args.batches % ACCUMULATE:
        parser.error(f"--batches must be a multiple of {ACCUMULATE}, the batches accumulated into a step")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="lightning")

    def strategy() -> ChunkStrategy:
        return ChunkStrategy(placement=AutoPlacementConfig(device_budget=args.budget), chunk_size=20_000)

    begin = time.perf_counter()
    # One directory for every rank (with torchrun each writes its own pieces into it), one per run.
    run = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getpid()))
    checkpoint = Path(tempfile.gettempdir()) / f"chunkmem-lightning-example-{run}" / "epoch1.ckpt"
    first, trainer = fit(strategy(), 1, args)
    trainer.save_checkpoint(checkpoint)  # a directory: model, optimizer (chunkmem's formats), trainer.ckpt
    saved = sorted(p.name for p in checkpoint.iterdir())
    second, trainer = fit(strategy(), args.epochs, args, ckpt_path=checkpoint)
    seconds = time.perf_counter() - begin
    trainer.strategy.barrier()
    if trainer.is_global_zero:
        shutil.rmtree(checkpoint.parent)
    losses = first.losses + second.losses
    stats = trainer.strategy.model.stats()
    if trainer.is_global_zero:
        print(f"checkpoint after epoch 1: {saved}")
        means = epoch_means(losses, args.epochs)
        print(f"chunkmem, resumed after epoch 1: mean loss per epoch {means}  ({seconds:.1f} s)")
        print(
            f"peak device bytes {stats.peak_device_bytes} <= budget {args.budget}; "
            f"{stats.evictions} evictions, {stats.gathers} gathers"
        )
    if trainer.world_size == 1:
        begin = time.perf_counter()
        plain, _ = fit("auto", args.epochs, args)
        seconds = time.perf_counter() - begin
        means = epoch_means(plain.losses, args.epochs)
        print(f"plain Lightning, uninterrupted:  mean loss per epoch {means}  ({seconds:.1f} s)")
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, plain.losses, strict=True))
        print(f"largest relative difference over {len(losses)} micro-batch losses: {worst:.1e}")


if __name__ == "__main__":
    main()
