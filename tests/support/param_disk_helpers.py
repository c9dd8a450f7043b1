"""Pieces of ``integration/tiers/test_param_disk.py`` that other tests use too."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from chunkmem import Booster, ChunkPlugin
from chunkmem.placement import StaticPlacementConfig
from support.peft_helpers import train

ON_DISK = StaticPlacementConfig(
    offload_optim_frac=1.0, offload_param_frac=1.0, offload_disk_frac=1.0, offload_param_disk_frac=1.0, max_prefetch=1
)


IN_RAM = StaticPlacementConfig(offload_optim_frac=1.0, offload_param_frac=1.0, max_prefetch=1)


CHUNK = 16_384  # GPT-2 2x64's largest parameter (the embedding): every chunk is as large


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def boosted(model: torch.nn.Module, placement: Any, precision: str, disk_dir: Any) -> tuple[Any, Any, Booster]:
    booster = Booster(ChunkPlugin(placement=placement, precision=precision, chunk_size=CHUNK, disk_dir=disk_dir))
    chunked, optimizer, *_ = booster.boost(model, adamw(model))
    return chunked, optimizer, booster


def train_counted(
    chunked: Any, optimizer: Any, booster: Booster, data: Sequence[torch.Tensor], rank: int = 0, world: int = 1
) -> tuple[list[float], list[Any]]:
    """Each step's loss on this rank's share, and ``stats()`` before and after every step."""
    stats, losses = [chunked.stats()], []
    for ids in data:
        losses += train(chunked, optimizer, booster, [ids], rank, world)
        stats.append(chunked.stats())
    return losses, stats


def assert_same_states(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name
