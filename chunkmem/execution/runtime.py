"""``ChunkRuntime``: the parameter-op hook bound to every managed parameter.

It turns hook calls into the calls of the objects that own each part, each in its own module:

* :class:`~chunkmem.execution.iteration.IterationTracker`: iterations, passes and the compute trace;
* :class:`~chunkmem.execution.executor.ResidencyExecutor`: what is on the device (``placement.DeviceResidency``)
  carried out around every op, gradients into flat buffers and their reductions, the budget;
* :class:`~chunkmem.ranks.rank_checks.RankChecks` and ``agree_backward``: ranks agree at every entry
  point, and at the end of each synchronised backward on the ops they ran and which parameters got
  gradients;
* :class:`~chunkmem.execution.profiling.NonModelProfile`: non-model memory, when the policy asks for it.

When nothing can move (one rank, every chunk served by its resident compute-dtype shard, gradients
added straight into the gradient shards, and a policy that measures nothing), the chunks are
gathered once at boost and the runtime does not observe ops: ops run as on plain parameters, with
only in-place writes refused, and gradients still arrive through the gradient hooks. Per-op hooks
would have nothing to do, yet cost Python time around every op and its backward.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Protocol

import torch

from chunkmem.hooks import ParamOpHook, bind, to_hooked, unbind, unhooked
from chunkmem.placement import ChunkSpec, ComputeTrace, Divergence, Phase, PlacementPolicy

from ..chunks.chunk import Chunk
from ..chunks.manager import ChunkManager
from ..chunks.tensor_state import TensorInfo, TensorState
from ..compat.torch import autograd_running
from ..errors import DiskTierError, NotSupportedError
from ..ranks.agreed_values import AgreedValues
from ..usage.accounting import Location, MemoryKind
from ..usage.stats import Stats
from .backward_agreement import agree_backward
from .executor import ResidencyExecutor
from .iteration import IterationTracker, Mode
from .profiling import NonModelProfile
from .read_agreement import agree_reads

__all__ = ["ChunkRuntime", "EarlyStepListener"]

log = logging.getLogger("chunkmem")


class EarlyStepListener(Protocol):
    """What the runtime tells the optimizer about early host steps (``chunkmem.optim.early_steps``)."""

    def gradient_final(self, chunk: Chunk) -> None:
        """``chunk``'s gradient of this iteration is final and on its way to the host."""
        ...

    def cancel_early_steps(self) -> None:
        """Put back any early step: something else is about to see masters or state."""
        ...


class ChunkRuntime(ParamOpHook):
    """The hook bound to every managed parameter; see the module docstring."""

    def __init__(
        self,
        manager: ChunkManager,
        policy: PlacementPolicy,
        specs: Sequence[ChunkSpec],
        stats: Stats,
    ) -> None:
        self._manager = manager
        self._policy = policy
        self._specs = tuple(specs)
        self._stats = stats
        self._comm = manager.comm
        self._ledger = manager.ledger
        self._rank = self._comm.rank
        self._tracker = IterationTracker(self._report)
        self._checks = self._comm.checks
        if self._checks is not None:
            self._checks.follow(self._tracker.where, lambda: self._tracker.recording)
        check = self._checks if self._checks is not None and self._checks.check_plans else None
        self._executor = ResidencyExecutor(manager, policy, specs, stats, check)
        self._profile = NonModelProfile(policy, self._comm, self._ledger)
        residency = self._executor.residency
        self._resident = (
            self._comm.world_size == 1
            and all(residency.gather_bytes(c) == 0 and residency.grad_buffer_bytes(c) == 0 for c in range(len(specs)))
            and not policy.needs_profile(None)
        )
        if self._resident:
            self._executor.keep_served()
        self._early: EarlyStepListener | None = None
        self._stepped_last = False  # the last training iteration ended in an optimizer step
        self._holders = 0  # boosted models served (``held_by``)
        params = [info.param for info in manager.infos]
        to_hooked(params)
        bind(params, self)
        self._grad_hooks = [
            info.param.register_post_accumulate_grad_hook(self._on_grad) for info in manager.infos if info.trainable
        ]

    def held_by(self, module: torch.nn.Module) -> None:
        """``module`` is one of the models whose parameters this runtime serves (several share one
        runtime under one budget): when the last of them is collected, the runtime ``detach``es."""
        self._holders += 1
        weakref.finalize(module, self._let_go)

    def _let_go(self) -> None:
        self._holders -= 1
        if self._holders == 0:
            self.detach()

    def detach(self) -> None:
        """Unbind from the parameters (when the boosted models are collected): the hook table holds
        the runtime for every parameter bound to it, and the runtime holds the parameters, so
        nothing would ever free them otherwise."""
        unbind([info.param for info in self._manager.infos], self)
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []

    # --- early host steps -------------------------------------------------------------------
    def listen_for_final_gradients(self, listener: EarlyStepListener) -> None:
        """Tell ``listener`` of each chunk with a host master whose gradient of the iteration is
        final and on its way to the host, when the iteration is expected to end in an optimizer
        step (see ``chunkmem.optim.early_steps``); and before anything reads or writes masters and
        optimizer state other than that step."""
        self._early = listener
        self._executor.on_start(self._reduction_started)

    def _reduction_started(self, chunk: Chunk) -> None:
        """A chunk's reduction is queued. Its gradient is final for the iteration when the
        iteration follows the recorded trace and no op after this one uses the chunk, in an
        iteration like the last one, which ended in a step."""
        listener = self._early
        trace = self._tracker.trace
        if (
            listener is None
            or trace is None
            or not self._stepped_last
            or self._tracker.mode is not Mode.BACKWARD
            or chunk.store.master_location is not Location.HOST
            or trace.next_use(chunk.chunk_id, self._tracker.position) is not None
        ):
            return
        if not chunk.store.receives_asynchronously:
            self._executor.finish_reduction(chunk)  # the worker reads the shard: it must be there
        listener.gradient_final(chunk)

    def grads_reduced(self, chunk_id: int) -> bool:
        """The chunk's gradient shard holds reduced gradients since the last ``zero_grad`` (after
        ``prepare_step`` every gradient is reduced; the device residency knows which chunks got any)."""
        return self._executor.residency.grads_reduced(chunk_id)

    def cancel_early_steps(self) -> None:
        """Something other than the optimizer step is about to read or change masters, optimizer
        state or gradients (a forward, zero_grad, a load, a state dict): put early steps back."""
        if self._early is not None:
            self._early.cancel_early_steps()

    def enter_state_access(self, what: str) -> None:
        """Before reading masters or optimizer state (state dicts, checkpoints, plain copies): the
        ranks agree (``agree_entry``) and early steps are put back."""
        self.agree_entry(what)
        self.cancel_early_steps()

    # --- public state -----------------------------------------------------------------------
    @property
    def policy(self) -> PlacementPolicy:
        return self._policy

    @property
    def specs(self) -> tuple[ChunkSpec, ...]:
        """The chunks as the placement sees them (what the layout was decided for)."""
        return self._specs

    def record_actions(self) -> Any:
        """A context manager collecting every residency action carried out in it (``ResidencyExecutor``)."""
        return self._executor.record_actions()

    @property
    def trace(self) -> ComputeTrace | None:
        """The most recently frozen training trace."""
        return self._tracker.last_training_trace

    @property
    def in_backward(self) -> bool:
        """A backward is running (ops or gradients of it have been seen and it has not finished)."""
        return self._tracker.mode is Mode.BACKWARD

    @property
    def tracker(self) -> IterationTracker:
        return self._tracker

    @property
    def observes_ops(self) -> bool:
        """False when nothing can move (module docstring): no trace is recorded then."""
        return not self._resident

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally; no gradient collective until the block exits. Where the
        device cannot hold every chunk's gradient buffer, buffers move to the host to make room
        (accumulated there in fp32) and are added back at the reduction."""
        with self._executor.no_sync():
            yield

    @property
    def stats_counters(self) -> Stats:
        """The live counters (the optimizer adds to them)."""
        return self._stats

    def stats(self) -> Stats:
        """A snapshot of the counters, with the ledger's current and peak bytes."""
        self._manager.transfers.settle()
        self._stats.device_bytes = self._ledger.device_bytes
        self._stats.host_bytes = self._ledger.host_bytes
        self._stats.peak_device_bytes = self._ledger.peak_device_bytes
        self._stats.peak_host_bytes = self._ledger.peak_host_bytes
        self._stats.disk_bytes = self._ledger.disk_bytes
        self._stats.quantized_bytes = sum(self._ledger.bytes(where, MemoryKind.QUANTIZED) for where in Location)
        self._stats.kv_cache_bytes = self._ledger.bytes(Location.DEVICE, MemoryKind.KV_CACHE)
        return self._stats.snapshot()

    # --- iterations -------------------------------------------------------------------------
    def agree_entry(self, name: str, detail: str = "", values: AgreedValues | None = None) -> None:
        """Before an entry point that issues collectives (forward, backward, optimizer step,
        gradient clipping, state dict, checkpoint): every rank must be at the same one, holding the
        same ``values`` (see ``RankChecks``)."""
        if self._checks is not None:
            self._checks.entry(name, detail, values=values)

    def _sync_detail(self) -> str:
        """Whether gradients are reduced (outside ``no_sync``): a backward inside ``no_sync`` on
        one rank only would leave the others waiting in its reductions."""
        return "" if self._executor.residency.can_reduce else ", no_sync"

    def begin_forward(self, in_step: bool = False, decoding: bool = False) -> None:
        """Called by the model wrapper when its forward starts. ``in_step``: the forward belongs
        to the training step even with grad disabled (a frozen model's, beside the trained one in
        training mode): it joins the step's iteration and trace rather than being one of its own.
        ``decoding``: an inference forward that is a decode step of ``generate`` (see
        ``IterationTracker``): it follows the decode trace, whose end leads into the next step."""
        self.cancel_early_steps()
        grad_enabled = torch.is_grad_enabled()
        in_step = in_step or grad_enabled
        if self._checks is not None:
            detail = f"grad enabled{self._sync_detail()}" if grad_enabled else "grad disabled"
            if in_step and not grad_enabled:
                detail += ", in the training step"
            if decoding and not in_step:
                detail += ", a decode step"
            self._checks.entry("forward", detail, self._tracker.next_forward(in_step))
        if self._tracker.mode is Mode.BACKWARD:
            self.finish_backward()
        self._check_requires_grad()
        if self._tracker.begin_forward(in_step, decoding):
            self._executor.begin_iteration()
            if in_step:
                self._comm.note_divergence(None)
                self._profile.start(self._tracker.last_training_trace)

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
        return self._profile.context() if self._tracker.training else nullcontext()

    def end_forward(self) -> None:
        """Called by the model wrapper when its forward returns: an inference forward is a whole
        iteration, after which what was running before it goes on."""
        if self._tracker.end_forward():
            self._executor.begin_iteration()

    def end_decoding(self) -> None:
        """``generate`` returned (or failed): the decode steps' last prefetches, of a next step that
        will not run, land and every idle gathered chunk is released (on every rank alike: the
        ranks decode in step)."""
        self._executor.wait_all()
        self._executor.release_all()

    def finish_backward(self) -> None:
        """After ``loss.backward()`` returns: reduce what is left and agree across ranks. The
        iteration goes on until the optimizer step."""
        if self._tracker.mode is not Mode.BACKWARD:
            return
        self._executor.end_backward()
        if self._executor.residency.can_reduce and self._comm.world_size > 1:
            self._agree_across_ranks()
        self._tracker.end_backward()

    def prepare_step(self) -> None:
        """Before the optimizer reads gradients: finish the backward, reduce buffers still pending
        (the last backward ran under ``no_sync``), and release gathered chunks: the step makes
        them stale, and its optimizer state needs the room the placement reserved for it. The
        caller has agreed the entry (a step, or a gradient clipping) with the other ranks."""
        self.finish_backward()
        if self._executor.residency.unreduced:
            self._executor.reduce_all()
            if self._comm.world_size > 1:
                self._agree_across_ranks()
        self._manager.failures.refuse_step()  # a read failed on some rank: these gradients are not the model's
        self._executor.wait_all()
        self._executor.release_all()

    def zero_grad(self) -> None:
        """Drop gradients. After a backward without an optimizer step this also ends the
        iteration (a zero_grad between a forward and its backward does not)."""
        self.cancel_early_steps()
        self._executor.zero_grads()
        self._manager.failures.end_iteration()
        if self._tracker.mode is Mode.IDLE:
            if self._end_training_iteration():
                self._stepped_last = False
            self.reset_states()

    def after_step(self) -> None:
        """The optimizer updated the master shards: the iteration ends; chunks kept gathered are
        refreshed, others released."""
        self.finish_backward()
        self._executor.wait_all()
        self._stepped_last = self._end_training_iteration() or self._stepped_last
        self._executor.masters_changed(by_step=True)
        self.reset_states()

    def masters_loaded(self) -> None:
        """The masters were written by a load: gathered chunks are filled again (every rank
        refreshes the same chunks, whatever it loaded)."""
        self._executor.masters_changed(by_step=False)

    def reset_states(self) -> None:
        """Every parameter back to HOLD (between iterations)."""
        for chunk in self._manager.chunks:
            chunk.reset_states()

    def _end_training_iteration(self) -> bool:
        """Close the training iteration, if one runs; returns whether one did."""
        training = self._tracker.training
        frozen = self._tracker.end_training_iteration()
        if frozen is not None:
            self._stats.trace_recordings += 1
        self._profile.finish(self._tracker.last_training_trace)
        return training

    def _agree_across_ranks(self) -> None:
        try:
            agree_backward(self._comm, self._tracker.digest, self._manager.chunks, self._manager.failures)
        except DiskTierError:
            self.cancel_early_steps()  # they stepped on gradients of values a rank never read
            self._tracker.end_backward()  # over on every rank; its step is refused until zero_grad
            raise

    def agree_reads(self) -> None:
        """A forward returned on this rank, or a state dict was gathered: with several ranks, where
        some read what gathers read from disk, they agree that no read failed (``read_agreement``)
        before its values are used."""
        if self._comm.world_size > 1 and self._manager.some_rank_reads_from_disk:
            agree_reads(self._comm, self._manager.failures)

    def _report(self, divergence: Divergence) -> None:
        self.cancel_early_steps()  # they trusted the trace this iteration has left
        self._stats.divergences += 1
        self._comm.note_divergence(divergence.describe())
        if self._checks is not None:
            self._checks.diverged(divergence.describe())
        self._executor.wait_all()
        log.warning(
            "chunkmem: rank %d: this iteration departed from the recorded compute trace %s; prefetch is off "
            "for the rest of it and the trace is being recorded again",
            self._rank,
            divergence.describe(),
        )

    # --- the hook ---------------------------------------------------------------------------
    def pre_op(self, params: Sequence[torch.Tensor]) -> None:
        """Make the op's chunks resident."""
        self._before(params, Phase.FORWARD)

    def post_op(self, params: Sequence[torch.Tensor]) -> None:
        """The op is done with its parameters; release what the policy says."""
        target = TensorState.HOLD_AFTER_FWD if torch.is_grad_enabled() else TensorState.HOLD
        self._after(params, Phase.FORWARD, target)

    def pre_backward(self, params: Sequence[torch.Tensor]) -> None:
        """Make the chunks the op's backward reads resident, with gradient buffers."""
        self._enter_backward()
        self._before(params, Phase.BACKWARD)

    def _enter_backward(self) -> None:
        """A backward reached managed parameters (an op's backward, or without op hooks the first
        gradient): refuse double backward, and mark the backward begun."""
        if torch.is_grad_enabled():
            raise NotImplementedError(
                f"rank {self._rank}: backward with create_graph=True (double backward, e.g. a gradient penalty) is "
                "not supported: the second-order graph reads parameters long after their chunks are released. "
                "Compute the penalty without create_graph, or train that model without chunkmem."
            )
        mode = self._tracker.mode
        if mode is Mode.BACKWARD:
            return
        if mode is Mode.FORWARD:
            self.agree_entry("backward", self._sync_detail().removeprefix(", "))
        self._tracker.begin_backward()

    def post_backward(self, params: Sequence[torch.Tensor]) -> None:
        """The op's backward is done with its parameters."""
        self._after(params, Phase.BACKWARD, TensorState.HOLD_AFTER_BWD)

    def mutating_op(self, params: Sequence[torch.Tensor], op_name: str) -> None:
        """Refuse: the master shard is the source of truth, an in-place write would be lost."""
        names = [self._manager.info(p).name for p in params]
        where = f"rank {self._rank}: " if self._comm.world_size > 1 else ""
        raise NotSupportedError(
            f"{where}in-place op '{op_name}' on managed parameter(s) {names} would be lost: chunkmem keeps each "
            "parameter's fp32 master shard as the source of truth and rebuilds the parameter from it. Change "
            "parameters through the optimizer booster.boost returned (build the optimizer from the model before "
            "boosting and pass it to booster.boost), or with model.load_state_dict()."
        )

    def traced_op(self, params: Sequence[torch.Tensor]) -> None:
        """Refuse a compiler's trace, whether or not ops are observed: a graph would skip the
        gathers, releases and gradient reductions of every later step."""
        names = [self._manager.info(p).name for p in params]
        raise NotSupportedError(
            f"rank {self._rank}: torch.compile is tracing an op on managed parameters {names}: chunkmem gathers "
            "chunks in Python hooks that a compiled graph cannot contain (tracing would issue real collectives on "
            "fake tensors). Run the boosted model eagerly, or compile its repeated blocks with "
            "ChunkPlugin(compile=CompileBlocks(...)), where the hooks run eagerly at each block's boundaries (a "
            "compiled block may read only its own parameters)."
        )

    def _before(self, params: Sequence[torch.Tensor], phase: Phase) -> None:
        infos = [self._manager.info(p) for p in params]
        chunk_ids = tuple(dict.fromkeys(info.chunk_id for info in infos))
        recompute = phase is Phase.FORWARD and _in_backward()
        if self._tracker.kind is None:
            self.cancel_early_steps()
        if self._checks is not None and self._tracker.kind is None:
            # Outside any forward of the boosted model (a submodule called directly): nothing
            # else tells the ranks that they do the same, so every such op is agreed.
            self._checks.entry("an op on managed parameters outside the boosted model's forward", f"{chunk_ids}")
        position = self._tracker.observe(phase, chunk_ids, recompute)
        if self._checks is not None and self._checks.alarmed:
            self._checks.poll()
        self._executor.before_op(infos, chunk_ids, position, phase, self._tracker.trace)
        if self._tracker.training:
            self._profile.sample()

    def _after(self, params: Sequence[torch.Tensor], phase: Phase, target: TensorState) -> None:
        infos = [self._manager.info(p) for p in params]
        chunk_ids = tuple(dict.fromkeys(info.chunk_id for info in infos))
        op = self._tracker.close()
        self._executor.after_op(
            infos, chunk_ids, target, self._tracker.position, phase, _in_backward(), self._tracker.trace, op
        )

    # --- budget and transient buffers -------------------------------------------------------
    def check_budget(self, what: str) -> None:
        """Raise if accounted device memory is over the budget after ``what`` allocated."""
        self._executor.check_budget(what)

    def transient_room(self, nbytes: int) -> int | None:
        """Device bytes free for a temporary buffer wanting ``nbytes`` (see ``ResidencyExecutor``)."""
        return self._executor.transient_room(nbytes)

    def transient(self, nbytes: int, what: str, kind: MemoryKind = MemoryKind.TRANSIENT) -> Any:
        """Account a temporary device buffer used outside training steps, of ``kind`` (see
        ``ResidencyExecutor``)."""
        return self._executor.transient(nbytes, what, kind)

    # --- gradients --------------------------------------------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        info: TensorInfo = self._manager.info(param)
        with unhooked():
            grad = param.grad
            param.grad = None
        if grad is None:
            return
        if self._resident:
            self._enter_backward()
        chunk = self._manager.chunk(info.chunk_id)
        self._executor.accumulate(chunk, info, grad, self._tracker.position, self._tracker.trace)


def _in_backward() -> bool:
    """The autograd engine is running (a forward op now is a recomputation)."""
    return autograd_running()
