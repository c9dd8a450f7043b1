"""``no_sync`` gradient accumulation is bit-exact against plain PyTorch, also where gradient buffers
move to the host in the middle of a backward, for weights used twice in one forward (a shared
layer, GPT-2's tied embeddings).

The reference is plain PyTorch's own order: per rank, ``.grad += g`` per parameter for each
micro-batch (autograd sums a parameter's uses within one backward before that), then the ranks'
sums added and divided by the world size (what DDP with ``no_sync`` reduces; at two ranks the
order of the two terms does not matter). chunkmem must make the same additions in the same
order: a buffer moved to the host mid-accumulation, or a chunk reduced before the last
micro-batch's gradients are all in, sums the same numbers in another order (differences of
1e-8 in a gradient, amplified to 1e-6 in the weights by three AdamW steps)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.distributed import run_ranks
from support.models import (
    adamw_two_groups,
    assert_state_close,
    batches,
    boost,
    copies,
    device_of,
    gpt2,
    lm_loss,
    tolerance,
)
from support.tier import slow_cases

from chunkmem import BudgetTooSmallError, ChunkedModel
from chunkmem.placement import AutoPlacementConfig, Verb

MICRO = 4
STEPS = 3


class SharedLayer(torch.nn.Module):
    """The middle layer runs twice per forward: its weight gets two contributions per backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(16, 32)
        self.shared = torch.nn.Linear(32, 32)
        self.out = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        return self.out(torch.tanh(self.shared(h)))


def _shared_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """As ``lm_loss``: a plain module gets its input on its device, a boosted model moves it."""
    return model(x if isinstance(model, ChunkedModel) else x.to(device_of(model))).pow(2).mean()


def _shared_data(step: int, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(4, 16, generator=g) for _ in range(MICRO)]


def _gpt2_data(step: int, rank: int) -> list[torch.Tensor]:
    return list(batches(1, batch=2 * MICRO, seed=100 * step + rank)[0].chunk(MICRO))


# name -> (model, chunk size, loss, micro-batches of a step and rank)
SETUPS: dict[str, tuple[Callable[[], torch.nn.Module], int, Callable[..., torch.Tensor], Callable[..., Any]]] = {
    "shared-layer": (SharedLayer, 1100, _shared_loss, _shared_data),
    "gpt2-tied": (gpt2, 10_000, lm_loss, _gpt2_data),
}


def _minimum(name: str) -> int:
    make, chunk_size, _, _ = SETUPS[name]
    with pytest.raises(BudgetTooSmallError) as refused:
        boost(make(), adamw_two_groups, precision="fp32", chunk_size=chunk_size, placement=_placement(1))
    return refused.value.minimum


def _placement(budget: int) -> AutoPlacementConfig:
    return AutoPlacementConfig(device_budget=budget, max_prefetch=1)


def _reference_step(
    ref: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: Callable[..., torch.Tensor], parts: list[list[Any]]
) -> None:
    """Plain PyTorch: each rank's micro-batches accumulated into ``.grad``, the ranks' sums added
    in rank order and divided by the world size, then one step."""
    world_size = len(parts)
    total: list[torch.Tensor] | None = None
    for rank_parts in parts:
        for part in rank_parts:
            (loss(ref, part) / MICRO).backward()
        grads = [p.grad.clone() for p in ref.parameters()]
        total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
        optimizer.zero_grad()
    assert total is not None
    for p, g in zip(ref.parameters(), total, strict=True):
        p.grad = g / world_size if world_size > 1 else g
    optimizer.step()
    optimizer.zero_grad()


def _accumulate_exactly(rank: int, world_size: int, name: str, budget_factor: float) -> dict[str, Any]:
    make, chunk_size, loss, data = SETUPS[name]
    budget = int(_minimum(name) * budget_factor)
    model, ref = copies(make())
    reference_optimizer = adamw_two_groups(ref)
    chunked, optimizer, booster = boost(
        model, adamw_two_groups, precision="fp32", chunk_size=chunk_size, placement=_placement(budget)
    )
    spills = early = 0
    for step in range(STEPS):
        parts = [data(step, r) for r in range(world_size)]
        _reference_step(ref, reference_optimizer, loss, parts)
        mine = parts[rank]
        with chunked.runtime.record_actions() as actions:
            with booster.no_sync(chunked, optimizer):
                for part in mine[:-1]:
                    booster.backward(loss(chunked, part) / MICRO, optimizer)
            booster.backward(loss(chunked, mine[-1]) / MICRO, optimizer)
        spills += sum(a.verb is Verb.SPILL_GRAD for a in actions)
        early += sum(a.verb is Verb.REDUCE_EARLY for a in actions)
        optimizer.step()
        optimizer.zero_grad()
    assert_state_close(chunked.state_dict(), ref.state_dict(), *tolerance(chunked, rtol=0.0, atol=0.0))
    return {"spills": spills, "early": early, "peak": chunked.stats().peak_device_bytes, "budget": budget}


@pytest.mark.parametrize("name", slow_cases(SETUPS, "gpt2-tied"))
def test_no_sync_is_bit_exact_at_one_rank(name: str) -> None:
    """At one rank nothing moves to the host (a reduction needs no other rank): a buffer the
    device needs room for is reduced early into the gradient shard, which adds each backward's
    gradients to the sum in order."""
    result = _accumulate_exactly(0, 1, name, 1.0)
    assert result["spills"] == 0 and result["peak"] <= result["budget"]


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("name", "budget_factor"),
    [
        # The smallest budget: buffers move to the host in every micro-batch, and in the last
        # backward chunks would be reduced before all their gradients are in.
        ("shared-layer", 1.0),
        # Room for more: a chunk moved to the host in one micro-batch keeps its buffer through
        # the next ones, which must go on adding to the sum the host holds.
        ("shared-layer", 1.5),
        ("gpt2-tied", 1.0),
    ],
)
def test_no_sync_with_buffers_moving_to_the_host_is_bit_exact_at_two_ranks(name: str, budget_factor: float) -> None:
    results = run_ranks(_accumulate_exactly, 2, args=(name, budget_factor))
    for result in results:
        assert result["spills"] > 0, "the budget was meant to move gradient buffers to the host"
        assert result["peak"] <= result["budget"]
