"""Placement policies on hand-built chunk catalogs: ``before_op`` decisions on hand-made
snapshots, the error when the budget is too small, the static layout (sharded, kept gathered,
offloaded fractions), ``after_op`` releases of both policies, the auto layout, the auto policy's
device cap before and after warmup, and ``make_policy``.

Fetch counts against an offline optimum, the hard budget and prefetching are in
``test_policy_optimality.py``; the shared builders are in ``policy_helpers.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.policy_helpers import (
    OPTIM,
    SHARD,
    B,
    F,
    S,
    auto,
    catalog,
    resident,
    spec,
    static,
    trace_of,
)
from support.tier import examples

from chunkmem.placement import (
    AutoPlacementConfig,
    AutoPolicy,
    BudgetTooSmallError,
    BufferKind,
    ChunkPlacement,
    ChunkSpec,
    ComputeTrace,
    FetchPlan,
    Layout,
    Location,
    OpSnapshot,
    PlacementPolicy,
    ReleaseSnapshot,
    ResidentSet,
    StaticPlacementConfig,
    StaticPolicy,
    WorkingSet,
    make_policy,
    simulate,
)

# --- before_op decisions on hand-made snapshots ----------------------------------------------------


def decided(policy: PlacementPolicy, n: int, **kwargs: Any) -> PlacementPolicy:
    specs = catalog(n, optim=0, **kwargs)
    policy.layout(specs, [WorkingSet(s.label, (s.chunk_id,)) for s in specs])
    return policy


def test_before_op_evicts_furthest_next_use_first() -> None:
    trace = trace_of([(F, (0,)), (F, (1,)), (F, (2,)), (F, (3,)), (F, (1,)), (F, (2,))])
    policy = decided(static(2 * S), 4)
    snap = OpSnapshot(
        position=3,
        phase=F,
        needed=(3,),
        needed_bytes=S,
        residency=ResidentSet((resident(0, last_use=0), resident(1, last_use=1), resident(2, last_use=2)), frozenset()),
        device_bytes=3 * S,
        trace=trace,
    )
    # 0 is never used again, then 2 (position 5) before 1 (position 4).
    assert policy.before_op(snap).evict == (0, 2)


def test_before_op_without_trace_evicts_least_recently_used() -> None:
    policy = decided(static(2 * S), 4)
    snap = OpSnapshot(
        position=7,
        phase=F,
        needed=(3,),
        needed_bytes=S,
        residency=ResidentSet((resident(0, last_use=5), resident(1, last_use=2), resident(2, last_use=6)), frozenset()),
        device_bytes=3 * S,
        trace=None,
    )
    assert policy.before_op(snap).evict == (1, 0)


def test_before_op_never_evicts_held_fetching_or_needed() -> None:
    trace = trace_of([(F, (0,)), (F, (1,)), (F, (2,)), (F, (3,)), (F, (4,))])
    policy = decided(static(2 * S), 5)
    snap = OpSnapshot(
        position=3,
        phase=F,
        needed=(3, 2),
        needed_bytes=S,
        residency=ResidentSet(
            (
                resident(0, held=True),
                resident(1, fetching=True),
                resident(2),
                resident(4, nbytes=0),
            ),
            frozenset(),
        ),
        device_bytes=3 * S,
        trace=trace,
    )
    assert policy.before_op(snap) == FetchPlan()


def test_before_op_flushes_gradient_buffers_after_gathered_at_equal_distance() -> None:
    trace = trace_of([(F, (0,)), (B, (1,)), (B, (0,)), (B, (2,))])
    policy = decided(static(2 * S), 3, grad=S)
    snap = OpSnapshot(
        position=3,
        phase=B,
        needed=(2,),
        needed_bytes=2 * S,
        residency=ResidentSet((resident(0, last_use=2), resident(0, kind=BufferKind.GRAD, last_use=2)), frozenset()),
        device_bytes=2 * S,
        trace=trace,
    )
    # Both of chunk 0's buffers are never needed again: the gathered one goes first, then the
    # gradient buffer is flushed because the op still does not fit.
    assert policy.before_op(snap) == FetchPlan(evict=(0,), flush=(0,))


def test_before_op_within_cap_does_nothing() -> None:
    trace = trace_of([(F, (0,)), (F, (1,))])
    policy = decided(static(2 * S), 2)
    snap = OpSnapshot(
        position=1,
        phase=F,
        needed=(1,),
        needed_bytes=S,
        residency=ResidentSet((resident(0, last_use=0),), frozenset()),
        device_bytes=S,
        trace=trace,
    )
    assert policy.before_op(snap) == FetchPlan()


# --- budget too small -----------------------------------------------------------------------------


def test_budget_too_small_names_budget_minimum_and_module() -> None:
    specs = (spec(0, grad=0), spec(1, grad=300), spec(2, grad=300), spec(3, grad=0))
    working_sets = [
        WorkingSet("embed", (0,)),
        WorkingSet("decoder.layers.1", (1, 2)),
        WorkingSet("head", (3,)),
    ]
    minimum = 4 * OPTIM + 2 * S + 2 * 300  # zero3 layout: optimizer sides at rest, the layer's gathers and grads
    static(minimum).layout(specs, working_sets)  # exactly enough

    budget = minimum - 1
    with pytest.raises(BudgetTooSmallError) as exc:
        static(budget).layout(specs, working_sets)
    message = str(exc.value)
    assert f"device_budget={budget}" in message
    assert str(minimum) in message
    assert "'decoder.layers.1'" in message
    assert isinstance(exc.value, ValueError)


def test_budget_too_small_via_simulate_with_default_working_sets() -> None:
    specs = (spec(0, size=S), spec(1, size=3 * S, label="lm_head.weight"))
    minimum = 2 * OPTIM + 3 * S
    trace = trace_of([(F, (0,)), (F, (1,))])
    with pytest.raises(BudgetTooSmallError) as exc:
        simulate(static(minimum - 1), specs, trace)
    assert str(minimum) in str(exc.value)
    assert f"device_budget={minimum - 1}" in str(exc.value)
    assert "lm_head.weight" in str(exc.value)
    result = simulate(static(minimum), specs, trace)
    assert result.peak_device_bytes == minimum


def test_auto_budget_too_small_names_module() -> None:
    # The auto layout puts nothing on the device when there is no room, so the minimum is the
    # largest working set alone.
    specs = (spec(0), spec(1, grad=S), spec(2))
    working_sets = [WorkingSet("attn", (0, 1)), WorkingSet("mlp", (2,))]
    minimum = 3 * S
    policy = auto(minimum)
    layout = policy.layout(specs, working_sets)
    assert layout.at_rest_bytes(specs) == 0
    with pytest.raises(BudgetTooSmallError) as exc:
        auto(minimum - 1).layout(specs, working_sets)
    assert f"device_budget={minimum - 1}" in str(exc.value)
    assert str(minimum) in str(exc.value)
    assert "'attn'" in str(exc.value)


def test_no_budget_never_raises() -> None:
    specs = catalog(3, size=10 * S)
    static(None).layout(specs, [WorkingSet("all", (0, 1, 2))])
    assert static(None).budget is None


# --- static layout ------------------------------------------------------------------------------


def static_layout(specs: Sequence[ChunkSpec], **kwargs: Any) -> Layout:
    policy = static(None, **kwargs)
    return policy.layout(specs, [WorkingSet(s.label, (s.chunk_id,)) for s in specs])


def test_static_default_is_zero3() -> None:
    layout = static_layout(catalog(4))
    assert all(p == ChunkPlacement(Location.DEVICE, Location.DEVICE) for p in layout.placements)
    assert layout.at_rest_bytes(catalog(4)) == 4 * OPTIM


def test_static_shard_half_keeps_first_half_gathered() -> None:
    specs = catalog(4)
    layout = static_layout(specs, shard_param_frac=0.5)
    assert [p.keep_gathered for p in layout.placements] == [True, True, False, False]
    assert all(p.optim is Location.DEVICE and p.shard is Location.DEVICE for p in layout.placements)
    assert layout.at_rest_bytes(specs) == 4 * OPTIM + 2 * S


def test_static_shard_fraction_is_by_memory_in_id_order() -> None:
    specs = (spec(0, size=3 * S), spec(1), spec(2), spec(3))
    layout = static_layout(specs, shard_param_frac=0.5)
    assert [p.keep_gathered for p in layout.placements] == [True, False, False, False]


@pytest.mark.parametrize(("frac", "kept"), [(1.0, 0), (0.75, 1), (0.5, 2), (0.25, 3), (0.0, 4)])
def test_static_shard_fractions(frac: float, kept: int) -> None:
    layout = static_layout(catalog(4), shard_param_frac=frac)
    assert [p.keep_gathered for p in layout.placements] == [i < kept for i in range(4)]


def test_static_shard_fraction_point_seven_of_ten() -> None:
    layout = static_layout(catalog(10), shard_param_frac=0.7)
    assert sum(p.keep_gathered for p in layout.placements) == 3


def test_static_offload_optim_all() -> None:
    specs = catalog(4)
    layout = static_layout(specs, offload_optim_frac=1.0)
    for p in layout.placements:
        assert p.optim is not Location.DEVICE
        assert p.shard is Location.DEVICE  # parameter shard copy stays on the device
        assert not p.keep_gathered
    assert layout.at_rest_bytes(specs) == 4 * SHARD


def test_static_offload_optim_and_params_all() -> None:
    specs = catalog(4)
    layout = static_layout(specs, offload_optim_frac=1.0, offload_param_frac=1.0)
    assert all(p == ChunkPlacement(Location.HOST, Location.HOST) for p in layout.placements)
    assert layout.at_rest_bytes(specs) == 0


def test_static_offload_params_half() -> None:
    layout = static_layout(catalog(4), offload_optim_frac=1.0, offload_param_frac=0.5)
    assert [p.shard is Location.DEVICE for p in layout.placements] == [False, False, True, True]
    assert not any(p.optim is Location.DEVICE for p in layout.placements)


def test_static_offload_optim_half() -> None:
    layout = static_layout(catalog(4), offload_optim_frac=0.5)
    assert [p.optim is Location.DEVICE for p in layout.placements] == [False, False, True, True]


def test_static_kept_chunks_are_never_offloaded() -> None:
    layout = static_layout(catalog(4), shard_param_frac=0.5, offload_optim_frac=1.0)
    assert [p.keep_gathered for p in layout.placements] == [True, True, False, False]
    assert [p.optim is Location.DEVICE for p in layout.placements] == [True, True, False, False]


def test_static_optim_fraction_is_of_all_chunk_memory() -> None:
    # Half the memory is kept gathered; a quarter of all memory is one of the two sharded chunks.
    layout = static_layout(catalog(4), shard_param_frac=0.5, offload_optim_frac=0.25)
    assert [p.optim is Location.DEVICE for p in layout.placements] == [True, True, False, True]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"shard_param_frac": 0.5},
        {"offload_optim_frac": 0.5},
        {"shard_param_frac": 0.25, "offload_optim_frac": 0.5},
        {"offload_optim_frac": 1.0, "offload_param_frac": 0.3},
    ],
)
def test_static_layout_is_deterministic(kwargs: dict[str, float]) -> None:
    specs = (spec(0, size=700), spec(1, size=1300), spec(2), spec(3, size=2 * S), spec(4, size=300))
    first = static_layout(specs, **kwargs)
    for _ in range(3):
        assert static_layout(specs, **kwargs) == first
    policy = static(None, **kwargs)
    ws = [WorkingSet(s.label, (s.chunk_id,)) for s in specs]
    assert policy.layout(specs, ws) == policy.layout(specs, ws) == first


def test_layout_requires_specs_indexed_by_id() -> None:
    with pytest.raises(ValueError, match="indexed by chunk id"):
        static(None).layout((spec(1), spec(0)), [])


def test_decisions_need_a_layout_first() -> None:
    with pytest.raises(RuntimeError, match="layout"):
        _ = static(None).layout_decided


def test_adopt_layout_checks_length() -> None:
    policy = static(None)
    policy.layout(catalog(2), [])
    with pytest.raises(ValueError, match="2 chunks"):
        policy.adopt_layout(Layout((ChunkPlacement(Location.DEVICE, Location.DEVICE),)))
    host = Layout((ChunkPlacement(Location.HOST, Location.HOST),) * 2)
    policy.adopt_layout(host)
    assert policy.layout_decided == host


# --- static after_op ------------------------------------------------------------------------------


def test_static_after_op_releases_finished_chunks_not_used_again_in_the_pass() -> None:
    policy = static(None, shard_param_frac=0.5)  # chunks 0, 1 and 2 kept gathered
    policy.layout(catalog(6), [])
    trace = trace_of([(F, (0, 1, 2, 3, 4, 5)), (F, (5, 4, 3)), (F, (4,)), (B, (3,)), (B, (5,))])
    snap = ReleaseSnapshot(1, F, (0, 5, 3, 1, 4), False, ResidentSet(), trace)
    # 4 is used again in the forward, 3 starts the backward; 5 goes.
    assert policy.after_op(snap) == (5,)


def test_static_after_op_while_recording_keeps_the_chunks_used_last() -> None:
    """With no trace the static policy cannot tell which chunks come back: it keeps the
    RECORDING_WINDOW (3) idle gathered chunks used last, and releases the rest, least recent
    first; a tie (chunks of one op) breaks on chunk id. Held, arriving and kept chunks are not its
    to release."""
    policy = static(None, shard_param_frac=0.875)  # chunk 0 kept gathered
    policy.layout(catalog(8), [])
    gathered = ResidentSet(
        (
            resident(1, last_use=9),
            resident(2, last_use=4),
            resident(3, last_use=9),
            resident(4, last_use=7),
            resident(5, last_use=8),
            resident(6, last_use=1, held=True),
            resident(7, last_use=-1),
            resident(4, kind=BufferKind.GRAD, last_use=7),
        )
    )
    for phase in (F, B):
        snap = ReleaseSnapshot(9, phase, (1, 3), phase is B, gathered)
        assert policy.after_op(snap) == (4, 2, 7)
    few = ResidentSet((resident(1, last_use=2), resident(2, last_use=1)))
    assert policy.after_op(ReleaseSnapshot(2, F, (1,), False, few)) == ()


def test_static_after_op_keeps_chunks_during_recomputation() -> None:
    policy = static(None)
    policy.layout(catalog(5), [])
    gathered = ResidentSet(tuple(resident(c, last_use=c) for c in range(5)))
    snap = ReleaseSnapshot(5, F, (0, 1, 2), True, gathered)
    assert policy.after_op(snap) == ()
    # The backward op itself (also inside the engine) does release beyond the window.
    snap = ReleaseSnapshot(6, B, (0, 1, 2), True, gathered)
    assert policy.after_op(snap) == (1, 0)


def test_auto_after_op_keeps_everything() -> None:
    policy = auto(None)
    policy.layout(catalog(3), [])
    for phase in (F, B):
        for in_backward in (False, True):
            assert policy.after_op(ReleaseSnapshot(1, phase, (0, 1, 2), in_backward, ResidentSet())) == ()


# --- auto layout ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("budget", "max_prefetch", "grad", "on_device"),
    [
        # warmup cap 2900 (capacity 11600 at 75% non-model data); room = cap - working set - prefetch
        (None, 1, 0, 3),  # 2900 - 1000 - 1000 = 900 -> three 300-byte sides
        (None, 0, 0, 4),  # 1900 -> all four (1200)
        (2500, 1, 0, 1),  # the budget lowers the cap: 500 -> one
        (None, 1, 500, 1),  # a 500-byte gradient buffer grows the working set: 400 -> one
        (2000, 1, 0, 0),  # 0 -> none
    ],
)
def test_auto_layout_puts_optimizer_sides_on_device_while_they_fit(
    budget: int | None, max_prefetch: int, grad: int, on_device: int
) -> None:
    specs = catalog(4, optim=300, grad=grad)
    policy = auto(budget, max_prefetch, capacity=11600, warmup_non_model_data_ratio=0.75)
    layout = policy.layout(specs, [WorkingSet(s.label, (s.chunk_id,)) for s in specs])
    assert [p.optim is Location.DEVICE for p in layout.placements] == [i < on_device for i in range(4)]
    assert all(
        (p.shard is Location.DEVICE) == (p.optim is Location.DEVICE) and not p.keep_gathered for p in layout.placements
    )
    assert layout.at_rest_bytes(specs) == 300 * on_device


# --- auto cap -------------------------------------------------------------------------------------

CAPACITY = 80_000
WARMUP_RATIO = 0.75  # warmup cap 20_000
STEADY_RATIO = 0.5  # steady cap 40_000 minus non-model data


def cap_trace() -> ComputeTrace:
    return trace_of([(F, (0,)), (F, (1,)), (B, (1,)), (B, (0,))])


@pytest.mark.parametrize("budget", [None, 50_000, 15_000, 1])
def test_auto_cap_before_warmup(budget: int | None) -> None:
    policy = auto(budget, capacity=CAPACITY, warmup_non_model_data_ratio=WARMUP_RATIO)
    expected = 20_000 if budget is None else min(20_000, budget)
    trace = cap_trace()
    for position in range(-1, 5):
        assert policy.cap(position, trace) == expected
        assert policy.cap(position, None) == expected
    assert not policy.profiled(trace)


@pytest.mark.parametrize("budget", [None, 50_000, 30_000, 15_000])
def test_auto_cap_after_warmup(budget: int | None) -> None:
    policy = auto(
        budget, capacity=CAPACITY, warmup_non_model_data_ratio=WARMUP_RATIO, steady_device_cap_ratio=STEADY_RATIO
    )
    trace = cap_trace()
    non_model = [1_000, 25_000, 5_000, 60_000]
    policy.observe_warmup(trace, non_model)
    assert policy.profiled(trace)
    # At each position the cap leaves room for this position's non-model data and the next one's
    # (the last position has no next).
    steady = {0: 40_000 - 25_000, 1: 40_000 - 25_000, 2: 0, 3: 0}
    for position, value in steady.items():
        expected = value if budget is None else min(value, budget)
        assert policy.cap(position, trace) == expected
        if budget is not None:
            assert policy.cap(position, trace) <= budget
    # Another trace (or no trace, or a position outside it) falls back to the warmup cap.
    warm = 20_000 if budget is None else min(20_000, budget)
    other = trace_of([(F, (0,)), (F, (1,)), (B, (1,))])
    assert not policy.profiled(other)
    assert policy.cap(0, other) == warm
    assert policy.cap(0, None) == warm
    assert policy.cap(-1, trace) == warm
    assert policy.cap(len(trace), trace) == warm


def test_auto_cap_with_flat_non_model_data() -> None:
    policy = auto(None, capacity=CAPACITY, steady_device_cap_ratio=STEADY_RATIO)
    trace = cap_trace()
    policy.observe_warmup(trace, [7_000] * 4)
    assert [policy.cap(p, trace) for p in range(4)] == [33_000] * 4


def test_auto_observe_warmup_needs_one_sample_per_position() -> None:
    policy = auto(None, capacity=CAPACITY)
    with pytest.raises(ValueError, match="3 samples"):
        policy.observe_warmup(cap_trace(), [0, 0, 0])


@pytest.mark.parametrize("capacity", [None, 0, -5])
def test_auto_needs_a_capacity(capacity: int | None) -> None:
    with pytest.raises(ValueError, match="device_capacity"):
        AutoPolicy(AutoPlacementConfig(), capacity)
    with pytest.raises(ValueError, match="device_capacity"):
        make_policy(AutoPlacementConfig(), capacity)


@settings(max_examples=examples(200), deadline=None, derandomize=True)
@given(
    capacity=st.integers(1, 10**12),
    budget=st.one_of(st.none(), st.integers(1, 10**12)),
    warmup=st.floats(0.01, 0.99),
    steady=st.floats(0.01, 1.0),
    non_model=st.lists(st.integers(0, 10**12), min_size=1, max_size=8),
    observed=st.booleans(),
)
def test_auto_cap_never_above_budget(
    capacity: int,
    budget: int | None,
    warmup: float,
    steady: float,
    non_model: list[int],
    observed: bool,
) -> None:
    policy = auto(budget, capacity=capacity, warmup_non_model_data_ratio=warmup, steady_device_cap_ratio=steady)
    trace = trace_of([(F, (i,)) for i in range(len(non_model))])
    if observed:
        policy.observe_warmup(trace, non_model)
    for position in range(-1, len(non_model) + 1):
        cap = policy.cap(position, trace)
        assert cap is not None
        assert 0 <= cap <= capacity
        if budget is not None:
            assert cap <= budget
        if observed and 0 <= position < len(non_model):
            nxt = non_model[min(position + 1, len(non_model) - 1)]
            assert cap <= capacity * steady - max(non_model[position], nxt) or cap == 0
        else:
            assert cap <= capacity * (1 - warmup)


# --- make_policy ----------------------------------------------------------------------------------


def test_make_policy() -> None:
    s = make_policy(StaticPlacementConfig(device_budget="1MiB", max_prefetch=2), None)
    assert isinstance(s, StaticPolicy)
    assert (s.budget, s.max_prefetch) == (2**20, 2)
    a = make_policy(AutoPlacementConfig(device_budget=5000), 10**9)
    assert isinstance(a, AutoPolicy)
    assert (a.budget, a.max_prefetch) == (5000, 0)
    assert isinstance(a.budget, int)
    with pytest.raises(TypeError, match="no policy"):
        make_policy(object(), 10)  # type: ignore[arg-type]
