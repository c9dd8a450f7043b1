"""``ChunkOptimizer``: the user's own torch optimizer, re-pointed at this rank's fp32 master pieces.

Each parameter is represented by the piece of it that falls in this rank's shard of its chunk (a
view of the master shard, on the host or the device as the placement says), in the user's own
param group, so hyperparameters, LR schedulers and per-group settings keep working. Gradients are
views of the chunk's reduced gradient shard. A parameter that received no gradient on any rank has
no gradient, so the optimizer skips it, as plain PyTorch does.

``ChunkOptimizer`` is a ``torch.optim.Optimizer``: every LR scheduler accepts it, its
``param_groups`` are the user's optimizer's own group dicts (edits take effect at the next step), and
``state_dict`` / ``load_state_dict`` speak plain PyTorch's format with full parameter shapes (see
``chunkmem.optim.state_dict``). The optimizer object the user passed to ``boost`` keeps
doing the stepping inside it; called directly after boosting it refuses to step or to save, since
its parameters are now the pieces.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..accounting import Location, MemoryKind
from ..agreed_values import hyperparameters
from ..agreement import agree
from ..chunk import Chunk, GradState
from ..chunk_layout import ShardPiece
from ..comm import Communicator
from ..disk import SidesFile
from ..errors import DiskTierError, NotSupportedError, StateDictMismatchError, UnscaledBackwardError
from ..gather import Destination
from ..grad_markers import clear_markers
from ..grad_norm import flat_norm
from ..grad_on_disk import GradOnDisk
from ..manager import ChunkManager
from ..progress import TrainingProgress
from ..runtime import ChunkRuntime
from ..tensor_state import TensorInfo
from .disk_sides import DiskSides
from .early_steps import EarlySteps, group_settings, same_settings
from .host_kernels import HostKernels
from .loss_scale import DynamicLossScaler
from .probe import StateSize, check_elementwise, optimizer_state_size
from .runs import Run, StepRuns
from .state_dict import full_optimizer_state, slice_state, stage_optimizer_state
from .step_config import StepAfterBackward, StepDuringBackward

__all__ = ["ChunkOptimizer", "Piece", "StateSize", "check_elementwise", "optimizer_state_size"]

log = logging.getLogger("chunkmem")


@dataclass(frozen=True)
class Piece:
    """The part of one parameter in this rank's shard of its chunk."""

    tensor: torch.Tensor
    """View of the master shard: what the inner optimizer steps."""
    chunk: Chunk
    info: TensorInfo
    part: ShardPiece
    """Which elements of the flattened parameter it holds, and where they sit in the shard."""

    @property
    def shard_slice(self) -> slice:
        """Where the piece sits in this rank's shard of the chunk."""
        return self.part.shard

    @property
    def param_slice(self) -> slice:
        """The elements of the flattened parameter it holds."""
        return self.part.param


class _OriginalGuard:
    """Hooks on the optimizer object the user passed to ``boost``. chunkmem steps that object on
    the pieces from inside ``ChunkOptimizer``; used directly after boosting it would step pieces
    without gradients and silently do nothing, or save piece-shaped state. So it refuses, unless
    ``ChunkOptimizer`` is the caller."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._name = type(optimizer).__name__
        self._inside = 0
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._refuse("step()"))
        optimizer.register_state_dict_pre_hook(lambda opt: self._refuse("state_dict()"))
        optimizer.register_load_state_dict_pre_hook(lambda opt, state: self._refuse("load_state_dict()"))

    @contextmanager
    def inside(self) -> Iterator[None]:
        """chunkmem itself is calling the optimizer."""
        self._inside += 1
        try:
            yield
        finally:
            self._inside -= 1

    def _refuse(self, verb: str) -> None:
        if self._inside:
            return
        raise NotSupportedError(
            f"{verb} on the {self._name} object that was passed to booster.boost: after boosting, that object "
            "steps this rank's shards of the parameters for chunkmem and must not be used directly. Call "
            f"{verb.split('(')[0]}() on the optimizer booster.boost returned (a torch.optim.Optimizer too)."
        )


class ChunkOptimizer(torch.optim.Optimizer):
    """What ``Booster.boost`` returns for the optimizer (module docstring). Beyond the
    ``torch.optim.Optimizer`` interface: ``clip_grad_norm``, ``backward`` (fp16 loss scaling) and
    ``loss_scale``."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        runtime: ChunkRuntime,
        manager: ChunkManager,
        progress: TrainingProgress,
        scaler: DynamicLossScaler | None,
        state_size: StateSize | None = None,
        host_step: StepAfterBackward | StepDuringBackward | None = None,
        disk: tuple[SidesFile, Sequence[Chunk]] | None = None,
    ) -> None:
        if isinstance(optimizer, ChunkOptimizer):
            raise ValueError("this optimizer is already boosted")
        self._built = False
        self._optim = optimizer
        self._runtime = runtime
        self._manager = manager
        self._progress = progress
        self._scaler = scaler
        self._unscaled = False
        self._found_inf = False
        self._scaled_backward = False
        self._unscaled_backward = False
        self._accounted: Counter[Location] = Counter()
        self._accounted_for: tuple[int, int, int] | None = None  # what _account_state measured last
        self._state_size = state_size if state_size is not None else optimizer_state_size(optimizer)
        self._stateful: set[int] = set()  # ids of the TensorInfos whose optimizer state exists (on some rank)
        self._pieces: list[Piece] = []
        # Each group's original parameters, in order: what a full (PyTorch-format) state dict indexes.
        self._group_infos: list[tuple[TensorInfo, ...]] = []
        self._guard = _OriginalGuard(optimizer)
        self._runs = StepRuns(lambda: self._optim.state)
        self._early: EarlySteps | None = None
        self._kernels = HostKernels(type(optimizer), manager.comm.device)
        existing = dict(optimizer.state)
        resharded: dict[torch.Tensor, dict[str, Any]] = {}
        for group in optimizer.param_groups:
            infos, pieces = self._cut(group["params"])
            self._group_infos.append(infos)
            self._pieces.extend(pieces)
            for piece in pieces:
                if piece.info.param in existing:
                    resharded[piece.tensor] = slice_state(existing[piece.info.param], piece)
            self._stateful.update(id(info) for info in infos if existing.get(info.param))
            group["params"] = self._runs.add_group(pieces)
        self._disk: DiskSides | None = None
        if disk is not None:
            file, chunks = disk
            self._disk = DiskSides(
                file,
                chunks,
                lambda chunk: self._state_size.reserved(chunk.shard_numel, len(chunk.tensors)),
                self._runs,
                lambda: self._optim.state,
                manager.ledger,
            )
            self._runs.read_from_disk(self._disk.view_of)
        self._probe_host_kernels()
        # torch's own bookkeeping (hook tables, step profiling), then share the user's groups and state.
        super().__init__([{"params": []}], optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._built = True
        if resharded:  # the user loaded a state before boosting
            self.load_local_state(resharded)
        if isinstance(host_step, StepDuringBackward):
            self._early = EarlySteps(
                int(host_step.backup_budget),
                self._runs,
                lambda: self._optim.state,
                lambda: self._optim.param_groups,
                self._step_runs,
                lambda: None if self._scaler is None else 1.0 / self._scaler.scale,
                lambda: runtime.in_backward,
                runtime.stats_counters,
            )
            runtime.listen_for_final_gradients(self)
        self._grad_hooks = []
        if scaler is not None:
            self._grad_hooks = [
                info.param.register_post_accumulate_grad_hook(self._note_gradient)
                for info in manager.infos
                if info.trainable
            ]

    def _cut(self, params: Iterable[torch.Tensor]) -> tuple[tuple[TensorInfo, ...], list[Piece]]:
        manager = self._manager
        infos: list[TensorInfo] = []
        pieces: list[Piece] = []
        for p in params:
            if not isinstance(p, torch.Tensor) or not manager.manages(p):
                shape = tuple(p.shape) if isinstance(p, torch.Tensor) else type(p).__name__
                raise NotSupportedError(
                    f"parameter {shape} is not part of the boosted model: chunkmem can only optimize parameters "
                    "that were in the model when it was boosted (they live in its chunks). Build the optimizer "
                    "over model.parameters() before boosting."
                )
            info = manager.info(p)
            infos.append(info)
            if not info.trainable:
                continue
            chunk = manager.chunk(info.chunk_id)
            part = chunk.piece(info)
            if part is not None:
                pieces.append(Piece(chunk.store.master_slice(part.shard.start, part.shard.stop), chunk, info, part))
        return tuple(infos), pieces

    # --- what checkpoints read --------------------------------------------------------------
    @property
    def runtime(self) -> ChunkRuntime:
        return self._runtime

    @property
    def progress(self) -> TrainingProgress:
        """The model's training progress, which each step advances."""
        return self._progress

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """This rank's pieces of every parameter the optimizer updates."""
        return tuple(self._pieces)

    def piece_state(self, piece: Piece) -> dict[str, Any]:
        """The optimizer state of one of this rank's pieces (views of what the optimizer keeps for
        the run it belongs to; empty when it has none yet)."""
        return self._runs.piece_state(piece)

    @property
    def group_infos(self) -> tuple[tuple[TensorInfo, ...], ...]:
        """Per param group, its original parameters in order (PyTorch-format ids count these)."""
        return tuple(self._group_infos)

    @property
    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        """The class of the user's optimizer, which does the stepping."""
        return type(self._optim)

    @property
    def loss_scaler(self) -> DynamicLossScaler | None:
        """The fp16 loss scaler (``None`` for fp32 and bf16)."""
        return self._scaler

    @property
    def communicator(self) -> Communicator:
        """The group the model's chunks are sharded over."""
        return self._manager.comm

    @property
    def manager(self) -> ChunkManager:
        """The chunks of the boosted model this optimizer steps."""
        return self._manager

    @property
    def loss_scale(self) -> float:
        return self._scaler.scale if self._scaler is not None else 1.0

    # --- the torch.optim.Optimizer interface ------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group over parameters of the boosted model that the optimizer does not hold yet
        (parameters from elsewhere are refused: they are in no chunk)."""
        if not self._built:  # torch's constructor, registering the placeholder group
            super().add_param_group(param_group)
            return
        self.cancel_early_steps()
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        infos, pieces = self._cut(params)
        held = {id(info) for group in self._group_infos for info in group}
        if any(id(info) in held for info in infos) or len({id(i) for i in infos}) != len(infos):
            raise ValueError("some parameters appear in more than one parameter group")
        with self._guard.inside():
            self._optim.add_param_group({**param_group, "params": [piece.tensor for piece in pieces]})
        try:
            check_elementwise(self._optim)
        except ValueError:
            self._optim.param_groups.pop()
            raise
        self._optim.param_groups[-1]["params"] = self._runs.add_group(pieces)
        self._group_infos.append(infos)
        self._pieces.extend(pieces)
        self._probe_host_kernels()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (buffers, shards and the record of which parameters had one)."""
        self._runtime.zero_grad()
        if set_to_none:
            clear_markers(info.param for info in self._manager.infos)
        self._unscaled = False
        self._found_inf = False
        self._unscaled_backward = False

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Reduce what is pending, unscale and check fp16 gradients (skipping the step on inf/nan
        on any rank), run the user's optimizer on this rank's master pieces, then refresh or
        release the gathered chunks. A ``closure`` runs forward and backward first, as in torch."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_groups()
        agreed = hyperparameters(self._optim.param_groups) if self.communicator.checks is not None else None
        self._runtime.agree_entry("optimizer step", values=agreed)
        self._prepare_grads()
        stats = self._runtime.stats_counters
        disk_failure: DiskTierError | None = None
        if self._found_inf:
            self.cancel_early_steps()
            stats.skipped_steps += 1
            log.info("chunkmem: inf/nan gradients at loss scale %s; step skipped", self.loss_scale)
        else:
            done = self._keep_early_steps()
            # Which chunks have gradients and for which parameters; each shard is read when its
            # runs are stepped (one on disk is only in memory then).
            reduced = {
                chunk.chunk_id: (chunk, chunk.params_with_grad)
                for chunk in self._manager.chunks
                if chunk.trainable and chunk.grad_state is GradState.REDUCED
            }
            has_grad: dict[int, bool] = {}
            for piece in self._pieces:
                entry = reduced.get(piece.chunk.chunk_id)
                has_grad[id(piece.tensor)] = entry is not None and entry[1][piece.info.index]
            # Chunks on disk are cut when they are in memory, in the disk pipeline.
            self._runs.split_by_gradient(has_grad, only=lambda chunk: not self._on_disk(chunk))
            # Which parameters get state is agreed (a gradient on any rank), so every rank
            # accounts the same chunks.
            for chunk_id, (_, flags) in reduced.items():
                tensors = self._manager.chunk(chunk_id).tensors
                self._stateful.update(id(info) for info in tensors if flags[info.index])
            self._manager.prepare_master_writes()
            stepped = [
                run
                for run in self._runs.runs()
                if has_grad[id(run.pieces[0].tensor)]
                and run.chunk.chunk_id not in done
                and not self._on_disk(run.chunk)
            ]
            self._step_with_grads(stepped, reduced)
            if self._disk is not None:
                disk_failure = self._step_from_disk(has_grad, reduced)
            self._account_state()
            self._runtime.check_budget(f"{type(self._optim).__name__}.step creating its state")
            stats.optimizer_steps += 1
        self._progress.advance()
        if self._scaler is not None:
            self._scaler.update(self._found_inf)
        self._unscaled = False
        self._found_inf = False
        self._runtime.after_step()
        if disk_failure is not None:  # raised once the step is finished (README, "the disk tier")
            raise disk_failure
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The full state in plain PyTorch's format (full parameter shapes, ids counting the
        original parameters group by group), on every rank's CPU; with fp16, the loss scaler under
        ``"loss_scaler"``. A collective: call it on every rank. ``booster.save_optimizer`` writes
        the same content but gathers it on rank 0 only."""
        return full_optimizer_state(self, Destination.EVERY_RANK)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state in plain PyTorch's format (from ``state_dict``, ``booster.save_optimizer``
        or a plain PyTorch optimizer of the same class over the same model). Everything is checked
        on every rank before anything changes; a refused state leaves the optimizer as it was. A
        collective: call it on every rank."""
        staged = agree(
            self.communicator,
            "loading the optimizer state",
            lambda: stage_optimizer_state(self, state_dict, "the state dict"),
            StateDictMismatchError,
            "from the state dict",
        )
        staged.install(self)

    def load_local_state(
        self,
        states: Mapping[torch.Tensor, Mapping[str, Any]],
        hyperparameters: Sequence[Mapping[str, Any]] | None = None,
        scaler_state: Mapping[str, Any] | None = None,
        stateful: Sequence[TensorInfo] | None = None,
    ) -> None:
        """Install per-piece state (keyed by ``Piece.tensor``) and, optionally, each group's
        hyperparameters and the loss scaler's state, replacing what was there. Goes through the
        optimizer's own ``load_state_dict``, which puts each value on the device and dtype its class
        expects. The caller has validated everything (``chunkmem.optim.state_dict``)."""
        self.cancel_early_steps()
        run_states, on_disk = self._runs.regroup({id(t): s for t, s in states.items()}, later=self._on_disk)
        index: dict[int, int] = {}
        groups = []
        for position, group in enumerate(self._optim.param_groups):
            group["params"] = self._runs.tensors(position)
            ids = []
            for tensor in group["params"]:
                index[id(tensor)] = len(index)
                ids.append(index[id(tensor)])
            settings = hyperparameters[position] if hyperparameters is not None else group
            groups.append({**{k: v for k, v in settings.items() if k != "params"}, "params": ids})
        with self._guard.inside():
            self._optim.load_state_dict(
                {"state": {index[id(t)]: s for t, s in run_states.items()}, "param_groups": groups}
            )
        # torch's load_state_dict replaces the group list and the state table: share the new ones.
        self.param_groups = self._optim.param_groups
        self.state = self._optim.state
        if self._scaler is not None and scaler_state is not None:
            self._scaler.load_state_dict(dict(scaler_state))
        if stateful is not None:  # the parameters with state in the full state (the same on every rank)
            self._stateful = {id(info) for info in stateful}
        if self._disk is not None:
            self._disk.install(on_disk)
        self._account_state()

    def _probe_host_kernels(self) -> None:
        """Decide the host kernel of every group with host runs now, not in the first step."""
        for position, group in enumerate(self._optim.param_groups):
            if any(run.location is Location.HOST for run in self._runs.groups[position]):
                self._kernels.fuse(group)

    def _step_runs(self, runs: Sequence[Run]) -> None:
        """Run the user's optimizer over ``runs`` (their gradients set): the runs whose master is
        on the device in one call, those on the host in another, each param group holding only
        its runs of that call. A group whose kernel the user left to PyTorch steps its host runs
        with the fastest CPU kernel (``HostKernels``); a single host tensor in a call would turn
        PyTorch's default for the device runs into its per-tensor loop, hence the two calls."""
        groups = self._optim.param_groups
        kept = [(group["params"], group.get("fused")) for group in groups]
        try:
            for location in (Location.DEVICE, Location.HOST):
                subsets: list[list[torch.Tensor]] = [[] for _ in groups]
                for run in runs:
                    if run.location is location:
                        subsets[run.group].append(run.tensor)
                # With nothing to step the optimizer is still called once, as plain PyTorch's
                # would be (LR schedulers and step hooks see the call).
                if not any(subsets) and (runs or location is Location.HOST):
                    continue
                for group, subset, (_, fused) in zip(groups, subsets, kept, strict=True):
                    group["params"] = subset
                    if "fused" in group:
                        group["fused"] = fused
                    if location is Location.HOST and subset and self._kernels.fuse(group):
                        group["fused"] = True
                begin = time.perf_counter()
                with self._guard.inside():
                    self._optim.step()
                if location is Location.HOST and threading.current_thread() is threading.main_thread():
                    self._runtime.stats_counters.host_step_seconds += time.perf_counter() - begin
        finally:
            for position, (group, (_, fused)) in enumerate(zip(groups, kept, strict=True)):
                group["params"] = self._runs.tensors(position)
                if "fused" in group:
                    group["fused"] = fused

    # --- beyond torch.optim.Optimizer -------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Backward with loss scaling (fp16), then finish the gradient reduction."""
        if self._scaler is not None:
            loss = loss * self._scaler.scale
        self._scaled_backward = True
        try:
            loss.backward()
        finally:
            self._scaled_backward = False
        self._runtime.finish_backward()

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm over all ranks to ``max_norm`` (like
        ``torch.nn.utils.clip_grad_norm_``) and return the norm before clipping. A collective:
        call it on every rank (to log the norm on one rank, log what every rank returns)."""
        norm_type = float(norm_type)
        self._runtime.agree_entry("clip_grad_norm", f"max_norm {float(max_norm)!r}, norm_type {norm_type!r}")
        self._prepare_grads()
        grads = self._reduced_grads()  # in chunk order: the sum below adds in the same order anywhere
        comm = self._manager.comm

        def norm_of(grad: torch.Tensor | GradOnDisk) -> float:
            return grad.norm(norm_type) if isinstance(grad, GradOnDisk) else flat_norm(grad, norm_type)

        if norm_type == float("inf"):
            local = max((norm_of(g) for g in grads), default=0.0)
            total = torch.tensor([local], dtype=torch.float64, device=comm.tensor_device)
            comm.all_reduce(total, dist.ReduceOp.MAX)
            norm = total[0]
        else:
            local = sum(norm_of(g) ** norm_type for g in grads)
            total = torch.tensor([local], dtype=torch.float64, device=comm.tensor_device)
            comm.all_reduce(total)
            norm = total[0] ** (1.0 / norm_type)
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            self.cancel_early_steps()  # they stepped on the gradients before clipping
            for g in grads:
                if isinstance(g, GradOnDisk):
                    g.scale(coef)
                else:
                    g.mul_(coef)
        return norm.to(torch.float32)

    # --- internals --------------------------------------------------------------------------
    def _note_gradient(self, param: torch.Tensor) -> None:
        if not self._scaled_backward:
            self._unscaled_backward = True

    def _check_groups(self) -> None:
        groups = self._optim.param_groups
        if len(groups) != len(self._group_infos):
            raise NotSupportedError(
                f"the optimizer has {len(groups)} param groups but chunkmem built {len(self._group_infos)}: a group "
                f"was added to the {type(self._optim).__name__} object passed to booster.boost (or to param_groups "
                "directly) after boosting. Call add_param_group on the optimizer booster.boost returned."
            )

    def _reduced_grads(self) -> list[torch.Tensor | GradOnDisk]:
        """Each reduced gradient shard, in chunk order: in memory, or the ``GradOnDisk`` of one on
        disk (which keeps what the checks need of it)."""
        out: list[torch.Tensor | GradOnDisk] = []
        for chunk in self._manager.chunks:
            if chunk.trainable and chunk.grad_state is GradState.REDUCED:
                grad = chunk.store.grad_on_disk
                out.append(grad if grad is not None else chunk.grad_shard)
        return out

    def _prepare_grads(self) -> None:
        """Reduce whatever is pending, then unscale fp16 gradients once and agree on inf/nan."""
        if self._unscaled_backward:
            raise UnscaledBackwardError(
                "fp16 gradients were computed by a plain loss.backward(): without loss scaling, small fp16 gradients "
                "underflow to zero and overflows go unnoticed, so the optimizer refuses to step on them. Use "
                "booster.backward(loss, optimizer) (it scales the loss and the step unscales and checks the "
                "gradients). Call optimizer.zero_grad() to drop the gradients computed so far."
            )
        self._runtime.prepare_step()
        if self._early is not None and self._early.pending:
            self._early.settle()  # the worker reads gradient shards that are unscaled below
        if self._scaler is None or self._unscaled:
            return
        inv = 1.0 / self._scaler.scale
        found = 0.0
        for g in self._reduced_grads():
            if isinstance(g, GradOnDisk):
                g.scale(inv)
                found = max(found, float(not g.finite))
            else:
                g.mul_(inv)
                found = max(found, float(not bool(torch.isfinite(g).all())))
        flag = torch.tensor([found], device=self._manager.comm.tensor_device)
        self._manager.comm.all_reduce(flag, dist.ReduceOp.MAX)
        self._found_inf = bool(flag[0] > 0)
        self._unscaled = True

    def _step_with_grads(self, runs: Sequence[Run], reduced: Mapping[int, tuple[Chunk, Any]]) -> None:
        """Step ``runs`` on their slices of the reduced gradient shards."""
        shards: dict[int, torch.Tensor] = {}
        try:
            for run in runs:
                chunk_id = run.chunk.chunk_id
                if chunk_id not in shards:
                    shards[chunk_id] = reduced[chunk_id][0].grad_shard
                run.tensor.grad = shards[chunk_id][run.start : run.stop]
            self._step_runs(runs)
        finally:
            for run in runs:
                run.tensor.grad = None

    def _step_from_disk(
        self, has_grad: Mapping[int, bool], reduced: Mapping[int, tuple[Chunk, Any]]
    ) -> DiskTierError | None:
        """The chunks on disk, through the disk pipeline. Returns the error of a read or write that
        failed on any rank, the same on every rank (the ranks agree after it; one small exchange a
        step): ``step`` finishes the step before raising it. A chunk whose write failed was stepped
        and keeps its values in memory; one whose read failed was left as it was."""
        disk = self._disk
        assert disk is not None, "only with chunks on disk"
        chunks = {run.chunk.chunk_id: run.chunk for run in self._runs.runs() if disk.holds(run.chunk)}
        ordered = [chunk for chunk_id, chunk in sorted(chunks.items()) if chunk_id in reduced]

        def run() -> None:
            disk.step(ordered, lambda chunk: self._step_chunk_from_disk(chunk, has_grad, reduced))

        try:
            agree(self.communicator, "stepping optimizer states on disk", run, DiskTierError)
        except DiskTierError as error:
            return error
        return None

    def _step_chunk_from_disk(
        self, chunk: Chunk, has_grad: Mapping[int, bool], reduced: Mapping[int, tuple[Chunk, Any]]
    ) -> None:
        """One chunk of the disk pipeline, its master and state in memory now."""
        self._runs.split_by_gradient(has_grad, only=lambda other: other is chunk)
        runs = [run for run in self._runs.runs() if run.chunk is chunk and has_grad[id(run.pieces[0].tensor)]]
        self._step_with_grads(runs, reduced)

    def state_staging(self, chunk: Chunk, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Where a load stages ``numel`` values of ``chunk``'s optimizer state before installing
        them: memory, or for a chunk on disk a file beside its other files."""
        if self._disk is None:
            return torch.empty(numel, dtype=dtype)
        return self._disk.staging(chunk, numel, dtype)

    def _on_disk(self, chunk: Chunk) -> bool:
        return self._disk is not None and self._disk.holds(chunk)

    def state_on_disk(self, chunk: Chunk) -> bool:
        """Whether ``chunk``'s optimizer state lives on disk (the same on every rank): reading it
        can fail there."""
        return self._on_disk(chunk)

    def _state_location(self, chunk: Chunk) -> Location:
        """Where ``chunk``'s optimizer state lives between steps."""
        if self._on_disk(chunk):
            return Location.DISK
        return chunk.store.master_location

    @contextmanager
    def resident_state(self, chunk: Chunk, write_back: bool = False) -> Iterator[None]:
        """``chunk``'s master and optimizer state in memory for the block, when they live on disk
        (checkpoints read and write them chunk by chunk); written back after it with
        ``write_back``. Elsewhere they are always in memory."""
        if self._disk is None or not self._disk.holds(chunk):
            yield
            return
        with self._disk.resident(chunk, write_back):
            yield

    # --- early host steps (chunkmem.optim.early_steps) --------------------------------------------
    def gradient_final(self, chunk: Chunk) -> None:
        """The runtime: ``chunk``'s gradient of the iteration is final and on its way to the host."""
        if self._early is not None and not self._on_disk(chunk):
            self._early.submit(chunk)

    def cancel_early_steps(self) -> None:
        """Put back the early steps still pending (see ``EarlySteps.undo``)."""
        if self._early is not None and self._early.pending:
            self._early.undo()

    def _keep_early_steps(self) -> frozenset[int]:
        """At the step: keep the early steps when they are the ones this step takes (the same
        hyperparameters, the same parameters with gradients as agreed over ranks), else put them
        back. Returns the chunks they stepped."""
        early = self._early
        if early is None or not early.pending:
            return frozenset()
        early.settle()
        now = group_settings(self._optim.param_groups)
        chunks = self._manager.chunks
        same = all(same_settings(settings, now) for settings in early.records_settings()) and all(
            early.flags(chunk.chunk_id) in (None, chunk.params_with_grad) for chunk in chunks if chunk.trainable
        )
        if same:
            return early.commit()
        early.undo()
        return frozenset()

    def _account_state(self) -> None:
        """Account optimizer state as the placement reserved it: for each chunk one of whose
        parameters has state (on some rank), ``StateSize.reserved`` - an upper bound over ranks,
        so every rank's ledger, and every placement decision made from it, is the same without a
        collective. This rank's actual state must fit in it (the optimizer was probed for that).
        Elementwise state keeps its size, so both are measured again only when state appeared."""
        table = self._optim.state
        key = (len(self._stateful), len(table), id(table))
        if key == self._accounted_for:
            return
        self._accounted_for = key
        reserved: Counter[Location] = Counter()
        for chunk in self._manager.chunks:
            if chunk.trainable and any(id(info) in self._stateful for info in chunk.tensors):
                reserved[self._state_location(chunk)] += self._state_size.reserved(
                    chunk.shard_numel, len(chunk.tensors)
                )
        actual = self._runs.state_bytes(self._state_location)
        for location in Location:
            if actual[location] > reserved[location]:
                raise NotSupportedError(
                    f"rank {self._manager.comm.rank}: {type(self._optim).__name__} holds "
                    f"{actual[location]} bytes of state on the {location.value}, more than the {reserved[location]} "
                    f"that probing it predicted ({self._state_size}): its state does not grow like an elementwise "
                    "optimizer's, so chunkmem cannot plan memory for it. Use an elementwise optimizer such as AdamW."
                )
        ledger = self._manager.ledger
        for location in Location:
            delta = reserved[location] - self._accounted[location]
            if delta > 0:
                ledger.alloc(location, MemoryKind.OPTIM_STATE, delta)
            elif delta < 0:
                ledger.free(location, MemoryKind.OPTIM_STATE, -delta)
        self._accounted = reserved
