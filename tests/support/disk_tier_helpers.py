"""Pieces of ``integration/tiers/test_disk_tier.py`` that other tests use too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from chunkmem import Booster, ChunkPlugin
from chunkmem.placement import StaticPlacementConfig

WIDTH, LAYERS, CHUNK = 64, 6, 4_200  # one layer a chunk


ON_DISK = StaticPlacementConfig(offload_optim_frac=1.0, offload_disk_frac=1.0, max_prefetch=0)


def _mlp(seed: int = 0, layers: int = LAYERS) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def _boost(placement: Any, precision: str, disk_dir: Path | None, seed: int = 0, layers: int = LAYERS) -> Any:
    model = _mlp(seed, layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    plugin = ChunkPlugin(placement=placement, precision=precision, chunk_size=CHUNK, disk_dir=disk_dir)
    booster = Booster(plugin=plugin)
    chunked, boosted, *_ = booster.boost(model, optimizer)
    return chunked, boosted, booster


def _train(chunked: Any, optimizer: Any, booster: Any, steps: int, seed: int = 1) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    stats = [chunked.stats()]
    for _ in range(steps):
        x = torch.randn(8, WIDTH, generator=g)
        booster.backward(chunked(x).float().square().mean(), optimizer)
        optimizer.step()
        optimizer.zero_grad()
        stats.append(chunked.stats())
    return stats


def _scratch(disk_dir: Path) -> list[Path]:
    return sorted(disk_dir.glob(".chunkmem-scratch-*"))
