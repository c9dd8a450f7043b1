"""``ActivationPlacement(auto=...)`` at two ranks when a step leaves the plan's figures: a later step
that saves more than any rank's measured step (a longer sequence on one rank) makes every rank
re-plan together and train as plain data parallelism, or, where no plan fits, raise the same error
within seconds; a forward that calls the auto blocks a different number of times on one rank raises
the same error on every rank. Before, the overrunning rank raised alone in a pack hook and the
others waited in their next collective until the process group's timeout."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.activation_budget_helpers import WIDTH, Stack
from support.activation_ranks_helpers import PER_BLOCK, ROWS, _boost, _data, _loss, _model_minimum
from support.distributed import run_ranks
from support.models import adamw_two_groups, as_reference, boost, device_of

from chunkmem import BudgetTooSmallError, ChunkmemError, TraceDivergenceError
from chunkmem.placement import ActivationChoice, ActivationPlacement, StaticPlacementConfig

PG_TIMEOUT = 30.0
LINGER = 8.0  # a rank that raised stays alive up to this long, as a process whose NCCL peers hang would


def _budget() -> int:
    """One call of the longer measured rank kept, and one call's room."""
    return _model_minimum() + 2 * PER_BLOCK + PER_BLOCK // 2


def _linger(rank: int, meeting: str) -> None:
    """Stay alive until the other rank got here too (at once where both raised), at most ``LINGER``
    seconds: a rank that raised alone must not end its process, whose end the other's gloo
    collectives would see at once (NCCL's would not)."""
    (Path(meeting) / f"{rank}").touch()
    other = Path(meeting) / f"{1 - rank}"
    deadline = time.monotonic() + LINGER
    while not other.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _step(chunked: Any, optimizer: Any, booster: Any, x: torch.Tensor) -> None:
    booster.backward(_loss(chunked, x), optimizer)
    optimizer.step()
    optimizer.zero_grad()


def _longer(rank: int, seq: int) -> torch.Tensor:
    """Rank 0's batch at ``seq`` (past every measured call), rank 1's a short one."""
    g = torch.Generator().manual_seed(7)
    return [torch.randn(ROWS, n, WIDTH, generator=g) for n in (seq, 12)][rank]


def _reference(seq: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch data parallelism over the steps ``_replanned`` takes."""
    model = as_reference(Stack())
    optimizer = adamw_two_groups(model)
    device = device_of(model)
    steps = [[_data(r)[0] for r in range(2)], [_data(r)[1] for r in range(2)], [_longer(r, seq) for r in range(2)]]
    steps.append([_data(r)[2] for r in range(2)])
    for batches in steps:
        loss = sum(_loss(model, x.to(device)) for x in batches) / len(batches)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


SEQ_REPLANNED = 20  # each call saves 1.25x the measured figure: a plan still fits


def _replanned(rank: int, world_size: int) -> dict[str, Any]:
    chunked, optimizer, booster = _boost(_budget())
    data = _data(rank)
    for x in data[:2]:  # measured, then placed by the plan
        _step(chunked, optimizer, booster, x)
    first = chunked.activation_plan
    _step(chunked, optimizer, booster, _longer(rank, SEQ_REPLANNED))
    _step(chunked, optimizer, booster, data[2])
    return {
        "state": chunked.state_dict(),
        "first": first,
        "plan": chunked.activation_plan,
        "peak": chunked.stats().peak_device_bytes,
        "budget": _budget(),
    }


@pytest.mark.slow
@pytest.mark.multirank
def test_a_step_saving_more_than_the_plan_re_plans_on_every_rank_and_trains_as_data_parallel() -> None:
    first, second = run_ranks(_replanned, 2)
    expected = _reference(SEQ_REPLANNED)
    for result in (first, second):
        assert result["state"].keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(result["state"][key].cpu(), value, rtol=1e-5, atol=1e-6)
        assert result["peak"] <= result["budget"]
    longer = ROWS * SEQ_REPLANNED * 4 * (WIDTH + 3 * 64)  # what one call of rank 0's longer step saves
    assert first["first"].saved_bytes == (PER_BLOCK,) * 4
    assert first["plan"].saved_bytes == second["plan"].saved_bytes == (longer,) * 4
    assert first["plan"].choices == second["plan"].choices
    assert first["plan"].reserve == longer


def _refused(rank: int, world_size: int, meeting: str) -> dict[str, Any]:
    chunked, optimizer, booster = _boost(_budget())
    for x in _data(rank)[:2]:
        _step(chunked, optimizer, booster, x)
    began = time.monotonic()
    with pytest.raises(ChunkmemError) as refused:  # before: one rank's error, the other's at the timeout
        _step(chunked, optimizer, booster, _longer(rank, 48))  # each call saves 3x: over the budget
    seconds = time.monotonic() - began
    _linger(rank, meeting)
    error = refused.value
    return {"message": str(error), "seconds": seconds, "kind": type(error), "minimum": getattr(error, "minimum", 0)}


@pytest.mark.slow
@pytest.mark.multirank
def test_a_step_saving_more_than_any_plan_fits_raises_the_same_error_on_every_rank_at_once(tmp_path: Path) -> None:
    first, second = run_ranks(_refused, 2, args=(str(tmp_path),), pg_timeout=PG_TIMEOUT, fresh=True)
    assert max(first["seconds"], second["seconds"]) < LINGER
    assert first["message"] == second["message"]
    assert first["kind"] is second["kind"] is BudgetTooSmallError
    message = first["message"]
    assert "ranks [0]" in message and "device_budget" in message and "block blocks." in message
    assert first["minimum"] > _budget() and str(first["minimum"]) in message


class Gate(torch.nn.Module):
    """A block without parameters: its calls touch no chunk, so the compute trace does not see them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x) * x


class Gated(Stack):
    """A gate after every block; rank 0 calls the first gate twice from the third step on."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.gates = torch.nn.ModuleList(Gate() for _ in self.blocks)
        self.rank, self.repeat = rank, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (block, gate) in enumerate(zip(self.blocks, self.gates, strict=True)):
            x = gate(block(x))
            if i == 0 and self.repeat and self.rank == 0:
                x = gate(x)
        return self.head(x)


def _more_calls(rank: int, world_size: int, meeting: str) -> dict[str, Any]:
    model = Gated(rank)
    chunked, optimizer, booster = boost(
        model,
        adamw_two_groups,
        chunk_size=8_000,
        placement=StaticPlacementConfig(device_budget=4 * _budget()),  # room: the ranks place chunks alike
        activations=ActivationPlacement(auto=["Gate"]),
        check_plans=False,  # as in production (check mode would report the ranks' differing ledgers first)
    )
    data = _data(rank)
    _step(chunked, optimizer, booster, data[0])
    _step(chunked, optimizer, booster, data[1])
    assert ActivationChoice.KEEP in chunked.activation_plan.choices
    model.repeat = True
    began = time.monotonic()
    with pytest.raises(TraceDivergenceError) as refused:  # before: no error, the ranks' ledgers apart
        _step(chunked, optimizer, booster, data[2])
    seconds = time.monotonic() - began
    _linger(rank, meeting)
    return {"message": str(refused.value), "seconds": seconds}


@pytest.mark.slow
@pytest.mark.multirank
def test_ranks_calling_the_auto_blocks_a_different_number_of_times_raise_the_same_error(tmp_path: Path) -> None:
    first, second = run_ranks(_more_calls, 2, args=(str(tmp_path),), pg_timeout=PG_TIMEOUT, fresh=True)
    assert first["message"] == second["message"]
    assert "5 on rank 0, 4 on rank 1" in first["message"]
    assert max(first["seconds"], second["seconds"]) < LINGER
