"""Ranks that depart from each other raise on every rank, within seconds, with a message naming
each rank's iteration and op and what to do - never a gloo abort or a hang until the timeout.

Each case runs a few normal steps, then one rank departs: an extra no-grad forward (evaluation)
on one rank, a module called outside the model's forward on one rank, a module skipped by a
rank-dependent branch (in the first, recording iteration and in a later, trace-following one, with
prefetch, at W=2 and W=4). The same departure taken by every rank is not an error.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from distributed import run_ranks
from models import boost

from placement import AutoPlacementConfig, StaticPlacementConfig

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

DEADLINE = 30.0  # seconds from the departure to an error on every rank


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, skip: int | None = None) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            if index != skip:
                x = x + block(x).tanh()
        return self.head(x).pow(2).mean()


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


PLACEMENTS = {
    "static": StaticPlacementConfig(),
    "static-prefetch2": StaticPlacementConfig(max_prefetch=2),
    "auto-budget-prefetch1": AutoPlacementConfig(device_budget=60_000, max_prefetch=1),
}


def _run(rank: int, world_size: int, placement: str, depart: str, at_step: int, who: int) -> dict[str, Any]:
    chunked, optimizer, booster = boost(
        _Blocks(), _adamw, precision="fp32", chunk_size=1_100, placement=PLACEMENTS[placement]
    )
    g = torch.Generator().manual_seed(rank)
    departed_at = None
    try:
        for step in range(at_step + 2):
            x = torch.randn(4, 32, generator=g)
            skip = None
            if step == at_step and rank in (who, -1):
                departed_at = time.monotonic()
                if depart == "eval":
                    with torch.no_grad():
                        chunked(x)
                elif depart == "submodule":
                    # Called directly, the block gets no input moving from the wrapper.
                    chunked.module.blocks[1](x.to(chunked.compute_device))
                elif depart == "skip":
                    skip = 2
            if step == at_step and depart == "skip" and who == -1:
                skip = 2
            loss = chunked(x, skip=skip)
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
    except Exception as error:  # every rank must get here
        return {"error": type(error).__name__, "message": str(error), "raised": time.monotonic()}
    return {"error": None, "departed": departed_at, "divergences": chunked.stats().divergences}


def _check_all_raised(results: list[dict[str, Any]], names: tuple[str, ...]) -> None:
    for rank, result in enumerate(results):
        assert result["error"] == "TraceDivergenceError", (rank, result)
        message = result["message"]
        assert f"rank {rank}:" in message
        for name in names:
            assert name in message, (rank, name, message)
        assert "every rank" in message or "Every rank" in message  # says what to do


@pytest.mark.parametrize("depart", ["eval", "submodule"])
def test_extra_work_on_one_rank_raises_everywhere(depart: str) -> None:
    start = time.monotonic()
    results = run_ranks(_run, 2, args=("static", depart, 2, 0), timeout=120, pg_timeout=60)
    assert time.monotonic() - start < DEADLINE + 20  # spawning ranks and three steps included
    _check_all_raised(results, ("rank 0", "rank 1", "training iteration 2"))
    if depart == "eval":
        assert "grad disabled" in results[0]["message"]


@pytest.mark.parametrize(
    ("placement", "at_step", "world_size"),
    [
        ("static", 0, 2),  # recording: collectives are agreed one by one
        ("static-prefetch2", 2, 2),  # following the trace: the departing rank alarms the others
        ("auto-budget-prefetch1", 2, 2),
        ("static-prefetch2", 2, 4),
    ],
)
def test_rank_dependent_skip_raises_everywhere(placement: str, at_step: int, world_size: int) -> None:
    who = world_size - 1
    start = time.monotonic()
    results = run_ranks(_run, world_size, args=(placement, "skip", at_step, who), timeout=150, pg_timeout=60)
    assert time.monotonic() - start < DEADLINE + 30
    _check_all_raised(results, (f"rank {who}", f"training iteration {at_step}"))
    if at_step > 0:
        # The departing rank is named as such on every rank.
        for result in results:
            assert f"ranks [{who}] departed from the compute trace" in result["message"]


def test_the_same_departure_on_every_rank_trains_on() -> None:
    results = run_ranks(_run, 2, args=("static-prefetch2", "skip", 2, -1), timeout=120)
    for result in results:
        assert result["error"] is None, result
        assert result["divergences"] >= 1


def _compile_second_model(rank: int, world_size: int) -> str:
    first, optimizer, booster = boost(_Blocks(), _adamw, precision="fp32", chunk_size=1_100)
    second, _, _ = boost(_Blocks(), _adamw, precision="fp32", chunk_size=1_100)
    x = torch.randn(4, 32)
    booster.backward(first(x), optimizer)
    optimizer.step()
    compiled = torch.compile(second)
    try:
        compiled(x)
    except Exception as error:  # dynamo wraps it; the message is chunkmem's
        return str(error)
    return "compiled and ran"


def test_torch_compile_of_a_boosted_model_is_refused_not_hung() -> None:
    start = time.monotonic()
    messages = run_ranks(_compile_second_model, 2, timeout=120, pg_timeout=60)
    assert time.monotonic() - start < DEADLINE + 30
    for message in messages:
        assert "torch.compile" in message and "eagerly" in message, message


def _hugging_face_on_one_rank(rank: int, world_size: int, depart: str, out_dir: str) -> dict[str, Any]:
    from models import adamw_two_groups, batches, gpt2, lm_loss

    chunked, optimizer, booster = boost(gpt2(), adamw_two_groups, precision="fp32", chunk_size=10_000)
    try:
        for step, ids in enumerate(batches(3, batch=4)):
            if step == 1 and rank == 0:
                if depart == "generate":
                    chunked.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
                else:
                    chunked.save_pretrained(out_dir)
            booster.backward(lm_loss(chunked, ids.chunk(world_size)[rank]), optimizer)
            optimizer.step()
            optimizer.zero_grad()
    except Exception as error:
        return {"error": type(error).__name__, "message": str(error)}
    return {"error": None}


@pytest.mark.parametrize("depart", ["generate", "save_pretrained"])
def test_hugging_face_calls_on_one_rank_raise_everywhere(depart: str, tmp_path: Any) -> None:
    start = time.monotonic()
    results = run_ranks(_hugging_face_on_one_rank, 2, args=(depart, str(tmp_path)), timeout=120, pg_timeout=60)
    assert time.monotonic() - start < DEADLINE + 30
    for rank, result in enumerate(results):
        assert result["error"] == "TraceDivergenceError", (rank, result)
        assert "plain_copy()" in result["message"]
    assert "inference iteration 0" in results[0]["message"] or "plain copy" in results[0]["message"]
