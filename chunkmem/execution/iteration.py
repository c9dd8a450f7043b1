"""``IterationTracker``: where the runtime is in a training step, and which compute trace it follows.

A **training iteration** runs from the first grad-enabled forward after an optimizer step to the next
step (or to a ``zero_grad`` after a backward): every micro-batch of gradient accumulation and every
forward call of the step is in it, so the trace is the same from step to step. A forward that is part
of the step although grad is disabled (a frozen model's beside the trained one, as a reference model's
in DPO) is in it too: one trace spans every model's ops of the step. Any other **inference** forward
(grad disabled) is an iteration of its own, on a trace of its own, after which whatever was running
before it goes on. The decode steps of ``generate`` (every forward after the prompt's) are such
iterations on a third trace, the **decode trace**: recorded by the first decode step, followed by the
next ones, and cyclic (``TraceCursor(cyclic=True)``): a step's trace leads into the next step's, so
the chunks the next step starts with are kept or prefetched at the end of this one. Other inference
forwards (the prompt's, an evaluation) do not break it.

Within an iteration the tracker follows the frozen trace op by op (or records one), keeps a digest
of the op sequence (ranks compare it), and numbers iterations so that messages and cross-rank
checks can say which one they mean. It knows nothing about chunks.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable

from chunkmem.placement import ComputeTrace, Divergence, Phase, TraceCursor, TraceStep, step_digest

from ..ranks.where import IterationKind, Where

__all__ = ["IterationKind", "IterationTracker", "Mode", "Where"]

_FOLD_EVERY = 4096


class Mode(enum.Enum):
    """Which part of an iteration the runtime is in."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class IterationTracker:
    """See the module docstring. ``report`` is called with every divergence from a frozen trace."""

    def __init__(self, report: Callable[[Divergence], None]) -> None:
        self._report = report
        self._train = TraceCursor()
        self._infer = TraceCursor()
        self._decode = TraceCursor(cyclic=True)
        self._cursor: TraceCursor | None = None
        self._mode = Mode.IDLE
        self._resume: tuple[TraceCursor | None, Mode] = (None, Mode.IDLE)
        self._iterations = {IterationKind.TRAINING: -1, IterationKind.INFERENCE: -1}
        self._digest = hashlib.blake2b(digest_size=8)
        self._unhashed: list[TraceStep] = []  # ops of the training iteration not in the digest yet
        self._open: list[int] = []  # positions of the ops whose parameters are in use, innermost last

    # --- where we are ---------------------------------------------------------------------------
    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def kind(self) -> IterationKind | None:
        """The kind of iteration running, ``None`` between iterations."""
        if self._cursor is None:
            return None
        return IterationKind.TRAINING if self._cursor is self._train else IterationKind.INFERENCE

    @property
    def training(self) -> bool:
        return self._cursor is self._train

    @property
    def trace(self) -> ComputeTrace | None:
        """The frozen trace while the current iteration follows it, else ``None``."""
        return self._cursor.trace if self._cursor is not None else None

    @property
    def last_training_trace(self) -> ComputeTrace | None:
        """The most recently frozen training trace."""
        return self._train.last_frozen

    @property
    def position(self) -> int:
        return self._cursor.position if self._cursor is not None else -1

    @property
    def recording(self) -> bool:
        """The current iteration has no trace to follow (it records one)."""
        return self._cursor is not None and self._cursor.trace is None

    def where(self) -> Where:
        kind = self.kind
        if kind is None:
            return Where(IterationKind.TRAINING, self._iterations[IterationKind.TRAINING], -1, between=True)
        return Where(kind, self._iterations[kind], self.position)

    def next_forward(self, in_step: bool) -> Where:
        """Where a forward starting now will run: a new inference iteration, the training
        iteration under way (another micro-batch), or the next training iteration. ``in_step``:
        the forward is part of a training step (grad enabled, or a frozen model's in the step)."""
        if not in_step:
            kind = IterationKind.INFERENCE
            return Where(kind, self._iterations[kind] + 1, -1)
        kind = IterationKind.TRAINING
        if self._cursor is self._train:
            return Where(kind, self._iterations[kind], self.position)
        return Where(kind, self._iterations[kind] + 1, -1)

    @property
    def digest(self) -> int:
        """Digest of the ops of the current training iteration (signed 63-bit). Ops are hashed in
        batches (when asked, once per synchronised backward with several ranks), not op by op."""
        self._fold()
        return int.from_bytes(self._digest.digest(), "little", signed=True) >> 1

    def _fold(self) -> None:
        for step in self._unhashed:
            self._digest.update(step_digest(step))
        self._unhashed.clear()

    # --- transitions ------------------------------------------------------------------------------
    def begin_forward(self, in_step: bool, decoding: bool = False) -> bool:
        """A forward starts (``in_step``: as in ``next_forward``; ``decoding``: an inference forward
        that is a decode step, on the decode trace). Returns whether it begins a new iteration
        (training or inference)."""
        if not in_step:
            self._resume = (self._cursor, self._mode)
            self._begin(self._decode if decoding else self._infer, IterationKind.INFERENCE)
            self._mode = Mode.FORWARD
            return True
        new = self._cursor is not self._train
        if new:
            self._begin(self._train, IterationKind.TRAINING)
            self._digest = hashlib.blake2b(digest_size=8)
            self._unhashed.clear()
        self._mode = Mode.FORWARD
        return new

    def _begin(self, cursor: TraceCursor, kind: IterationKind) -> None:
        self._note(cursor.begin_iteration())
        self._open.clear()
        self._iterations[kind] += 1
        self._cursor = cursor

    def end_forward(self) -> bool:
        """A forward returned. An inference iteration ends here (returns True) and what ran
        before it goes on."""
        cursor = self._cursor
        if cursor is not self._infer and cursor is not self._decode:
            return False
        self._note(cursor.end_iteration())
        self._cursor, self._mode = self._resume
        return True

    def begin_backward(self) -> None:
        if self._mode is Mode.FORWARD:
            self._mode = Mode.BACKWARD

    def end_backward(self) -> None:
        self._mode = Mode.IDLE

    def end_training_iteration(self) -> ComputeTrace | None:
        """Close the training iteration (optimizer step, or zero_grad after a backward). Returns
        the trace frozen from it when it was recorded, else ``None``."""
        if self._cursor is not self._train:
            return None
        cursor = self._train
        recording = cursor.recording
        self._cursor = None
        self._mode = Mode.IDLE
        self._note(cursor.end_iteration())
        return cursor.last_frozen if recording else None

    def observe(self, phase: Phase, chunk_ids: tuple[int, ...], recompute: bool) -> int:
        """One hooked op: advance the cursor (reporting a divergence) and return its position
        (-1 outside any iteration)."""
        cursor = self._cursor
        if cursor is None:
            return -1
        step = TraceStep(phase, chunk_ids, recompute)
        if cursor is self._train:
            self._unhashed.append(step)
            if len(self._unhashed) >= _FOLD_EVERY:  # bounded memory when nobody asks (one rank)
                self._fold()
        self._note(cursor.observe(step))
        self._open.append(cursor.position)
        return cursor.position

    def close(self) -> int:
        """The innermost op still open let go of its parameters (ops nest in backward, around a
        recomputation): the trace notes where. Returns that op's position (-1: none was open)."""
        position = self._open.pop() if self._open else -1
        if self._cursor is not None:
            self._cursor.close(position)
        return position

    def _note(self, divergence: Divergence | None) -> None:
        if divergence is not None:
            self._report(divergence)
