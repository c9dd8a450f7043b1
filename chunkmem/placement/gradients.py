"""``GradientBuffers``: the gradient side of :class:`~placement.residency.DeviceResidency`.

For every chunk it keeps whether its gradient buffer accepts gradients or is being reduced, which
chunks hold gradients on the host (moved there where they could not be reduced), which accumulated
inside ``no_sync``, which the trace says are complete, and which have reduced gradients in their
shard (a later buffer's reduction is added to them); and it holds the one rule for when a
chunk's gradients are complete (``start_complete``), which the run and its replay both follow. It
accounts the device bytes of the buffers, holds no tensor, and yields the :class:`Action` s of its
verbs. Where a buffer needs room first is the residency's to decide (it asks the policy).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from .actions import Action, Verb
from .trace import ComputeTrace, Phase

__all__ = ["GradBuffer", "GradientBuffers"]


class GradBuffer(enum.Enum):
    """A chunk's gradient buffer."""

    NONE = "none"
    ACCEPTING = "accepting"
    """Gradients are added into it."""
    REDUCING = "reducing"
    """Its reduction is in flight; it is still allocated."""


class GradientBuffers:
    """See the module docstring. ``grad_bytes`` are the device bytes each chunk's buffer allocates
    (0 where it is the gradient shard, or the chunk is frozen); ``require`` raises naming the chunk
    and what it holds when a verb's precondition fails."""

    def __init__(
        self,
        trainable: Sequence[bool],
        grad_bytes: Sequence[int],
        world_size: int,
        require: Callable[[bool, int, str, str], None],
    ) -> None:
        self._trainable = tuple(trainable)
        self._bytes_of = tuple(grad_bytes)
        self._alone = world_size == 1
        self._require = require
        self._state = [GradBuffer.NONE] * len(self._trainable)
        self._accepting: dict[int, None] = {}
        self._reducing: dict[int, None] = {}  # in start order
        self._spilled: set[int] = set()  # chunks with gradients on the host, not reduced yet
        # Chunks that got a buffer inside no_sync, not reduced since: their sum over the
        # micro-batches is reduced once, whole (see ``reducible``).
        self._carried: set[int] = set()
        # Chunks whose gradients the trace says are complete, waiting for the next op (or the end
        # of the backward) to start their reduction (see ``start_complete``).
        self._complete: dict[int, None] = {}
        self._reduced: set[int] = set()  # chunks whose gradient shard holds reduced gradients, until ``zero``
        self._sync = True
        self.nbytes = 0
        """Device bytes of the buffers allocated now."""

    # --- state ---------------------------------------------------------------------------------------
    def state(self, chunk_id: int) -> GradBuffer:
        return self._state[chunk_id]

    def buffer_bytes(self, chunk_id: int) -> int:
        """Device bytes the chunk's buffer allocates (0 when it is the gradient shard)."""
        return self._bytes_of[chunk_id]

    def reduced(self, chunk_id: int) -> bool:
        """The chunk's gradient shard holds reduced gradients (a reduction finished since the last
        ``zero``): a buffer's reduction is added to them, and the optimizer steps on them."""
        return chunk_id in self._reduced

    def needs_buffer(self, chunk_id: int) -> bool:
        """A backward op on the chunk needs a buffer it does not have."""
        return self._trainable[chunk_id] and chunk_id not in self._accepting

    @property
    def accepting(self) -> Sequence[int]:
        """Chunks whose buffer accepts gradients, in allocation order."""
        return tuple(self._accepting)

    @property
    def reducing(self) -> Sequence[int]:
        """Chunks whose reduction is in flight, in start order."""
        return tuple(self._reducing)

    @property
    def unreduced(self) -> bool:
        """Gradients wait for a reduction (in a buffer, in flight, or on the host)."""
        return bool(self._accepting or self._reducing or self._spilled)

    @property
    def can_reduce(self) -> bool:
        """A reduction may run now: always at world size 1 (nothing to communicate), else only
        outside ``no_sync``."""
        return self._sync or self._alone

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally; no gradient collective until the block exits."""
        previous = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = previous

    def reducible(self, chunk_id: int) -> bool:
        """Whether the chunk's buffer may be reduced before its gradients are complete. Not inside
        ``no_sync`` at world size > 1, and not a buffer that accumulated there: plain PyTorch
        reduces each parameter's sum over the micro-batches once, and reducing part of a chunk now
        and the rest later would add the ranks' partial sums in another order."""
        return self.can_reduce and chunk_id not in self._carried

    # --- verbs ---------------------------------------------------------------------------------------
    def allocate(self, chunk_id: int) -> Iterator[Action]:
        """Give the chunk a buffer (after its reduction in flight, if one is)."""
        if self._state[chunk_id] is GradBuffer.REDUCING:
            yield from self.finish(chunk_id)
        self._require(
            self._state[chunk_id] is GradBuffer.NONE,
            chunk_id,
            "allocate a gradient buffer for",
            "it has one; reduce it or drop it (zero_grads) first",
        )
        self._state[chunk_id] = GradBuffer.ACCEPTING
        self._accepting[chunk_id] = None
        if not self.can_reduce:
            self._carried.add(chunk_id)
        self.nbytes += self._bytes_of[chunk_id]
        yield Action(
            Verb.ALLOCATE_GRAD, chunk_id, from_host=chunk_id in self._spilled, onto_reduced=chunk_id in self._reduced
        )

    def start(self, chunk_id: int, verb: Verb) -> Iterator[Action]:
        self._require(
            self._state[chunk_id] is GradBuffer.ACCEPTING,
            chunk_id,
            "reduce",
            "it has no gradient buffer; a gradient allocates one first",
        )
        self._state[chunk_id] = GradBuffer.REDUCING
        del self._accepting[chunk_id]
        self._reducing[chunk_id] = None
        self._spilled.discard(chunk_id)
        self._carried.discard(chunk_id)
        yield Action(verb, chunk_id, onto_reduced=chunk_id in self._reduced)

    def finish(self, chunk_id: int) -> Iterator[Action]:
        """Wait for the chunk's reduction and free its buffer."""
        self._require(
            self._state[chunk_id] is GradBuffer.REDUCING,
            chunk_id,
            "finish reducing",
            "none is in flight; start its reduction first",
        )
        self._state[chunk_id] = GradBuffer.NONE
        del self._reducing[chunk_id]
        self._reduced.add(chunk_id)
        self.nbytes -= self._bytes_of[chunk_id]
        yield Action(Verb.FINISH_REDUCE, chunk_id)

    def flush(self, chunk_id: int) -> Iterator[Action]:
        """Free a buffer now: reduce it early, or where it may not be reduced yet move it to the
        host (later gradients go to a fresh one either way), or finish its reduction in flight."""
        if self._state[chunk_id] is GradBuffer.ACCEPTING and not self.reducible(chunk_id):
            self._state[chunk_id] = GradBuffer.NONE
            del self._accepting[chunk_id]
            self.nbytes -= self._bytes_of[chunk_id]
            self._spilled.add(chunk_id)
            yield Action(Verb.SPILL_GRAD, chunk_id)
            return
        if self._state[chunk_id] is GradBuffer.ACCEPTING:
            yield from self.start(chunk_id, Verb.REDUCE_EARLY)
        if self._state[chunk_id] is GradBuffer.REDUCING:  # (a listener of the start may have finished it)
            yield from self.finish(chunk_id)

    def op_done(self, op: int, phase: Phase, chunk_ids: tuple[int, ...], trace: ComputeTrace | None) -> None:
        """The op at position ``op`` of ``trace`` let go of its chunks: note those whose gradients
        it completes (see ``start_complete``)."""
        if phase is Phase.BACKWARD and trace is not None:
            done = trace.gradients_complete_after(op)
            for c in chunk_ids:
                if c in done and self._trainable[c]:
                    self._complete[c] = None

    def start_complete(self, following: bool) -> Iterator[Action]:
        """The one rule for "a chunk's gradients are complete", for the run and its replay alike:
        after the last backward op of the pass that uses the chunk in the trace the iteration
        follows, once autograd has accumulated what that op produced (it does so before the next
        op starts, or the backward ends: that is when this runs), reduce its buffer, unless inside
        ``no_sync`` (then it keeps accumulating). Without a trace (the first iteration) or once the
        iteration has departed from it (``following`` is false: the trace said nothing of what
        runs now), gradients are complete at the end of the backward (``reduce_all``). What a
        parameter's ops leave out (a layer never called, a branch not taken, frozen parameters)
        changes nothing: the rule reads ops, not parameters. A gradient that arrives after all
        (an op the hooks do not see) finds the buffer reducing: ``allocate`` waits for that
        reduction and gives the chunk a fresh buffer, reduced at the end and added to the shard,
        so nothing is lost or counted twice."""
        complete, self._complete = self._complete, {}
        if not (following and self.can_reduce):
            return
        for c in complete:
            if self._state[c] is GradBuffer.ACCEPTING:
                yield from self.start(c, Verb.START_REDUCE)

    def forget_complete(self) -> None:
        """What the last ops completed is not reduced now (a new iteration, the end of a backward
        inside ``no_sync``: the sum over the micro-batches is reduced once, later)."""
        self._complete.clear()

    def finish_all(self) -> Iterator[Action]:
        """Wait for every reduction in flight (in the order they started)."""
        for c in list(self._reducing):
            yield from self.finish(c)

    def to_reduce(self) -> list[int]:
        """Every chunk with a buffer accepting or gradients on the host, in chunk order (the same
        on every rank)."""
        return sorted({*self._accepting, *self._spilled})

    def on_host_only(self, chunk_id: int) -> bool:
        """The chunk's gradients are on the host, with no buffer to reduce them from."""
        return self._state[chunk_id] is GradBuffer.NONE and chunk_id in self._spilled

    def zero(self) -> Iterator[Action]:
        """Drop all gradients (reductions in flight are waited for first: their buffers are in use)."""
        yield from self.finish_all()
        for c in self._accepting:
            self._state[c] = GradBuffer.NONE
            self.nbytes -= self._bytes_of[c]
        self._accepting.clear()
        self._reduced.clear()
        self._spilled.clear()
        self._carried.clear()
        self._complete.clear()
        for c in range(len(self._state)):
            yield Action(Verb.ZERO_GRAD, c)
