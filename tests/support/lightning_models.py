"""The Lightning side of ``test_lightning.py``: a small ``LightningModule``, its data, and the plain
and chunkmem Trainers that fit it. A module of its own, imported by the tests that use it, so that
collecting the tests (every pytest-xdist worker collects every module) does not import Lightning
(seconds); ``conftest.py``'s fork server then does not hold it either, and a rank imports it when it
runs one of these tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from chunkmem.integrations.lightning import ChunkStrategy
from chunkmem.placement import AutoPlacementConfig

# The model below holds 1633 fp32 parameters: with gradients and AdamW's two states everything
# takes about 26 KB; 12 000 bytes is just above the largest single-op working set, so chunks are
# evicted and gathered again during every step.
BUDGET = 12_000
CHUNK = 400
STEPS_PER_EPOCH = 8


class Regressor(L.LightningModule):
    """Three linear layers, AdamW with two param groups and a per-step LR schedule; records the
    loss of every micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.val_losses.append(torch.nn.functional.mse_loss(self.net(x), y).item())

    def configure_optimizers(self) -> Any:
        matrices = [p for p in self.parameters() if p.ndim == 2]
        vectors = [p for p in self.parameters() if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}], lr=2e-2
        )
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class DropoutRegressor(Regressor):
    """The same layers and parameters with dropout between them: each step draws from the RNG."""

    def __init__(self) -> None:
        super().__init__()
        first, tanh, middle, tanh_again, last = self.net
        self.net = torch.nn.Sequential(
            first, tanh, torch.nn.Dropout(0.2), middle, tanh_again, torch.nn.Dropout(0.2), last
        )


def loader(seed: int = 1, batches: int = STEPS_PER_EPOCH) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batches * 8, 16, generator=g)
    return DataLoader(TensorDataset(x, x[:, :1].sin() + 0.1 * torch.randn(len(x), 1, generator=g)), batch_size=8)


def trainer(strategy: Any, epochs: int, **kwargs: Any) -> L.Trainer:
    kwargs.setdefault("num_sanity_val_steps", 2)
    kwargs.setdefault("enable_checkpointing", False)
    kwargs.setdefault("devices", 1)
    return L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def validation_loader() -> DataLoader:
    return loader(seed=2, batches=2)


def fit(
    strategy: Any,
    epochs: int = 2,
    ckpt_path: Path | None = None,
    validate: bool = False,
    module_class: type[Regressor] = Regressor,
    **kwargs: Any,
) -> tuple[Regressor, L.Trainer]:
    module = module_class()
    run = trainer(strategy, epochs, **kwargs)
    run.fit(module, loader(), validation_loader() if validate else None, ckpt_path=ckpt_path)
    return module, run


def chunk_strategy() -> ChunkStrategy:
    return ChunkStrategy(placement=AutoPlacementConfig(device_budget=BUDGET), chunk_size=CHUNK)


# --- modules the strategy refuses ------------------------------------------------------------------
class Manual(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class OwnBackward(Regressor):
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward()
