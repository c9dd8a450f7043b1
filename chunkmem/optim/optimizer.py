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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..boosted.grad_markers import clear_markers
from ..boosted.progress import TrainingProgress
from ..chunks.chunk import Chunk
from ..chunks.manager import ChunkManager
from ..chunks.tensor_state import TensorInfo
from ..errors import DiskTierError, NotSupportedError, StateDictMismatchError
from ..execution.gather import Destination
from ..execution.runtime import ChunkRuntime
from ..ranks.agreed_values import hyperparameters
from ..ranks.agreement import agree
from ..ranks.comm import Communicator
from .disk_sides import DiskSides
from .early_steps import EarlySteps
from .loss_scale import DynamicLossScaler
from .optimizer_state import OptimizerState
from .piece import Piece
from .places import SidePlaces
from .probe import StateSize, check_elementwise, optimizer_state_size
from .runs import StepRuns
from .scaling import GradScaling
from .state_dict import full_optimizer_state, slice_state, stage_optimizer_state
from .state_ledger import StateLedger
from .step_config import StepAfterBackward, StepDuringBackward
from .stepper import RunStepper

__all__ = ["ChunkOptimizer", "Piece", "StateSize", "check_elementwise", "optimizer_state_size"]

log = logging.getLogger("chunkmem")
_STEP_TAKEN = (
    "The step was taken on every rank (README, 'A disk that fails'): a chunk whose write failed was stepped and "
    "keeps its values in host memory (written again after its next step); one whose read failed keeps its values "
    "from before the step. Free space, then go on (zero_grad(), the next batch) without repeating this step"
)


class ChunkOptimizer(torch.optim.Optimizer):
    """What ``Booster.boost`` returns for the optimizer (module docstring). Beyond the
    ``torch.optim.Optimizer`` interface: ``clip_grad_norm``, ``backward`` (fp16 loss scaling) and
    ``loss_scale``. ``places`` says where each chunk's optimizer side lives (the plugin builds it
    from the layout)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        runtime: ChunkRuntime,
        manager: ChunkManager,
        progress: TrainingProgress,
        places: SidePlaces,
        scaler: DynamicLossScaler | None,
        state_size: StateSize | None = None,
        host_step: StepAfterBackward | StepDuringBackward | None = None,
    ) -> None:
        if isinstance(optimizer, ChunkOptimizer):
            raise ValueError("this optimizer is already boosted")
        self._built = False
        self._optim = optimizer
        self._runtime = runtime
        self._manager = manager
        self._progress = progress
        self._places = places
        self._pieces: list[Piece] = []
        # Each group's original parameters, in order: what a full (PyTorch-format) state dict indexes.
        self._group_infos: list[tuple[TensorInfo, ...]] = []
        self._state = OptimizerState(optimizer)
        self._runs = StepRuns(self._state)
        self._stepper = RunStepper(optimizer, self._runs, manager.comm.layer, runtime.stats_counters)
        size = state_size if state_size is not None else optimizer_state_size(optimizer)
        self._ledger = StateLedger(manager, places, size, self._runs, self._state)
        existing = dict(optimizer.state)
        resharded: dict[torch.Tensor, dict[str, Any]] = {}
        for group in optimizer.param_groups:
            infos, pieces = self._cut(group["params"])
            self._group_infos.append(infos)
            self._pieces.extend(pieces)
            for piece in pieces:
                if piece.info.param in existing:
                    resharded[piece.tensor] = slice_state(existing[piece.info.param], piece)
            self._ledger.note_stateful(info for info in infos if existing.get(info.param))
            group["params"] = self._runs.add_group(pieces)
        self._disk: DiskSides | None = None
        if places.file is not None:
            self._disk = DiskSides(
                places.file,
                places.on_disk_of(manager.chunks),
                lambda chunk: size.reserved(chunk.layout.shard_numel, len(chunk.layout.tensors)),
                self._runs,
                self._state,
                manager.ledger,
            )
            self._runs.read_from_disk(self._disk.view_of)
        self._stepper.probe_host_kernels()
        # torch's own bookkeeping (hook tables, step profiling), then share the user's groups and state.
        super().__init__([{"params": []}], optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        self._built = True
        self._early: EarlySteps | None = None
        if isinstance(host_step, StepDuringBackward):
            self._early = EarlySteps(
                int(host_step.backup_budget),
                self._runs,
                self._state,
                self._stepper,
                runtime,
                lambda: self._scaling.inverse(),  # built next, on the early steps
                runtime.stats_counters,
            )
            self._runs.settle_early_steps_with(self._early.cancel)
            runtime.listen_for_final_gradients(self)
        self._scaling = GradScaling(runtime, manager, scaler, self._early)
        if resharded:  # the user loaded a state before boosting
            self.load_local_state(resharded)

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
            part = chunk.layout.piece(info)
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
        the run it belongs to; empty when it has none yet). Early host steps still pending are put
        back first: the state is the one the last ``step()`` left."""
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
        return self._scaling.scaler

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
        return self._scaling.scale

    # --- the torch.optim.Optimizer interface ------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group over parameters of the boosted model that the optimizer does not hold yet
        (parameters from elsewhere are refused: they are in no chunk)."""
        if not self._built:  # torch's constructor, registering the placeholder group
            super().add_param_group(param_group)
            return
        self._runs.settle_early_steps("a param group is added")  # the worker steps the group list
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        infos, pieces = self._cut(params)
        held = {id(info) for group in self._group_infos for info in group}
        if any(id(info) in held for info in infos) or len({id(i) for i in infos}) != len(infos):
            raise ValueError("some parameters appear in more than one parameter group")
        with self._stepper.inside():
            self._optim.add_param_group({**param_group, "params": [piece.tensor for piece in pieces]})
        try:
            check_elementwise(self._optim)
        except ValueError:
            self._optim.param_groups.pop()
            raise
        self._optim.param_groups[-1]["params"] = self._runs.add_group(pieces)
        self._group_infos.append(infos)
        self._pieces.extend(pieces)
        self._stepper.probe_host_kernels()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (buffers, shards and the record of which parameters had one)."""
        self._runtime.zero_grad()
        if set_to_none:
            clear_markers(info.param for info in self._manager.infos)
        self._scaling.zero_grad()

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
        self._scaling.prepare()
        stats = self._runtime.stats_counters
        disk_failure: DiskTierError | None = None
        if self._scaling.found_inf:  # the early steps were put back when it was found
            stats.skipped_steps += 1
            log.info("chunkmem: inf/nan gradients at loss scale %s; step skipped", self.loss_scale)
        else:
            done = self._early.keep_if_unchanged(self._manager.chunks) if self._early is not None else frozenset()
            disk_failure = self._step_on(done)
            stats.optimizer_steps += 1
        self._progress.advance()
        self._scaling.after_step()
        self._runtime.after_step()
        if disk_failure is not None:  # raised once the step is finished (README, "the disk tier")
            raise disk_failure
        return loss

    def _step_on(self, done: frozenset[int]) -> DiskTierError | None:
        """Step every run with a gradient, but those of the chunks ``done`` (stepped early and
        kept). Returns the error of the disk tier, if its pipeline failed (see ``_step_from_disk``)."""
        # Which chunks have gradients and for which parameters; each shard is read when its
        # runs are stepped (one on disk is only in memory then).
        reduced = {
            chunk.chunk_id: (chunk, chunk.grads.params_with_grad)
            for chunk in self._manager.chunks
            if chunk.layout.trainable and self._runtime.grads_reduced(chunk.chunk_id)
        }
        has_grad: dict[int, bool] = {}
        for piece in self._pieces:
            entry = reduced.get(piece.chunk.chunk_id)
            has_grad[id(piece.tensor)] = entry is not None and entry[1][piece.info.index]
        on_disk = self._places.on_disk
        # Chunks on disk are cut when they are in memory, in the disk pipeline.
        self._runs.split_by_gradient(has_grad, only=lambda chunk: not on_disk(chunk))
        # Which parameters get state is agreed (a gradient on any rank), so every rank
        # accounts the same chunks.
        for chunk_id, (_, flags) in reduced.items():
            tensors = self._manager.chunk(chunk_id).layout.tensors
            self._ledger.note_stateful(info for info in tensors if flags[info.index])
        self._manager.prepare_master_writes()
        stepped = [
            run
            for run in self._runs.runs()
            if has_grad[id(run.pieces[0].tensor)] and run.chunk.chunk_id not in done and not on_disk(run.chunk)
        ]
        self._stepper.step_with_grads(stepped, lambda chunk_id: reduced[chunk_id][0].grads.shard)
        failure = self._step_from_disk(has_grad, reduced) if self._disk is not None else None
        self._ledger.account()
        self._runtime.check_budget(f"{type(self._optim).__name__}.step creating its state")
        return failure

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
        run_states, on_disk = self._runs.regroup({id(t): s for t, s in states.items()}, later=self._places.on_disk)
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
        with self._stepper.inside():
            self._optim.load_state_dict(
                {"state": {index[id(t)]: s for t, s in run_states.items()}, "param_groups": groups}
            )
        # torch's load_state_dict replaces the group list and the state table: share the new ones.
        self.param_groups = self._optim.param_groups
        self.state = self._optim.state
        if self._scaling.scaler is not None and scaler_state is not None:
            self._scaling.scaler.load_state_dict(dict(scaler_state))
        if stateful is not None:  # the parameters with state in the full state (the same on every rank)
            self._ledger.replace_stateful(stateful)
        if self._disk is not None:
            self._disk.install(on_disk)
        self._ledger.account()

    # --- beyond torch.optim.Optimizer -------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Backward with loss scaling (fp16), then finish the gradient reduction."""
        self._scaling.backward(loss)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm over all ranks to ``max_norm`` (like
        ``torch.nn.utils.clip_grad_norm_``) and return the norm before clipping. A collective:
        call it on every rank (to log the norm on one rank, log what every rank returns)."""
        return self._scaling.clip(max_norm, norm_type)

    # --- internals --------------------------------------------------------------------------
    def _check_groups(self) -> None:
        groups = self._optim.param_groups
        if len(groups) != len(self._group_infos):
            raise NotSupportedError(
                f"the optimizer has {len(groups)} param groups but chunkmem built {len(self._group_infos)}: a group "
                f"was added to the {type(self._optim).__name__} object passed to booster.boost (or to param_groups "
                "directly) after boosting. Call add_param_group on the optimizer booster.boost returned."
            )

    def _step_from_disk(
        self, has_grad: Mapping[int, bool], reduced: Mapping[int, tuple[Chunk, Any]]
    ) -> DiskTierError | None:
        """The chunks on disk, through the disk pipeline. Returns the error of a read or write that
        failed on any rank, the same on every rank (the ranks agree after it; one small exchange a
        step): ``step`` finishes the step before raising it. A chunk whose write failed was stepped
        and keeps its values in memory; one whose read failed was left as it was."""
        disk = self._disk
        assert disk is not None, "only with chunks on disk"
        ordered = [chunk for chunk in self._places.on_disk_of(self._manager.chunks) if chunk.chunk_id in reduced]

        def run() -> None:
            disk.step(ordered, lambda chunk: self._step_chunk_from_disk(chunk, has_grad, reduced))

        try:
            agree(self.communicator, "stepping the chunks on disk", run, DiskTierError, changes_nothing=False)
        except DiskTierError as error:
            failure = DiskTierError(f"{error}. {_STEP_TAKEN}")
            failure.__cause__ = error
            return failure
        return None

    def _step_chunk_from_disk(
        self, chunk: Chunk, has_grad: Mapping[int, bool], reduced: Mapping[int, tuple[Chunk, Any]]
    ) -> None:
        """One chunk of the disk pipeline, its master and state in memory now."""
        self._runs.split_by_gradient(has_grad, only=lambda other: other is chunk)
        runs = [run for run in self._runs.runs() if run.chunk is chunk and has_grad[id(run.pieces[0].tensor)]]
        self._stepper.step_with_grads(runs, lambda chunk_id: reduced[chunk_id][0].grads.shard)

    # --- where the sides live (``SidePlaces``) ----------------------------------------------
    def state_staging(self, chunk: Chunk, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Where a load stages ``numel`` values of ``chunk``'s optimizer state before installing
        them: memory, or for a chunk on disk a file beside its other files."""
        if self._disk is None or not self._places.on_disk(chunk):
            return torch.empty(numel, dtype=dtype)
        return self._disk.staging(numel, dtype)

    def state_on_disk(self, chunk: Chunk) -> bool:
        """Whether ``chunk``'s optimizer state lives on disk (the same on every rank): reading it
        can fail there."""
        return self._places.on_disk(chunk)

    @contextmanager
    def resident_state(self, chunk: Chunk, write_back: bool = False) -> Iterator[None]:
        """``chunk``'s master and optimizer state in memory for the block, when they live on disk
        (checkpoints read and write them chunk by chunk); written back after it with
        ``write_back``. Elsewhere they are always in memory."""
        if self._disk is None or not self._places.on_disk(chunk):
            yield
            return
        with self._disk.resident(chunk, write_back):
            yield

    # --- early host steps (chunkmem.optim.early_steps) --------------------------------------
    def gradient_final(self, chunk: Chunk) -> None:
        """The runtime: ``chunk``'s gradient of the iteration is final and on its way to the host."""
        if self._early is not None and not self._places.on_disk(chunk):
            self._early.submit(chunk)

    def cancel_early_steps(self) -> None:
        """The runtime: something other than the step is about to read or change masters, state
        or gradients (``EarlySteps.cancel``)."""
        if self._early is not None:
            self._early.cancel("the runtime reads or changes masters")
