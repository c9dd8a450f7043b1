"""Device budgets and byte accounting during training, against analytic counts."""

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
    tolerance,
    train_chunked,
    train_reference,
)
from support.tier import slow_cases

from chunkmem import Booster, ChunkPlugin
from chunkmem.placement import AutoPlacementConfig, BudgetTooSmallError, StaticPlacementConfig
from chunkmem.usage.accounting import Location, MemoryKind

CHUNK = 12_000


def _param_numels(model: torch.nn.Module) -> list[int]:
    return [p.numel() for p in model.parameters()]


def test_static_fp32_accounting_matches_analytic_counts() -> None:
    """World size 1, fp32, nothing offloaded: each chunk holds its fp32 master and gradient shard
    (capacity x 4 bytes each) on the device, and after the first step AdamW's state is accounted as
    reserved for every element of each shard (exp_avg and exp_avg_sq: 8 bytes, padding included, so
    that every rank accounts the same) plus a 4-byte step counter per parameter (an upper bound)."""
    model = gpt2()
    numels = _param_numels(model)
    chunked, optimizer, booster = boost(model, adamw_two_groups, precision="fp32", chunk_size=CHUNK)
    ledger = chunked.manager.ledger
    capacity = sum(c.layout.capacity for c in chunked.manager.chunks)
    assert ledger.bytes(Location.DEVICE, MemoryKind.MASTER) == 4 * capacity
    assert ledger.bytes(Location.DEVICE, MemoryKind.GRAD_SHARD) == 4 * capacity
    assert ledger.host_bytes == 0
    train_chunked(chunked, optimizer, booster, batches(2))
    assert ledger.bytes(Location.DEVICE, MemoryKind.OPTIM_STATE) == 8 * capacity + 4 * len(numels)
    actual = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values())
    # AdamW steps runs of adjacent parameters as one tensor each: two fp32 moments per element and
    # one step counter per run, fewer than the one per parameter that is reserved.
    runs = sum(len(group["params"]) for group in optimizer.param_groups)
    assert runs < len(numels)
    assert actual == 8 * sum(numels) + 4 * runs <= 8 * capacity + 4 * len(numels)
    # fp32 at world size 1: the master is the gathered chunk and gradients accumulate in the shard.
    assert ledger.bytes(Location.DEVICE, MemoryKind.GATHERED) == 0
    assert ledger.bytes(Location.DEVICE, MemoryKind.GRAD_BUFFER) == 0
    assert chunked.stats().peak_device_bytes == 8 * capacity + 8 * capacity + 4 * len(numels)


def test_offloaded_training_moves_exactly_the_gathered_bytes() -> None:
    """Everything on the host, bf16 compute: each gather sends a bf16 shard (capacity x 2 bytes)
    host-to-device; each reduction sends an fp32 gradient shard (capacity x 4) back. Nothing stays
    on the device between steps."""
    model = gpt2()
    placement = StaticPlacementConfig(offload_optim_frac=1.0, offload_param_frac=1.0)
    # 16384 elements: the largest parameter's size, so every chunk has the same capacity.
    chunked, optimizer, booster = boost(
        model, adamw_two_groups, precision="bf16", chunk_size=16_384, placement=placement
    )
    chunks = chunked.manager.chunks
    capacity = {c.chunk_id: c.layout.capacity for c in chunks}
    ledger = chunked.manager.ledger
    assert ledger.device_bytes == 0
    train_chunked(chunked, optimizer, booster, batches(1))
    before = chunked.stats()
    train_chunked(chunked, optimizer, booster, batches(1, seed=9))
    after = chunked.stats()
    # Demand gathers and prefetches alike fetch a whole bf16 shard.
    gathers = after.gathers - before.gathers + after.prefetches - before.prefetches
    assert gathers > 0
    assert set(capacity.values()) == {16_384}
    assert after.h2d_bytes - before.h2d_bytes == gathers * 2 * next(iter(capacity.values()))
    assert after.grad_reductions - before.grad_reductions == len(chunks)
    assert after.d2h_bytes - before.d2h_bytes == 4 * sum(capacity.values())
    assert ledger.device_bytes == 0


@pytest.mark.parametrize("max_prefetch", slow_cases([0, 1, 3], 1, 3))  # the fast tier: auto, no prefetch
@pytest.mark.parametrize("policy", slow_cases(["static", "auto"], "static"))
def test_budget_never_exceeded_and_training_unchanged(policy: str, max_prefetch: int) -> None:
    model, ref = copies(gpt2(n_layer=3))
    data = batches(4)
    expected = train_reference(ref, adamw_two_groups, data)
    budget = 450_000
    placement: Any = (
        StaticPlacementConfig(
            offload_optim_frac=1.0, offload_param_frac=1.0, device_budget=budget, max_prefetch=max_prefetch
        )
        if policy == "static"
        else AutoPlacementConfig(device_budget=budget, max_prefetch=max_prefetch)
    )
    chunked, optimizer, booster = boost(
        model, adamw_two_groups, precision="fp32", chunk_size=CHUNK, placement=placement
    )
    losses = train_chunked(chunked, optimizer, booster, data)
    assert losses == tolerance(chunked, rtol=1e-5, atol=1e-6).approx(expected)
    assert_state_close(chunked.state_dict(), ref.state_dict(), *tolerance(chunked, rtol=1e-4, atol=1e-5))
    # The ledger records its peak at every allocation, so this covers every instant of training.
    stats = chunked.stats()
    assert stats.peak_device_bytes <= budget
    if max_prefetch:
        assert stats.prefetches > 0 and stats.prefetch_hits > 0


def test_budget_below_one_op_is_refused_before_training() -> None:
    model = gpt2()
    placement = AutoPlacementConfig(device_budget="100KiB")
    with pytest.raises(BudgetTooSmallError) as error:
        Booster(plugin=ChunkPlugin(placement=placement, precision="fp32", chunk_size=CHUNK)).boost(
            model, adamw_two_groups(model)
        )
    message = str(error.value)
    assert "device_budget=102400" in message
    assert "minimum" in message and "module '" in message


def test_static_budget_too_small_for_what_stays_on_device() -> None:
    model = gpt2()
    placement = StaticPlacementConfig(device_budget=1_000_000)  # masters, grads and states alone are more
    with pytest.raises(BudgetTooSmallError, match="stay on the device between uses"):
        Booster(plugin=ChunkPlugin(placement=placement, precision="fp32", chunk_size=CHUNK)).boost(
            model, adamw_two_groups(model)
        )


@pytest.mark.slow  # the fast tier's case: the auto policy under a budget, above
def test_auto_policy_measures_non_model_data_in_warmup() -> None:
    chunked, optimizer, booster = boost(
        gpt2(), adamw_two_groups, precision="fp32", chunk_size=CHUNK, placement=AutoPlacementConfig()
    )
    policy = chunked.runtime.policy
    train_chunked(chunked, optimizer, booster, batches(1))
    trace = chunked.runtime.trace
    assert trace is not None and policy.profiled(trace)
    profile = policy.non_model_profile
    assert len(profile) == len(trace)
    # Activations saved for backward grow through the forward and are freed during backward.
    peak = max(range(len(profile)), key=profile.__getitem__)
    assert profile[peak] > 0
    assert profile[-1] < profile[peak]
