"""``DeviceResidency``: what is on the device, owned in one place, and the moves that change it.

For every chunk it keeps whether its full buffer is released, being gathered (in flight) or
gathered; whether a prefetch brought it and no op has claimed it yet; when an op last used it; which
evicted chunks an op ahead in the pass still needs; which ops hold it now; and, through its
:class:`~placement.gradients.GradientBuffers`, whether its gradient buffer accepts gradients or is
being reduced and when its gradients are complete. It accounts the device bytes of those buffers, and
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

import contextlib
import enum
import heapq
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from .actions import Action, Verb
from .gradients import GradBuffer, GradientBuffers
from .policy import PlacementPolicy
from .snapshot import BufferKind, ChunkSpec, FetchPlan, OpSnapshot, ReleaseSnapshot, ResidentChunk
from .trace import ComputeTrace, Phase

__all__ = ["Action", "DeviceResidency", "GradBuffer", "Held", "NoRoomError", "PlanObserver", "Verb"]


class Held(enum.Enum):
    """A chunk's full buffer."""

    RELEASED = "released"
    FETCHING = "fetching"
    """An asynchronous gather into it is in flight."""
    GATHERED = "gathered"


# What a verb's refusal says is wrong, and what to do (a refusal is a caller's bug: the runtime's
# executor and ``simulate`` call the verbs in the order the residency's own actions need).
_GATHERED = "it is gathered or in flight; use it as it is, or release it first"
_IN_USE = "an op still uses it; release it once the op lets go of it (after_op)"
_NOT_GATHERED = "it is not gathered; gather it first (before_op)"
_NOT_HELD = "no op holds it; every after_op follows the before_op of the same op"


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
    needs the other ranks (inside ``no_sync`` only at world size 1 it may run); ``rank``, where a
    run has one, is named in its errors."""

    def __init__(
        self,
        policy: PlacementPolicy,
        specs: Sequence[ChunkSpec],
        world_size: int,
        base_bytes: Callable[[], int],
        observer: PlanObserver | None = None,
        rank: int | None = None,
    ) -> None:
        layout = policy.layout_decided
        self._who = "DeviceResidency" if rank is None else f"DeviceResidency (rank {rank})"
        self._policy = policy
        self._budget = policy.budget
        self._base = base_bytes
        self._observer = observer
        n = len(specs)
        self._labels = [s.label for s in specs]
        self._trainable = [s.trainable for s in specs]
        self._keep = [layout[i].keep_gathered for i in range(n)]
        # Device bytes a gathered buffer allocates (0: a resident shard serves as the chunk).
        self._gather_bytes = [layout[i].fetch_bytes(s, ignore_keep=True) for i, s in enumerate(specs)]
        grad_bytes = [layout[i].grad_buffer_bytes(s) if s.trainable else 0 for i, s in enumerate(specs)]
        self._grads = GradientBuffers(self._trainable, grad_bytes, world_size, self._require)
        self._held = [Held.RELEASED] * n
        self._holds = [0] * n  # running ops using the chunk
        self._buffers: dict[int, None] = {}  # gathered chunks the policy may release, in gather order
        self._prefetched: set[int] = set()
        self._last_use: dict[int, int] = {}
        self._awaited: list[tuple[int, int]] = []  # heap: (next use in the pass, chunk) of evicted chunks
        self._position = -1
        self._bytes = 0  # of gathered buffers

    # --- what the policy sees (placement.Residency) ------------------------------------------------
    def is_gathered(self, chunk_id: int) -> bool:
        return chunk_id in self._buffers

    def has_grad_buffer(self, chunk_id: int) -> bool:
        return self._grads.state(chunk_id) is GradBuffer.ACCEPTING

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
        grads = self._grads
        out += [ResidentChunk(c, BufferKind.REDUCING, grads.buffer_bytes(c), False, False, -1) for c in grads.reducing]
        # Flushing a gradient buffer reduces it early, or where it may not be reduced moves it to the host.
        out += [
            ResidentChunk(
                c,
                BufferKind.GRAD if grads.reducible(c) else BufferKind.SPILL,
                grads.buffer_bytes(c),
                self._holds[c] > 0,
                False,
                self._last_use.get(c, -1),
            )
            for c in grads.accepting
            if grads.buffer_bytes(c) > 0
        ]
        return out

    def awaited(self) -> Sequence[tuple[int, int]]:
        awaited = self._awaited
        while awaited and (awaited[0][0] <= self._position or awaited[0][1] in self._buffers):
            heapq.heappop(awaited)
        return sorted(awaited) if awaited else ()

    # --- state ---------------------------------------------------------------------------------------
    def grads_reduced(self, chunk_id: int) -> bool:
        """The chunk's gradient shard holds reduced gradients (since the last ``zero_grads``): a
        buffer's reduction adds to them, and the optimizer steps on them."""
        return self._grads.reduced(chunk_id)

    def gather_bytes(self, chunk_id: int) -> int:
        """Device bytes the chunk's gathered buffer allocates (0 when a resident shard serves)."""
        return self._gather_bytes[chunk_id]

    def grad_buffer_bytes(self, chunk_id: int) -> int:
        """Device bytes the chunk's gradient buffer allocates (0 when it is the gradient shard)."""
        return self._grads.buffer_bytes(chunk_id)

    @property
    def buffer_bytes(self) -> int:
        """Device bytes of the gathered and gradient buffers accounted here."""
        return self._bytes + self._grads.nbytes

    @property
    def device_bytes(self) -> int:
        """Everything accounted on the device: what stays between uses, and the buffers here."""
        return self._base() + self.buffer_bytes

    @property
    def unreduced(self) -> bool:
        """Gradients wait for a reduction (in a buffer, in flight, or on the host)."""
        return self._grads.unreduced

    @property
    def can_reduce(self) -> bool:
        """A reduction may run now: always at world size 1, else only outside ``no_sync``."""
        return self._grads.can_reduce

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Gradients accumulate locally; no gradient collective until the block exits."""
        return self._grads.no_sync()

    def _require(self, ok: bool, chunk_id: int, verb: str, fix: str) -> None:
        if not ok:
            raise RuntimeError(
                f"{self._who}: cannot {verb} chunk {chunk_id} ('{self._labels[chunk_id]}'; buffer "
                f"{self._held[chunk_id].value}, gradient buffer {self._grads.state(chunk_id).value}): {fix}"
            )

    # --- the gathered buffer -------------------------------------------------------------------------
    def _gather(self, chunk_id: int, verb: Verb) -> Iterator[Action]:
        self._require(self._held[chunk_id] is Held.RELEASED, chunk_id, verb.value, _GATHERED)
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
        self._require(self._holds[chunk_id] == 0, chunk_id, verb.value, _IN_USE)
        yield from self._land(chunk_id)
        self._require(self._held[chunk_id] is Held.GATHERED, chunk_id, verb.value, _NOT_GATHERED)
        self._held[chunk_id] = Held.RELEASED
        self._bytes -= self._gather_bytes[chunk_id]
        self._buffers.pop(chunk_id, None)
        self._prefetched.discard(chunk_id)
        yield Action(verb, chunk_id)

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
        self._grads.forget_complete()
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
        yield from self._grads.start_complete(trace is not None)
        for c in chunk_ids:
            if c in self._prefetched:
                self._prefetched.discard(c)
                yield Action(Verb.CLAIM, c, in_flight=self._held[c] is Held.FETCHING)
            yield from self._land(c)
        backward, grads = phase is Phase.BACKWARD, self._grads
        needed = sum(
            (self._gather_bytes[c] if self._held[c] is Held.RELEASED else 0)
            + (grads.buffer_bytes(c) if backward and grads.needs_buffer(c) else 0)
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
            if backward and grads.needs_buffer(c):
                yield from grads.allocate(c)
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
        the chunks whose gradients this op completes (``GradientBuffers.start_complete``)."""
        self._grads.op_done(position if op is None else op, phase, chunk_ids, trace)
        finished = []
        for c in chunk_ids:
            self._require(self._holds[c] > 0, c, "let go of", _NOT_HELD)
            self._holds[c] -= 1
            # Releasing a chunk served by a resident shard frees nothing: it stays as it is.
            if self._holds[c] == 0 and self._held[c] is not Held.RELEASED and self._gather_bytes[c]:
                finished.append(c)
        if not finished:
            return
        release = self._policy.after_op(
            ReleaseSnapshot(
                position=position,
                phase=phase,
                finished=tuple(finished),
                in_backward=in_backward,
                residency=self,
                trace=trace,
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
            yield from self._grads.flush(c)
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
        backward, or reduced before a later gradient arrived): make room, allocate."""
        grads = self._grads
        if grads.state(chunk_id) is GradBuffer.ACCEPTING:
            return
        if grads.state(chunk_id) is GradBuffer.REDUCING:
            yield from grads.finish(chunk_id)
        yield from self._room_for_grad(chunk_id, position, trace)
        yield from grads.allocate(chunk_id)

    def _room_for_grad(self, chunk_id: int, position: int, trace: ComputeTrace | None) -> Iterator[Action]:
        needed = self._grads.buffer_bytes(chunk_id)
        if needed:  # else the buffer is the gradient shard (world size 1): there is no room to make
            yield from self._plan(position, Phase.BACKWARD, (chunk_id,), needed, trace)
            self._require_room(needed, (chunk_id,), position)

    def end_backward(self) -> Iterator[Action]:
        """``loss.backward()`` returned: land the gathers in flight; outside ``no_sync`` reduce
        every gradient (``reduce_all``); inside it, the chunks the last op completed go on
        accumulating with the others (their sum over the micro-batches is reduced once, at the end
        of a backward outside ``no_sync``)."""
        yield from self.wait_all()
        if self.can_reduce:
            yield from self.reduce_all()
        else:
            self._grads.forget_complete()

    def finish_reduction(self, chunk_id: int) -> Iterator[Action]:
        """Wait for the chunk's reduction in flight (its gradient shard is read now)."""
        if self._grads.state(chunk_id) is GradBuffer.REDUCING:
            yield from self._grads.finish(chunk_id)

    def reduce_all(self) -> Iterator[Action]:
        """Reduce every buffer still accepting and every chunk with gradients on the host (in
        chunk order, the same on every rank; a chunk whose gradients are only on the host gets a
        buffer for its reduction first), then wait for every reduction. Chunks the last op
        completed start first (``GradientBuffers.start_complete``)."""
        grads = self._grads
        yield from grads.start_complete(True)
        for c in grads.to_reduce():
            if grads.on_host_only(c):
                yield from self._room_for_grad(c, self._position, None)
                yield from grads.allocate(c)
            if grads.state(c) is GradBuffer.ACCEPTING:
                yield from grads.start(c, Verb.START_REDUCE)
        yield from grads.finish_all()

    def zero_grads(self) -> Iterator[Action]:
        """Drop all gradients (reductions in flight are waited for first: their buffers are in use)."""
        yield from self._grads.zero()

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
        (kept gathered, served by a resident shard) refreshed, unless frozen: a step never
        changes a frozen chunk's values."""
        yield from self.wait_all()
        for c, held in enumerate(self._held):
            if held is Held.RELEASED:
                continue
            if c in self._buffers:
                yield from self._release(c, Verb.DROP)
            elif self._trainable[c]:
                yield Action(Verb.REFRESH, c)

    def refresh(self) -> Iterator[Action]:
        """The masters changed outside a step (a load): every gathered buffer is filled again."""
        yield from self.wait_all()
        for c, held in enumerate(self._held):
            if held is Held.GATHERED:
                yield Action(Verb.REFRESH, c)
