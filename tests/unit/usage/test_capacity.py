"""What the auto policy may use: the process's capacity (free device memory plus what the process
holds, within its memory fraction) and an optional total limit on model plus non-model bytes.
When the budget plus measured non-model memory exceeds it, the policy warns once with the three
figures and keeps model data lower instead of running out of memory. Tested on the CPU with the
capacity substituted through ``total_limit``."""

from __future__ import annotations

import logging

import pytest
import torch
from support.models import (
    adamw_two_groups,
    as_reference,
    assert_state_close,
    batches,
    boost,
    gpt2,
    tolerance,
    train_chunked,
    train_reference,
)

from chunkmem.placement import AutoPlacementConfig
from chunkmem.placement.policy import format_bytes
from chunkmem.usage.memory import DeviceMemory, process_capacity

BUDGET = 3_000_000


def test_memory_the_process_holds_counts_as_usable_by_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # The host's capacity, asked for by device (the CPU branch): the same on a GPU machine. The
    # kernel's "available" figure lags allocations by hundreds of MiB on shared machines, so free
    # memory is modelled as falling by exactly what this process takes; the process's own resident
    # memory is measured. Were held memory not counted, capacity would fall by the whole 512 MiB.
    import psutil

    import chunkmem.usage.memory

    real = chunkmem.usage.memory.host_memory()
    start = psutil.Process().memory_info().rss

    def probe() -> DeviceMemory:
        taken = psutil.Process().memory_info().rss - start
        return DeviceMemory(total=real.total, free=real.free // 2 - taken, source="model")

    monkeypatch.setattr(chunkmem.usage.memory, "host_memory", probe)
    before = process_capacity(torch.device("cpu"))
    held = torch.ones(128 * 2**20, dtype=torch.float32)  # 512 MiB, touched
    during = process_capacity(torch.device("cpu"))
    assert psutil.Process().memory_info().rss - start > 400 * 2**20, "the tensor is resident"
    del held
    assert abs(during - before) < 32 * 2**20


def _train(limit: int | None) -> tuple[object, int, list[float]]:
    model = gpt2(n_layer=4)
    placement = AutoPlacementConfig(device_budget=BUDGET, total_limit=limit)
    chunked, optimizer, booster = boost(
        model, adamw_two_groups, precision="fp32", chunk_size=4_000, placement=placement
    )
    data = batches(5, batch=8, seq=32)
    train_chunked(chunked, optimizer, booster, data[:2])  # warmup measures non-model memory
    ledger = chunked.manager.ledger
    ledger.reset_peak()
    losses = train_chunked(chunked, optimizer, booster, data[2:])
    return chunked, ledger.peak_device_bytes, losses


@pytest.mark.slow  # the fast tier's case: usable memory, below
def test_budget_plus_non_model_over_the_limit_warns_once_and_lowers_model_data(
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, unlimited_peak, _ = _train(None)
    limit = 6_000_000
    with caplog.at_level(logging.WARNING, logger="chunkmem"):
        chunked, peak, losses = _train(limit)
    profile = chunked.runtime.policy.non_model_profile
    assert max(profile) + BUDGET > 0.9 * limit  # the case under test
    warnings = [r.getMessage() for r in caplog.records if "non-model data" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once, not per step
    for figure in (BUDGET, max(profile), int(0.9 * limit)):
        assert format_bytes(figure) in warnings[0]
    # Where activations peak the cap leaves less than the budget for model data: the policy kept
    # less on the device than it does with room to spare, and the result is the same.
    trace = chunked.runtime.trace
    assert min(chunked.runtime.policy.cap(p, trace) for p in range(len(profile))) < BUDGET
    assert peak < unlimited_peak <= BUDGET
    # The reference trains after chunkmem's runs, so that it is not part of the memory they measure.
    reference = as_reference(gpt2(n_layer=4))
    expected = train_reference(reference, adamw_two_groups, batches(5, batch=8, seq=32))
    assert losses == tolerance(chunked, rtol=1e-5).approx(expected[2:])
    assert_state_close(chunked.state_dict(), reference.state_dict(), *tolerance(chunked, rtol=1e-4, atol=1e-5))
