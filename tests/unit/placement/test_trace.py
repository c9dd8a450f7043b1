"""The compute trace (next-use queries, upcoming chunks, digest) and the cursor that follows it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.tier import examples

from chunkmem.placement import ComputeTrace, CursorMode, Divergence, Phase, TraceCursor, TraceStep

F, B = Phase.FORWARD, Phase.BACKWARD


def fwd(*chunks: int) -> TraceStep:
    return TraceStep(F, chunks)


def bwd(*chunks: int) -> TraceStep:
    return TraceStep(B, chunks)


# A small training iteration: forward 0,1,2 (op 1 touches two chunks), backward in reverse.
STEPS = [fwd(0), fwd(1, 3), fwd(2), bwd(2), bwd(1, 3), bwd(0)]


# --- ComputeTrace ---------------------------------------------------------------------------------


def test_basic_accessors() -> None:
    trace = ComputeTrace(STEPS)
    assert len(trace) == 6
    assert trace[1] == fwd(1, 3)
    assert trace.steps == tuple(STEPS)
    assert trace.chunk_ids() == frozenset({0, 1, 2, 3})


def test_trace_is_a_copy_of_its_input() -> None:
    steps = list(STEPS)
    trace = ComputeTrace(steps)
    steps.append(fwd(9))
    assert len(trace) == 6
    assert 9 not in trace.chunk_ids()


@pytest.mark.parametrize(
    ("chunk", "after", "expected"),
    [
        (0, -1, 0),
        (0, 0, 5),  # strictly after
        (0, 4, 5),
        (0, 5, None),
        (1, -1, 1),
        (3, 1, 4),
        (2, 2, 3),
        (2, 3, None),
        (7, -1, None),  # never used
        (1, 100, None),
    ],
)
def test_next_use_any_phase(chunk: int, after: int, expected: int | None) -> None:
    assert ComputeTrace(STEPS).next_use(chunk, after) == expected


@pytest.mark.parametrize(
    ("chunk", "after", "phase", "expected"),
    [
        (0, -1, B, 5),
        (0, -1, F, 0),
        (0, 0, F, None),
        (1, -1, B, 4),
        (3, 4, B, None),
        (2, 1, F, 2),
        (2, 2, F, None),
        (2, 2, B, 3),
        (7, -1, F, None),
    ],
)
def test_next_use_with_phase(chunk: int, after: int, phase: Phase, expected: int | None) -> None:
    assert ComputeTrace(STEPS).next_use(chunk, after, phase) == expected


step_strategy = st.builds(
    TraceStep,
    st.sampled_from([F, B]),
    st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True).map(tuple),
    st.booleans(),  # recompute (in backward: a forward op the autograd engine runs)
).filter(lambda step: step.phase is F or not step.recompute)
steps_strategy = st.lists(step_strategy, max_size=12)


@settings(max_examples=examples(80), deadline=None, derandomize=True)
@given(steps=steps_strategy, chunk=st.integers(0, 6), after=st.integers(-2, 13), phase=st.sampled_from([None, F, B]))
def test_next_use_matches_linear_scan(steps: list[TraceStep], chunk: int, after: int, phase: Phase | None) -> None:
    expected = next(
        (
            i
            for i, step in enumerate(steps)
            if i > after and chunk in step.chunks and (phase is None or step.phase is phase)
        ),
        None,
    )
    assert ComputeTrace(steps).next_use(chunk, after, phase) == expected


def reference_passes(steps: list[TraceStep]) -> list[int]:
    """Pass index of each step: a new pass starts whenever an op's side (backward pass: backward
    ops and recomputed forward ops; forward pass: the rest) differs from the previous op's."""
    out, current, side = [], -1, None
    for step in steps:
        mine = step.phase is B or step.recompute
        if mine is not side:
            current, side = current + 1, mine
        out.append(current)
    return out


def test_entries_are_first_uses_per_pass() -> None:
    # Forward 0, 1+3, 2, 0 again (tied weights), then backward in reverse.
    steps = [fwd(0), fwd(1, 3), fwd(2), fwd(0), bwd(0), bwd(2), bwd(1, 3), bwd(0)]
    trace = ComputeTrace(steps)
    assert list(trace.entries_after(-1)) == [(0, 0), (1, 1), (1, 3), (2, 2), (4, 0), (5, 2), (6, 1), (6, 3)]
    assert list(trace.entries_after(3)) == [(4, 0), (5, 2), (6, 1), (6, 3)]
    assert list(trace.entries_after(7)) == []  # no wrap-around into the next iteration
    assert trace.used_again_in_pass(0, 0)  # the tied weight at op 3
    assert not trace.used_again_in_pass(0, 3)  # next use is in the backward pass
    assert not trace.used_again_in_pass(0, 7)


def test_recomputation_belongs_to_the_backward_pass() -> None:
    recompute = TraceStep(F, (1,), recompute=True)
    steps = [fwd(0), fwd(1), bwd(2), recompute, bwd(1), bwd(0)]
    trace = ComputeTrace(steps)
    assert [trace.pass_of(i) for i in range(len(steps))] == [0, 0, 1, 1, 1, 1]
    # Gathered once for the recomputation, kept for its backward: one entry, and the gradient
    # buffer is allocated at the first backward-phase use.
    assert list(trace.entries_after(1)) == [(2, 2), (3, 1), (5, 0)]
    assert list(trace.grad_entries_in(-1, 5)) == [(2, 2), (4, 1), (5, 0)]
    assert trace.used_again_in_pass(1, 3)
    assert recompute.in_backward_pass and recompute != TraceStep(F, (1,))


@settings(max_examples=examples(80), deadline=None, derandomize=True)
@given(steps=steps_strategy, after=st.integers(-1, 13), until=st.integers(-1, 13))
def test_pass_queries_match_brute_force(steps: list[TraceStep], after: int, until: int) -> None:
    trace = ComputeTrace(steps)
    passes = reference_passes(steps)
    assert [trace.pass_of(i) for i in range(len(steps))] == passes
    entries, grad_entries, seen, seen_grad = [], [], set(), set()
    for i, step in enumerate(steps):
        for c in step.chunks:
            if (passes[i], c) not in seen:
                seen.add((passes[i], c))
                entries.append((i, c))
            if step.phase is B and (passes[i], c) not in seen_grad:
                seen_grad.add((passes[i], c))
                grad_entries.append((i, c))
    assert list(trace.entries_after(after)) == [e for e in entries if e[0] > after]
    assert list(trace.grad_entries_in(after, until)) == [e for e in grad_entries if after < e[0] <= until]
    for i, step in enumerate(steps):
        for c in step.chunks:
            again = any(c in steps[j].chunks and passes[j] == passes[i] for j in range(i + 1, len(steps)))
            assert trace.used_again_in_pass(c, i) == again


def test_digest_equal_for_equal_traces() -> None:
    a = ComputeTrace(STEPS)
    b = ComputeTrace([TraceStep(s.phase, tuple(s.chunks)) for s in STEPS])
    assert a.digest == b.digest
    assert isinstance(a.digest, int)
    assert -(2**63) <= a.digest < 2**63


@pytest.mark.parametrize(
    "other",
    [
        [fwd(0), fwd(1, 3), fwd(2), bwd(2), bwd(1, 3)],  # shorter
        [*STEPS, fwd(0)],  # longer
        [fwd(0), fwd(3, 1), fwd(2), bwd(2), bwd(1, 3), bwd(0)],  # order within an op
        [fwd(0), fwd(1), fwd(3), fwd(2), bwd(2), bwd(1, 3), bwd(0)],  # op boundaries
        [fwd(0), fwd(1, 3), fwd(2), fwd(2), bwd(1, 3), bwd(0)],  # phase
        [fwd(0), fwd(1, 3), fwd(2), bwd(2), bwd(1, 3), bwd(4)],  # chunk id
        [fwd(0), fwd(13), fwd(2), bwd(2), bwd(1, 3), bwd(0)],  # "1,3" vs "13"
        [fwd(0), fwd(1, 3), bwd(2), fwd(2), bwd(1, 3), bwd(0)],  # swapped ops
    ],
)
def test_digest_differs_for_different_traces(other: list[TraceStep]) -> None:
    assert ComputeTrace(other).digest != ComputeTrace(STEPS).digest


@settings(max_examples=examples(100), deadline=None, derandomize=True)
@given(a=steps_strategy, b=steps_strategy)
def test_digest_equal_iff_steps_equal(a: list[TraceStep], b: list[TraceStep]) -> None:
    assert (ComputeTrace(a).digest == ComputeTrace(b).digest) == (a == b)


def test_empty_trace() -> None:
    trace = ComputeTrace([])
    assert len(trace) == 0
    assert trace.chunk_ids() == frozenset()
    assert trace.next_use(0, -1) is None
    assert list(trace.entries_after(-1)) == []
    assert trace.digest == ComputeTrace(()).digest
    assert trace.digest != ComputeTrace([fwd(0)]).digest


# --- TraceCursor ----------------------------------------------------------------------------------


def run_iteration(cursor: TraceCursor, steps: list[TraceStep]) -> list[Divergence | None]:
    """Observe every step, returning what each observe returned (end_iteration not called)."""
    return [cursor.observe(step) for step in steps]


def recorded(steps: list[TraceStep]) -> TraceCursor:
    cursor = TraceCursor()
    assert cursor.begin_iteration() is None
    assert run_iteration(cursor, steps) == [None] * len(steps)
    assert cursor.end_iteration() is None
    return cursor


def test_first_iteration_records() -> None:
    cursor = TraceCursor()
    assert cursor.recording
    assert cursor.trace is None
    assert cursor.last_frozen is None
    assert cursor.position == -1
    assert cursor.begin_iteration() is None
    for i, step in enumerate(STEPS):
        assert cursor.observe(step) is None
        assert cursor.position == i
        assert cursor.recording
        assert cursor.trace is None  # nothing frozen to serve yet
    assert cursor.end_iteration() is None
    assert not cursor.recording
    assert cursor.position == -1
    frozen = cursor.last_frozen
    assert frozen is not None
    assert frozen.steps == tuple(STEPS)
    assert cursor.trace is frozen


def test_first_iteration_without_begin_records() -> None:
    cursor = TraceCursor()
    assert run_iteration(cursor, STEPS) == [None] * len(STEPS)
    assert cursor.end_iteration() is None
    assert cursor.last_frozen is not None
    assert cursor.last_frozen.steps == tuple(STEPS)


def test_frozen_trace_is_not_changed_by_later_observes() -> None:
    cursor = recorded(STEPS)
    frozen = cursor.last_frozen
    assert frozen is not None
    cursor.begin_iteration()
    cursor.observe(fwd(5))
    assert frozen.steps == tuple(STEPS)


def test_matching_iteration_serves_the_trace() -> None:
    cursor = recorded(STEPS)
    frozen = cursor.last_frozen
    for _ in range(3):
        assert cursor.begin_iteration() is None
        assert not cursor.recording
        assert cursor.trace is frozen
        for i, step in enumerate(STEPS):
            assert cursor.observe(step) is None
            assert cursor.position == i
            assert cursor.trace is frozen
            assert not cursor.recording
        assert cursor.end_iteration() is None
        assert cursor.last_frozen is frozen
        assert cursor.trace is frozen


@pytest.mark.parametrize("p", range(len(STEPS)))
def test_divergence_at_each_position(p: int) -> None:
    cursor = recorded(STEPS)
    frozen = cursor.last_frozen
    assert frozen is not None
    actual = fwd(9) if STEPS[p] != fwd(9) else bwd(9)
    new_steps = [*STEPS[:p], actual, *STEPS[p + 1 :]]

    cursor.begin_iteration()
    for step in STEPS[:p]:
        assert cursor.observe(step) is None
        assert cursor.trace is frozen
    divergence = cursor.observe(actual)
    assert divergence == Divergence(position=p, expected=STEPS[p], actual=actual)
    assert cursor.position == p
    # The rest of this iteration runs without a trace, even where it matches the old one again.
    assert cursor.trace is None
    assert cursor.recording
    for step in STEPS[p + 1 :]:
        assert cursor.observe(step) is None
        assert cursor.trace is None
    assert cursor.last_frozen is frozen
    assert cursor.end_iteration() is None

    # The next iteration follows the re-recorded trace.
    refrozen = cursor.last_frozen
    assert refrozen is not None
    assert refrozen.steps == tuple(new_steps)
    assert refrozen.digest != frozen.digest
    assert cursor.begin_iteration() is None
    assert cursor.trace is refrozen
    assert run_iteration(cursor, new_steps) == [None] * len(new_steps)
    assert cursor.trace is refrozen
    assert cursor.end_iteration() is None


def test_old_trace_diverges_after_rerecording() -> None:
    cursor = recorded(STEPS)
    other = [fwd(0), fwd(2), bwd(2), bwd(0)]
    cursor.begin_iteration()
    divs = run_iteration(cursor, other)
    assert divs[0] is None
    assert divs[1] == Divergence(1, STEPS[1], fwd(2))
    assert divs[2:] == [None, None]
    assert cursor.end_iteration() is None  # already recording: not reported twice
    assert cursor.last_frozen is not None
    assert cursor.last_frozen.steps == tuple(other)
    # Going back to the original order is now a divergence from the re-recorded trace.
    cursor.begin_iteration()
    assert cursor.observe(STEPS[0]) is None
    assert cursor.observe(STEPS[1]) == Divergence(1, fwd(2), STEPS[1])


@pytest.mark.parametrize("stop", range(len(STEPS)))
def test_iteration_ending_early_is_reported_at_end(stop: int) -> None:
    cursor = recorded(STEPS)
    cursor.begin_iteration()
    assert run_iteration(cursor, STEPS[:stop]) == [None] * stop
    assert cursor.trace is cursor.last_frozen  # nothing wrong seen yet
    divergence = cursor.end_iteration()
    assert divergence == Divergence(position=stop, expected=STEPS[stop], actual=None)
    assert "end of iteration" in divergence.describe()
    # The short iteration becomes the trace (when it observed anything).
    assert cursor.last_frozen is not None
    if stop:
        assert cursor.last_frozen.steps == tuple(STEPS[:stop])
        cursor.begin_iteration()
        assert run_iteration(cursor, STEPS[:stop]) == [None] * stop
        assert cursor.end_iteration() is None
    else:
        assert cursor.last_frozen.steps == tuple(STEPS)


def test_iteration_running_past_the_end() -> None:
    cursor = recorded(STEPS)
    cursor.begin_iteration()
    assert run_iteration(cursor, STEPS) == [None] * len(STEPS)
    extra = fwd(4)
    assert cursor.observe(extra) == Divergence(len(STEPS), None, extra)
    assert cursor.trace is None
    assert cursor.end_iteration() is None
    assert cursor.last_frozen is not None
    assert cursor.last_frozen.steps == (*STEPS, extra)


def test_begin_iteration_closes_an_open_matching_iteration() -> None:
    cursor = recorded(STEPS)
    frozen = cursor.last_frozen
    cursor.begin_iteration()
    run_iteration(cursor, STEPS)
    # No end_iteration: the next begin closes it; it matched, so nothing to report.
    assert cursor.begin_iteration() is None
    assert cursor.position == -1
    assert cursor.trace is frozen


def test_begin_iteration_closes_an_open_short_iteration() -> None:
    cursor = recorded(STEPS)
    cursor.begin_iteration()
    run_iteration(cursor, STEPS[:2])
    assert cursor.begin_iteration() == Divergence(2, STEPS[2], None)
    assert cursor.position == -1
    assert cursor.trace is not None
    assert cursor.trace.steps == tuple(STEPS[:2])


def test_begin_iteration_closes_an_open_first_iteration() -> None:
    cursor = TraceCursor()
    cursor.begin_iteration()
    run_iteration(cursor, STEPS)
    assert cursor.begin_iteration() is None
    assert cursor.trace is not None
    assert cursor.trace.steps == tuple(STEPS)
    assert run_iteration(cursor, STEPS) == [None] * len(STEPS)


def test_begin_iteration_closes_an_open_diverged_iteration() -> None:
    cursor = recorded(STEPS)
    cursor.begin_iteration()
    new = [fwd(0), bwd(0)]
    run_iteration(cursor, new)
    assert cursor.begin_iteration() is None  # reported at observe, not again
    assert cursor.trace is not None
    assert cursor.trace.steps == tuple(new)


def test_divergence_describe() -> None:
    d = Divergence(3, fwd(1, 2), bwd(4))
    text = d.describe()
    assert "position 3" in text
    assert "forward op on chunks (1, 2)" in text
    assert "backward op on chunks (4,)" in text
    assert "end of iteration" in Divergence(7, None, fwd(0)).describe()


def test_recording_stops_past_max_steps_and_keeps_the_previous_trace() -> None:
    """Forwards that never reach an optimizer step must not grow a recording without bound."""
    cursor = TraceCursor(max_steps=3)
    steps = [TraceStep(Phase.FORWARD, (i,)) for i in range(3)]
    cursor.begin_iteration()
    for step in steps:
        cursor.observe(step)
    cursor.end_iteration()
    first = cursor.last_frozen
    assert first is not None and len(first) == 3
    cursor.begin_iteration()
    for step in [*steps, TraceStep(Phase.FORWARD, (9,)), *steps]:  # departs at 3, then runs past the cap
        cursor.observe(step)
    assert cursor.mode is CursorMode.OVERFLOWED and cursor.trace is None
    cursor.end_iteration()
    assert cursor.last_frozen is first
    assert cursor.mode is CursorMode.FOLLOWING


# --- the iteration tracker's op-sequence digest ----------------------------------------------------


@pytest.mark.parametrize("asked_at", [[], [1], [5_000], [1, 4_096, 4_097, 9_000]])
def test_tracker_digest_does_not_depend_on_when_it_is_asked(asked_at: list[int]) -> None:
    """Ranks compare the digest after each synchronised backward: however often it was asked (and
    however ops were batched into it), it is the digest of the whole op sequence so far."""
    from chunkmem.execution.iteration import IterationTracker

    def digest_of(ask: list[int], odd_op: int = -1) -> int:
        tracker = IterationTracker(lambda divergence: None)
        tracker.begin_forward(in_step=True)
        for i in range(10_000):
            chunks = (i % 7, i % 5) if i != odd_op else (i % 5, i % 7)
            tracker.observe(F if i % 3 else B, chunks, recompute=False)
            if i in ask:
                assert isinstance(tracker.digest, int)
        return tracker.digest

    assert digest_of(asked_at) == digest_of([])
    # Every op counts, also one late in the sequence, after earlier ops were folded in.
    assert digest_of(asked_at, odd_op=9_990) != digest_of([])


def test_the_trace_notes_where_each_op_let_go_of_its_chunks() -> None:
    """A backward op whose activations are recomputed (non-reentrant checkpointing) holds its
    chunks across the recomputation: the trace says so, without making it part of what ran."""
    cursor = TraceCursor()
    cursor.begin_iteration()
    cursor.observe(TraceStep(Phase.BACKWARD, (0,)))
    cursor.observe(TraceStep(Phase.FORWARD, (1,), recompute=True))
    cursor.close(1)
    cursor.close(0)
    cursor.observe(TraceStep(Phase.BACKWARD, (1,)))
    cursor.close(2)
    cursor.end_iteration()
    frozen = cursor.last_frozen
    assert frozen is not None and frozen.closes == (1, 1, 2)
    plain = ComputeTrace(frozen.steps)
    assert plain.closes == (0, 1, 2) and plain.digest == frozen.digest
    # Following it, the same ops are no divergence, and the closes stay the recorded ones.
    cursor.begin_iteration()
    for step in frozen.steps:
        assert cursor.observe(step) is None
    assert cursor.end_iteration() is None and cursor.last_frozen is frozen
    with pytest.raises(ValueError, match="closes"):
        ComputeTrace(frozen.steps, (0, 0, 2))


# --- a cyclic cursor (the decode steps of generate) ---------------------------------------------
DECODE = [fwd(0), fwd(1), fwd(2), fwd(0)]  # a tied embedding: the first and the last op share chunk 0


def test_a_cyclic_trace_leads_into_the_next_iteration() -> None:
    cursor = TraceCursor(cyclic=True)
    cursor.begin_iteration()
    assert run_iteration(cursor, DECODE) == [None] * len(DECODE)
    assert cursor.end_iteration() is None
    trace = cursor.trace
    assert trace is not None and trace.steps == (*DECODE, *DECODE)  # this step, then the next
    assert [trace.pass_of(p) for p in range(8)] == [0] * 4 + [1] * 4
    assert not trace.used_again_in_pass(0, 3)  # released after the step's last op, or kept for the next:
    assert trace.next_use(0, 3) == 4 and trace.entry_rank(0, 4) == 0  # the next step starts with it
    assert list(trace.entries_after(2)) == [(4, 0), (5, 1), (6, 2)]  # what the step's last ops prefetch
    # Iterations follow the first copy only: the same steps match, one op more is a divergence.
    cursor.begin_iteration()
    assert run_iteration(cursor, DECODE) == [None] * len(DECODE)
    extra = fwd(3)
    assert cursor.observe(extra) == Divergence(len(DECODE), None, extra)
    assert cursor.end_iteration() is None
    assert cursor.last_frozen is not None and cursor.last_frozen.steps == (*DECODE, extra) * 2
    cursor.begin_iteration()  # and one that stops short of the recorded step
    assert run_iteration(cursor, [*DECODE, extra][:3]) == [None] * 3
    assert cursor.end_iteration() == Divergence(3, DECODE[3], None)
