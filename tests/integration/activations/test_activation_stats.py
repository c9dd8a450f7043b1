"""``stats()`` counts every byte autograd saves on the device for a boosted training forward, and
says which bytes the device budget governs and which it only measures: the saved activations
outside the budget (``unbudgeted_activation_bytes``) equal, after the forward, a plain-PyTorch
saved-tensor hooks meter over the same model run the same way (plain, with Hugging Face's own
checkpointing where chunkmem recomputes, outside the blocks where ``auto`` governs them), and go
to zero once the backward ran; ``peak_device_bytes`` stays the governed figure; a tensor written in
place after it was saved raises in the backward as plain PyTorch does."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from support.models import (
    adamw_two_groups,
    as_reference,
    batches,
    boost,
    device_of,
    enable_checkpointing,
    gpt2,
    lm_loss,
)
from support.tier import slow_cases

from chunkmem.placement import ActivationPlacement, AutoPlacementConfig, StaticPlacementConfig

BLOCK = "GPT2Block"


def _saved_on_plain(model: torch.nn.Module, run: Callable[[], Any], skip: Iterable[torch.nn.Module] = ()) -> int:
    """Bytes autograd saves while ``run()`` runs the plain ``model``, each storage once, parameters
    and views of them left out, and (``skip``) what is saved inside those modules' calls."""
    seen: dict[int, Any] = {}
    inside = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        parameter = isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)
        if not parameter and not inside[0]:
            storage = tensor.untyped_storage()
            seen.setdefault(storage.data_ptr(), storage)  # held: no address is reused meanwhile
        return tensor

    def enter(module: torch.nn.Module, args: Any) -> None:
        inside[0] += 1

    def leave(module: torch.nn.Module, args: Any, out: Any) -> None:
        inside[0] -= 1

    handles = [h for m in skip for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for handle in handles:
            handle.remove()
    return sum(storage.nbytes() for storage in seen.values())


def _plain_figure(how: str) -> int:
    """The bytes outside the budget, measured on plain PyTorch run as chunkmem runs ``how``."""
    # Where blocks may be recomputed (recompute, auto), training forwards run without caching.
    model = as_reference(gpt2(use_cache=how == "none"))
    ids = batches(1)[0]
    if how == "recompute":
        enable_checkpointing(model, reentrant=False)
    skip = model.transformer.h if how == "auto" else ()
    return _saved_on_plain(model, lambda: lm_loss(model, ids), skip)


PLACEMENTS: dict[str, tuple[ActivationPlacement | None, int | None]] = {
    "recompute": (ActivationPlacement(recompute=[BLOCK]), None),
    "auto": (ActivationPlacement(auto=[BLOCK]), 2**30),  # every call kept, under the budget
    "offload, all small": (ActivationPlacement(offload=[BLOCK], min_offload_bytes=2**40), None),
    "a block no placement names": (ActivationPlacement(offload=["Conv1D"], min_offload_bytes=2**40), None),
    # AutoPlacementConfig profiles its first step with saved-tensor hooks of its own (on the CPU):
    # the meter must see what is saved there as well.
    "offload, all small, AutoPlacementConfig": (ActivationPlacement(offload=[BLOCK], min_offload_bytes=2**40), 2**30),
}


def _placement(how: str, budget: int | None) -> StaticPlacementConfig | AutoPlacementConfig:
    if how.endswith("AutoPlacementConfig"):
        assert budget is not None, "an auto placement has a budget"
        return AutoPlacementConfig(device_budget=budget)
    return StaticPlacementConfig(device_budget=budget)


@pytest.mark.parametrize("how", slow_cases(PLACEMENTS, "offload, all small", "a block no placement names"))
def test_unbudgeted_saved_bytes_equal_a_plain_pytorch_meter_and_go_with_the_backward(how: str) -> None:
    activations, budget = PLACEMENTS[how]
    chunked, optimizer, booster = boost(
        gpt2(), adamw_two_groups, activations=activations, placement=_placement(how, budget)
    )
    expected = _plain_figure(how if how in ("recompute", "auto") else "none")  # the others keep all on the device
    for step, ids in enumerate(batches(2)):  # the second step: auto's planned calls
        loss = lm_loss(chunked, ids)
        after_forward = chunked.stats()
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        after = chunked.stats()
        if how == "auto" and step == 0:
            continue  # the measured step offloads every call
        assert after_forward.unbudgeted_activation_bytes == expected > 0
        assert after.unbudgeted_activation_bytes == 0, "what the backward used is given back"
        assert after.peak_unbudgeted_activation_bytes == expected
    if how == "auto":
        assert after_forward.activation_bytes > 0 and after_forward.activation_bytes <= after_forward.device_bytes
    text = str(after)
    assert "under device_budget" in text and "not under the budget, only measured: saved activations" in text


def test_without_a_placement_the_saved_activations_are_said_to_be_unmeasured() -> None:
    """Plain chunkmem runs the forward as plain PyTorch does, without saved-tensor hooks."""
    chunked, optimizer, booster = boost(gpt2(), adamw_two_groups)
    booster.backward(lm_loss(chunked, batches(1)[0]), optimizer)
    stats = chunked.stats()
    assert stats.unbudgeted_activation_bytes is None and stats.peak_unbudgeted_activation_bytes is None
    assert "not measured (no ActivationPlacement: every one is outside the budget)" in str(stats)


def test_offloaded_copies_fetched_back_are_measured_until_their_backward_used_them() -> None:
    chunked, optimizer, booster = boost(gpt2(), adamw_two_groups, activations=ActivationPlacement(offload=[BLOCK]))
    model = as_reference(gpt2())
    outside = _saved_on_plain(model, lambda: lm_loss(model, batches(1)[0]), model.transformer.h)
    booster.backward(lm_loss(chunked, batches(1)[0]), optimizer)
    stats = chunked.stats()
    assert stats.unbudgeted_activation_bytes == 0, "the device copies go with their calls, not at the next forward"
    assert stats.peak_unbudgeted_activation_bytes > outside  # a call's copies came back beside what stayed


class _Sigmoid(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sigmoid()  # saves its output


class _WritesASavedOutput(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Sigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        y.mul_(2)  # what sigmoid saved for its backward
        return y.sum()


# The sigmoid's output kept by the meter's hooks (outside the placed Linear), or by an offload
# block's whose tensors are all small.
@pytest.mark.parametrize(
    "activations",
    [ActivationPlacement(offload=[torch.nn.Linear]), ActivationPlacement(offload=[_Sigmoid], min_offload_bytes=2**40)],
)
def test_a_saved_tensor_written_in_place_raises_in_the_backward_as_plain_pytorch(activations: Any) -> None:
    torch.manual_seed(0)
    plain = as_reference(_WritesASavedOutput())
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as expected:
        plain(x.to(device_of(plain))).backward()
    chunked, optimizer, booster = boost(_WritesASavedOutput(), adamw_two_groups, activations=activations)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as raised:
        booster.backward(chunked(x), optimizer)
    assert "is at version 1; expected version 0" in str(expected.value)
    assert "is at version 1; expected version 0" in str(raised.value)
