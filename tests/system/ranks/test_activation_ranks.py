"""``ActivationPlacement(auto=...)`` at two ranks that differ in what their calls save or keep: every
decision reads rank-agreed figures, so the ranks' collectives stay in step and training equals
plain data parallelism (each rank's gradients, averaged)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.activation_budget_helpers import BLOCKS, Stack
from support.activation_ranks_helpers import PER_BLOCK, SEQ, STEPS, _boost, _data, _loss, _model_minimum
from support.distributed import run_ranks
from support.models import adamw_two_groups, as_reference, device_of

from chunkmem import BudgetTooSmallError
from chunkmem.placement import ActivationChoice


def _reference(steps: range = range(STEPS)) -> dict[str, torch.Tensor]:
    """Plain PyTorch data parallelism: the mean of the ranks' gradients at every step."""
    model = as_reference(Stack())
    optimizer = adamw_two_groups(model)
    device = device_of(model)
    for step in steps:
        loss = sum(_loss(model, _data(rank)[step].to(device)) for rank in range(len(SEQ))) / len(SEQ)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _assert_matches_reference(state: dict[str, torch.Tensor], steps: range = range(STEPS)) -> None:
    expected = _reference(steps)
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(state[key].cpu(), value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


def _trained(budget: int, rank: int) -> Any:
    """The stack boosted under ``budget``, trained on this rank's data as data parallelism does."""
    chunked, optimizer, booster = _boost(budget)
    for x in _data(rank):
        booster.backward(_loss(chunked, x), optimizer)
        optimizer.step()
        optimizer.zero_grad()
    _assert_matches_reference(chunked.state_dict())
    return chunked


def _uneven(rank: int, world_size: int) -> dict[str, Any]:
    budget = _model_minimum() + 2 * PER_BLOCK + PER_BLOCK // 2  # one call of the longer rank kept, one's room
    chunked = _trained(budget, rank)
    plan = chunked.activation_plan
    assert plan.saved_bytes == (PER_BLOCK,) * BLOCKS  # the longer rank's, on both ranks
    assert chunked.stats().peak_device_bytes <= budget
    return {"choices": plan.choices}


@pytest.mark.slow
@pytest.mark.multirank
def test_ranks_saving_different_bytes_place_by_the_agreed_figures_and_train_as_data_parallel() -> None:
    first, second = run_ranks(_uneven, 2, pg_timeout=20.0)
    assert first["choices"] == second["choices"]
    assert ActivationChoice.KEEP in first["choices"] and set(first["choices"]) != {ActivationChoice.KEEP}


def _one_rank_keeps_a_measured_graph(rank: int, world_size: int) -> dict[str, Any]:
    """A first training forward without a backward (a metric computed with autograd on), whose
    output only rank 1 keeps for a while: its measured calls wait for a backward there only."""
    budget = _model_minimum() + 2 * PER_BLOCK + PER_BLOCK // 2
    chunked, optimizer, booster = _boost(budget)
    data = _data(rank)
    kept = chunked(data[0])  # measured: every call offloaded, nothing fetched
    if rank == 0:
        del kept
    plans = []
    for step, x in enumerate(data[1:]):
        if step == 1:
            kept = None  # rank 1 lets go of it too
        booster.backward(_loss(chunked, x), optimizer)
        optimizer.step()
        optimizer.zero_grad()
        plans.append(chunked.activation_plan is not None)
    _assert_matches_reference(chunked.state_dict(), range(1, STEPS))
    assert chunked.stats().peak_device_bytes <= budget
    return {"plans": plans, "choices": chunked.activation_plan.choices}


@pytest.mark.slow
@pytest.mark.multirank
def test_the_plan_is_made_when_every_rank_let_go_of_the_measured_graphs() -> None:
    first, second = run_ranks(_one_rank_keeps_a_measured_graph, 2, pg_timeout=20.0)
    assert first["plans"] == second["plans"] == [False, True, True]  # decided once rank 1 let go
    assert first["choices"] == second["choices"]


def _under_the_minimum(rank: int, world_size: int) -> dict[str, Any]:
    """A budget one byte under what the longer rank's calls need: both ranks refuse it at their first
    training forward with the same minimum (the shorter rank's own calls would fit), and the minimum
    trains as data parallelism."""
    minimum = _model_minimum() + PER_BLOCK
    chunked, _, _ = _boost(minimum - 1)
    with pytest.raises(BudgetTooSmallError) as refused:
        _loss(chunked, _data(rank)[0])
    chunked = _trained(minimum, rank)
    assert chunked.stats().peak_device_bytes <= minimum
    return {"minimum": refused.value.minimum, "expected": minimum}


@pytest.mark.slow
@pytest.mark.multirank
def test_every_rank_refuses_a_budget_under_the_minimum_at_the_first_forward_naming_it() -> None:
    first, second = run_ranks(_under_the_minimum, 2, pg_timeout=20.0)
    assert first["minimum"] == second["minimum"] == first["expected"]
