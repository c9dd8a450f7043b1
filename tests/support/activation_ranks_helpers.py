"""Pieces of ``system/ranks/test_activation_ranks.py`` that other tests use too."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from chunkmem import BudgetTooSmallError
from chunkmem.placement import ActivationPlacement, StaticPlacementConfig
from support.activation_budget_helpers import WIDTH, Stack
from support.models import adamw_two_groups, boost

STEPS = 4


SEQ = (12, 16)  # each rank's sequence length (dynamic padding: one rank's batch is shorter)


ROWS = 32


FP32 = 4


# What one call of the longer rank saves (fc1's input, GELU's input, the product's operand, fc2's input).
PER_BLOCK = ROWS * max(SEQ) * FP32 * (WIDTH + 3 * 64)


def _data(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    steps = [[torch.randn(ROWS, seq, WIDTH, generator=g) for seq in SEQ] for _ in range(STEPS)]
    return [step[rank] for step in steps]


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _model_minimum() -> int:
    with pytest.raises(BudgetTooSmallError) as refused:
        boost(Stack(), adamw_two_groups, chunk_size=8_000, placement=StaticPlacementConfig(device_budget=1))
    return refused.value.minimum


def _boost(budget: int) -> tuple[Any, Any, Any]:
    return boost(
        Stack(),
        adamw_two_groups,
        chunk_size=8_000,
        placement=StaticPlacementConfig(device_budget=budget),
        activations=ActivationPlacement(auto=["Block"]),
    )
