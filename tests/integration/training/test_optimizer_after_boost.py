"""An optimizer built from a boosted model's parameters (``AdamW(model.parameters())`` after
boosting) is refused at its first step, before it changes anything, with a chunkmem error that
says what happened and the one-line fix, naming a rank only where there are several; boosting a
boosted model again says what to do instead."""

from __future__ import annotations

import pytest
import torch
from support.distributed import run_ranks

from chunkmem import AlreadyBoostedError, Booster, ChunkmemError, ChunkPlugin, OptimizerAfterBoostError

FIX = "model, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), ...))"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


def _step_after_boost(rank: int, world_size: int) -> str:
    booster = Booster(ChunkPlugin(precision="fp32"))
    model, *_ = booster.boost(_model())
    before = model.state_dict()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-1)
    model(torch.randn(4, 8)).sum().backward()
    with pytest.raises(OptimizerAfterBoostError) as refused:
        optimizer.step()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # refused before it changed anything
    return str(refused.value)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [1, 2])
def test_an_optimizer_built_after_boosting_is_refused_with_the_fix(world_size: int) -> None:
    for rank, message in enumerate(run_ranks(_step_after_boost, world_size)):
        assert "built from the parameters of a boosted model ('0.weight'" in message
        assert message.endswith(FIX)
        if world_size == 1:
            assert "rank" not in message
        else:
            assert message.startswith(f"rank {rank}: AdamW.step() refused")


def test_the_refusal_is_a_chunkmem_error_and_other_optimizers_still_step() -> None:
    booster = Booster(ChunkPlugin(precision="fp32"))
    model, *_ = booster.boost(_model())
    plain = _model()
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=1.0)
    plain(torch.randn(4, 8)).sum().backward()
    weight = plain[0].weight.detach().clone()
    plain_optimizer.step()  # a model that was never boosted trains as in plain PyTorch
    assert not torch.equal(plain[0].weight, weight)
    with pytest.raises(ChunkmemError):
        torch.optim.SGD(model.parameters(), lr=1.0).step()


def test_boosting_a_boosted_model_again_says_what_to_do() -> None:
    booster = Booster(ChunkPlugin(precision="fp32"))
    original = _model()
    model, *_ = booster.boost(original)
    late = torch.optim.AdamW(model.parameters())
    for again in (model, original):
        with pytest.raises(AlreadyBoostedError) as refused:
            booster.boost(again, late)
        message = str(refused.value)
        assert "already" in message and "built from the boosted model's parameters" in message
        assert message.endswith(FIX) and "rank" not in message
    fresh = _model()
    _, boosted_optimizer, *_ = booster.boost(fresh, torch.optim.AdamW(fresh.parameters()))
    with pytest.raises(AlreadyBoostedError, match=r"this optimizer is what booster\.boost returned"):
        booster.boost(_model(), boosted_optimizer)
