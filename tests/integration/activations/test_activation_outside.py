"""``ActivationPlacement(offload_outside=True)``: what autograd saves outside the named blocks (the
embeddings, the head, the loss inside a Hugging Face model's forward) is offloaded, each stretch
between block calls a call of its own. Training is bit for bit plain PyTorch's (with the same
checkpointing for recomputed blocks) at one rank, and the same placement's without the option at
two; the copies equal a saved-tensor hooks count over the plain model of what is saved outside the
blocks; the planner predicts them; with ``auto`` blocks the stretches are in the ledger, within the
budget."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.activations_helpers import _assert_identical, _saved_bytes
from support.distributed import run_ranks
from support.models import (
    adamw_two_groups,
    as_reference,
    batches,
    boost,
    enable_checkpointing,
    gpt2,
    lm_loss,
    train_accumulating,
    train_chunked,
    train_reference,
)
from support.plan_activations_helpers import _lm_plan, _lm_run
from support.tier import slow_cases

from chunkmem import BudgetTooSmallError, NotSupportedError
from chunkmem.placement import ActivationChoice, ActivationPlacement, BlockPlacement, StaticPlacementConfig

STEPS = 2
MIN_OFFLOAD = 1024


def _outside_storages(model: torch.nn.Module) -> list[dict[int, int]]:
    """Per stretch of a plain GPT-2's forward outside its blocks (before the first block, between
    blocks, after the last), the storages autograd saves there: address -> bytes, parameters and
    views of them left out."""
    stretches: list[dict[int, int]] = [{}]
    inner: list[Any] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not (isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)):
            stretches[-1].setdefault(tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        return tensor

    def enter(module: torch.nn.Module, args: Any) -> None:  # inside a block: not counted here
        inner.append(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
        inner[-1].__enter__()

    def leave(module: torch.nn.Module, args: Any, out: Any) -> None:
        inner.pop().__exit__(None, None, None)
        stretches.append({})

    blocks = model.transformer.h
    handles = [h for b in blocks for h in (b.register_forward_pre_hook(enter), b.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lm_loss(model, batches(1)[0])
    finally:
        for handle in handles:
            handle.remove()
    return stretches


def _outside_bytes(small: bool = False) -> int:
    """What one forward saves outside the blocks, each storage once per stretch: those of at least
    ``MIN_OFFLOAD`` bytes (the copies), or (``small``) those under it (left on the device)."""
    stretches = _outside_storages(as_reference(gpt2(n_embd=32)))
    return sum(n for s in stretches for n in s.values() if (n < MIN_OFFLOAD) == small)


def _placement(how: str, **kwargs: Any) -> ActivationPlacement:
    return ActivationPlacement(**{how: ["GPT2Block"]}, offload_outside=True, **kwargs)


def _plain(checkpointed: bool) -> dict[str, Any]:
    model = as_reference(gpt2(n_embd=32))
    if checkpointed:
        enable_checkpointing(model, reentrant=False)
    losses = train_reference(model, adamw_two_groups, batches(STEPS))
    return {"losses": losses, "state": model.state_dict()}


@pytest.mark.parametrize("how", slow_cases(["recompute", "offload"], "offload"))  # offload's: at two ranks
def test_outside_is_bit_exact_and_copies_what_plain_pytorch_saves_outside_the_blocks(how: str) -> None:
    chunked, optimizer, booster = boost(
        gpt2(n_embd=32), adamw_two_groups, chunk_size=4_000, activations=_placement(how)
    )
    run = {"losses": train_chunked(chunked, optimizer, booster, batches(STEPS)), "state": chunked.state_dict()}
    _assert_identical(run, _plain(checkpointed=how == "recompute"))
    model = as_reference(gpt2(n_embd=32))
    blocks = _saved_bytes(model.transformer.h, lambda: lm_loss(model, batches(1)[0])) if how == "offload" else 0
    outside = _outside_bytes()
    assert outside >= 4 * 16 * 256 * 4  # at least the loss's log-softmax of the logits (batch 4x16, vocab 256)
    stats = chunked.stats()
    assert stats.activation_d2h_bytes == stats.activation_h2d_bytes == STEPS * (outside + blocks)


def _accumulated(rank: int, world_size: int, activations: ActivationPlacement | None, precision: str) -> dict[str, Any]:
    """One step of two micro-batches (the first under ``no_sync``) on this rank's slice."""
    chunked, optimizer, booster = boost(
        gpt2(n_embd=32), adamw_two_groups, precision=precision, chunk_size=4_000, activations=activations
    )
    losses = train_accumulating(chunked, optimizer, booster, batches(1, batch=8), rank, world_size)
    return {"losses": losses, "state": chunked.state_dict(), "copied": chunked.stats().activation_d2h_bytes}


def _two_ranks(rank: int, world_size: int, precision: str) -> None:
    """With ``no_sync`` micro-batches, recomputed and offloaded blocks with the option equal keeping
    everything bit for bit (no dropout: recomputing is exact), and copy what is saved outside."""
    keep = _accumulated(rank, world_size, None, precision)
    for how in ("recompute", "offload"):
        outside = _accumulated(rank, world_size, _placement(how), precision)
        _assert_identical(outside, keep)
        assert outside["copied"] > 0, how


@pytest.mark.multirank
@pytest.mark.parametrize("precision", slow_cases(["fp32", "bf16"], "bf16"))
def test_two_ranks_with_the_option_equal_keeping_everything_bit_for_bit(precision: str) -> None:
    run_ranks(_two_ranks, 2, args=(precision,))


@pytest.mark.parametrize(
    ("how", "attention"), slow_cases([("recompute", "sdpa"), ("offload", "eager")], ("offload", "eager"))
)
def test_the_plan_predicts_the_outside_copies_a_run_makes(how: str, attention: str) -> None:
    activations = _placement(how)
    predicted = _lm_plan("gpt2", activations, attention)
    hows = [c.how for c in predicted.activation_calls]
    block = BlockPlacement(how)
    assert hows == [BlockPlacement.OUTSIDE, block, BlockPlacement.OUTSIDE, block, BlockPlacement.OUTSIDE]
    assert sum(c.offload_bytes for c in predicted.activation_calls if c.how is BlockPlacement.OUTSIDE) > 0
    for step in _lm_run("gpt2", activations, attention):
        assert step["activation_d2h_bytes"] == predicted.activation_d2h_bytes_per_step
        assert step["activation_h2d_bytes"] == predicted.activation_h2d_bytes_per_step


def _model_minimum() -> int:
    with pytest.raises(BudgetTooSmallError) as refused:
        _auto_boost(1, None)
    return refused.value.minimum


def _auto_boost(budget: int, activations: ActivationPlacement | None) -> Any:
    return boost(
        gpt2(n_embd=32),
        adamw_two_groups,
        chunk_size=4_000,
        placement=StaticPlacementConfig(device_budget=budget),
        activations=activations,
    )


def test_with_auto_blocks_the_stretches_are_offloaded_calls_of_the_plan_in_the_ledger_within_the_budget() -> None:
    # Counted without caching: auto blocks may be recomputed, so training forwards run with use_cache=False.
    model = as_reference(gpt2(n_embd=32, use_cache=False))
    kept = _saved_bytes(model.transformer.h, lambda: lm_loss(model, batches(1)[0]), keep_below=0)
    budget = _model_minimum() + 2 * kept  # room to keep both block calls
    chunked, optimizer, booster = _auto_boost(budget, _placement("auto"))
    losses, after_forward = [], []
    for ids in batches(2):
        loss = lm_loss(chunked, ids)
        after_forward.append(chunked.stats())
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    reference = as_reference(gpt2(n_embd=32))
    _assert_identical(
        {"losses": losses, "state": chunked.state_dict()},
        {"losses": train_reference(reference, adamw_two_groups, batches(2)), "state": reference.state_dict()},
    )
    plan = chunked.activation_plan
    keep, offload = ActivationChoice.KEEP, ActivationChoice.OFFLOAD
    assert plan is not None and plan.choices == (offload, keep, offload, keep, offload)
    # Once planned, each forward holds the kept calls and what the stretches leave on the device
    # (their small storages) in the ledger, and copies what they save beyond that.
    for forward in after_forward[1:]:
        assert forward.activation_bytes == kept + _outside_bytes(small=True)
    stats = chunked.stats()
    assert stats.activation_bytes == 0
    first_copies = after_forward[0].activation_d2h_bytes  # the first step copies in its forward
    assert stats.activation_d2h_bytes - first_copies == _outside_bytes()
    assert stats.peak_device_bytes <= budget


def test_a_checkpoint_around_the_whole_model_is_refused() -> None:
    from torch.utils.checkpoint import checkpoint

    chunked, _, _ = boost(gpt2(n_embd=32), adamw_two_groups, activations=_placement("recompute"))
    ids = batches(1)[0]
    with pytest.raises(NotSupportedError, match="offload_outside=False"):
        checkpoint(lambda: lm_loss(chunked, ids), use_reentrant=False)
