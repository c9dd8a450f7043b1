"""``PlanExecutor``: carries out the placement policy's decisions around every op.

Before an op it claims gathers already in flight for the op's chunks, asks the policy for a plan,
releases what the plan evicts and frees the gradient buffers it flushes, enforces the device budget,
gathers what is still missing, gives a backward op's chunks gradient buffers, and starts the plan's
prefetches. After an op it asks the policy which chunks to release.

What is on the device is kept incrementally (chunks gathered, in gather order; gradient buffers in
the router), and the policy reads it through the :class:`placement.Residency` interface: an op that
fits costs no scan over all chunks. Every decision depends only on what every rank shares (the
trace, chunk sizes, the budget, the accounted bytes), so all ranks issue the same collectives; an
optional check agrees a fingerprint of every plan across ranks.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

from placement import (
    BufferKind,
    ComputeTrace,
    FetchPlan,
    Layout,
    OpSnapshot,
    Phase,
    PlacementPolicy,
    ReleaseSnapshot,
    ResidentChunk,
)
from placement.policy import format_bytes

from .accounting import Location, MemoryKind
from .chunk import Chunk, ChunkState
from .errors import BudgetExceededError
from .grad_router import GradientRouter
from .manager import ChunkManager
from .stats import Stats
from .tensor_state import TensorInfo, TensorState

__all__ = ["PlanCheck", "PlanExecutor"]


class PlanCheck(Protocol):
    """Something that verifies a plan before it is carried out (the cross-rank check mode)."""

    def check_plan(
        self, position: int, phase: Phase, chunk_ids: tuple[int, ...], device_bytes: int, plan: FetchPlan
    ) -> None: ...


class PlanExecutor:
    """See the module docstring."""

    def __init__(
        self,
        manager: ChunkManager,
        policy: PlacementPolicy,
        layout: Layout,
        grads: GradientRouter,
        stats: Stats,
        check: PlanCheck | None = None,
    ) -> None:
        self._manager = manager
        self._policy = policy
        self._layout = layout
        self._grads = grads
        self._stats = stats
        self._check = check
        self._ledger = manager.ledger
        self._rank = manager.comm.rank
        self._gathered: dict[int, None] = {}  # chunks holding their own device buffer, in gather order
        self._prefetched: set[int] = set()
        self._last_use: dict[int, int] = {}
        self._awaited: list[tuple[int, int]] = []  # heap: (next use in the pass, chunk) of evicted chunks
        self._position = -1
        for chunk in manager.chunks:
            if layout[chunk.chunk_id].keep_gathered:
                chunk.gather(async_op=False)

    # --- placement.Residency --------------------------------------------------------------------
    def is_gathered(self, chunk_id: int) -> bool:
        return chunk_id in self._gathered

    def has_grad_buffer(self, chunk_id: int) -> bool:
        return self._grads.has_buffer(chunk_id)

    def buffers(self) -> Sequence[ResidentChunk]:
        out = []
        for chunk_id in self._gathered:
            chunk = self._manager.chunk(chunk_id)
            out.append(
                ResidentChunk(
                    chunk_id=chunk_id,
                    kind=BufferKind.GATHERED,
                    release_bytes=chunk.gathered_bytes,
                    held=chunk.in_use,
                    fetching=chunk.state is ChunkState.GATHERING,
                    last_use=self._last_use.get(chunk_id, -1),
                )
            )
        for chunk_id in self._grads.reducing:
            chunk = self._manager.chunk(chunk_id)
            out.append(ResidentChunk(chunk_id, BufferKind.REDUCING, chunk.flush_device_bytes, False, False, -1))
        if self._grads.can_reduce:
            # Flushing a gradient buffer is a reduction: a collective, so never inside no_sync.
            for chunk_id in self._grads.accepting:
                chunk = self._manager.chunk(chunk_id)
                if chunk.flush_device_bytes > 0:
                    out.append(
                        ResidentChunk(
                            chunk_id=chunk_id,
                            kind=BufferKind.GRAD,
                            release_bytes=chunk.flush_device_bytes,
                            held=chunk.in_use,
                            fetching=False,
                            last_use=self._last_use.get(chunk_id, -1),
                        )
                    )
        return out

    def awaited(self) -> Sequence[tuple[int, int]]:
        awaited = self._awaited
        while awaited and (awaited[0][0] <= self._position or awaited[0][1] in self._gathered):
            heapq.heappop(awaited)
        return sorted(awaited) if awaited else ()

    # --- iterations -----------------------------------------------------------------------------
    def begin_iteration(self) -> None:
        """Positions restart: forget when chunks were last used and which evicted ones are awaited."""
        self._last_use.clear()
        self._awaited.clear()
        self._position = -1

    # --- around an op ---------------------------------------------------------------------------
    def before_op(
        self,
        infos: Sequence[TensorInfo],
        chunk_ids: tuple[int, ...],
        position: int,
        phase: Phase,
        trace: ComputeTrace | None,
    ) -> None:
        """Make the op's chunks resident (with gradient buffers for a backward op) and start
        prefetches; then mark its parameters in use."""
        chunks = [self._manager.chunk(c) for c in chunk_ids]
        for chunk in chunks:
            self._claim_prefetch(chunk)
        backward = phase is Phase.BACKWARD
        needed = sum(
            (c.gather_bytes if c.state is ChunkState.RELEASED else 0)
            + (c.grad_buffer_bytes if backward and c.trainable and not c.has_grad_buffer else 0)
            for c in chunks
        )
        plan = self._plan(position, phase, chunk_ids, needed, trace)
        if self._over_budget(needed) and any(
            self._manager.chunk(c).state is ChunkState.GATHERING for c in self._gathered
        ):
            # Only buffers still being gathered are in the way: let them land, then they can go.
            self.wait_all()
            plan = self._plan(position, phase, chunk_ids, needed, trace)
        self._require_room(needed, chunks, position)
        for chunk in chunks:
            if chunk.state is ChunkState.RELEASED:
                self._gather(chunk, async_op=False)
                self._stats.gathers += 1
            if backward and chunk.trainable and not chunk.has_grad_buffer:
                self._grads.prepare(chunk)
            self._last_use[chunk.chunk_id] = position
        if plan.prefetch:
            self._start_prefetch(plan.prefetch, position)
        for info in infos:
            self._manager.chunk(info.chunk_id).enter_compute(info)

    def after_op(
        self,
        infos: Sequence[TensorInfo],
        target: TensorState,
        position: int,
        phase: Phase,
        in_backward: bool,
        trace: ComputeTrace | None,
    ) -> None:
        """The op is done with its parameters; release what the policy says."""
        finished: list[int] = []
        for info in infos:
            chunk = self._manager.chunk(info.chunk_id)
            chunk.leave_compute(info, target)
            # Releasing a chunk served by a resident shard frees nothing: it stays as it is.
            if not chunk.in_use and chunk.holds_device_buffer and chunk.chunk_id not in finished:
                finished.append(chunk.chunk_id)
        if not finished:
            return
        release = self._policy.after_op(
            ReleaseSnapshot(
                position=position, phase=phase, finished=tuple(finished), in_backward=in_backward, trace=trace
            )
        )
        for chunk_id in release:
            chunk = self._manager.chunk(chunk_id)
            if chunk.state is ChunkState.GATHERED and not chunk.in_use:
                self.release(chunk)
                self._stats.releases += 1

    def _plan(
        self, position: int, phase: Phase, chunk_ids: tuple[int, ...], needed: int, trace: ComputeTrace | None
    ) -> FetchPlan:
        """Ask the policy, and carry out its evictions and flushes (the rest is the caller's)."""
        self._position = position
        plan = self._policy.before_op(
            OpSnapshot(
                position=position,
                phase=phase,
                needed=chunk_ids,
                needed_bytes=needed,
                residency=self,
                device_bytes=self._ledger.device_bytes,
                trace=trace,
            )
        )
        self._stats.decision_work += plan.examined
        if self._check is not None:
            self._check.check_plan(position, phase, chunk_ids, self._ledger.device_bytes, plan)
        for chunk_id in plan.evict:
            self.release(self._manager.chunk(chunk_id))
            self._stats.evictions += 1
            if trace is not None and trace.used_again_in_pass(chunk_id, position):
                heapq.heappush(self._awaited, (trace.next_use(chunk_id, position) or -1, chunk_id))
        for chunk_id in plan.flush:
            self._grads.flush(self._manager.chunk(chunk_id))
        return plan

    def ensure_grad_buffer(self, chunk: Chunk, position: int, trace: ComputeTrace | None) -> None:
        """A gradient arrived for a chunk without a buffer (flushed to make room after the op's
        backward, or reduced before a later gradient of a shared parameter): make room, allocate."""
        if chunk.reducing:
            self._grads.finish(chunk)
        needed = chunk.grad_buffer_bytes
        if needed:  # else the buffer is the gradient shard (world size 1): there is no room to make
            self._plan(position, Phase.BACKWARD, (chunk.chunk_id,), needed, trace)
            self._require_room(needed, [chunk], position)
        self._grads.prepare(chunk)

    # --- moving chunks ---------------------------------------------------------------------------
    def _gather(self, chunk: Chunk, async_op: bool) -> None:
        chunk.gather(async_op)
        if chunk.holds_device_buffer and not self._layout[chunk.chunk_id].keep_gathered:
            self._gathered[chunk.chunk_id] = None

    def gather_served(self) -> None:
        """Gather, once and for all, every chunk a resident shard serves (world size 1): nothing is
        allocated or copied, and no plan releases them (releasing them would free nothing)."""
        for chunk in self._manager.chunks:
            if chunk.state is ChunkState.RELEASED and chunk.gather_bytes == 0:
                self._gather(chunk, async_op=False)

    def release(self, chunk: Chunk) -> None:
        """Release ``chunk``, waiting first for a gather still in flight."""
        if chunk.state is ChunkState.GATHERING:
            chunk.wait()
        chunk.release()
        self._gathered.pop(chunk.chunk_id, None)
        self._prefetched.discard(chunk.chunk_id)

    def release_all(self) -> None:
        """Release every gathered chunk no op uses (chunks kept gathered stay)."""
        for chunk_id in list(self._gathered):
            chunk = self._manager.chunk(chunk_id)
            if not chunk.in_use:
                self.release(chunk)

    def wait_all(self) -> None:
        """Land every gather in flight."""
        for chunk_id in list(self._gathered):
            chunk = self._manager.chunk(chunk_id)
            if chunk.state is ChunkState.GATHERING:
                chunk.wait()

    def _claim_prefetch(self, chunk: Chunk) -> None:
        if chunk.chunk_id not in self._prefetched:
            if chunk.state is ChunkState.GATHERING:
                chunk.wait()
            return
        self._prefetched.discard(chunk.chunk_id)
        self._stats.prefetch_hits += 1
        if chunk.state is ChunkState.GATHERING:
            if not chunk.pending.is_completed():
                self._stats.prefetch_waits += 1
            chunk.wait()

    def _start_prefetch(self, chunk_ids: Sequence[int], position: int) -> None:
        for chunk_id in chunk_ids:
            chunk = self._manager.chunk(chunk_id)
            if chunk.state is ChunkState.RELEASED:
                self._gather(chunk, async_op=True)
                self._stats.prefetches += 1
                self._prefetched.add(chunk_id)
        self.check_budget(f"prefetching {tuple(chunk_ids)} at position {position}")

    # --- the budget ------------------------------------------------------------------------------
    def _over_budget(self, needed: int) -> bool:
        budget = self._policy.budget
        return budget is not None and self._ledger.device_bytes + needed > budget

    def _require_room(self, needed: int, chunks: Sequence[Chunk], position: int) -> None:
        budget = self._policy.budget
        if budget is None or self._ledger.device_bytes + needed <= budget:
            return
        ledger = self._ledger
        busy = [c for c in self._gathered if self._manager.chunk(c).in_use]
        evictable = sum(r.release_bytes for r in self.buffers() if not r.held and not r.fetching)
        minimum = ledger.device_bytes - evictable + needed
        parts = ", ".join(
            f"{kind.value} {format_bytes(ledger.bytes(Location.DEVICE, kind))}"
            for kind in MemoryKind
            if ledger.bytes(Location.DEVICE, kind)
        )
        causes = []
        if busy:
            causes.append(
                f"chunks {busy} are used by ops still running (ops overlap when activation checkpointing "
                "recomputes a forward op inside a backward op, so both need their chunks at once)"
            )
        if not self._grads.can_reduce and self._grads.accepting:
            causes.append(
                f"{len(self._grads.accepting)} gradient buffers accumulate under no_sync and cannot be reduced "
                "before the synchronised backward"
            )
        raise BudgetExceededError(
            f"rank {self._rank}: device_budget={budget} ({format_bytes(budget)}) cannot fit the op at trace position "
            f"{position} on chunks {tuple(c.chunk_id for c in chunks)}: it needs {format_bytes(needed)} more while "
            f"{format_bytes(ledger.device_bytes)} are held ({parts}). "
            + (("It cannot evict enough because " + "; and ".join(causes) + ". ") if causes else "")
            + f"A device_budget of at least {minimum} ({format_bytes(minimum)}) would run this op.",
            minimum,
        )

    def check_budget(self, what: str) -> None:
        """Raise if accounted device memory is over the budget after ``what`` allocated."""
        budget = self._policy.budget
        if budget is not None and self._ledger.device_bytes > budget:
            raise BudgetExceededError(
                f"rank {self._rank}: {what} took accounted device memory to {self._ledger.device_bytes} bytes, over "
                f"device_budget={budget}; the placement's estimate was too small. Raise device_budget or offload "
                "more to the host."
            )

    @contextmanager
    def transient(self, nbytes: int, what: str) -> Iterator[None]:
        """Account a temporary device buffer used outside training steps (state dicts,
        checkpoints): idle gathered chunks are released first if the budget needs the room."""
        budget = self._policy.budget
        if budget is not None and self._ledger.device_bytes + nbytes > budget:
            self.wait_all()
            self.release_all()
        if budget is not None and self._ledger.device_bytes + nbytes > budget:
            raise BudgetExceededError(
                f"rank {self._rank}: {what} needs a {format_bytes(nbytes)} device buffer but only "
                f"{format_bytes(budget - self._ledger.device_bytes)} of device_budget={budget} are free"
            )
        self._ledger.alloc(Location.DEVICE, MemoryKind.TRANSIENT, nbytes)
        try:
            yield
        finally:
            self._ledger.free(Location.DEVICE, MemoryKind.TRANSIENT, nbytes)
