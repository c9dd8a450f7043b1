"""The compute trace: which chunks each hooked op touched, in order, for one training iteration.

A trace is recorded during the first iteration (forward and backward) and frozen. Later iterations
follow it with a :class:`TraceCursor`; when an iteration departs from it (a different op order, a
branch not taken) the cursor reports the divergence, stops serving the frozen trace for the rest of
that iteration and records a new one, as DeepSpeed's parameter coordinator does.

An iteration is a sequence of **passes**: a forward pass, then the backward pass (which includes the
forward ops that activation checkpointing recomputes inside it), then with gradient accumulation
another forward pass, and so on. A chunk's **entry** is its first use in a pass: where it must be on
the device when chunks are released at the end of their use in each pass, and so what prefetch
looks ahead at. The trace indexes entries once, so a look-ahead of ``k`` costs ``O(k)`` per op.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["ComputeTrace", "CursorMode", "Divergence", "Phase", "TraceCursor", "TraceStep", "step_digest"]


class Phase(enum.Enum):
    """Which hook an op entered through: a forward-style op (including recomputation under
    activation checkpointing) or the backward of an op."""

    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True, slots=True)
class TraceStep:
    """One hooked op: its phase and the ids of the chunks it needs, in first-use order."""

    phase: Phase
    chunks: tuple[int, ...]
    recompute: bool = False
    """A forward op run by the autograd engine during backward (activation-checkpointing
    recomputation): it belongs to the backward pass."""

    @property
    def in_backward_pass(self) -> bool:
        return self.phase is Phase.BACKWARD or self.recompute

    def describe(self) -> str:
        kind = "recomputed forward" if self.recompute else self.phase.value
        return f"{kind} op on chunks {self.chunks}"


def step_digest(step: TraceStep) -> bytes:
    """The bytes a step contributes to an op-sequence digest (the same on every rank)."""
    kind = b"r" if step.recompute else step.phase.value[:1].encode()
    return kind + b"[" + ",".join(map(str, step.chunks)).encode() + b"]"


class ComputeTrace:
    """An immutable recorded sequence of :class:`TraceStep` with next-use, pass and entry queries.

    ``closes`` says, for each op, the position of the latest op when it let go of its parameters:
    its own, unless other ops ran inside it (a backward op whose saved activations are recomputed
    under non-reentrant activation checkpointing holds its chunks across the recomputation). It
    is part of what happened, not of what ran: it is not compared or hashed."""

    def __init__(
        self, steps: Sequence[TraceStep], closes: Sequence[int] | None = None, pass_starts: Sequence[int] = ()
    ) -> None:
        """``pass_starts``: positions that begin a new pass although the phase does not change (the
        next decode step of a cyclic trace, ``TraceCursor(cyclic=True)``)."""
        self._steps: tuple[TraceStep, ...] = tuple(steps)
        self._closes = tuple(range(len(self._steps))) if closes is None else tuple(closes)
        if len(self._closes) != len(self._steps) or any(
            not i <= c < len(self._steps) for i, c in enumerate(self._closes)
        ):
            raise ValueError(f"ComputeTrace: closes {self._closes} must give, per step, a position at or after it")
        positions: dict[tuple[int, Phase | None], list[int]] = {}
        passes: list[int] = []
        entries: list[tuple[int, int]] = []
        entry_rank: dict[tuple[int, int], int] = {}
        grad_entries: list[tuple[int, int]] = []
        last_backward: dict[tuple[int, int], int] = {}  # (pass, chunk) -> its last backward op there
        seen: set[int] = set()
        seen_backward: set[int] = set()
        current, backward = -1, None
        starts = frozenset(pass_starts)
        for index, step in enumerate(self._steps):
            if step.in_backward_pass is not backward or index in starts:
                current, backward = current + 1, step.in_backward_pass
                seen.clear()
                seen_backward.clear()
            passes.append(current)
            for chunk_id in step.chunks:
                positions.setdefault((chunk_id, None), []).append(index)
                positions.setdefault((chunk_id, step.phase), []).append(index)
                if chunk_id not in seen:
                    entry_rank[(index, chunk_id)] = len(seen)
                    seen.add(chunk_id)
                    entries.append((index, chunk_id))
                if step.phase is Phase.BACKWARD:
                    last_backward[(current, chunk_id)] = index
                    if chunk_id not in seen_backward:
                        seen_backward.add(chunk_id)
                        grad_entries.append((index, chunk_id))
        self._positions = {key: tuple(p) for key, p in positions.items()}
        self._passes = tuple(passes)
        self._entries = tuple(entries)
        self._entry_rank = entry_rank
        self._entry_positions = tuple(p for p, _ in entries)
        self._grad_entries = tuple(grad_entries)
        self._grad_entry_positions = tuple(p for p, _ in grad_entries)
        grad_exits: dict[int, list[int]] = {}
        for (_, chunk_id), index in last_backward.items():
            grad_exits.setdefault(index, []).append(chunk_id)
        self._grad_exits = {index: tuple(chunks) for index, chunks in grad_exits.items()}
        h = hashlib.blake2b(digest_size=8)
        for step in self._steps:
            h.update(step_digest(step))
        self._digest = int.from_bytes(h.digest(), "little", signed=True)

    def __len__(self) -> int:
        return len(self._steps)

    def __getitem__(self, index: int) -> TraceStep:
        return self._steps[index]

    @property
    def steps(self) -> tuple[TraceStep, ...]:
        return self._steps

    @property
    def digest(self) -> int:
        """A signed 64-bit fingerprint; equal traces have equal digests on every rank."""
        return self._digest

    @property
    def closes(self) -> tuple[int, ...]:
        """Per op, the position of the latest op when it let go of its parameters."""
        return self._closes

    def chunk_ids(self) -> frozenset[int]:
        """Every chunk the trace uses."""
        return frozenset(c for c, phase in self._positions if phase is None)

    def next_use(self, chunk_id: int, after: int, phase: Phase | None = None) -> int | None:
        """Position of the first use of ``chunk_id`` (by an op of ``phase``, if given) strictly
        after position ``after`` in this iteration, or ``None`` when there is none before the
        iteration ends."""
        positions = self._positions.get((chunk_id, phase))
        if positions is None:
            return None
        i = bisect.bisect_right(positions, after)
        return positions[i] if i < len(positions) else None

    def pass_of(self, position: int) -> int:
        """Index of the pass (forward, backward, forward...) that ``position`` belongs to."""
        return self._passes[position]

    def used_again_in_pass(self, chunk_id: int, position: int) -> bool:
        """Whether an op after ``position`` in the same pass uses ``chunk_id``: if not, a chunk
        released now is not needed again before the pass ends."""
        nxt = self.next_use(chunk_id, position)
        return nxt is not None and self._passes[nxt] == self._passes[position]

    def entry_rank(self, chunk_id: int, position: int) -> int | None:
        """How many chunks the pass of ``position`` entered before ``chunk_id``, when ``position``
        is ``chunk_id``'s first use in that pass (``None`` otherwise)."""
        return self._entry_rank.get((position, chunk_id))

    def entries_after(self, after: int) -> Iterator[tuple[int, int]]:
        """Yield ``(position, chunk_id)`` for each chunk's first use in its pass, strictly after
        ``after``, in trace order. Stops at the end of the iteration."""
        entries = self._entries
        for index in range(bisect.bisect_right(self._entry_positions, after), len(entries)):
            yield entries[index]

    def grad_entries_in(self, after: int, until: int) -> Iterator[tuple[int, int]]:
        """``(position, chunk_id)`` for each chunk's first backward-phase use in a pass (where its
        gradient buffer is allocated) in ``(after, until]``."""
        start = bisect.bisect_right(self._grad_entry_positions, after)
        stop = bisect.bisect_right(self._grad_entry_positions, until)
        return iter(self._grad_entries[start:stop])

    def gradients_complete_after(self, position: int) -> tuple[int, ...]:
        """The chunks whose last backward-phase use in their pass is the op at ``position``: once
        that op's backward has run and autograd has accumulated what it produced, no op of the pass
        adds to their gradients (parameters of theirs that no op used, or that are frozen, get
        none)."""
        return self._grad_exits.get(position, ())


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where an iteration departed from the frozen trace."""

    position: int
    expected: TraceStep | None
    """The recorded step at that position (``None``: the iteration ran past the recorded end)."""
    actual: TraceStep | None
    """The step that ran instead (``None``: the iteration ended before the recorded end)."""

    def describe(self) -> str:
        """One line for the log: where, what was expected, what ran."""

        def fmt(step: TraceStep | None) -> str:
            return "end of iteration" if step is None else step.describe()

        return f"at position {self.position} expected {fmt(self.expected)}, got {fmt(self.actual)}"


class CursorMode(enum.Enum):
    RECORDING = "recording"
    """No usable trace for this iteration: ops are recorded into a new one."""
    FOLLOWING = "following"
    """The iteration matches the frozen trace so far."""
    OVERFLOWED = "overflowed"
    """The iteration ran past ``max_steps`` while recording (e.g. forwards that never reach an
    optimizer step): recording stopped, nothing will be frozen from it."""


class TraceCursor:
    """Follows iterations against the frozen trace, recording a new one when there is none or when
    an iteration diverges.

    ``observe`` is called once per hooked op, ``end_iteration`` once per iteration. The frozen trace
    is served (``trace``) only while the current iteration still matches it.

    ``cyclic``: the iterations repeat back to back with nothing between them that uses chunks (the
    decode steps of ``generate``). The trace served then holds the recorded iteration twice, the
    second time as the next pass, so that its next uses, releases and prefetches near the end of an
    iteration see the start of the next one; an iteration still follows only the first copy (its
    ``period``), and one that runs past it has diverged.
    """

    def __init__(self, max_steps: int = 1_000_000, cyclic: bool = False) -> None:
        self._max_steps = max_steps
        self._cyclic = cyclic
        self._period = 0  # ops of one iteration of the frozen trace
        self._frozen: ComputeTrace | None = None
        self._mode = CursorMode.RECORDING
        self._recorded: list[TraceStep] = []
        self._closes: list[int] = []
        self._position = -1

    @property
    def position(self) -> int:
        """Index of the most recently observed op in the current iteration (-1 before the first)."""
        return self._position

    @property
    def mode(self) -> CursorMode:
        return self._mode

    @property
    def trace(self) -> ComputeTrace | None:
        """The frozen trace while the current iteration follows it, else ``None``."""
        return self._frozen if self._mode is CursorMode.FOLLOWING else None

    @property
    def recording(self) -> bool:
        return self._mode is CursorMode.RECORDING

    @property
    def last_frozen(self) -> ComputeTrace | None:
        """The most recently frozen trace, whether or not the current iteration follows it."""
        return self._frozen

    def _start(self) -> None:
        self._position = -1
        self._recorded = []
        self._closes = []
        self._mode = CursorMode.FOLLOWING if self._frozen is not None else CursorMode.RECORDING

    def begin_iteration(self) -> Divergence | None:
        """Start a new iteration. If the previous one was left open (no ``end_iteration``), it is
        closed first and any divergence that closing finds is returned."""
        divergence = self.end_iteration() if self._position >= 0 else None
        self._start()
        return divergence

    def observe(self, step: TraceStep) -> Divergence | None:
        """Advance by one op. Returns the divergence if this op is where the iteration departs
        from the frozen trace (it then records from here on)."""
        self._position += 1
        if self._mode is CursorMode.RECORDING:
            self._recorded.append(step)
            self._closes.append(self._position)
            if len(self._recorded) > self._max_steps:
                self._mode = CursorMode.OVERFLOWED
                self._recorded = []
                self._closes = []
            return None
        if self._mode is CursorMode.OVERFLOWED:
            return None
        frozen = self._frozen
        assert frozen is not None, "TraceCursor: following without a frozen trace"
        expected = frozen[self._position] if self._position < self._period else None
        if expected == step:
            return None
        self._mode = CursorMode.RECORDING
        self._recorded = [*frozen.steps[: self._position], step]
        self._closes = [*frozen.closes[: self._position], self._position]
        return Divergence(self._position, expected, step)

    def close(self, position: int) -> None:
        """The op at ``position`` let go of its parameters now (at the current position)."""
        if self._mode is CursorMode.RECORDING and 0 <= position < len(self._closes):
            self._closes[position] = self._position

    def end_iteration(self) -> Divergence | None:
        """Close the iteration: freeze what was recorded. An iteration that stopped short of the
        frozen trace is a divergence too (a branch not taken)."""
        divergence = None
        frozen = self._frozen
        if self._mode is CursorMode.FOLLOWING and frozen is not None and self._position + 1 < self._period:
            divergence = Divergence(self._position + 1, frozen[self._position + 1], None)
            self._mode = CursorMode.RECORDING
            self._recorded = list(frozen.steps[: self._position + 1])
            self._closes = [min(c, self._position) for c in frozen.closes[: self._position + 1]]
        if self._mode is CursorMode.RECORDING and self._recorded:
            self._freeze()
        self._start()
        return divergence

    def _freeze(self) -> None:
        """Freeze what was recorded (twice over, the second time as the next pass, when cyclic)."""
        steps, closes = self._recorded, self._closes
        self._period = len(steps)
        if self._cyclic:
            period = self._period
            self._frozen = ComputeTrace([*steps, *steps], [*closes, *(c + period for c in closes)], (period,))
        else:
            self._frozen = ComputeTrace(steps, closes)
