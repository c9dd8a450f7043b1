"""``ResidencyExecutor``: carries out, on real chunks, what the device residency decides.

What is on the device (gathered, in flight, prefetched, awaited, gradient buffers accepting or
reducing, and their bytes) is owned by one tensor-free :class:`placement.DeviceResidency`, which
asks the placement policy and yields the actions to take. This class is its adapter: it turns each
action into the chunk verb that does it (a gather, a wait on a pending all-gather, a release, a
gradient reduction), counts it, and turns a refusal into chunkmem's error naming what the device
holds. Gradients from autograd are added into the chunks' flat buffers here, and the residency
says when a buffer's reduction starts.

Every decision depends only on what every rank shares (the trace, chunk sizes, the budget, the
accounted bytes), so all ranks issue the same collectives; an optional check agrees a fingerprint
of every plan across ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch

from chunkmem.placement import ChunkSpec, ComputeTrace, FetchPlan, Phase, PlacementPolicy
from chunkmem.placement.actions import Action, Verb
from chunkmem.placement.policy import format_bytes
from chunkmem.placement.residency import DeviceResidency, NoRoomError

from ..chunks.chunk import Chunk
from ..chunks.manager import ChunkManager
from ..chunks.tensor_state import TensorInfo, TensorState
from ..errors import BudgetExceededError
from ..usage.accounting import Location, MemoryKind
from ..usage.stats import Stats

__all__ = ["PlanCheck", "ResidencyExecutor"]

_BUFFERS = (MemoryKind.GATHERED, MemoryKind.GRAD_BUFFER)


class PlanCheck(Protocol):
    """Something that verifies a plan before it is carried out (the cross-rank check mode)."""

    def check_plan(
        self, position: int, phase: Phase, chunk_ids: tuple[int, ...], device_bytes: int, plan: FetchPlan
    ) -> None: ...


class ResidencyExecutor:
    """See the module docstring."""

    def __init__(
        self,
        manager: ChunkManager,
        policy: PlacementPolicy,
        specs: Sequence[ChunkSpec],
        stats: Stats,
        check: PlanCheck | None = None,
    ) -> None:
        self._manager = manager
        self._policy = policy
        self._stats = stats
        self._check = check
        self._ledger = manager.ledger
        self._rank = manager.comm.rank
        self._residency = DeviceResidency(
            policy, specs, manager.comm.world_size, self._resting_bytes, self, rank=self._rank
        )
        self._on_start: Callable[[Chunk], None] | None = None
        self._records: list[list[Action]] = []
        for chunk in manager.chunks:
            if chunk.residency.gather_bytes != self._residency.gather_bytes(chunk.chunk_id) or (
                chunk.grads.buffer_bytes != self._residency.grad_buffer_bytes(chunk.chunk_id)
            ):
                raise RuntimeError(
                    f"rank {self._rank}: chunk {chunk.chunk_id} allocates {chunk.residency.gather_bytes} bytes "
                    "when gathered and "
                    f"{chunk.grads.buffer_bytes} for gradients, but its placement accounts "
                    f"{self._residency.gather_bytes(chunk.chunk_id)} and "
                    f"{self._residency.grad_buffer_bytes(chunk.chunk_id)}; the layout was not realized as decided"
                )
        self._carry(self._residency.start())

    @property
    def residency(self) -> DeviceResidency:
        """What is on the device (read it; change it only through this executor)."""
        return self._residency

    def _resting_bytes(self) -> int:
        """Accounted device bytes other than the buffers the residency owns."""
        ledger = self._ledger
        return ledger.device_bytes - sum(ledger.bytes(Location.DEVICE, kind) for kind in _BUFFERS)

    # --- placement.PlanObserver ------------------------------------------------------------------
    def plan_made(
        self, position: int, phase: Phase, chunk_ids: tuple[int, ...], device_bytes: int, plan: FetchPlan
    ) -> None:
        self._stats.decision_work += plan.examined
        if self._check is not None:
            self._check.check_plan(position, phase, chunk_ids, device_bytes, plan)

    # --- carrying out ----------------------------------------------------------------------------
    def _carry(self, actions: Iterable[Action]) -> bool:
        """Do each action on its chunk, in order. Returns whether a prefetch was started."""
        prefetched = False
        stats = self._stats
        try:
            for action in actions:
                for record in self._records:
                    record.append(action)
                chunk = self._manager.chunk(action.chunk)
                verb = action.verb
                if verb is Verb.GATHER:
                    chunk.residency.gather(async_op=False)
                    stats.gathers += 1
                elif verb is Verb.PREFETCH:
                    chunk.residency.gather(async_op=True)
                    stats.prefetches += 1
                    prefetched = True
                elif verb is Verb.CLAIM:
                    stats.prefetch_hits += 1
                    if action.in_flight and not chunk.residency.pending.is_completed():
                        stats.prefetch_waits += 1  # rank-local: a statistic, never a decision
                elif verb is Verb.WAIT:
                    chunk.residency.wait()
                elif verb in (Verb.RELEASE, Verb.EVICT, Verb.DROP):
                    chunk.residency.release()
                    stats.releases += verb is Verb.RELEASE
                    stats.evictions += verb is Verb.EVICT
                elif verb is Verb.KEEP:
                    chunk.residency.gather(async_op=False)
                elif verb is Verb.REFRESH:
                    chunk.residency.refresh()
                elif verb is Verb.ALLOCATE_GRAD:
                    chunk.grads.prepare(from_host=action.from_host, onto_reduced=action.onto_reduced)
                elif verb in (Verb.START_REDUCE, Verb.REDUCE_EARLY):
                    chunk.start_reduce(onto_reduced=action.onto_reduced)
                    stats.grad_flushes += verb is Verb.REDUCE_EARLY
                    if self._on_start is not None:
                        self._on_start(chunk)
                elif verb is Verb.SPILL_GRAD:
                    chunk.grads.spill()
                    stats.grad_spills += 1
                elif verb is Verb.FINISH_REDUCE:
                    chunk.grads.finish_reduce()
                elif verb is Verb.ZERO_GRAD:
                    chunk.grads.zero()
                else:  # pragma: no cover - every verb is handled above
                    raise AssertionError(f"unhandled action {action}")
        except NoRoomError as refused:
            raise self._budget_error(refused) from None
        return prefetched

    @contextmanager
    def record_actions(self) -> Iterator[list[Action]]:
        """Every action carried out in the block, in order (for tests and debugging: what a
        replay of the same trace through ``placement.simulate`` must also do)."""
        record: list[Action] = []
        self._records.append(record)
        try:
            yield record
        finally:
            self._records.remove(record)

    def _check_accounts(self) -> None:
        """The residency's buffer bytes are the ledger's: one owner, and it is right."""
        ledger_bytes = sum(self._ledger.bytes(Location.DEVICE, kind) for kind in _BUFFERS)
        if ledger_bytes != self._residency.buffer_bytes:
            raise RuntimeError(
                f"rank {self._rank}: the device residency accounts {self._residency.buffer_bytes} bytes of gathered "
                f"and gradient buffers but {ledger_bytes} are allocated; a buffer moved outside the residency executor"
            )

    # --- iterations -----------------------------------------------------------------------------
    def begin_iteration(self) -> None:
        """Positions restart: forget when chunks were last used and which evicted ones are awaited."""
        self._residency.begin_iteration()

    def keep_served(self) -> None:
        """Gather, once and for all, every chunk a resident shard serves (world size 1)."""
        self._carry(self._residency.keep_served())

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
        if self._carry(self._residency.before_op(position, phase, chunk_ids, trace)):
            self.check_budget(f"prefetching at position {position}")
        self._check_accounts()
        for info in infos:
            self._manager.chunk(info.chunk_id).enter_compute(info)

    def after_op(
        self,
        infos: Sequence[TensorInfo],
        chunk_ids: tuple[int, ...],
        target: TensorState,
        position: int,
        phase: Phase,
        in_backward: bool,
        trace: ComputeTrace | None,
        op: int,
    ) -> None:
        """The op at ``op`` is done with its parameters; release what the policy says."""
        for info in infos:
            self._manager.chunk(info.chunk_id).leave_compute(info, target)
        self._carry(self._residency.after_op(position, phase, chunk_ids, in_backward, trace, op))

    # --- gradients --------------------------------------------------------------------------------
    def on_start(self, listener: Callable[[Chunk], None] | None) -> None:
        """Call ``listener`` with each chunk whose reduction has just started."""
        self._on_start = listener

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally; no gradient collective until the block exits."""
        with self._residency.no_sync():
            yield

    def accumulate(
        self, chunk: Chunk, info: TensorInfo, grad: torch.Tensor, position: int, trace: ComputeTrace | None
    ) -> None:
        """Add a parameter's gradient into its chunk's buffer (making room for one first if the
        chunk has none). The residency says when the buffer's reduction starts (its one rule for
        complete gradients, the same in a replay)."""
        self._carry(self._residency.gradient_arrives(chunk.chunk_id, position, trace))
        chunk.accumulate_grad(info, grad)

    def finish_reduction(self, chunk: Chunk) -> None:
        """Wait for ``chunk``'s reduction in flight (its gradient shard is read now)."""
        self._carry(self._residency.finish_reduction(chunk.chunk_id))

    def end_backward(self) -> None:
        """``loss.backward()`` returned: land gathers, and outside ``no_sync`` reduce everything."""
        self._carry(self._residency.end_backward())

    def reduce_all(self) -> None:
        """Reduce every buffer still accepting, then wait for every reduction."""
        self._carry(self._residency.reduce_all())

    def zero_grads(self) -> None:
        """Drop all gradients."""
        self._carry(self._residency.zero_grads())

    # --- between ops ------------------------------------------------------------------------------
    def wait_all(self) -> None:
        """Land every gather in flight."""
        self._carry(self._residency.wait_all())

    def release_all(self) -> None:
        """Release every gathered chunk no op uses (chunks kept gathered stay)."""
        self._carry(self._residency.release_idle())

    def masters_changed(self, by_step: bool) -> None:
        """The masters were written (an optimizer step, or a load): after a step gathered chunks
        the policy manages are released and the others refreshed; after a load every gathered
        chunk is refreshed. A step leaves frozen chunks as they were: their copies stay current."""
        self.wait_all()
        for chunk in self._manager.chunks:
            if chunk.layout.trainable or not by_step:
                chunk.store.mark_updated()
        self._carry(self._residency.after_step() if by_step else self._residency.refresh())

    # --- the budget ------------------------------------------------------------------------------
    def _budget_error(self, refused: NoRoomError) -> BudgetExceededError:
        ledger = self._ledger
        budget = refused.budget
        parts = ", ".join(
            f"{kind.value} {format_bytes(ledger.bytes(Location.DEVICE, kind))}"
            for kind in MemoryKind
            if ledger.bytes(Location.DEVICE, kind)
        )
        causes = []
        if refused.busy:
            causes.append(
                f"chunks {list(refused.busy)} are used by ops still running (ops overlap when activation checkpointing "
                "recomputes a forward op inside a backward op, so both need their chunks at once)"
            )
        minimum = refused.minimum
        return BudgetExceededError(
            f"rank {self._rank}: device_budget={budget} ({format_bytes(budget)}) cannot fit the op at trace position "
            f"{refused.position} on chunks {refused.chunks}: it needs {format_bytes(refused.needed)} more while "
            f"{format_bytes(refused.device_bytes)} are held ({parts}). "
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

    def transient_room(self, nbytes: int) -> int | None:
        """The device bytes a temporary buffer outside training steps may take once idle gathered
        chunks are released for ``nbytes`` (``None``: no budget). Accounted bytes are the same on
        every rank, so every rank gets the same answer."""
        budget = self._policy.budget
        self._carry(self._residency.make_room(nbytes))
        return None if budget is None else max(0, budget - self._ledger.device_bytes)

    @contextmanager
    def transient(self, nbytes: int, what: str, kind: MemoryKind = MemoryKind.TRANSIENT) -> Iterator[None]:
        """Account a temporary device buffer of ``kind`` used outside training steps (state dicts,
        checkpoints; a generate's KV cache): idle gathered chunks are released first if the budget
        needs the room."""
        budget = self._policy.budget
        self._carry(self._residency.make_room(nbytes))
        if budget is not None and self._ledger.device_bytes + nbytes > budget:
            raise BudgetExceededError(
                f"rank {self._rank}: {what} needs a {format_bytes(nbytes)} device buffer but only "
                f"{format_bytes(budget - self._ledger.device_bytes)} of device_budget={budget} are free"
            )
        self._ledger.alloc(Location.DEVICE, kind, nbytes)
        try:
            yield
        finally:
            self._ledger.free(Location.DEVICE, kind, nbytes)
