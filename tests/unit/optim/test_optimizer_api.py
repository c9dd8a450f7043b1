"""The boosted optimizer is a ``torch.optim.Optimizer``: every LR scheduler works on it, its
param groups are live, ``add_param_group`` works for the model's parameters, ``state_dict`` is
PyTorch's format both ways, the user's kernel choice is kept, and the object passed to ``boost``
refuses to be used behind chunkmem's back. Each against plain PyTorch doing the same."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.models import (
    assert_close_on_cpu,
    assert_state_close,
    batches,
    copies,
    device_of,
    llama,
    lm_loss,
    tolerance,
)
from support.state_helpers import assert_identical, raw_state

from chunkmem import Booster, ChunkOptimizer, ChunkPlugin, NotSupportedError
from chunkmem.optim import ChunkOptimizer as OptimModuleClass

Sched = torch.optim.lr_scheduler


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """On the CPU, from a CPU generator: the same data on every machine."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)) for _ in range(steps)]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Inputs and targets where the model computes (the reference's device, chunkmem's compute device)."""
    device = device_of(model)
    return torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))


def _boost(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, ChunkOptimizer, Booster]:
    booster = Booster(plugin=ChunkPlugin(precision="fp32", chunk_size=100))
    chunked, boosted, *_ = booster.boost(model, optimizer)
    assert boosted is not None
    return chunked, boosted, booster


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "LambdaLR": lambda o: Sched.LambdaLR(o, lambda step: 0.8**step),
    "StepLR": lambda o: Sched.StepLR(o, step_size=2, gamma=0.5),
    "OneCycleLR": lambda o: Sched.OneCycleLR(o, max_lr=0.05, total_steps=6),
    "CosineAnnealingLR": lambda o: Sched.CosineAnnealingLR(o, T_max=4),
    "ReduceLROnPlateau": lambda o: Sched.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "SequentialLR": lambda o: Sched.SequentialLR(
        o, [Sched.LinearLR(o, start_factor=0.5, total_iters=2), Sched.ExponentialLR(o, gamma=0.9)], milestones=[2]
    ),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_every_scheduler_built_after_boost_matches_pytorch(name: str) -> None:
    model, ref = copies(_mlp())
    reference_optimizer = _adamw(ref)
    reference_scheduler = SCHEDULERS[name](reference_optimizer)
    chunked, optimizer, booster = _boost(model, _adamw(model))
    assert isinstance(optimizer, torch.optim.Optimizer)
    scheduler = SCHEDULERS[name](optimizer)  # raised "is not an Optimizer" before
    for x, y in _data(5):
        expected = _loss(ref, x, y)
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        loss = _loss(chunked, x, y)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        if name == "ReduceLROnPlateau":
            reference_scheduler.step(expected.item())
            scheduler.step(loss.item())
        else:
            reference_scheduler.step()
            scheduler.step()
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx(
            [g["lr"] for g in reference_optimizer.param_groups], rel=1e-12
        )
    assert_state_close(chunked.state_dict(), ref.state_dict(), *tolerance(chunked, rtol=1e-5, atol=1e-6))


def test_param_group_edits_take_effect_like_pytorch() -> None:
    def make(m: torch.nn.Module) -> torch.optim.Optimizer:
        params = list(m.parameters())
        return torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=0.01)

    model, ref = copies(_mlp())
    reference_optimizer = make(ref)
    chunked, optimizer, booster = _boost(model, make(model))
    for step, (x, y) in enumerate(_data(5)):
        if step == 2:
            for opt in (reference_optimizer, optimizer):
                opt.param_groups[0]["lr"] = 0.05
                opt.param_groups[1]["weight_decay"] = 0.3
        _loss(ref, x, y).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        booster.backward(_loss(chunked, x, y), optimizer)
        optimizer.step()
        optimizer.zero_grad()
    assert_state_close(chunked.state_dict(), ref.state_dict(), *tolerance(chunked, rtol=1e-5, atol=1e-6))


def test_add_param_group_for_model_parameters_and_refusals() -> None:
    model, ref = copies(_mlp())
    reference_optimizer = torch.optim.SGD(list(ref.parameters())[:2], lr=0.1, momentum=0.9)
    chunked, optimizer, booster = _boost(model, torch.optim.SGD(list(model.parameters())[:2], lr=0.1, momentum=0.9))
    for step, (x, y) in enumerate(_data(5)):
        if step == 2:
            reference_optimizer.add_param_group({"params": list(ref.parameters())[2:], "lr": 0.05})
            optimizer.add_param_group({"params": list(model.parameters())[2:], "lr": 0.05})
        _loss(ref, x, y).backward()
        reference_optimizer.step()
        ref.zero_grad()  # chunkmem's zero_grad drops every gradient of the model, not only the optimizer's
        booster.backward(_loss(chunked, x, y), optimizer)
        optimizer.step()
        optimizer.zero_grad()
    assert_state_close(chunked.state_dict(), ref.state_dict(), *tolerance(chunked, rtol=1e-5, atol=1e-6))
    before = raw_state(chunked, optimizer)
    with pytest.raises(NotSupportedError, match=r"not part of the boosted model"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    with pytest.raises(ValueError, match=r"more than one parameter group"):
        optimizer.add_param_group({"params": [next(model.parameters())]})
    assert len(optimizer.param_groups) == 2
    assert_identical(raw_state(chunked, optimizer), before)


def test_the_optimizer_passed_to_boost_refuses_to_step_or_save() -> None:
    model = _mlp()
    original = _adamw(model)
    chunked, optimizer, booster = _boost(model, original)
    x, y = _data(1)[0]
    booster.backward(_loss(chunked, x, y), optimizer)
    before = raw_state(chunked, optimizer)
    with pytest.raises(NotSupportedError, match=r"step\(\) on the AdamW object that was passed to booster.boost"):
        original.step()
    with pytest.raises(NotSupportedError, match=r"passed to booster.boost"):
        original.state_dict()
    with pytest.raises(NotSupportedError, match=r"passed to booster.boost"):
        original.load_state_dict({"state": {}, "param_groups": []})
    assert_identical(raw_state(chunked, optimizer), before)
    optimizer.step()  # the returned one works
    assert chunked.stats().optimizer_steps == 1
    original.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    with pytest.raises(NotSupportedError, match=r"add_param_group on the optimizer booster.boost returned"):
        optimizer.step()


def test_state_dict_is_pytorch_format_both_ways() -> None:
    data = _data(6)
    model, ref = copies(_mlp())
    reference_optimizer = _adamw(ref)
    chunked, optimizer, _ = _boost(model, _adamw(model))
    for x, y in data[:3]:
        for m, opt in ((ref, reference_optimizer), (chunked, optimizer)):
            _loss(m, x, y).backward()
            opt.step()
            opt.zero_grad()
    saved = optimizer.state_dict()
    expected = reference_optimizer.state_dict()
    assert saved["param_groups"] == expected["param_groups"]
    assert saved["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            where = f"state[{index}][{key!r}]"
            assert_close_on_cpu(saved["state"][index][key], value, tolerance(chunked, rtol=1e-5, atol=1e-7), where)
    # chunkmem -> plain PyTorch, and plain PyTorch -> chunkmem, then both train on.
    plain = copy.deepcopy(ref)
    plain.load_state_dict(chunked.state_dict())
    plain_optimizer = _adamw(plain)
    plain_optimizer.load_state_dict(saved)
    fresh = _mlp(seed=9)
    other, other_optimizer, _ = _boost(fresh, _adamw(fresh))
    other.load_state_dict(ref.state_dict())
    other_optimizer.load_state_dict(expected)
    for x, y in data[3:]:
        for m, opt in ((ref, reference_optimizer), (plain, plain_optimizer), (other, other_optimizer)):
            _loss(m, x, y).backward()
            opt.step()
            opt.zero_grad()
    within = tolerance(chunked, other, rtol=1e-5, atol=1e-6)
    assert_state_close(plain.state_dict(), ref.state_dict(), *within)
    assert_state_close(other.state_dict(), ref.state_dict(), *within)


def test_step_with_a_closure_like_pytorch() -> None:
    model, ref = copies(_mlp())
    reference_optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
    chunked, optimizer, _ = _boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for x, y in _data(3):

        def closure(
            m: torch.nn.Module = chunked, opt: torch.optim.Optimizer = optimizer, x: Any = x, y: Any = y
        ) -> torch.Tensor:
            opt.zero_grad()
            loss = _loss(m, x, y)
            loss.backward()
            return loss

        expected = reference_optimizer.step(lambda: closure(ref, reference_optimizer))
        assert optimizer.step(closure).item() == tolerance(chunked, rtol=1e-6).approx(expected.item())
    assert_state_close(chunked.state_dict(), ref.state_dict(), *tolerance(chunked, rtol=1e-5, atol=1e-6))


def test_users_kernel_choice_is_kept_and_results_are_bit_identical() -> None:
    """AdamW(fused=None) stays fused=None: the same kernel as plain PyTorch, the same bits."""
    model, ref = copies(llama())

    def make(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, fused=None)

    reference_optimizer = make(ref)
    booster = Booster(plugin=ChunkPlugin(precision="fp32", chunk_size=12_000))
    chunked, optimizer, *_ = booster.boost(model, make(model))
    assert isinstance(optimizer, OptimModuleClass)
    assert all(g["fused"] is None and g["foreach"] is None for g in optimizer.param_groups)
    for ids in batches(4):
        lm_loss(ref, ids).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        booster.backward(lm_loss(chunked, ids), optimizer)
        optimizer.step()
        optimizer.zero_grad()
    # Both step on the compute device with the same kernel (the optimizer's state stays there).
    state = chunked.state_dict()
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name], value.cpu()), name
