"""Recomputed blocks and ``use_cache``: a training forward of a boosted model whose blocks may be
recomputed runs with ``use_cache=False`` and a warning, as plain Hugging Face does under its own
gradient checkpointing (the same losses, weights and returned cache, ``None``), with eager and SDPA
attention; a cache passed into such a forward is refused in training mode, naming the block, and
left to the block in eval mode (plain Hugging Face's result, its cache included)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from support.activations_helpers import _assert_identical
from support.models import adamw_two_groups, as_reference, batches, boost, device_of, enable_checkpointing, gpt2
from support.tier import slow_cases
from transformers import DynamicCache

from chunkmem import ChunkedModel, NotSupportedError
from chunkmem.placement import ActivationPlacement, StaticPlacementConfig

RECOMPUTE = ActivationPlacement(recompute=["GPT2Block"])


def _train(model: torch.nn.Module, optimizer: Any, booster: Any) -> dict[str, Any]:
    """Two training steps with ``use_cache=True``: the losses, the caches returned, the weights."""
    losses, caches = [], []
    for ids in batches(2):
        if not isinstance(model, ChunkedModel):
            ids = ids.to(device_of(model))
        out = model(input_ids=ids, labels=ids, use_cache=True)
        (out.loss.backward() if booster is None else booster.backward(out.loss, optimizer))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out.loss.detach()))
        caches.append(out.cache)
    return {"losses": losses, "caches": caches, "state": model.state_dict()}


def _warned(caplog: pytest.LogCaptureFixture) -> bool:
    """Whether chunkmem said it turned caching off (plain Hugging Face warns once a process, and the
    tests quiet it)."""
    return any(r.name == "chunkmem" and "Setting use_cache=False" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("attention", slow_cases(["eager", "sdpa"], "sdpa"))
def test_use_cache_in_training_is_turned_off_as_hf_gradient_checkpointing_does(
    attention: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    plain_model = as_reference(gpt2(attn_implementation=attention))
    enable_checkpointing(plain_model, reentrant=False)
    plain = _train(plain_model, adamw_two_groups(plain_model), None)
    chunked, optimizer, booster = boost(gpt2(attn_implementation=attention), adamw_two_groups, activations=RECOMPUTE)
    ours = _train(chunked, optimizer, booster)
    assert plain["caches"] == [None, None]
    assert ours["caches"] == plain["caches"], "a training forward returns no cache, as plain Hugging Face's"
    _assert_identical(ours, plain)
    assert _warned(caplog), "chunkmem says it turned caching off"


@pytest.mark.slow
def test_auto_blocks_turn_use_cache_off_too(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    chunked, optimizer, booster = boost(
        gpt2(),
        adamw_two_groups,
        placement=StaticPlacementConfig(device_budget=2**30),
        activations=ActivationPlacement(auto=["GPT2Block"]),
    )
    assert _train(chunked, optimizer, booster)["caches"] == [None, None]
    assert _warned(caplog)


def test_a_cache_passed_into_a_training_forward_is_refused_and_left_alone_in_eval() -> None:
    chunked, _, _ = boost(gpt2(), adamw_two_groups, activations=RECOMPUTE)
    ids = batches(1)[0]
    with pytest.raises(NotSupportedError, match=r"block transformer\.h\.0 is recomputed .* hands it a KV cache"):
        chunked(input_ids=ids, labels=ids, cache=DynamicCache(config=chunked.config))
    plain = as_reference(gpt2())
    plain.eval()
    chunked.eval()
    expected = plain(input_ids=ids.to(device_of(plain)), cache=DynamicCache(config=plain.config), use_cache=True)
    out = chunked(input_ids=ids, cache=DynamicCache(config=chunked.config), use_cache=True)
    assert torch.equal(out.logits.cpu(), expected.logits.cpu())
    assert [layer.keys.shape for layer in out.cache.layers] == [layer.keys.shape for layer in expected.cache.layers]
