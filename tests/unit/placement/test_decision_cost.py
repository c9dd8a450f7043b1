"""The cost of deciding, per op, is bounded by the look-ahead: the policy examines at most
``max_prefetch`` trace entries (and the gradient entries between them) when nothing has to be
evicted, whatever the number of chunks or the length of the trace. Counted with
``Stats.decision_work``, not timed."""

from __future__ import annotations

import pytest
from support.models import adamw_two_groups, batches, gpt2
from support.tier import slow_cases

from chunkmem import Booster, ChunkPlugin
from chunkmem.placement import AutoPlacementConfig, StaticPlacementConfig


def _work_per_op(placement: object, chunk_size: int) -> tuple[float, int]:
    # bf16: every gather casts the fp32 master, so prefetch has real work to consider.
    model = gpt2(n_layer=3, n_embd=32)
    booster = Booster(ChunkPlugin(placement, precision="bf16", chunk_size=chunk_size))
    chunked, optimizer, *_ = booster.boost(model, adamw_two_groups(model))
    for step, ids in enumerate(batches(3, batch=2, seq=8)):
        if step == 1:  # after the recording iteration
            before = chunked.stats()
        loss = chunked(input_ids=ids, labels=ids).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    after = chunked.stats()
    ops = 2 * len(chunked.runtime.trace)
    return (after.decision_work - before.decision_work) / ops, len(chunked.manager.chunks)


@pytest.mark.parametrize("make", slow_cases([StaticPlacementConfig, AutoPlacementConfig], AutoPlacementConfig))
def test_decision_work_per_op_is_bounded_by_the_look_ahead(make: type) -> None:
    k = 2
    few, n_few = _work_per_op(make(max_prefetch=k), chunk_size=100_000)
    many, n_many = _work_per_op(make(max_prefetch=k), chunk_size=500)
    assert n_many >= 4 * n_few  # the same model in many more chunks
    # Each op looks at k entries and the first backward uses between them: at most 2k per op on
    # average (an entry can be a gradient entry too), whatever the number of chunks.
    assert 0 < few <= 2 * k
    assert 0 < many <= 2 * k


@pytest.mark.slow  # the fast tier's case: the static policy's bound, above
def test_no_decision_work_without_prefetch_or_budget() -> None:
    work, _ = _work_per_op(StaticPlacementConfig(max_prefetch=0), chunk_size=2_000)
    assert work == 0
