"""Ranks that differ in what they step with, or in a gradient collective one rank makes alone, raise
on every rank within seconds (issue 28 items 3 and 5), never train on silently or wait for the
process-group timeout (60 s for these pooled ranks, far above the deadline).

* A learning rate changed on one rank only (``if rank == 0: scheduler.step()``): each param
  group's hyperparameters are agreed at every optimizer step; the error names the group, the key,
  each rank's value and the fix. The same schedule on every rank trains on.
* ``optimizer.clip_grad_norm()`` on one rank only (to log the norm there), and ``no_sync`` entered
  on one rank only.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from support.distributed import run_ranks
from support.models import boost

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

SOON = 20.0  # seconds from the start of the loop to an error on every rank


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x).tanh()
        return self.head(x).pow(2).mean()


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [{"params": model.blocks.parameters(), "weight_decay": 0.1}, {"params": model.head.parameters()}], lr=1e-3
    )


def _train(rank: int, world_size: int, odd: str) -> dict[str, Any]:
    """Four steps; rank 0 does ``odd`` in the second (``scheduler``: it alone steps the LR
    scheduler after each step; ``scheduler_everywhere``: every rank does)."""
    chunked, optimizer, booster = boost(_Blocks(), _adamw, precision="fp32", chunk_size=1_100)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    g = torch.Generator().manual_seed(rank)
    started = time.monotonic()
    try:
        for step in range(4):
            x = torch.randn(4, 32, generator=g)
            here = step == 1 and rank == 0
            if odd == "no_sync" and here:
                with booster.no_sync(chunked, optimizer):
                    booster.backward(chunked(x), optimizer)
            else:
                booster.backward(chunked(x), optimizer)
            if odd == "clip" and here:
                optimizer.clip_grad_norm(1.0)
            optimizer.step()
            optimizer.zero_grad()
            if odd == "scheduler_everywhere" or (odd == "scheduler" and rank == 0):
                scheduler.step()
    except Exception as error:  # every rank must get here
        return {"error": type(error).__name__, "message": str(error), "raised": time.monotonic() - started}
    return {"error": None, "lr": [group["lr"] for group in optimizer.param_groups]}


def _check_raised(results: list[dict[str, Any]], *names: str) -> None:
    for rank, result in enumerate(results):
        assert result["error"] == "TraceDivergenceError", (rank, result)
        assert result["raised"] < SOON, (rank, result)
        message = result["message"]
        assert message.startswith(f"rank {rank}:"), message
        assert "on every rank" in message, message  # what to do
        for name in names:
            assert name in message, (name, message)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_learning_rate_changed_on_one_rank_raises_everywhere(world_size: int) -> None:
    results = run_ranks(_train, world_size, args=("scheduler",), timeout=150)
    others = "".join(f", 0.001 on rank {r}" for r in range(1, world_size))
    _check_raised(results, f"param group 0 'lr': 0.0005 on rank 0{others}", "param group 1 'lr': 0.0005 on rank 0")
    for result in results:
        assert result["message"].split(":")[1].strip().startswith("Every rank must step with the same hyperparameters")
        assert "'weight_decay':" not in result["message"]  # only what differs


def test_a_learning_rate_schedule_on_every_rank_trains_on() -> None:
    results = run_ranks(_train, 2, args=("scheduler_everywhere",), timeout=150)
    assert results[0] == results[1] == {"error": None, "lr": [1e-3 / 16, 1e-3 / 16]}


@pytest.mark.parametrize("world_size", [2, 3])
def test_clip_grad_norm_on_one_rank_raises_everywhere(world_size: int) -> None:
    results = run_ranks(_train, world_size, args=("clip",), timeout=150)
    _check_raised(results, "rank 0: clip_grad_norm", "rank 1: optimizer step", "clip_grad_norm() ")


@pytest.mark.parametrize("world_size", [2, 3])
def test_no_sync_on_one_rank_raises_everywhere(world_size: int) -> None:
    results = run_ranks(_train, world_size, args=("no_sync",), timeout=150)
    _check_raised(results, "rank 0: forward (grad enabled, no_sync)", "rank 1: forward (grad enabled)", "no_sync()")


class _LateWork:
    """A collective that completes just after a bounded wait gave up on it (seen under load: gloo's
    'Operation timed out' while ``is_completed()`` was already true), or that failed."""

    def __init__(self, failure: Exception | None = None) -> None:
        self.failure = failure
        self.waits: list[Any] = []

    def wait(self, timeout: Any = None) -> bool:
        self.waits.append(timeout)
        if timeout is not None:
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Operation timed out!")
        if self.failure is not None:
            raise self.failure
        return True

    def is_completed(self) -> bool:
        return True


def test_an_agreement_whose_collective_completes_as_its_poll_times_out_goes_on() -> None:
    from chunkmem.ranks.rank_checks import _done

    late = _LateWork()
    assert _done(late)
    assert len(late.waits) == 2
    with pytest.raises(RuntimeError, match="Connection closed"):
        _done(_LateWork(RuntimeError("Connection closed by peer")))
