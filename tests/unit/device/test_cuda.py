"""GPU paths: side-stream prefetch, allocator-based non-model measurement (pinned host buffers:
``test_device_layer.py``, on a GPU and on the simulated device). Skipped without a CUDA device (the
``cuda`` marker)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.models import (
    adamw_two_groups,
    assert_state_close,
    batches,
    boost,
    copies,
    gpt2,
    lm_loss,
    tolerance,
    train_reference,
)

from chunkmem.placement import AutoPlacementConfig, StaticPlacementConfig

pytestmark = pytest.mark.cuda

PLACEMENTS: dict[str, Any] = {
    "static": StaticPlacementConfig(),
    "offload-prefetch2": StaticPlacementConfig(offload_optim_frac=1.0, offload_param_frac=1.0, max_prefetch=2),
    "auto-budget-prefetch3": AutoPlacementConfig(device_budget=600_000, max_prefetch=3),
}


def _train_on_gpu(model: torch.nn.Module, placement: Any, precision: str, steps: int = 5) -> tuple[Any, ...]:
    chunked, optimizer, booster = boost(
        model, adamw_two_groups, placement=placement, precision=precision, chunk_size=12_000
    )
    losses = []
    for ids in batches(steps):
        loss = lm_loss(chunked, ids)  # the wrapper moves inputs to the GPU
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return chunked, losses


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_fp32_parity_on_gpu(placement: str) -> None:
    model, ref = copies(gpt2())
    expected = train_reference(ref, adamw_two_groups, batches(5))  # plain PyTorch on the same GPU
    chunked, losses = _train_on_gpu(model, PLACEMENTS[placement], "fp32")
    assert chunked.compute_device.type == "cuda"
    # The CPU suite's tolerances, widened only where the optimizer steps on the host (DEVICE_TOLERANCE).
    assert losses == tolerance(chunked, rtol=1e-5, atol=1e-6).approx(expected)
    assert_state_close(chunked.state_dict(), ref.state_dict(), *tolerance(chunked, rtol=1e-4, atol=1e-5))
    budget = PLACEMENTS[placement].device_budget
    if budget is not None:
        assert chunked.stats().peak_device_bytes <= budget


def test_bf16_on_gpu_within_tolerance() -> None:
    model, ref = copies(gpt2())
    expected = train_reference(ref, adamw_two_groups, batches(5))
    chunked, losses = _train_on_gpu(model, PLACEMENTS["offload-prefetch2"], "bf16")
    assert losses == tolerance(chunked, rtol=2e-3).approx(expected)


def test_prefetch_runs_on_the_side_stream_and_hits() -> None:
    chunked, _ = _train_on_gpu(gpt2(n_layer=3), PLACEMENTS["offload-prefetch2"], "bf16", steps=3)
    stats = chunked.stats()
    assert stats.prefetches > 0 and stats.prefetch_hits > 0
    assert stats.h2d_bytes > 0


def test_auto_policy_measures_non_model_data_from_the_allocator() -> None:
    chunked, _ = _train_on_gpu(gpt2(), AutoPlacementConfig(), "bf16", steps=2)
    policy = chunked.runtime.policy
    assert policy.profiled(chunked.runtime.trace)
    assert max(policy.non_model_profile) > 0
