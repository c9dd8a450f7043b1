"""Pieces of ``integration/trainers/test_hf_trainer.py`` that other tests use too."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from chunkmem import ChunkPlugin
from chunkmem.placement import AutoPlacementConfig
from support.models import VOCAB

if TYPE_CHECKING:
    from transformers import Trainer, TrainingArguments

# Below the model's ~470 KiB of fp32 chunk data: chunks are evicted and gathered again every step.
BUDGET = 200_000


RTOL = 1e-6  # the gradient norm's last bits, and the losses' once clipping acts (module docstring)


def plugin(budget: int = BUDGET) -> ChunkPlugin:
    return ChunkPlugin(placement=AutoPlacementConfig(device_budget=budget), chunk_size=8192, precision="fp32")


def dataset(n: int = 16, seq: int = 16, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, VOCAB, (seq,), generator=g) for _ in range(n)]
    return [{"input_ids": ids, "labels": ids} for ids in rows]


def training_args(output_dir: Path, cls: type[TrainingArguments] | None = None, **overrides: Any) -> Any:
    """Accumulation, clipping, warmup then linear decay, a log line per step (``cls``: a subclass
    such as TRL's ``SFTConfig``; by default ``TrainingArguments``)."""
    from transformers import TrainingArguments

    settings: dict[str, Any] = {
        "output_dir": str(output_dir),
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": 3,
        "learning_rate": 1e-3,
        "weight_decay": 0.1,
        "lr_scheduler_type": "linear",
        "warmup_steps": 1,
        "max_grad_norm": 0.5,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
    }
    settings.update(overrides)
    return (cls or TrainingArguments)(**settings)


def logged(trainer: Trainer, after: int = 0) -> list[dict[str, float]]:
    """The per-step log lines (loss, grad_norm, learning_rate) of the steps after ``after`` (a
    resumed trainer's history starts with the checkpoint's)."""
    return [
        {key: line[key] for key in ("loss", "grad_norm", "learning_rate")}
        for line in trainer.state.log_history
        if "loss" in line and line["step"] > after
    ]


def assert_same_training(
    actual: list[dict[str, float]], expected: list[dict[str, float]], exact: bool, rtol: float = RTOL
) -> None:
    """The same learning rates; the same losses, bit for bit where ``exact``; norms within ``rtol``."""
    assert len(actual) == len(expected) > 0
    assert [line["learning_rate"] for line in actual] == [line["learning_rate"] for line in expected]
    if exact:
        assert [line["loss"] for line in actual] == [line["loss"] for line in expected]
    for got, want in zip(actual, expected, strict=True):
        assert math.isclose(got["loss"], want["loss"], rel_tol=rtol), (got, want)
        assert math.isclose(got["grad_norm"], want["grad_norm"], rel_tol=rtol), (got, want)
