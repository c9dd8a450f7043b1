"""Pieces of ``integration/activations/test_activation_budget.py`` that other tests use too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from chunkmem import BudgetTooSmallError
from chunkmem.placement import (
    ActivationChoice,
    ActivationPlacement,
    StaticPlacementConfig,
)
from support.models import adamw_two_groups, as_reference, boost, device_of

WIDTH, HIDDEN, BATCH, BLOCKS, STEPS = 32, 64, 512, 4, 3


FP32 = 4


# What one block call saves (fc1's input, GELU's input, the product's operand, fc2's input).
PER_BLOCK = BATCH * FP32 * (WIDTH + 3 * HIDDEN)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(WIDTH, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = F.gelu(self.fc1(x))
        return x + self.fc2(g * g)


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = torch.nn.Linear(WIDTH, 4)
        self.checkpointed: set[int] = set()  # the reference's checkpointed blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=False) if i in self.checkpointed else block(x)
        return self.head(x)


def _data(rank: int = 0, world_size: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(BATCH * world_size, WIDTH, generator=g).chunk(world_size)[rank] for _ in range(STEPS)]


def _loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _auto() -> ActivationPlacement:
    return ActivationPlacement(auto=["Block"])


AUTO = ActivationPlacement(auto=["Block"])


def _boosted(
    budget: int | None, activations: ActivationPlacement | None = AUTO, optim_on_host: bool = False
) -> tuple[Any, Any, Any]:
    """The stack boosted under ``budget`` with ``activations`` (default: every block ``auto``), its
    optimizer side on the host with ``optim_on_host``."""
    return boost(
        Stack(),
        adamw_two_groups,
        chunk_size=8_000,
        placement=StaticPlacementConfig(device_budget=budget, offload_optim_frac=float(optim_on_host)),
        activations=activations,
    )


def _train(
    budget: int | None,
    activations: ActivationPlacement | None,
    rank: int = 0,
    world_size: int = 1,
    optim_on_host: bool = False,
) -> dict[str, Any]:
    chunked, optimizer, booster = _boosted(budget, activations, optim_on_host)
    losses, after_forward, after_first = [], [], None
    for x in _data(rank, world_size):
        loss = _loss(chunked, x)
        after_forward.append(chunked.stats())
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        after_first = after_first or chunked.stats()
    return {
        "losses": losses,
        "state": chunked.state_dict(),
        "stats": chunked.stats(),
        "after_forward": after_forward,
        "after_first": after_first,
        "plan": chunked.activation_plan,
    }


def _plain(recomputed: set[int], data: list[torch.Tensor] | None = None) -> dict[str, Any]:
    """Plain PyTorch on ``data`` (default ``_data()``): the first step as it is, the next ones with
    the recomputed blocks under non-reentrant checkpointing."""
    model = as_reference(Stack())
    optimizer = adamw_two_groups(model)
    losses = []
    for step, x in enumerate(_data() if data is None else data):
        model.checkpointed = recomputed if step else set()
        loss = _loss(model, x.to(device_of(model)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": model.state_dict()}


def _model_minimum(optim_on_host: bool = False) -> int:
    """The device budget model data alone needs (boost refuses a smaller one, naming it)."""
    with pytest.raises(BudgetTooSmallError) as refused:
        _boosted(1, None, optim_on_host)
    return refused.value.minimum


def _recomputed(plan: Any) -> set[int]:
    return {i for i, choice in enumerate(plan.choices) if choice is ActivationChoice.RECOMPUTE}
