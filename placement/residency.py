"""``DeviceResidency``: what is on the device, owned in one place, and the moves that change it.

For every chunk it keeps whether its full buffer is released, being gathered (in flight) or
gathered; whether a prefetch brought it and no op has claimed it yet; when an op last used it; which
evicted chunks an op ahead in the pass still needs; which ops hold it now; and whether its gradient
buffer accepts gradients or is being reduced. It accounts the device bytes of those buffers, and
takes the bytes that stay on the device between uses (shards, masters, optimizer states, transient
buffers) from whoever knows them (``base_bytes``).

It holds no tensor. Its verbs ask the placement policy where a decision is needed and yield the
:class:`Action` s to carry out, in order, changing its own state as each is yielded (so a verb
called while an action is being carried out, such as finishing the reduction that was just
started, sees it). The runtime's plan executor carries them out on real chunks; ``simulate`` and
the planner run the very same object on a trace with nothing behind it, so a prediction is what a
run does.

Every decision is a function of what all ranks share (the trace, chunk sizes, the budget, the
positions and these states), so every rank yields the same actions, hence the same collectives.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from .policy import PlacementPolicy
from .snapshot import BufferKind, ChunkSpec, FetchPlan, OpSnapshot, ReleaseSnapshot, ResidentChunk
from .trace import ComputeTrace, Phase

__all__ = ["Action", "DeviceResidency", "GradBuffer", "Held", "NoRoomError", "PlanObserver", "Verb"]


class Verb(enum.Enum):
    """What an action does to a chunk."""

    KEEP = "keep"
    """Gather once and for all: the chunk stays gathered (a placement that keeps it gathered, or a
    resident shard that serves as the chunk at world size 1, so gathering allocates nothing)."""
    GATHER = "gather"
    """Gather now: an op needs the chunk (a demand fetch)."""
    PREFETCH = "prefetch"
    """Start an asynchronous gather ahead of use."""
    CLAIM = "claim"
    """An op takes a chunk a prefetch brought (a prefetch hit); a WAIT follows if it is in flight."""
    WAIT = "wait"
    """Land an asynchronous gather."""
    RELEASE = "release"
    """The policy releases a chunk an op has finished with."""
    EVICT = "evict"
    """The policy releases a chunk to make room."""
    DROP = "drop"
    """Release between uses without a policy decision (after a step, before a transient buffer)."""
    REFRESH = "refresh"
    """Fill a gathered buffer again: the master changed (a step, a load)."""
    ALLOCATE_GRAD = "allocate_grad"
    """Give the chunk a gradient buffer."""
    START_REDUCE = "start_reduce"
    """Start reducing a gradient buffer whose gradients are complete (asynchronous)."""
    REDUCE_EARLY = "reduce_early"
    """Start reducing a gradient buffer before all its gradients arrived, to make room."""
    SPILL_GRAD = "spill_grad"
    """Move what a gradient buffer holds to the host and free it, to make room, where it may not
    be reduced yet (inside ``no_sync``, or before the gradients of a chunk that accumulated there
    are complete); the chunk's next buffer starts from it."""
    FINISH_REDUCE = "finish_reduce"
    """Wait for a reduction and free its buffer."""
    ZERO_GRAD = "zero_grad"
    """Forget the chunk's gradients (buffer and reduced shard)."""


@dataclass(frozen=True, slots=True)
class Action:
    """One move of one chunk."""

    verb: Verb
    chunk: int


class Held(enum.Enum):
    """A chunk's full buffer."""

    RELEASED = "released"
    FETCHING = "fetching"
    """An asynchronous gather into it is in flight."""
    GATHERED = "gathered"


class GradBuffer(enum.Enum):
    """A chunk's gradient buffer."""

    NONE = "none"
    ACCEPTING = "accepting"
    """Gradients are added into it."""
    REDUCING = "reducing"
    """Its reduction is in flight; it is still allocated."""


class NoRoomError(Exception):
    """An op cannot run within the budget even after evicting everything evictable. The fields
    say why; the runtime turns it into its own error with what the memory holds."""

    def __init__(
        self,
        budget: int,
        position: int,
        chunks: tuple[int, ...],
        needed: int,
        device_bytes: int,
        minimum: int,
        busy: tuple[int, ...],
    ) -> None:
        super().__init__(
            f"device_budget={budget} cannot fit the op at trace position {position} on chunks {chunks}: it needs "
            f"{needed} bytes more while {device_bytes} are held; at least {minimum} would run it"
        )
        self.budget = budget
        self.position = position
        self.chunks = chunks
        self.needed = needed
        self.device_bytes = device_bytes
        self.minimum = minimum
        self.busy = busy
        """Chunks holding device buffers that running ops use (so they cannot be evicted)."""


class PlanObserver(Protocol):
    """Told of every plan before it is carried out (the cross-rank check, decision counters)."""

    def plan_made(
        self, position: int, phase: Phase, chunk_ids: tuple[int, ...], device_bytes: int, plan: FetchPlan
    ) -> None: ...


class DeviceResidency:
    """See the module docstring. ``specs`` are the chunks as the policy's layout was decided for
    them (``policy.layout_decided`` is read once, here); ``world_size`` says whether a reduction
    needs the other ranks (inside ``no_sync`` only at world size 1 it may run)."""

    def __init__(
        self,
        policy: PlacementPolicy,
        specs: Sequence[ChunkSpec],
        world_size: int,
        base_bytes: Callable[[], int],
        observer: PlanObserver | None = None,
    ) -> None:
        layout = policy.layout_decided
        self._policy = policy
        self._budget = policy.budget
        self._base = base_bytes
        self._observer = observer
        self._alone = world_size == 1
        n = len(specs)
        self._labels = [s.label for s in specs]
        self._trainable = [s.trainable for s in specs]
        self._keep = [layout[i].keep_gathered for i in range(n)]
        # Device bytes a gathered buffer allocates (0: a resident shard serves as the chunk).
        self._gather_bytes = [layout[i].fetch_bytes(s, ignore_keep=True) for i, s in enumerate(specs)]
        self._grad_bytes = [layout[i].grad_buffer_bytes(s) if s.trainable else 0 for i, s in enumerate(specs)]
        self._held = [Held.RELEASED] * n
        self._grad = [GradBuffer.NONE] * n
        self._holds = [0] * n  # running ops using the chunk
        self._buffers: dict[int, None] = {}  # gathered chunks the policy may release, in gather order
        self._prefetched: set[int] = set()
        self._accepting: dict[int, None] = {}
        self._reducing: dict[int, None] = {}  # in start order
        self._spilled: set[int] = set()  # chunks with gradients on the host, not reduced yet
        # Chunks that got a gradient buffer inside no_sync, not reduced since: their sum over the
        # micro-batches is reduced once, whole (see ``_reducible``).
        self._carried: set[int] = set()
        # Chunks whose gradients the trace says are complete, waiting for the next op (or the end
        # of the backward) to start their reduction; see ``_complete``.
        self._complete: dict[int, None] = {}
        self._last_use: dict[int, int] = {}
        self._awaited: list[tuple[int, int]] = []  # heap: (next use in the pass, chunk) of evicted chunks
        self._position = -1
        self._bytes = 0
        self._sync = True

    # --- what the policy sees (placement.Residency) ------------------------------------------------
    def is_gathered(self, chunk_id: int) -> bool:
        return chunk_id in self._buffers

    def has_grad_buffer(self, chunk_id: int) -> bool:
        return self._grad[chunk_id] is GradBuffer.ACCEPTING

    def buffers(self) -> Sequence[ResidentChunk]:
        out = [
            ResidentChunk(
                chunk_id=c,
                kind=BufferKind.GATHERED,
                release_bytes=self._gather_bytes[c],
                held=self._holds[c] > 0,
                fetching=self._held[c] is Held.FETCHING,
                last_use=self._last_use.get(c, -1),
            )
            for c in self._buffers
        ]
        out += [ResidentChunk(c, BufferKind.REDUCING, self._grad_bytes[c], False, False, -1) for c in self._reducing]
        # Flushing a gradient buffer reduces it early, or where it may not be reduced moves it to the host.
        out += [
            ResidentChunk(
                c,
                BufferKind.GRAD if self._reducible(c) else BufferKind.SPILL,
                self._grad_bytes[c],
                self._holds[c] > 0,
                False,
                self._last_use.get(c, -1),
            )
            for c in self._accepting
            if self._grad_bytes[c] > 0
        ]
        return out

    def awaited(self) -> Sequence[tuple[int, int]]:
        awaited = self._awaited
        while awaited and (awaited[0][0] <= self._position or awaited[0][1] in self._buffers):
            heapq.heappop(awaited)
        return sorted(awaited) if awaited else ()

    # --- state ---------------------------------------------------------------------------------------
    def held(self, chunk_id: int) -> Held:
        return self._held[chunk_id]

    def gather_bytes(self, chunk_id: int) -> int:
        """Device bytes the chunk's gathered buffer allocates (0 when a resident shard serves)."""
        return self._gather_bytes[chunk_id]

    def grad_buffer_bytes(self, chunk_id: int) -> int:
        """Device bytes the chunk's gradient buffer allocates (0 when it is the gradient shard)."""
        return self._grad_bytes[chunk_id]

    @property
    def buffer_bytes(self) -> int:
        """Device bytes of the gathered and gradient buffers accounted here."""
        return self._bytes

    @property
    def device_bytes(self) -> int:
        """Everything accounted on the device: what stays between uses, and the buffers here."""
        return self._base() + self._bytes

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

    def _reducible(self, chunk_id: int) -> bool:
        """Whether the chunk's buffer may be reduced before its gradients are complete. Not inside
        ``no_sync`` at world size > 1, and not a buffer that accumulated there: plain PyTorch
        reduces each parameter's sum over the micro-batches once, and reducing part of a chunk now
        and the rest later would add the ranks' partial sums in another order."""
        return self.can_reduce and chunk_id not in self._carried

    def _require(self, ok: bool, chunk_id: int, verb: str, fix: str) -> None:
        if not ok:
            raise RuntimeError(
                f"DeviceResidency: cannot {verb} chunk {chunk_id} ('{self._labels[chunk_id]}'; buffer "
                f"{self._held[chunk_id].value}, gradient buffer {self._grad[chunk_id].value}): {fix}"
            )

    # --- the gathered buffer -------------------------------------------------------------------------
    def _gather(self, chunk_id: int, verb: Verb) -> Iterator[Action]:
        self._require(self._held[chunk_id] is Held.RELEASED, chunk_id, verb.value, "it is gathered or in flight")
        self._held[chunk_id] = Held.FETCHING if verb is Verb.PREFETCH else Held.GATHERED
        self._bytes += self._gather_bytes[chunk_id]
        if self._gather_bytes[chunk_id] and not self._keep[chunk_id] and verb is not Verb.KEEP:
            self._buffers[chunk_id] = None
        if verb is Verb.PREFETCH:
            self._prefetched.add(chunk_id)
        yield Action(verb, chunk_id)

    def _land(self, chunk_id: int) -> Iterator[Action]:
        if self._held[chunk_id] is Held.FETCHING:
            self._held[chunk_id] = Held.GATHERED
            yield Action(Verb.WAIT, chunk_id)

    def _release(self, chunk_id: int, verb: Verb) -> Iterator[Action]:
        self._require(self._holds[chunk_id] == 0, chunk_id, verb.value, "an op still uses it")
        yield from self._land(chunk_id)
        self._require(self._held[chunk_id] is Held.GATHERED, chunk_id, verb.value, "it is not gathered")
        self._held[chunk_id] = Held.RELEASED
        self._bytes -= self._gather_bytes[chunk_id]
        self._buffers.pop(chunk_id, None)
        self._prefetched.discard(chunk_id)
        yield Action(verb, chunk_id)

    # --- the gradient buffer -------------------------------------------------------------------------
    def _allocate_grad(self, chunk_id: int) -> Iterator[Action]:
        if self._grad[chunk_id] is GradBuffer.REDUCING:
            yield from self._finish(chunk_id)
        self._require(self._grad[chunk_id] is GradBuffer.NONE, chunk_id, "allocate a gradient buffer for", "it has one")
        self._grad[chunk_id] = GradBuffer.ACCEPTING
        self._accepting[chunk_id] = None
        if not self.can_reduce:
            self._carried.add(chunk_id)
        self._bytes += self._grad_bytes[chunk_id]
        yield Action(Verb.ALLOCATE_GRAD, chunk_id)

    def _start(self, chunk_id: int, verb: Verb) -> Iterator[Action]:
        self._require(self._grad[chunk_id] is GradBuffer.ACCEPTING, chunk_id, "reduce", "it has no gradient buffer")
        self._grad[chunk_id] = GradBuffer.REDUCING
        del self._accepting[chunk_id]
        self._reducing[chunk_id] = None
        self._spilled.discard(chunk_id)
        self._carried.discard(chunk_id)
        yield Action(verb, chunk_id)

    def _finish(self, chunk_id: int) -> Iterator[Action]:
        self._require(self._grad[chunk_id] is GradBuffer.REDUCING, chunk_id, "finish reducing", "none is in flight")
        self._grad[chunk_id] = GradBuffer.NONE
        del self._reducing[chunk_id]
        self._bytes -= self._grad_bytes[chunk_id]
        yield Action(Verb.FINISH_REDUCE, chunk_id)

    def _flush(self, chunk_id: int) -> Iterator[Action]:
        """Free a gradient buffer now: reduce it early, or where it may not be reduced yet move it
        to the host (later gradients go to a fresh one either way), or finish its reduction in
        flight."""
        if self._grad[chunk_id] is GradBuffer.ACCEPTING and not self._reducible(chunk_id):
            self._grad[chunk_id] = GradBuffer.NONE
            del self._accepting[chunk_id]
            self._bytes -= self._grad_bytes[chunk_id]
            self._spilled.add(chunk_id)
            yield Action(Verb.SPILL_GRAD, chunk_id)
            return
        if self._grad[chunk_id] is GradBuffer.ACCEPTING:
            yield from self._start(chunk_id, Verb.REDUCE_EARLY)
        if self._grad[chunk_id] is GradBuffer.REDUCING:  # (a listener of the start may have finished it)
            yield from self._finish(chunk_id)

    # --- iterations ----------------------------------------------------------------------------------
    def start(self) -> Iterator[Action]:
        """Gather the chunks the placement keeps gathered."""
        for chunk_id, keep in enumerate(self._keep):
            if keep:
                yield from self._gather(chunk_id, Verb.KEEP)

    def keep_served(self) -> Iterator[Action]:
        """Gather, once and for all, every chunk a resident shard serves (nothing is allocated or
        copied, and no plan releases them)."""
        for chunk_id, held in enumerate(self._held):
            if held is Held.RELEASED and self._gather_bytes[chunk_id] == 0:
                yield from self._gather(chunk_id, Verb.KEEP)

    def begin_iteration(self) -> None:
        """Positions restart: forget when chunks were last used and which evicted ones are awaited."""
        self._complete.clear()
        self._last_use.clear()
        self._awaited.clear()
        self._position = -1

    # --- around an op --------------------------------------------------------------------------------
    def before_op(
        self, position: int, phase: Phase, chunk_ids: tuple[int, ...], trace: ComputeTrace | None
    ) -> Iterator[Action]:
        """Make the op's chunks resident (with gradient buffers for a backward op) and start the
        plan's prefetches; the op then holds its chunks until ``after_op``. Raises
        ``NoRoomError`` when the op cannot fit under the budget."""
        yield from self._start_complete(trace is not None)
        for c in chunk_ids:
            if c in self._prefetched:
                self._prefetched.discard(c)
                yield Action(Verb.CLAIM, c)
            yield from self._land(c)
        backward = phase is Phase.BACKWARD
        needed = sum(
            (self._gather_bytes[c] if self._held[c] is Held.RELEASED else 0)
            + (self._grad_bytes[c] if backward and self._trainable[c] and c not in self._accepting else 0)
            for c in chunk_ids
        )
        plan = yield from self._plan(position, phase, chunk_ids, needed, trace)
        if self._over(needed) and any(self._held[c] is Held.FETCHING for c in self._buffers):
            # Only buffers still being gathered are in the way: let them land, then they can go.
            yield from self.wait_all()
            plan = yield from self._plan(position, phase, chunk_ids, needed, trace)
        self._require_room(needed, chunk_ids, position)
        for c in chunk_ids:
            if self._held[c] is Held.RELEASED:
                yield from self._gather(c, Verb.GATHER)
            if backward and self._trainable[c] and c not in self._accepting:
                yield from self._allocate_grad(c)
            self._last_use[c] = position
        for c in plan.prefetch:
            if self._held[c] is Held.RELEASED:
                yield from self._gather(c, Verb.PREFETCH)
        for c in chunk_ids:
            self._holds[c] += 1

    def after_op(
        self,
        position: int,
        phase: Phase,
        chunk_ids: tuple[int, ...],
        in_backward: bool,
        trace: ComputeTrace | None,
        op: int | None = None,
    ) -> Iterator[Action]:
        """The op at ``op`` (default ``position``; it is earlier when ops ran inside it) let go of
        its chunks at ``position``: release what the policy says of those no op holds now, and note
        the chunks whose gradients this op completes (see ``_complete``)."""
        if phase is Phase.BACKWARD and trace is not None:
            done = trace.gradients_complete_after(position if op is None else op)
            for c in chunk_ids:
                if c in done and self._trainable[c]:
                    self._complete[c] = None
        finished = []
        for c in chunk_ids:
            self._require(self._holds[c] > 0, c, "let go of", "no op holds it")
            self._holds[c] -= 1
            # Releasing a chunk served by a resident shard frees nothing: it stays as it is.
            if self._holds[c] == 0 and self._held[c] is not Held.RELEASED and self._gather_bytes[c]:
                finished.append(c)
        if not finished:
            return
        release = self._policy.after_op(
            ReleaseSnapshot(
                position=position, phase=phase, finished=tuple(finished), in_backward=in_backward, trace=trace
            )
        )
        for c in release:
            if self._held[c] is Held.GATHERED and self._holds[c] == 0:
                yield from self._release(c, Verb.RELEASE)

    def _plan(
        self, position: int, phase: Phase, chunk_ids: tuple[int, ...], needed: int, trace: ComputeTrace | None
    ) -> Iterator[Action]:
        """Ask the policy, and carry out its evictions and flushes; returns the plan (the rest is
        the caller's)."""
        self._position = position
        device_bytes = self.device_bytes
        plan = self._policy.before_op(
            OpSnapshot(
                position=position,
                phase=phase,
                needed=chunk_ids,
                needed_bytes=needed,
                residency=self,
                device_bytes=device_bytes,
                trace=trace,
            )
        )
        if self._observer is not None:
            self._observer.plan_made(position, phase, chunk_ids, device_bytes, plan)
        for c in plan.evict:
            yield from self._release(c, Verb.EVICT)
            if trace is not None and trace.used_again_in_pass(c, position):
                heapq.heappush(self._awaited, (trace.next_use(c, position) or -1, c))
        for c in plan.flush:
            yield from self._flush(c)
        return plan

    def _over(self, needed: int) -> bool:
        return self._budget is not None and self.device_bytes + needed > self._budget

    def _require_room(self, needed: int, chunk_ids: tuple[int, ...], position: int) -> None:
        if not self._over(needed):
            return
        assert self._budget is not None, "over no budget"
        device_bytes = self.device_bytes
        evictable = sum(r.release_bytes for r in self.buffers() if not r.held and not r.fetching)
        raise NoRoomError(
            budget=self._budget,
            position=position,
            chunks=chunk_ids,
            needed=needed,
            device_bytes=device_bytes,
            minimum=device_bytes - evictable + needed,
            busy=tuple(c for c in self._buffers if self._holds[c] > 0),
        )

    # --- gradients -----------------------------------------------------------------------------------
    def gradient_arrives(self, chunk_id: int, position: int, trace: ComputeTrace | None) -> Iterator[Action]:
        """A gradient arrived for a chunk without a buffer (flushed to make room after the op's
        backward, or reduced before a later gradient of a shared parameter): make room, allocate."""
        if self._grad[chunk_id] is GradBuffer.ACCEPTING:
            return
        if self._grad[chunk_id] is GradBuffer.REDUCING:
            yield from self._finish(chunk_id)
        yield from self._room_for_grad(chunk_id, position, trace)
        yield from self._allocate_grad(chunk_id)

    def _room_for_grad(self, chunk_id: int, position: int, trace: ComputeTrace | None) -> Iterator[Action]:
        needed = self._grad_bytes[chunk_id]
        if needed:  # else the buffer is the gradient shard (world size 1): there is no room to make
            yield from self._plan(position, Phase.BACKWARD, (chunk_id,), needed, trace)
            self._require_room(needed, (chunk_id,), position)

    def _start_complete(self, following: bool) -> Iterator[Action]:
        """The one rule for "a chunk's gradients are complete", for the run and its replay alike:
        after the last backward op of the pass that uses the chunk in the trace the iteration
        follows, once autograd has accumulated what that op produced (it does so before the next
        op starts, or the backward ends: that is when this runs), reduce its buffer, unless inside
        ``no_sync`` (then it keeps accumulating). Without a trace (the first iteration) or once the
        iteration has departed from it (``following`` is false: the trace said nothing of what
        runs now), gradients are complete at the end of the backward (``reduce_all``). What a
        parameter's ops leave out (a layer never called, a branch not taken, frozen parameters)
        changes nothing: the rule reads ops, not parameters. A gradient that arrives after all
        (an op the hooks do not see) finds the buffer reducing: ``gradient_arrives`` waits for
        that reduction and gives the chunk a fresh buffer, reduced at the end and added to the
        shard, so nothing is lost or counted twice."""
        complete, self._complete = self._complete, {}
        if not (following and self.can_reduce):
            return
        for c in complete:
            if self._grad[c] is GradBuffer.ACCEPTING:
                yield from self._start(c, Verb.START_REDUCE)

    def end_backward(self) -> Iterator[Action]:
        """``loss.backward()`` returned: land the gathers in flight; outside ``no_sync`` reduce
        every gradient (``reduce_all``); inside it, the chunks the last op completed go on
        accumulating with the others (what it completed then is forgotten: their sum over the
        micro-batches is reduced once, at the end of a backward outside ``no_sync``)."""
        yield from self.wait_all()
        if self.can_reduce:
            yield from self.reduce_all()
        else:
            self._complete.clear()

    def finish_reduction(self, chunk_id: int) -> Iterator[Action]:
        """Wait for the chunk's reduction in flight (its gradient shard is read now)."""
        if self._grad[chunk_id] is GradBuffer.REDUCING:
            yield from self._finish(chunk_id)

    def finish_reductions(self) -> Iterator[Action]:
        """Wait for every reduction in flight (in the order they started)."""
        for c in list(self._reducing):
            yield from self.finish_reduction(c)

    def reduce_all(self) -> Iterator[Action]:
        """Reduce every buffer still accepting and every chunk with gradients on the host (in
        chunk order, the same on every rank; a chunk whose gradients are only on the host gets a
        buffer for its reduction first), then wait for every reduction. Chunks the last op
        completed start first (see ``_start_complete``)."""
        yield from self._start_complete(True)
        for c in sorted({*self._accepting, *self._spilled}):
            if self._grad[c] is GradBuffer.NONE and c in self._spilled:
                yield from self._room_for_grad(c, self._position, None)
                yield from self._allocate_grad(c)
            if self._grad[c] is GradBuffer.ACCEPTING:
                yield from self._start(c, Verb.START_REDUCE)
        yield from self.finish_reductions()

    def zero_grads(self) -> Iterator[Action]:
        """Drop all gradients (reductions in flight are waited for first: their buffers are in use)."""
        yield from self.finish_reductions()
        for c in list(self._accepting):
            self._grad[c] = GradBuffer.NONE
            self._bytes -= self._grad_bytes[c]
        self._accepting.clear()
        self._spilled.clear()
        self._carried.clear()
        self._complete.clear()
        for c in range(len(self._grad)):
            yield Action(Verb.ZERO_GRAD, c)

    # --- between ops ---------------------------------------------------------------------------------
    def wait_all(self) -> Iterator[Action]:
        """Land every gather in flight."""
        for c in list(self._buffers):
            yield from self._land(c)

    def release_idle(self) -> Iterator[Action]:
        """Release every gathered chunk no op uses (chunks kept gathered stay)."""
        for c in list(self._buffers):
            if self._holds[c] == 0 and c in self._buffers:
                yield from self._release(c, Verb.DROP)

    def make_room(self, nbytes: int) -> Iterator[Action]:
        """A temporary buffer of ``nbytes`` is about to be allocated outside training steps: release
        idle gathered chunks if the budget needs the room (whether that suffices is the caller's
        to check)."""
        if self._over(nbytes):
            yield from self.wait_all()
            yield from self.release_idle()

    def after_step(self) -> Iterator[Action]:
        """The masters changed: gathered chunks the policy manages are released, the others
        (kept gathered, served by a resident shard) refreshed."""
        yield from self.wait_all()
        for c, held in enumerate(self._held):
            if held is Held.RELEASED:
                continue
            if c in self._buffers:
                yield from self._release(c, Verb.DROP)
            else:
                yield Action(Verb.REFRESH, c)

    def refresh(self) -> Iterator[Action]:
        """The masters changed outside a step (a load): every gathered buffer is filled again."""
        yield from self.wait_all()
        for c, held in enumerate(self._held):
            if held is Held.GATHERED:
                yield Action(Verb.REFRESH, c)
