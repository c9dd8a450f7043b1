"""``ChunkRuntime``: the parameter-op hook that executes placement decisions.

Before an op it waits for gathers already in flight for the op's chunks, asks the policy for a
plan, releases what the plan evicts, enforces the device budget, gathers what is still missing,
allocates gradient buffers for a backward op, and starts the plan's prefetches. After an op it asks
the policy which chunks to release. Gradients are added into the chunks' flat buffers as soon as
autograd accumulates them, and a chunk is reduced as soon as all its parameters have one.

It also delimits iterations (forward, backward, optimizer step), follows or records the compute
trace, and checks at the end of each synchronised backward that every rank ran the same ops.
"""

from __future__ import annotations

import enum
import hashlib
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from hooks import ParamOpHook, bind, to_hooked, unhooked
from placement import (
    AutoPolicy,
    BufferKind,
    ComputeTrace,
    Divergence,
    Layout,
    OpSnapshot,
    Phase,
    PlacementPolicy,
    ReleaseSnapshot,
    ResidentChunk,
    TraceCursor,
    TraceStep,
)
from placement.policy import format_bytes

from .accounting import Location, MemoryKind
from .chunk import Chunk, ChunkState
from .errors import BudgetExceededError, TraceDivergenceError
from .manager import ChunkManager
from .memory import NonModelSampler
from .stats import Stats
from .tensor_state import TensorInfo, TensorState

__all__ = ["ChunkRuntime"]

log = logging.getLogger("chunkmem")


class Mode(enum.Enum):
    """Where the runtime is in an iteration."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class ChunkRuntime(ParamOpHook):
    """The hook bound to every managed parameter; see the module docstring."""

    def __init__(
        self,
        manager: ChunkManager,
        policy: PlacementPolicy,
        layout: Layout,
        stats: Stats,
    ) -> None:
        self._manager = manager
        self._policy = policy
        self._layout = layout
        self._stats = stats
        self._comm = manager.comm
        self._ledger = manager.ledger
        self._rank = self._comm.rank
        self._train_cursor = TraceCursor()
        self._infer_cursor = TraceCursor()
        self._cursor: TraceCursor | None = None
        self._mode = Mode.IDLE
        self._sync_grads = True
        self._resident: dict[int, None] = {}  # chunks holding their own gathered buffer, gather order
        self._accumulating: dict[int, None] = {}  # chunks with a gradient buffer
        self._prefetched: set[int] = set()
        self._last_use: dict[int, int] = {}
        self._digest = hashlib.blake2b(digest_size=8)
        self._sampler = NonModelSampler(self._comm.device, self._ledger) if isinstance(policy, AutoPolicy) else None
        self._sampling = False
        self._resume: tuple[TraceCursor | None, Mode] = (None, Mode.IDLE)
        params = [info.param for info in manager.infos]
        to_hooked(params)
        bind(params, self)
        self._grad_hooks = [
            info.param.register_post_accumulate_grad_hook(self._on_grad) for info in manager.infos if info.trainable
        ]
        for chunk in manager.chunks:
            if layout[chunk.chunk_id].keep_gathered:
                self._manager.gather(chunk, async_op=False)

    # --- public state -----------------------------------------------------------------------
    @property
    def manager(self) -> ChunkManager:
        return self._manager

    @property
    def policy(self) -> PlacementPolicy:
        return self._policy

    @property
    def trace(self) -> ComputeTrace | None:
        """The most recently frozen training trace."""
        return self._train_cursor.last_frozen

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally; no gradient collective until the block exits."""
        previous = self._sync_grads
        self._sync_grads = False
        try:
            yield
        finally:
            self._sync_grads = previous

    @property
    def stats_counters(self) -> Stats:
        """The live counters (the optimizer adds to them)."""
        return self._stats

    def stats(self) -> Stats:
        """A snapshot of the counters, with the ledger's current and peak bytes."""
        self._stats.device_bytes = self._ledger.device_bytes
        self._stats.host_bytes = self._ledger.host_bytes
        self._stats.peak_device_bytes = self._ledger.peak_device_bytes
        return self._stats.snapshot()

    # --- iterations -------------------------------------------------------------------------
    # A training iteration runs from the first grad-enabled forward after an optimizer step to the
    # next step (or a zero_grad after a backward): every micro-batch of gradient accumulation and
    # every forward call of the step is in it, so the trace is the same from step to step. An
    # inference forward (no grad) is an iteration of its own, on a trace of its own.
    def begin_forward(self) -> None:
        """Called by the model wrapper when its forward starts."""
        if self._mode is Mode.BACKWARD:
            self.finish_backward()
        self._check_requires_grad()
        if not torch.is_grad_enabled():
            self._resume = (self._cursor, self._mode)
            self._report(self._infer_cursor.begin_iteration())
            self._cursor = self._infer_cursor
        elif self._cursor is not self._train_cursor:
            self._report(self._train_cursor.begin_iteration())
            self._comm.note_divergence(None)
            self._digest = hashlib.blake2b(digest_size=8)
            self._sampling = self._needs_profile(self._train_cursor)
            if self._sampler is not None:
                self._sampler.reset()
            self._cursor = self._train_cursor
        self._mode = Mode.FORWARD

    def _check_requires_grad(self) -> None:
        with unhooked():
            changed = [i for i in self._manager.infos if i.param.requires_grad != i.trainable]
        if changed:
            info = changed[0]
            raise RuntimeError(
                f"rank {self._rank}: parameter '{info.name}' changed requires_grad after boosting "
                f"({info.trainable} -> {not info.trainable}; {len(changed)} parameter(s) in all). Chunks, gradient "
                "buffers and optimizer pieces are built when boosting: set requires_grad before boosting, or boost "
                "a fresh copy of the model."
            )

    def forward_context(self) -> Any:
        """Around the wrapped module's forward: saved-activation tracking while measuring."""
        if self._sampling and self._sampler is not None:
            return self._sampler.saved_tensor_hooks()
        return nullcontext()

    def end_forward(self) -> None:
        """Called by the model wrapper when its forward returns: an inference forward is a whole
        iteration, after which what was running before it goes on."""
        if self._cursor is self._infer_cursor:
            self._report(self._infer_cursor.end_iteration())
            self._cursor, self._mode = self._resume

    def _needs_profile(self, cursor: TraceCursor) -> bool:
        if not isinstance(self._policy, AutoPolicy):
            return False
        return not self._policy.profiled(cursor.last_frozen)

    def finish_backward(self) -> None:
        """After ``loss.backward()`` returns: reduce what is left and agree across ranks. The
        iteration goes on until the optimizer step."""
        if self._mode is not Mode.BACKWARD:
            return
        self._wait_all()
        if self._sync_grads or self._comm.world_size == 1:
            self._reduce_pending()
        self._mode = Mode.IDLE

    def prepare_step(self) -> None:
        """Before the optimizer reads gradients: finish the backward, reduce buffers still pending
        (the last backward ran under ``no_sync``), and release gathered chunks: the step makes
        them stale, and its optimizer state needs the room the placement reserved for it."""
        self.finish_backward()
        if self._accumulating:
            self._reduce_pending()
        self._wait_all()
        self._release_all()

    def zero_grad(self) -> None:
        """Drop gradients. After a backward without an optimizer step this also ends the
        iteration (a zero_grad between a forward and its backward does not)."""
        for chunk in self._manager.chunks:
            chunk.zero_grad()
        self._accumulating.clear()
        if self._mode is Mode.IDLE:
            self._end_training_iteration()
            self.reset_states()

    def _reduce_pending(self) -> None:
        for chunk_id in sorted(self._accumulating):
            self._reduce(self._manager.chunk(chunk_id))
        if self._comm.world_size > 1:
            self._agree_across_ranks()

    def _end_training_iteration(self) -> None:
        if self._cursor is not self._train_cursor:
            return
        cursor = self._train_cursor
        self._cursor = None
        self._mode = Mode.IDLE
        recording = cursor.recording
        self._report(cursor.end_iteration())
        if recording and cursor.last_frozen is not None:
            self._stats.trace_recordings += 1
        if self._sampling and self._sampler is not None and cursor.last_frozen is not None:
            self._adopt_profile(cursor.last_frozen)
        self._sampling = False

    def _adopt_profile(self, trace: ComputeTrace) -> None:
        assert self._sampler is not None and isinstance(self._policy, AutoPolicy), "profiling without auto policy"
        samples = self._sampler.samples
        if len(samples) != len(trace):
            return  # the iteration diverged mid-way; measure again on the next one
        profile = torch.tensor(samples, dtype=torch.int64, device=self._comm.device)
        self._comm.all_reduce(profile, dist.ReduceOp.MAX)
        self._policy.observe_warmup(trace, profile.tolist())

    def _agree_across_ranks(self) -> None:
        """One small all-reduce: every rank's op-sequence digest (max of d and of -d tell whether
        all agree) and which parameters got a gradient on any rank."""
        digest = int.from_bytes(self._digest.digest(), "little", signed=True) >> 1
        chunks = [c for c in self._manager.chunks if c.trainable]
        flags = [int(f) for c in chunks for f in c.params_with_grad]
        payload = torch.tensor([digest, -digest, *flags], dtype=torch.int64, device=self._comm.device)
        self._comm.all_reduce(payload, dist.ReduceOp.MAX)
        if int(payload[0]) != digest or int(-payload[1]) != digest:
            everyone = self._comm.all_gather_tensors(torch.tensor([digest], device=self._comm.device))
            digests = [int(d) for d in everyone]
            reference = max(set(digests), key=digests.count)
            odd = [r for r, d in enumerate(digests) if d != reference]
            raise TraceDivergenceError(
                f"rank {self._rank}: ranks {odd} ran different operations on managed parameters than the "
                f"other ranks in this iteration (op-sequence digests {digests}), so chunk collectives did not "
                "match and gradients are not trustworthy; the optimizer step must not run. All ranks must "
                "use the same parameters in the same order (no rank-dependent branches in the model)."
            )
        agreed = [bool(v) for v in payload[2:].tolist()]
        start = 0
        for chunk in chunks:
            n = len(chunk.tensors)
            chunk.set_params_with_grad(tuple(agreed[start : start + n]))
            start += n

    def _report(self, divergence: Divergence | None) -> None:
        if divergence is None:
            return
        self._stats.divergences += 1
        self._comm.note_divergence(divergence.describe())
        log.warning(
            "chunkmem: rank %d: this iteration departed from the recorded compute trace %s; prefetch is off "
            "for the rest of it and the trace is being recorded again",
            self._rank,
            divergence.describe(),
        )

    def after_step(self) -> None:
        """The optimizer updated the master shards: the iteration ends; chunks kept gathered are
        refreshed, others released."""
        self.finish_backward()
        self._wait_all()
        self._end_training_iteration()
        for chunk in self._manager.chunks:
            chunk.store.mark_updated()
            if self._layout[chunk.chunk_id].keep_gathered:
                chunk.refresh()
            elif chunk.state is not ChunkState.RELEASED:
                self._release(chunk)
        self.reset_states()

    def reset_states(self) -> None:
        """Every parameter back to HOLD (between iterations)."""
        for chunk in self._manager.chunks:
            chunk.reset_states()

    # --- the hook ---------------------------------------------------------------------------
    def pre_op(self, params: Sequence[torch.Tensor]) -> None:
        """Make the op's chunks resident (see ``_before``)."""
        self._before(params, Phase.FORWARD)

    def post_op(self, params: Sequence[torch.Tensor]) -> None:
        """The op is done with its parameters; release what the policy says."""
        target = TensorState.HOLD_AFTER_FWD if torch.is_grad_enabled() else TensorState.HOLD
        self._after(params, Phase.FORWARD, target)

    def pre_backward(self, params: Sequence[torch.Tensor]) -> None:
        """Make the chunks the op's backward reads resident, with gradient buffers."""
        if torch.is_grad_enabled():
            raise NotImplementedError(
                f"rank {self._rank}: backward with create_graph=True (double backward, e.g. a gradient penalty) is "
                "not supported: the second-order graph reads parameters long after their chunks are released. "
                "Compute the penalty without create_graph, or train that model without chunkmem."
            )
        if self._mode is Mode.FORWARD:
            self._mode = Mode.BACKWARD
        self._before(params, Phase.BACKWARD)

    def post_backward(self, params: Sequence[torch.Tensor]) -> None:
        """The op's backward is done with its parameters."""
        self._after(params, Phase.BACKWARD, TensorState.HOLD_AFTER_BWD)

    def mutating_op(self, params: Sequence[torch.Tensor], op_name: str) -> None:
        """Refuse: the master shard is the source of truth, an in-place write would be lost."""
        names = [self._manager.info(p).name for p in params]
        raise RuntimeError(
            f"rank {self._rank}: in-place op '{op_name}' on managed parameter(s) {names} would be lost: chunkmem "
            "keeps each parameter's fp32 master shard as the source of truth and rebuilds the parameter from "
            "it. Change parameters through the optimizer, or with model.load_state_dict()."
        )

    def _before(self, params: Sequence[torch.Tensor], phase: Phase) -> None:
        infos = [self._manager.info(p) for p in params]
        chunk_ids = tuple(dict.fromkeys(info.chunk_id for info in infos))
        position = self._observe(phase, chunk_ids)
        chunks = [self._manager.chunk(c) for c in chunk_ids]
        for chunk in chunks:
            self._claim_prefetch(chunk)
        backward = phase is Phase.BACKWARD
        needed = sum(
            (c.gather_bytes if c.state is ChunkState.RELEASED else 0)
            + (c.grad_buffer_bytes if backward and c.trainable and not c.has_grad_buffer else 0)
            for c in chunks
        )
        trace = self._cursor.trace if self._cursor is not None else None
        plan = self._plan(position, phase, chunk_ids, needed, trace)
        if self._over_budget(needed) and any(c.state is ChunkState.GATHERING for c in self._resident_chunks()):
            # Only buffers still being gathered are in the way: let them land, then they can go.
            self._wait_all()
            plan = self._plan(position, phase, chunk_ids, needed, trace)
        self._check_budget(needed, chunks, position)
        for chunk in chunks:
            if chunk.state is ChunkState.RELEASED:
                self._gather(chunk, async_op=False)
                self._stats.gathers += 1
            if backward and chunk.trainable and not chunk.has_grad_buffer:
                self._prepare_grad(chunk)
            self._last_use[chunk.chunk_id] = position
        if plan.prefetch:
            self._start_prefetch(plan.prefetch, position)
        for info in infos:
            self._manager.chunk(info.chunk_id).enter_compute(info)
        if self._sampling and self._sampler is not None and self._cursor is self._train_cursor:
            self._sampler.sample()

    def _plan(
        self, position: int, phase: Phase, chunk_ids: tuple[int, ...], needed: int, trace: ComputeTrace | None
    ) -> Any:
        """Ask the policy, and carry out its evictions and flushes (the rest is the caller's)."""
        plan = self._policy.before_op(
            OpSnapshot(
                position=position,
                phase=phase,
                needed=chunk_ids,
                needed_bytes=needed,
                resident=self._resident_view(),
                grad_buffers=frozenset(self._accumulating),
                device_bytes=self._ledger.device_bytes,
                trace=trace,
            )
        )
        for chunk_id in plan.evict:
            self._release(self._manager.chunk(chunk_id))
            self._stats.evictions += 1
        for chunk_id in plan.flush:
            self._reduce(self._manager.chunk(chunk_id))
            self._stats.grad_flushes += 1
        return plan

    def _over_budget(self, needed: int) -> bool:
        budget = self._policy.budget
        return budget is not None and self._ledger.device_bytes + needed > budget

    def _after(self, params: Sequence[torch.Tensor], phase: Phase, target: TensorState) -> None:
        finished: list[int] = []
        for p in params:
            info = self._manager.info(p)
            chunk = self._manager.chunk(info.chunk_id)
            chunk.leave_compute(info, target)
            # Releasing a chunk served by a resident shard frees nothing: it stays as it is.
            if not chunk.in_use and chunk.holds_device_buffer and chunk.chunk_id not in finished:
                finished.append(chunk.chunk_id)
        if not finished:
            return
        release = self._policy.after_op(
            ReleaseSnapshot(
                position=self._cursor.position if self._cursor is not None else -1,
                phase=phase,
                finished=tuple(finished),
                in_backward=torch._C._current_graph_task_id() != -1,
            )
        )
        for chunk_id in release:
            chunk = self._manager.chunk(chunk_id)
            if chunk.state is ChunkState.GATHERED and not chunk.in_use:
                self._release(chunk)
                self._stats.releases += 1

    def _observe(self, phase: Phase, chunk_ids: tuple[int, ...]) -> int:
        cursor = self._cursor
        if cursor is None:
            return -1
        step = TraceStep(phase, chunk_ids)
        self._digest.update(phase.value.encode() + b"[" + ",".join(map(str, chunk_ids)).encode() + b"]")
        divergence = cursor.observe(step)
        if divergence is not None:
            self._report(divergence)
            self._wait_all()
        return cursor.position

    # --- executing --------------------------------------------------------------------------
    def _resident_chunks(self) -> list[Chunk]:
        return [self._manager.chunk(chunk_id) for chunk_id in self._resident]

    def _resident_view(self) -> tuple[ResidentChunk, ...]:
        out = [
            ResidentChunk(
                chunk_id=chunk.chunk_id,
                kind=BufferKind.GATHERED,
                release_bytes=chunk.gathered_bytes,
                held=chunk.in_use,
                fetching=chunk.state is ChunkState.GATHERING,
                last_use=self._last_use.get(chunk.chunk_id, -1),
            )
            for chunk in self._resident_chunks()
        ]
        if self._sync_grads or self._comm.world_size == 1:
            # Flushing a gradient buffer is a reduction: a collective, so never inside no_sync.
            for chunk_id in self._accumulating:
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
        return tuple(out)

    def _gather(self, chunk: Chunk, async_op: bool) -> None:
        self._manager.gather(chunk, async_op)
        if chunk.holds_device_buffer and not self._layout[chunk.chunk_id].keep_gathered:
            self._resident[chunk.chunk_id] = None

    def _release(self, chunk: Chunk) -> None:
        self._manager.release(chunk)
        self._resident.pop(chunk.chunk_id, None)
        self._prefetched.discard(chunk.chunk_id)

    def _release_all(self) -> None:
        for chunk_id in list(self._resident):
            chunk = self._manager.chunk(chunk_id)
            if not chunk.in_use:
                self._release(chunk)

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

    def _wait_all(self) -> None:
        for chunk_id in list(self._resident):
            chunk = self._manager.chunk(chunk_id)
            if chunk.state is ChunkState.GATHERING:
                chunk.wait()

    def _start_prefetch(self, chunk_ids: Sequence[int], position: int) -> None:
        for chunk_id in chunk_ids:
            chunk = self._manager.chunk(chunk_id)
            if chunk.state is ChunkState.RELEASED:
                self._gather(chunk, async_op=True)
                self._stats.prefetches += 1
                self._prefetched.add(chunk_id)
        self.check_budget(f"prefetching {tuple(chunk_ids)} at position {position}")

    def _check_budget(self, needed: int, chunks: Sequence[Chunk], position: int) -> None:
        budget = self._policy.budget
        if budget is None or self._ledger.device_bytes + needed <= budget:
            return
        ledger = self._ledger
        held = [c.chunk_id for c in self._resident_chunks() if c.in_use]
        evictable = sum(r.release_bytes for r in self._resident_view() if not r.held and not r.fetching)
        minimum = ledger.device_bytes - evictable + needed
        parts = ", ".join(
            f"{kind.value} {format_bytes(ledger.bytes(Location.DEVICE, kind))}"
            for kind in MemoryKind
            if ledger.bytes(Location.DEVICE, kind)
        )
        raise BudgetExceededError(
            f"rank {self._rank}: device_budget={budget} ({format_bytes(budget)}) cannot fit the op at trace position "
            f"{position} on chunks {tuple(c.chunk_id for c in chunks)}: it needs {format_bytes(needed)} more while "
            f"{format_bytes(ledger.device_bytes)} are held ({parts}); chunks in use by ops still running {held} and "
            f"gradient buffers under no_sync cannot be evicted. A device_budget of at least {minimum} "
            f"({format_bytes(minimum)}) would run this op. Ops overlap when activation checkpointing recomputes a "
            "forward op inside a backward op, so both need their chunks at once."
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
            self._wait_all()
            self._release_all()
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

    # --- gradients --------------------------------------------------------------------------
    def _prepare_grad(self, chunk: Chunk) -> None:
        chunk.prepare_grad()
        self._accumulating[chunk.chunk_id] = None

    def _reduce(self, chunk: Chunk) -> None:
        chunk.reduce_grad()
        self._accumulating.pop(chunk.chunk_id, None)

    def _on_grad(self, param: torch.Tensor) -> None:
        info: TensorInfo = self._manager.info(param)
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        chunk = self._manager.chunk(info.chunk_id)
        if not chunk.has_grad_buffer:
            # Its buffer was flushed to make room after the op's backward: a fresh one is needed.
            position = self._cursor.position if self._cursor is not None else -1
            trace = self._cursor.trace if self._cursor is not None else None
            self._plan(position, Phase.BACKWARD, (chunk.chunk_id,), chunk.grad_buffer_bytes, trace)
            self._check_budget(chunk.grad_buffer_bytes, [chunk], position)
            self._prepare_grad(chunk)
        chunk.accumulate_grad(info, grad)
        if chunk.all_ready_for_reduce and (self._sync_grads or self._comm.world_size == 1):
            self._reduce(chunk)
