"""Placement policies on hand-built chunk catalogs, replayed with ``placement.simulate``: how
many fetches they make and whether they stay within the device budget.

The central claim, eviction by furthest next use, is checked against an offline optimum that this
file computes on its own: an exhaustive dynamic program over every set of chunks the device could
hold after each op (not a second Belady). Hypothesis-generated paging and training problems then
check the hard budget (every static variant and the auto policy, with and without prefetch, with
regression examples) and what prefetching buys when the budget leaves room for it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import hypothesis
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from support.policy_helpers import (
    OPTIM,
    B,
    F,
    S,
    auto,
    catalog,
    op_working_sets,
    resident,
    spec,
    static,
    trace_of,
)
from support.tier import examples

from chunkmem.placement import (
    ChunkSpec,
    ComputeTrace,
    FetchPlan,
    Location,
    OpSnapshot,
    Phase,
    PlacementPolicy,
    ResidentSet,
    SimulationResult,
    WorkingSet,
    simulate,
)

FAST = settings(max_examples=examples(30, 10), deadline=None, derandomize=True)


# --- the independent optimum ---------------------------------------------------------------------


def offline_min_fetches(requests: Sequence[Sequence[int]], n: int, k: int) -> int:
    """Fewest chunk loads that any schedule needs to serve ``requests`` in order with at most ``k``
    of the ``n`` chunks on the device at a time, starting empty.

    Exhaustive: before request ``i`` the device holds some set ``D_i`` with ``R_i <= D_i`` and
    ``|D_i| <= k``; moving from ``D_{i-1}`` to ``D_i`` costs ``|D_i - D_{i-1}|`` loads. Every such
    sequence of sets is considered (so loading early, i.e. prefetching, is allowed too), with a
    dynamic program keyed by the current set (bit masks)."""
    states = [m for m in range(1 << n) if m.bit_count() <= k]
    best = {0: 0}
    for request in requests:
        need = 0
        for c in request:
            need |= 1 << c
        assert need.bit_count() <= k, "an op wider than the device can never run"
        nxt: dict[int, int] = {}
        for held, cost in best.items():
            for state in states:
                if state & need == need:
                    total = cost + (state & ~held).bit_count()
                    if total < nxt.get(state, math.inf):
                        nxt[state] = total
        best = nxt
    return min(best.values())


def test_offline_optimum_on_known_cases() -> None:
    # Sanity of the reference itself, on cases worked by hand.
    assert offline_min_fetches([], 3, 1) == 0
    assert offline_min_fetches([[0], [1], [0], [1]], 2, 2) == 2  # everything fits: compulsory loads only
    assert offline_min_fetches([[0], [1], [0], [1]], 2, 1) == 4  # one slot: every switch loads
    # Classic: 1 2 3 1 2 with two slots -> 1 2 3(evict 1? no: evict 2 keeps 1) -> 4 loads.
    assert offline_min_fetches([[0], [1], [2], [0], [1]], 3, 2) == 4
    assert offline_min_fetches([[0, 1], [2], [0, 1]], 3, 2) == 4  # 0 1, then 2 over one, then it back
    assert offline_min_fetches([[0, 1], [2], [0, 1]], 3, 3) == 3


# --- strategies ---------------------------------------------------------------------------------


Problem = tuple[int, int, list[tuple[Phase, tuple[int, ...]]]]


@st.composite
def paging_problems(draw: st.DrawFn, max_width: int = 1, hard: bool = False) -> Problem:
    """(chunks n <= 6, device slots k, steps of length <= 14 whose ops touch at most
    ``min(max_width, k)`` distinct chunks each). ``hard``: many chunks, few slots, long traces,
    where most schedules must evict."""
    n = draw(st.sampled_from(range(4, 7) if hard else range(1, 7)))
    k = draw(st.sampled_from(range(max(1, max_width - 1), n - 1) if hard else range(1, n + 1)))
    width = min(max_width, k)
    op = st.tuples(
        st.sampled_from([F, B]),
        st.lists(st.sampled_from(range(n)), min_size=1, max_size=width, unique=True).map(tuple),
    )
    length = draw(st.sampled_from(range(10, 15) if hard else range(1, 15)))
    steps = draw(st.lists(op, min_size=length, max_size=length))
    return n, k, steps


LAYOUTS = ["optim-on-device", "optim-on-host"]


def frozen_catalog_and_budget(layout: str, n: int, k: int) -> tuple[tuple[ChunkSpec, ...], int, int]:
    """Frozen equal-size chunks and a budget of exactly ``k`` gathered chunks on top of what the
    auto layout keeps on the device between uses. Returns (specs, budget, at_rest)."""
    if layout == "optim-on-device":
        # Small optimizer sides: with a huge device and k*S of slack the auto layout fits them all.
        specs = catalog(n, optim=OPTIM)
        at_rest = n * OPTIM
    else:
        # Optimizer sides larger than the whole budget: the auto layout leaves them on the host.
        specs = catalog(n, optim=100 * S)
        at_rest = 0
    return specs, k * S + at_rest, at_rest


def check_layout(policy: PlacementPolicy, specs: Sequence[ChunkSpec], layout: str, at_rest: int) -> None:
    decided = policy.layout_decided
    on_device = layout == "optim-on-device"
    for placement in decided.placements:
        assert not placement.keep_gathered
        assert (placement.optim is Location.DEVICE) is on_device
    assert decided.at_rest_bytes(tuple(specs)) == at_rest


def check_within(result: SimulationResult, budget: int) -> None:
    assert not result.over_budget, result
    assert result.peak_device_bytes <= budget, result


# --- optimality ---------------------------------------------------------------------------------


# Each drawn problem is checked under every layout (one draw and one optimum serve them all: drawing
# dominates these tests' time).


@settings(max_examples=examples(80, 30), deadline=None, derandomize=True)
@given(problem=st.one_of(paging_problems(max_width=1), paging_problems(max_width=1, hard=True)))
def test_auto_demand_fetches_are_optimal_single_chunk_ops(problem: Problem) -> None:
    n, k, steps = problem
    optimum = offline_min_fetches([c for _, c in steps], n, k)
    for layout in LAYOUTS:
        _in_context(_optimal_single_chunk_ops, f"layout {layout}")(layout, n, k, steps, optimum)


def _in_context(check: Any, context: str) -> Any:
    """``check``, its failures noting ``context`` (which of the cases one test runs failed)."""

    def checked(*args: Any) -> Any:
        try:
            return check(*args)
        except AssertionError as failed:
            failed.add_note(context)
            raise

    return checked


def _optimal_single_chunk_ops(
    layout: str, n: int, k: int, steps: list[tuple[Phase, tuple[int, ...]]], optimum: int
) -> None:
    trace = trace_of(steps)
    specs, budget, at_rest = frozen_catalog_and_budget(layout, n, k)
    policy = auto(budget)
    result = simulate(policy, specs, trace)
    check_layout(policy, specs, layout, at_rest)
    assert result.demand_fetches == optimum
    assert result.prefetches == 0
    assert result.flushes == 0
    assert result.fetched_bytes == optimum * S
    check_within(result, budget)
    # Everything is released between iterations: each one costs the optimum again.
    again = simulate(auto(budget), specs, trace, iterations=3)
    assert again.demand_fetches == 3 * optimum


@settings(max_examples=examples(80, 30), deadline=None, derandomize=True)
@given(problem=st.one_of(paging_problems(max_width=3), paging_problems(max_width=3, hard=True)))
def test_auto_demand_fetches_multi_chunk_ops(problem: Problem) -> None:
    n, k, steps = problem
    optimum = offline_min_fetches([c for _, c in steps], n, k)
    for layout in LAYOUTS:
        _in_context(_optimal_multi_chunk_ops, f"layout {layout}")(layout, n, k, steps, optimum)


def _optimal_multi_chunk_ops(
    layout: str, n: int, k: int, steps: list[tuple[Phase, tuple[int, ...]]], optimum: int
) -> None:
    trace = trace_of(steps)
    specs, budget, at_rest = frozen_catalog_and_budget(layout, n, k)
    policy = auto(budget)
    result = simulate(policy, specs, trace, working_sets=op_working_sets(trace))
    check_layout(policy, specs, layout, at_rest)
    check_within(result, budget)
    # Sanity: the simulated run is a schedule, and no schedule beats the optimum.
    assert result.demand_fetches >= optimum
    # Furthest-next-use eviction, applied to ops that need several equal-size chunks at once, also
    # reaches the exhaustive optimum (observed here; the classic proof covers one chunk per op).
    assert result.demand_fetches == optimum


@pytest.mark.parametrize("max_prefetch", [1, 3])
@FAST
@given(problem=paging_problems(max_width=2))
def test_auto_total_fetches_with_prefetch_never_below_optimum(max_prefetch: int, problem: Problem) -> None:
    n, k, steps = problem
    trace = trace_of(steps)
    specs, budget, _ = frozen_catalog_and_budget("optim-on-host", n, k)
    result = simulate(auto(budget, max_prefetch), specs, trace, working_sets=op_working_sets(trace))
    # The optimum allows loading early, so prefetching cannot beat it either.
    assert result.fetches >= offline_min_fetches([c for _, c in steps], n, k)
    check_within(result, budget)


def first_uses_per_pass(steps: Sequence[tuple[Phase, Sequence[int]]], carry: int = 0) -> int:
    """Chunk gathers when every chunk is released after its last use in each pass (a forward
    pass, then a backward pass, ...): one per chunk per pass that uses it, except that a chunk the
    previous pass used and that is among the first ``carry`` chunks the next pass enters stays
    gathered across the boundary."""
    passes: list[list[int]] = []
    backward = None
    for phase, chunks in steps:
        if (phase is Phase.BACKWARD) is not backward:
            passes.append([])
            backward = phase is Phase.BACKWARD
        passes[-1].extend(c for c in chunks if c not in passes[-1])
    count = 0
    for index, entered in enumerate(passes):
        carried = set(entered[:carry]) & set(passes[index - 1]) if index else set()
        count += len(entered) - len(carried)
    return count


@FAST
@given(problem=paging_problems(max_width=3))
def test_static_gathers_once_per_pass_without_budget_pressure(problem: Problem) -> None:
    # ZeRO-3 by default: gather at a chunk's first use in a pass, release after its last, except
    # the chunk the next pass starts with (max_prefetch=0: only the first), which stays gathered.
    n, _, steps = problem
    trace = trace_of(steps)
    result = simulate(static(None), catalog(n), trace, working_sets=op_working_sets(trace))
    assert result.demand_fetches == first_uses_per_pass(steps, carry=1)
    assert result.prefetches == 0


@FAST
@given(problem=paging_problems(max_width=3), max_prefetch=st.integers(1, 3))
def test_static_prefetching_gathers_once_per_pass(problem: Problem, max_prefetch: int) -> None:
    # Prefetching moves gathers earlier without adding any; the chunks a pass starts with, up to
    # 1 + max_prefetch of them, stay gathered from the pass before.
    n, _, steps = problem
    trace = trace_of(steps)
    result = simulate(static(None, max_prefetch), catalog(n), trace, working_sets=op_working_sets(trace))
    assert result.demand_fetches + result.prefetches == first_uses_per_pass(steps, carry=1 + max_prefetch)


@FAST
@given(problem=paging_problems(max_width=3))
def test_static_under_a_budget_fetches_between_optimum_and_every_use(problem: Problem) -> None:
    n, k, steps = problem
    trace = trace_of(steps)
    budget = k * S + n * OPTIM  # default static layout: every optimizer side on the device
    result = simulate(static(budget), catalog(n), trace, working_sets=op_working_sets(trace))
    uses = sum(len(c) for _, c in steps)
    assert offline_min_fetches([c for _, c in steps], n, k) <= result.demand_fetches <= uses
    assert result.prefetches == 0
    check_within(result, budget)


def test_belady_beats_lru_where_it_matters() -> None:
    # 0 1 2 0 1 2 ... with two slots: LRU misses every time, furthest-next-use keeps one of them.
    steps = [(F, (c,)) for c in [0, 1, 2] * 4]
    trace = trace_of(steps)
    result = simulate(auto(2 * S + 3 * OPTIM), catalog(3), trace)
    optimum = offline_min_fetches([c for _, c in steps], 3, 2)
    assert result.demand_fetches == optimum
    assert optimum < len(steps)


# --- hard budget ----------------------------------------------------------------------------------

STATIC_VARIANTS: dict[str, dict[str, float]] = {
    "zero3": {},
    "optim-offload": {"offload_optim_frac": 1.0},
    "full-offload": {"offload_optim_frac": 1.0, "offload_param_frac": 1.0},
    "all-gathered": {"shard_param_frac": 0.0},
}


def static_minimum(variant: str, specs: Sequence[ChunkSpec], working_sets: Sequence[WorkingSet]) -> int:
    """The smallest budget that runs every op under a static variant, by arithmetic: bytes kept on
    the device between uses plus the largest op's gathers and gradient buffers."""
    if variant == "zero3":
        at_rest = sum(s.optim_side_bytes for s in specs)
        fetch = {s.chunk_id: s.gathered_bytes for s in specs}
    elif variant == "optim-offload":
        at_rest = sum(s.shard_copy_bytes for s in specs)
        fetch = {s.chunk_id: s.gathered_bytes for s in specs}
    elif variant == "full-offload":
        at_rest = 0
        fetch = {s.chunk_id: s.gathered_bytes for s in specs}
    else:
        at_rest = sum(s.optim_side_bytes + s.gathered_bytes for s in specs)
        fetch = {s.chunk_id: 0 for s in specs}
    worst = max(sum(fetch[c] + specs[c].grad_bytes for c in ws.chunks) for ws in working_sets)
    return at_rest + worst


@st.composite
def training_problems(draw: st.DrawFn, trainable: bool) -> tuple[tuple[ChunkSpec, ...], ComputeTrace, int]:
    """Chunks of mixed sizes (some trainable when ``trainable``), a trace of forward and backward
    ops touching up to three chunks, and extra budget in bytes."""
    n = draw(st.sampled_from(range(1, 7)))
    specs = []
    for i in range(n):
        size = draw(st.sampled_from([S // 2, S, 2 * S]))
        grad = draw(st.sampled_from([0, S // 2, S, 3 * S])) if trainable else 0
        specs.append(spec(i, size=size, grad=grad, optim=draw(st.integers(0, S)), shard=draw(st.integers(0, S))))
    op = st.tuples(
        st.sampled_from([F, B]),
        st.lists(st.sampled_from(range(n)), min_size=1, max_size=min(3, n), unique=True).map(tuple),
    )
    length = draw(st.sampled_from(range(1, 15)))
    trace = trace_of(draw(st.lists(op, min_size=length, max_size=length)))
    extra = draw(st.one_of(st.just(0), st.integers(0, 4 * S)))
    return tuple(specs), trace, extra


def _run_budget_case(
    policy_kind: str, max_prefetch: int, problem: tuple[tuple[ChunkSpec, ...], ComputeTrace, int]
) -> SimulationResult:
    specs, trace, extra = problem
    ws = op_working_sets(trace)
    if policy_kind.startswith("static-"):
        variant = policy_kind.removeprefix("static-")
        budget = static_minimum(variant, specs, ws) + extra
        policy: PlacementPolicy = static(budget, max_prefetch, **STATIC_VARIANTS[variant])
    else:
        # The auto layout only puts optimizer sides on the device where the budget leaves room for
        # the largest working set, so the working set alone is a feasible budget.
        budget = max(sum(specs[c].gathered_bytes + specs[c].grad_bytes for c in w.chunks) for w in ws) + extra
        policy = auto(budget, max_prefetch)
    result = simulate(policy, specs, trace, iterations=2, working_sets=ws)
    check_within(result, budget)
    assert policy.layout_decided.at_rest_bytes(specs) <= result.peak_device_bytes
    return result


POLICY_KINDS = ["auto", *(f"static-{v}" for v in STATIC_VARIANTS)]

# Regression cases: prefetch once treated chunks evicted in the same plan (by before_op or by its own
# room-making) as still resident, skipped them and prefetched later chunks past them; when the skipped
# chunk was needed again the later prefetch was still in flight (not evictable) and the op ran over
# device_budget.

# Frozen chunks of 1000, 2000 and 500 bytes, used 1 0 1 2; the auto budget is the largest chunk.
EVICTED_THEN_SKIPPED = (
    (spec(0, size=1000, optim=0, shard=0), spec(1, size=2000, optim=0, shard=0), spec(2, size=500, optim=0, shard=0)),
    trace_of([(F, (1,)), (F, (0,)), (F, (1,)), (F, (2,))]),
    0,
)


def _run_budget_cases(
    cases: Sequence[tuple[str, int]], problem: tuple[tuple[ChunkSpec, ...], ComputeTrace, int]
) -> None:
    """Each (policy, max_prefetch) of ``cases`` on one drawn problem: one draw serves them all
    (drawing dominates these tests' time), a failure names its case."""
    for policy_kind, max_prefetch in cases:
        _in_context(_run_budget_case, f"policy {policy_kind}, max_prefetch {max_prefetch}")(
            policy_kind, max_prefetch, problem
        )


@FAST
@given(problem=training_problems(trainable=False))
@example(problem=EVICTED_THEN_SKIPPED)
def test_hard_budget_never_exceeded_frozen(problem: tuple[tuple[ChunkSpec, ...], ComputeTrace, int]) -> None:
    _run_budget_cases([(kind, mp) for kind in POLICY_KINDS for mp in (0, 1, 3)], problem)


def test_prefetch_does_not_skip_a_chunk_evicted_in_the_same_plan() -> None:
    specs, trace, _ = EVICTED_THEN_SKIPPED
    policy = auto(2000, max_prefetch=1)
    policy.layout(specs, [WorkingSet(s.label, (s.chunk_id,)) for s in specs])
    # Before op 1 (chunk 0): chunk 1 (2000 bytes) must go to make room. It is next needed at op 2,
    # before chunk 2, and cannot be prefetched back (1000 + 2000 > 2000), so nothing may be
    # prefetched past it: a prefetch of chunk 2 would pin 500 bytes that op 2 needs.
    snap = OpSnapshot(
        position=1,
        phase=F,
        needed=(0,),
        needed_bytes=1000,
        residency=ResidentSet((resident(1, nbytes=2000, last_use=0),), frozenset()),
        device_bytes=2000,
        trace=trace,
    )
    assert policy.before_op(snap) == FetchPlan(evict=(1,))


@pytest.mark.parametrize(
    ("sizes", "chunks", "budget", "max_prefetch"),
    [
        # before_op evicts chunk 1 for op 1; the prefetch skips it and takes chunk 2.
        ((1000, 2000, 500), [(1,), (0,), (1,), (2,)], 2000, 1),
        ((1000, 2000, 500), [(1,), (0,), (1,), (2,)], 2000, 3),
        # the prefetch itself evicts chunk 2 to make room for chunk 0, then skips 2 and takes 1.
        ((1000, 500, 2000, 500), [(2,), (3,), (0,), (0, 2), (1,)], 3000, 2),
    ],
)
def test_auto_prefetch_keeps_frozen_chunks_within_budget(
    sizes: tuple[int, ...], chunks: list[tuple[int, ...]], budget: int, max_prefetch: int
) -> None:
    specs = tuple(spec(i, size=size, optim=0, shard=0) for i, size in enumerate(sizes))
    trace = trace_of([(F, c) for c in chunks])
    result = simulate(auto(budget, max_prefetch), specs, trace, working_sets=op_working_sets(trace))
    check_within(result, budget)


@FAST
@given(problem=training_problems(trainable=True))
def test_hard_budget_never_exceeded_trainable_no_prefetch(
    problem: tuple[tuple[ChunkSpec, ...], ComputeTrace, int],
) -> None:
    _run_budget_cases([(kind, 0) for kind in POLICY_KINDS], problem)


# Regression cases: prefetch once filled the budget with gathers for upcoming chunks without keeping room
# for the gradient buffers that backward ops before them allocate; the prefetched buffers were still in
# flight (not evictable) at those ops, which then ran over device_budget.


# The smallest case: a trainable chunk's backward right after its forward, with another chunk
# prefetched in between (see test_prefetch_leaves_room_for_gradient_buffers).
GRAD_AFTER_PREFETCH = (
    (
        spec(0, size=100, optim=0, shard=0),
        spec(1, size=100, grad=150, optim=0, shard=0),
        spec(2, size=100, optim=0, shard=0),
    ),
    trace_of([(F, (1,)), (B, (1,)), (F, (2,))]),
    50,
)


@settings(
    max_examples=examples(30, 10),
    deadline=None,
    derandomize=True,
    phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
)
@given(problem=training_problems(trainable=True))
@example(problem=GRAD_AFTER_PREFETCH)
def test_hard_budget_never_exceeded_trainable_with_prefetch(
    problem: tuple[tuple[ChunkSpec, ...], ComputeTrace, int],
) -> None:
    # all-gathered never prefetches
    _run_budget_cases([(kind, mp) for kind in POLICY_KINDS[:-1] for mp in (1, 3)], problem)


@pytest.mark.parametrize(
    ("policy_kind", "max_prefetch", "steps"),
    [
        # static, one prefetch: chunk 1 is released after op 0, then re-gathered with a gradient
        # buffer while prefetched chunk 2 cannot be evicted.
        ("static", 1, [(F, (1,)), (B, (1,)), (F, (2,))]),
        # static and auto, three prefetches: ops 1 and 2 prefetched at op 0 fill the budget.
        ("static", 3, [(F, (0,)), (B, (1,)), (F, (2,))]),
        ("auto", 3, [(F, (0,)), (B, (1,)), (F, (2,))]),
        # auto, one prefetch: chunk 1 is cached, chunk 2 prefetched, then 1's gradient buffer.
        ("auto", 1, [(F, (1,)), (F, (0,)), (B, (1,)), (F, (2,))]),
    ],
)
def test_prefetch_leaves_room_for_gradient_buffers(
    policy_kind: str, max_prefetch: int, steps: list[tuple[Phase, tuple[int, ...]]]
) -> None:
    # Three 100-byte chunks, chunk 1 trainable with a 150-byte gradient buffer, no optimizer side
    # on the device: the largest working set is 100 + 150 = 250 bytes, the budget 300.
    specs = (
        spec(0, size=100, optim=0, shard=0),
        spec(1, size=100, grad=150, optim=0, shard=0),
        spec(2, size=100, optim=0, shard=0),
    )
    budget = 300
    policy = auto(budget, max_prefetch) if policy_kind == "auto" else static(budget, max_prefetch)
    result = simulate(policy, specs, trace_of(steps))
    check_within(result, budget)


# --- prefetch -----------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [auto, static], ids=["auto", "static"])
def test_prefetch_reduces_demand_fetches_when_budget_allows(make: Any) -> None:
    n = 5
    specs = catalog(n)
    trace = trace_of([(F, (c,)) for c in range(n)])
    at_rest = n * OPTIM  # both layouts keep every optimizer side on the device here
    budget = 2 * S + at_rest  # the op's chunk plus one in flight

    plain = simulate(make(budget, 0), specs, trace)
    assert (plain.demand_fetches, plain.prefetches) == (n, 0)

    ahead = simulate(make(budget, 1), specs, trace)
    # Only the first op gathers on demand; every later chunk arrives ahead of its use.
    assert (ahead.demand_fetches, ahead.prefetches) == (1, n - 1)
    assert ahead.fetched_bytes == plain.fetched_bytes == n * S
    check_within(ahead, budget)
    check_within(plain, budget)

    more = simulate(make(n * S + at_rest, 3), specs, trace)
    assert more.demand_fetches == 1
    assert more.prefetches == n - 1


@pytest.mark.parametrize("make", [auto, static], ids=["auto", "static"])
def test_prefetch_only_uses_free_budget(make: Any) -> None:
    # A budget of exactly one chunk leaves nothing to prefetch into: same as no prefetch.
    n = 4
    specs = catalog(n)
    trace = trace_of([(F, (c,)) for c in range(n)])
    budget = S + n * OPTIM
    result = simulate(make(budget, 3), specs, trace)
    assert (result.demand_fetches, result.prefetches) == (n, 0)
    check_within(result, budget)


@pytest.mark.parametrize("make", [auto, static], ids=["auto", "static"])
def test_prefetch_without_budget_is_limited_by_max_prefetch(make: Any) -> None:
    n = 6
    specs = catalog(n)
    trace = trace_of([(F, (c,)) for c in range(n)])
    policy = make(None, 2)
    policy.layout(specs, [WorkingSet(s.label, (s.chunk_id,)) for s in specs])
    plan = policy.before_op(
        OpSnapshot(
            position=0,
            phase=F,
            needed=(0,),
            needed_bytes=S,
            residency=ResidentSet((), frozenset()),
            device_bytes=0,
            trace=trace,
        )
    )
    assert plan == FetchPlan(prefetch=(1, 2))
    # While recording (no trace) nothing is prefetched.
    plan = policy.before_op(
        OpSnapshot(
            position=0,
            phase=F,
            needed=(0,),
            needed_bytes=S,
            residency=ResidentSet((), frozenset()),
            device_bytes=0,
            trace=None,
        )
    )
    assert plan == FetchPlan()
