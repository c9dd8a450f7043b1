"""Train a small GPT-2 with Lightning under chunkmem's ``ChunkStrategy`` on the CPU, beside plain
Lightning on the same module and data: gradient accumulation, norm clipping, a cosine LR schedule,
a device budget below what the model needs, and a checkpoint after the first epoch from which a new
``Trainer`` resumes.

    python examples/lightning_train.py

Under ``torchrun --nproc-per-node N`` every rank runs it and ``Trainer(devices=N)`` shards the data
(the comparison with plain Lightning is then skipped; checkpoints are sharded directories)."""

from __future__ import annotations

import logging
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

from chunkmem.integrations.lightning import ChunkStrategy
from chunkmem.placement import AutoPlacementConfig

EPOCHS = 2
BATCHES = 8  # per epoch
ACCUMULATE = 2
BUDGET = 1_500_000  # bytes: the model, its gradients and AdamW's states take 1.6 MB


class TinyGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=256, n_positions=16, n_embd=64, n_layer=2, n_head=4, bos_token_id=0)
        config.eos_token_id = 0
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0  # deterministic, to compare runs
        self.model = GPT2LMHeadModel(config)
        self.losses: list[float] = []

    def training_step(self, ids: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)
        steps = EPOCHS * BATCHES // ACCUMULATE
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def loader() -> DataLoader:
    """Arithmetic progressions of tokens mod 256: a pattern the model learns within a few steps."""
    g = torch.Generator().manual_seed(1)
    start = torch.randint(0, 256, (BATCHES * 8, 1), generator=g)
    stride = torch.randint(1, 5, (BATCHES * 8, 1), generator=g)
    return DataLoader((start + stride * torch.arange(16)) % 256, batch_size=8)


def fit(strategy: Any, epochs: int, ckpt_path: Path | None = None) -> tuple[TinyGPT, L.Trainer]:
    module = TinyGPT()
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
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return module, trainer


def epoch_means(losses: list[float]) -> str:
    """This rank's micro-batch losses averaged per epoch (with torchrun a rank sees 1/N of the batches)."""
    per_epoch = len(losses) // EPOCHS
    return ", ".join(f"{sum(losses[i : i + per_epoch]) / per_epoch:.4f}" for i in range(0, len(losses), per_epoch))


def main() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="lightning")

    def strategy() -> ChunkStrategy:
        return ChunkStrategy(placement=AutoPlacementConfig(device_budget=BUDGET), chunk_size=20_000)

    begin = time.perf_counter()
    # One directory for every rank (with torchrun each writes its own pieces into it).
    checkpoint = Path(tempfile.gettempdir()) / "chunkmem_lightning_example" / "epoch1.ckpt"
    first, trainer = fit(strategy(), epochs=1)
    trainer.save_checkpoint(checkpoint)  # a directory: model, optimizer (chunkmem's formats), trainer.ckpt
    saved = sorted(p.name for p in checkpoint.iterdir())
    second, trainer = fit(strategy(), epochs=EPOCHS, ckpt_path=checkpoint)
    seconds = time.perf_counter() - begin
    trainer.strategy.barrier()
    if trainer.is_global_zero:
        shutil.rmtree(checkpoint.parent)
    losses = first.losses + second.losses
    stats = trainer.strategy.model.stats()
    if trainer.is_global_zero:
        print(f"checkpoint after epoch 1: {saved}")
        print(f"chunkmem, resumed after epoch 1: mean loss per epoch {epoch_means(losses)}  ({seconds:.1f} s)")
        print(
            f"peak device bytes {stats.peak_device_bytes} <= budget {BUDGET}; "
            f"{stats.evictions} evictions, {stats.gathers} gathers"
        )
    if trainer.world_size == 1:
        begin = time.perf_counter()
        plain, _ = fit("auto", epochs=EPOCHS)
        seconds = time.perf_counter() - begin
        print(f"plain Lightning, uninterrupted:  mean loss per epoch {epoch_means(plain.losses)}  ({seconds:.1f} s)")
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, plain.losses, strict=True))
        print(f"largest relative difference over {len(losses)} micro-batch losses: {worst:.1e}")


if __name__ == "__main__":
    main()
