"""One owner for what is on the device: the runtime carries out the actions of a
``placement.DeviceResidency``, and ``placement.simulate`` replays the same object on a trace with
nothing behind it. A real training step and the replay of its recorded trace take the same actions,
in the same order, at one and two ranks, for each policy under budgets and prefetch (the replay's
counts are what the optimality tests judge). The residency's verbs refuse what their state forbids,
naming the chunk."""

from __future__ import annotations

from typing import Any

import pytest
from support.distributed import run_ranks
from support.models import adamw_two_groups, batches, boost, enable_checkpointing, gpt2, lm_loss
from support.policy_helpers import B, F, catalog, static, trace_of

from chunkmem.placement import (
    Action,
    AutoPlacementConfig,
    AutoPolicy,
    DeviceResidency,
    PlacementConfig,
    StaticPlacementConfig,
    Verb,
    WorkingSet,
    make_policy,
    simulate,
)

CHUNK = 6_000


def _steps(placement: PlacementConfig, precision: str, checkpointing: bool | None, rank: int, world_size: int) -> Any:
    """Two training steps of GPT-2 (the first records the trace); the second's actions, and the
    replay of its trace through a fresh policy of the same config."""
    model = gpt2(n_layer=2, n_embd=64)
    if checkpointing is not None:
        enable_checkpointing(model, reentrant=checkpointing)
    chunked, optimizer, booster = boost(
        model, adamw_two_groups, precision=precision, chunk_size=CHUNK, placement=placement
    )
    runtime = chunked.runtime
    recorded: list[Action] = []
    for step, ids in enumerate(batches(2, batch=2 * world_size)):
        part = ids.chunk(world_size)[rank]
        with runtime.record_actions() as actions:
            booster.backward(lm_loss(chunked, part), optimizer)
            optimizer.step()
            optimizer.zero_grad()
        if step == 1:
            recorded = actions
    trace = runtime.trace
    assert trace is not None
    capacity = runtime.policy.capacity if isinstance(runtime.policy, AutoPolicy) else None
    fresh = make_policy(placement, capacity)
    replay = simulate(
        fresh, runtime.specs, trace, iterations=2, working_sets=runtime.policy.working_sets, world_size=world_size
    )
    assert not replay.over_budget
    return [(a.verb.value, a.chunk) for a in recorded], [(a.verb.value, a.chunk) for a in replay.actions[1]]


def _minimum(placement: Any, precision: str) -> int:
    """The smallest budget boost accepts for this placement (a one-byte budget is refused with it)."""
    from chunkmem import BudgetTooSmallError

    with pytest.raises(BudgetTooSmallError) as refused:
        boost(
            gpt2(n_layer=2, n_embd=64),
            adamw_two_groups,
            precision=precision,
            chunk_size=CHUNK,
            placement=placement.model_copy(update={"device_budget": 1}),
        )
    return refused.value.minimum


CASES = {
    "static-offload-prefetch2": (
        StaticPlacementConfig(offload_optim_frac=1.0, offload_param_frac=1.0, max_prefetch=2),
        "fp32",
        None,
        None,
    ),
    "static-budget-prefetch1": (StaticPlacementConfig(max_prefetch=1), "bf16", 1.3, None),
    "auto-budget-prefetch2": (AutoPlacementConfig(max_prefetch=2), "bf16", 1.2, None),
    # Recomputation runs inside a backward op (non-reentrant) or beside it (reentrant).
    "auto-budget-checkpointed": (AutoPlacementConfig(max_prefetch=1), "bf16", 1.5, False),
    "static-budget-checkpointed-reentrant": (StaticPlacementConfig(max_prefetch=2), "bf16", 1.5, True),
}


def _case(name: str) -> tuple[PlacementConfig, str, bool | None]:
    placement, precision, factor, checkpointing = CASES[name]
    if factor is not None:
        placement = placement.model_copy(update={"device_budget": int(_minimum(placement, precision) * factor)})
    return placement, precision, checkpointing


@pytest.mark.parametrize("name", list(CASES))
def test_a_step_and_the_replay_of_its_trace_take_the_same_actions(name: str) -> None:
    placement, precision, checkpointing = _case(name)
    real, replayed = _steps(placement, precision, checkpointing, 0, 1)
    assert any(verb in ("gather", "prefetch") for verb, _ in real), "nothing moved: the case tests nothing"
    assert real == replayed


def _at_ranks(rank: int, world_size: int, name: str) -> Any:
    placement, precision, checkpointing = _case(name)
    return _steps(placement, precision, checkpointing, rank, world_size)


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["static-budget-prefetch1", "auto-budget-prefetch2"])
def test_at_two_ranks_every_rank_and_the_replay_take_the_same_actions(name: str) -> None:
    results = run_ranks(_at_ranks, 2, args=(name,))
    for real, replayed in results:
        assert any(verb == "start_reduce" for verb, _ in real)
        assert real == replayed
    assert results[0][0] == results[1][0]


# --- the verbs' preconditions ----------------------------------------------------------------------


def _residency(n: int = 3, rank: int | None = None) -> DeviceResidency:
    specs = catalog(n)
    policy = static(None)
    policy.layout(specs, [WorkingSet(s.label, (s.chunk_id,)) for s in specs])
    return DeviceResidency(policy, specs, world_size=2, base_bytes=lambda: 0, rank=rank)


def test_the_verbs_say_what_is_wrong_and_name_the_chunk_and_the_rank() -> None:
    """The residency is the one record of what is on the device (a chunk keeps no state of its
    own: ``ChunkState`` is gone), so its refusals name the chunk, the rank and what to do."""
    import chunkmem
    from chunkmem.chunks.chunk import Chunk
    from chunkmem.chunks.chunk_residency import ChunkResidency

    assert not hasattr(chunkmem, "ChunkState") and not hasattr(Chunk, "state")
    assert not hasattr(ChunkResidency, "state")
    residency = _residency(rank=1)
    trace = trace_of([(F, (0,)), (F, (1,))])
    assert [a.verb for a in residency.before_op(0, F, (0,), trace)] == [Verb.GATHER]
    assert residency.buffer_bytes == 1000 and residency.is_gathered(0)
    with pytest.raises(
        RuntimeError,
        match=r"DeviceResidency \(rank 1\): cannot let go of chunk 1 \('block1'; buffer released.*no op holds it; "
        "every after_op follows the before_op",
    ):
        list(residency.after_op(1, F, (1,), False, trace))
    assert list(residency.release_idle()) == []  # an op still holds chunk 0
    # The residency alone counts the ops holding a chunk (a chunk keeps no second count).
    with pytest.raises(
        RuntimeError,
        match=r"\(rank 1\): cannot drop chunk 0 \('block0'; buffer gathered.*an op still uses it; release it once",
    ):
        list(residency.after_step())
    list(residency.after_op(0, F, (0,), False, trace))


def test_an_evicted_chunk_is_awaited_and_gathered_again_within_the_budget() -> None:
    """Two chunk slots, uses 0 1 2 0 1: chunk 2 evicts chunk 1 (needed furthest), which the
    pass still needs at op 4, so it is awaited there and gathered again."""
    specs = catalog(3)
    resting = 3 * 37
    budget = 2 * 1000 + resting
    policy = static(budget)
    policy.layout(specs, [WorkingSet(s.label, (s.chunk_id,)) for s in specs])
    residency = DeviceResidency(policy, specs, world_size=2, base_bytes=lambda: resting)
    trace = trace_of([(F, (0,)), (F, (1,)), (F, (2,)), (F, (0,)), (F, (1,))])
    done = []
    for position, step in enumerate(trace.steps):
        done += list(residency.before_op(position, step.phase, step.chunks, trace))
        assert residency.device_bytes <= budget
        if position == 2:
            assert list(residency.awaited()) == [(4, 1)]
        done += list(residency.after_op(position, step.phase, step.chunks, False, trace))
    assert [(a.verb, a.chunk) for a in done] == [
        (Verb.GATHER, 0),
        (Verb.GATHER, 1),
        (Verb.EVICT, 1),
        (Verb.GATHER, 2),
        (Verb.RELEASE, 2),
        (Verb.RELEASE, 0),
        (Verb.GATHER, 1),
        (Verb.RELEASE, 1),
    ]
    assert residency.buffer_bytes == 0 and residency.device_bytes == resting


def test_the_residency_alone_knows_which_gradient_shards_hold_reduced_gradients() -> None:
    """Whether a chunk's shard holds reduced gradients (so a later buffer's reduction adds to it,
    and the optimizer steps on it) has one owner, the residency's gradient side; a chunk holds
    tensors and is told (``prepare_grad``/``start_reduce`` take ``onto_reduced``), with no state of
    its own to keep equal."""
    import chunkmem
    from chunkmem.chunks.chunk import Chunk
    from chunkmem.chunks.chunk_grads import ChunkGrads

    assert not hasattr(chunkmem, "GradState") and not hasattr(Chunk, "grad_state")
    assert not hasattr(ChunkGrads, "state")
    trace = trace_of([(F, (0, 1)), (B, (0,))])
    with_grads = catalog(3, grad=500)
    policy = static(None)
    policy.layout(with_grads, [WorkingSet(s.label, (s.chunk_id,)) for s in with_grads])
    residency = DeviceResidency(policy, with_grads, world_size=2, base_bytes=lambda: 0)

    def backward() -> list[tuple[Verb, int]]:
        residency.begin_iteration()
        done = [*residency.before_op(0, F, (0, 1), trace), *residency.after_op(0, F, (0, 1), False, trace)]
        done += [*residency.before_op(1, B, (0,), trace), *residency.after_op(1, B, (0,), True, trace)]
        done += residency.end_backward()
        return [(a.verb, a.chunk) for a in done if a.verb not in (Verb.GATHER, Verb.RELEASE)]

    assert not any(residency.grads_reduced(c) for c in range(3))
    assert backward() == [(Verb.ALLOCATE_GRAD, 0), (Verb.START_REDUCE, 0), (Verb.FINISH_REDUCE, 0)]
    assert [residency.grads_reduced(c) for c in range(3)] == [True, False, False]
    # A second backward without zero_grad: the new buffer's reduction adds to the reduced shard.
    assert backward() == [(Verb.ALLOCATE_GRAD, 0), (Verb.START_REDUCE, 0), (Verb.FINISH_REDUCE, 0)]
    assert residency.grads_reduced(0)
    assert [(a.verb, a.chunk) for a in residency.zero_grads()] == [(Verb.ZERO_GRAD, c) for c in range(3)]
    assert not any(residency.grads_reduced(c) for c in range(3))
