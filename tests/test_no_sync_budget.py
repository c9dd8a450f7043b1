"""Gradient accumulation without communication (``booster.no_sync``) under a device budget, at
world size 2 and 4: every chunk's gradient buffer is kept until the synchronised backward, so the
placement plans room for all of them (``ChunkPlugin(gradient_accumulation=True)``), and a budget
that cannot hold them is refused before training touches anything - never a failure in the middle
of a backward. Parity is against plain PyTorch on the whole batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_ranks
from models import adamw_two_groups, assert_state_close, batches, boost, copies, gpt2, lm_loss, tolerance

from chunkmem import BudgetTooSmallError
from placement import AutoPlacementConfig, StaticPlacementConfig

CHUNK = 10_000


def _minimum(make: Any) -> int:
    """The minimum the plugin reports for accumulation (a budget of one byte is refused with it)."""
    with pytest.raises(BudgetTooSmallError) as refused:
        boost(
            gpt2(), adamw_two_groups, precision="fp32", chunk_size=CHUNK, placement=make(1), gradient_accumulation=True
        )
    return refused.value.minimum


def _accumulate(rank: int, world_size: int, kind: str, factor: float, micro: int) -> dict[str, Any]:
    def make(budget: int) -> Any:
        if kind == "auto":
            return AutoPlacementConfig(device_budget=budget, max_prefetch=1)
        return StaticPlacementConfig(device_budget=budget, max_prefetch=1, offload_optim_frac=1.0)

    budget = int(_minimum(make) * factor)
    model, ref = copies(gpt2())
    reference_optimizer = adamw_two_groups(ref)
    chunked, optimizer, booster = boost(
        model, adamw_two_groups, precision="fp32", chunk_size=CHUNK, placement=make(budget), gradient_accumulation=True
    )
    for ids in batches(3, batch=4 * micro):
        lm_loss(ref, ids).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        parts = ids.chunk(world_size)[rank].chunk(micro)
        before = chunked.stats().reduce_scatter_bytes
        with booster.no_sync(chunked, optimizer):
            for part in parts[:-1]:
                booster.backward(lm_loss(chunked, part) / micro, optimizer)
        assert chunked.stats().reduce_scatter_bytes == before, "no_sync must not reduce gradients"
        booster.backward(lm_loss(chunked, parts[-1]) / micro, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    # Micro-batch gradients summed against the whole batch's round differently; AdamW turns that,
    # in an element whose gradient is near zero, into up to a few percent of its lr (1e-3) a step.
    assert_state_close(chunked.state_dict(), ref.state_dict(), *tolerance(chunked, rtol=1e-4, atol=5e-5))
    return {"peak": chunked.stats().peak_device_bytes, "budget": budget}


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("kind", "factor", "micro", "world_size"),
    [
        ("auto", 1.0, 2, 2),
        ("auto", 2.0, 4, 2),
        ("static", 1.0, 3, 2),
        ("auto", 1.0, 3, 4),
    ],
)
def test_no_sync_trains_under_budgets_from_the_reported_minimum(
    kind: str, factor: float, micro: int, world_size: int
) -> None:
    for result in run_ranks(_accumulate, world_size, args=(kind, factor, micro)):
        assert result["peak"] <= result["budget"]


def _refused(rank: int, world_size: int) -> dict[str, Any]:
    # Enough for ordinary training (gradient buffers come and go), not for accumulation.
    placement = StaticPlacementConfig(device_budget=1_300_000)
    chunked, optimizer, booster = boost(
        gpt2(), adamw_two_groups, precision="fp32", chunk_size=CHUNK, placement=placement
    )
    ids = batches(1, batch=8)[0].chunk(world_size)[rank]
    booster.backward(lm_loss(chunked, ids), optimizer)
    optimizer.step()
    optimizer.zero_grad()
    before = chunked.state_dict()
    with pytest.raises(BudgetTooSmallError) as refused, booster.no_sync(chunked, optimizer):
        pass
    message = str(refused.value)
    assert "gradient buffers accumulate under no_sync" in message
    assert "gradient_accumulation=True" in message
    assert "checkpointing" not in message  # only causes that apply
    assert refused.value.minimum > 1_300_000
    after = chunked.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # Training without no_sync goes on.
    booster.backward(lm_loss(chunked, ids), optimizer)
    optimizer.step()
    return {"minimum": refused.value.minimum}


@pytest.mark.multirank
@pytest.mark.fast_tier
def test_no_sync_that_cannot_fit_is_refused_on_entry_on_every_rank() -> None:
    results = run_ranks(_refused, 2)
    assert results[0]["minimum"] == results[1]["minimum"]
