"""``ChunkStrategy``: ``lightning.Trainer(strategy=ChunkStrategy(placement=...))`` trains a
``LightningModule`` with its parameters in chunkmem's chunks.

At setup the module and the optimizer from ``configure_optimizers`` are boosted together
(``Booster.boost``); LR schedulers keep working (they share the optimizer's param groups). Lightning's
loop then runs unchanged: ``accumulate_grad_batches`` through chunkmem's ``no_sync``, backward through
``Booster.backward``, ``gradient_clip_val`` through ``ChunkOptimizer.clip_grad_norm``, and
``Trainer(precision=...)`` chooses chunkmem's compute precision ("32-true", "bf16-mixed", "16-mixed").

A checkpoint (``trainer.save_checkpoint`` / ``ModelCheckpoint``) is a directory in chunkmem's own
formats: ``model`` and ``optimizer`` (verified files, or sharded directories at W>1) beside
``trainer.ckpt``, Lightning's own state (loops, schedulers, callbacks, hyperparameters); ``ckpt_path=``
reads it back at any world size.

What the strategy cannot honour is refused at setup, naming the setting (see ``_refuse_unsupported``).
Needs Lightning (``pip install 'chunkmem[lightning]'``); ``import chunkmem`` does not import it."""

from __future__ import annotations

import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

try:
    from lightning.fabric.plugins.environments import ClusterEnvironment
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.plugins.io import CheckpointIO
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.strategies import ParallelStrategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities.model_helpers import is_overridden
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from ..compat.lightning import init_dist_connection, layer_sync, sync_ddp_if_available
except ImportError as error:  # pragma: no cover - the message is the point
    raise ImportError(
        "chunkmem.integrations.lightning needs Lightning 2.5 or 2.6: pip install 'chunkmem[lightning]'"
    ) from error

from chunkmem.placement import AutoPlacementConfig, StaticPlacementConfig

from ..boosted.compile_config import CompileBlocks
from ..boosted.model import ChunkedModel
from ..booster import Booster
from ..device import collective_backend, compute_device
from ..errors import CheckpointError, NotSupportedError
from ..optim import ChunkOptimizer
from ..optim.loss_scale import LossScaleConfig
from ..optim.step_config import StepAfterBackward, StepDuringBackward
from ..plugin import ChunkPlugin
from ..plugin import Precision as ChunkPrecisionName
from ..ranks.comm import Communicator

__all__ = ["ChunkStrategy", "ProcessGroupEnvironment"]

# Inside a checkpoint directory.
MODEL = "model"
OPTIMIZER = "optimizer"
TRAINER_STATE = "trainer.ckpt"


def _loss_scale_config(value: LossScaleConfig | Mapping[str, Any] | None) -> LossScaleConfig | None:
    """``ChunkStrategy``'s ``loss_scale`` as a config (a mapping is validated field by field)."""
    if value is None or isinstance(value, LossScaleConfig):
        return value
    if isinstance(value, Mapping):
        return LossScaleConfig.model_validate(dict(value))
    raise TypeError(
        f"loss_scale must be a LossScaleConfig or a mapping of its fields ({', '.join(LossScaleConfig.model_fields)}), "
        f"got {type(value).__name__}"
    )


# --- what the strategy hands Lightning besides itself: the precision plugin that routes backward
# and clipping through chunkmem's optimizer, and the environment of a process group formed before
# the Trainer (ranks started by the caller) ---------------------------------------------------------

# Lightning's precision flag -> chunkmem's compute precision. Master weights, gradients and optimizer
# states are fp32 under every one, as in Lightning's mixed modes; "bf16-true" / "16-true" would keep
# no fp32 master, which chunkmem always keeps, so they are refused rather than quietly upgraded.
_PRECISIONS: dict[str, ChunkPrecisionName] = {"32-true": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}


def chunk_precision(plugin: Precision) -> ChunkPrecisionName:
    """chunkmem's compute precision for the precision plugin Lightning built from
    ``Trainer(precision=...)``; anything else is refused with the reason."""
    flag = getattr(plugin, "precision", None)
    if type(plugin) in (Precision, MixedPrecision) and flag in _PRECISIONS:
        return _PRECISIONS[flag]
    raise NotSupportedError(
        f"Trainer(precision={flag!r}) with {type(plugin).__name__} refused by ChunkStrategy: chunkmem keeps fp32 "
        "master weights, gradients and optimizer states and computes in fp32, bf16 or fp16 itself (no autocast, no "
        "other "
        f"precision plugin). Use precision= one of {sorted(_PRECISIONS)} (computing in "
        f"{', '.join(_PRECISIONS.values())} respectively)."
    )


class ChunkPrecision(Precision):
    """Backward through ``Booster.backward`` (fp16 loss scaling, then the end-of-backward gradient
    reduction) and norm clipping through ``ChunkOptimizer.clip_grad_norm`` (the global norm over
    every rank's shards). No autocast: the model computes in chunkmem's precision already."""

    def __init__(self, flag: str, booster: Booster, optimizer: ChunkOptimizer | None) -> None:
        super().__init__()
        self.precision = flag  # type: ignore[assignment]
        self._booster = booster
        self._optimizer = optimizer

    def _boosted_optimizer(self, what: str) -> ChunkOptimizer:
        if self._optimizer is None:
            raise NotSupportedError(f"{what} needs an optimizer, and ChunkStrategy boosted this model without one")
        return self._optimizer

    def backward(  # type: ignore[override]
        self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        if args or kwargs:
            raise NotSupportedError(
                f"backward arguments {args!r} {kwargs!r} refused by ChunkStrategy: chunkmem's backward finishes the "
                "gradient reduction, so the graph cannot be kept (retain_graph) or given other gradients"
            )
        self._booster.backward(tensor, self._boosted_optimizer("backward"))

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        self._boosted_optimizer("gradient clipping").clip_grad_norm(float(clip_val))

    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        raise value_clipping_refused()


def value_clipping_refused() -> NotSupportedError:
    return NotSupportedError(
        "gradient_clip_algorithm='value' refused by ChunkStrategy: chunkmem clips by the global norm "
        "(ChunkOptimizer.clip_grad_norm); per-element clipping of the sharded gradients is not implemented. "
        "Use gradient_clip_algorithm='norm'."
    )


class ProcessGroupEnvironment(ClusterEnvironment):
    """The ranks of the default process group, formed before the ``Trainer`` was built: they exist
    already (nothing to launch), and their number and ranks are the group's."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        return dist.is_available() and dist.is_initialized()

    def world_size(self) -> int:
        return dist.get_world_size()

    def set_world_size(self, size: int) -> None:
        if size != dist.get_world_size():
            raise ValueError(f"the process group has {dist.get_world_size()} ranks, not {size}")

    def global_rank(self) -> int:
        return dist.get_rank()

    def set_global_rank(self, rank: int) -> None:
        if rank != dist.get_rank():
            raise ValueError(f"this process is rank {dist.get_rank()} of the process group, not {rank}")

    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", dist.get_rank()))

    def node_rank(self) -> int:
        return int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")))


class ChunkStrategy(ParallelStrategy):
    """Train a ``LightningModule`` with chunkmem (module docstring).

    Args:
        placement, chunk_size, loss_scale, check_plans, host_step, disk_dir, compile: as ``ChunkPlugin``
            (validated here, so a wrong setting fails where it is written). The precision is
            ``Trainer(precision=...)``'s; ``gradient_accumulation`` is set from
            ``accumulate_grad_batches``.
        sharded_checkpoint: write checkpoints as sharded directories (every rank its own pieces)
            rather than files gathered on rank 0. ``None`` (default): sharded at world size > 1.
        cluster_environment: where the ranks come from. ``None``: the default process group when
            it exists already (``ProcessGroupEnvironment``), else what Lightning detects (torchrun,
            SLURM...). Several ranks must be started outside the ``Trainer`` (torchrun or your own
            process group): this strategy launches no processes.
    """

    strategy_name = "chunkmem"

    def __init__(
        self,
        placement: StaticPlacementConfig | AutoPlacementConfig | dict[str, Any] | None = None,
        chunk_size: int | None = None,
        loss_scale: LossScaleConfig | dict[str, Any] | None = None,
        check_plans: bool | None = None,
        host_step: StepAfterBackward | StepDuringBackward | dict[str, Any] | None = None,
        disk_dir: str | Path | None = None,
        compile: CompileBlocks | dict[str, Any] | None = None,
        sharded_checkpoint: bool | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
    ) -> None:
        if cluster_environment is None and ProcessGroupEnvironment.detect():
            cluster_environment = ProcessGroupEnvironment()
        super().__init__(cluster_environment=cluster_environment, checkpoint_io=checkpoint_io)
        # Validated now, applied at setup: whether it applies depends on Trainer(precision=...).
        self._loss_scale = _loss_scale_config(loss_scale)
        self._settings = ChunkPlugin(
            placement=placement,
            precision="fp32",
            chunk_size=chunk_size,
            check_plans=check_plans,
            host_step=host_step,
            disk_dir=disk_dir,
            compile=compile,
        )
        if sharded_checkpoint is not None and not isinstance(sharded_checkpoint, bool):
            raise TypeError(f"sharded_checkpoint must be True, False or None, got {sharded_checkpoint!r}")
        self._sharded_checkpoint = sharded_checkpoint
        self._booster: Booster | None = None
        self._boosted: tuple[LightningModule, ChunkedModel, ChunkOptimizer | None] | None = None

    # --- where and how many ---------------------------------------------------------------------
    @property
    def root_device(self) -> torch.device:
        """The Trainer's device for this rank (``accelerator=`` / ``devices=``), where chunkmem
        computes: on a GPU machine ``accelerator="cpu"`` computes on the CPU, as plain Lightning does."""
        devices = self.parallel_devices
        if not devices:
            return compute_device()
        if devices[0].type == "cpu":
            return torch.device("cpu")
        if self.local_rank >= len(devices):
            raise NotSupportedError(
                f"local rank {self.local_rank} has no device among Trainer(devices=...)'s {len(devices)}: give "
                "Trainer(devices=<processes per node>)"
            )
        return devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup_environment(self) -> None:
        environment = self.cluster_environment
        processes = len(self.parallel_devices or [])
        if environment is not None and processes > 1 and not environment.creates_processes_externally:
            raise NotSupportedError(
                f"Trainer(devices={processes}) refused by ChunkStrategy: it launches no processes. Start one "
                "process per rank with torchrun (Trainer(devices=<processes per node>)), or form the default "
                "process group yourself before building the Trainer; then every rank runs the same script."
            )
        super().setup_environment()
        if self.world_size > 1:
            # What DDPStrategy, FSDPStrategy and DeepSpeedStrategy do in their distributed setup:
            # every rank's RNG back to seed_everything's seed (nothing without one), so that dropout
            # draws the masks plain DDP draws from the first step. At one rank the plain counterpart
            # is SingleDeviceStrategy, which leaves the RNG where the script left it.
            reset_seed()
        if self.world_size > 1 and not dist.is_initialized():
            assert environment is not None, "ChunkStrategy: no cluster environment (Lightning sets one before this)"
            init_dist_connection(environment, collective_backend(self.root_device))
        rank_zero_only.rank = self.global_rank

    def model_to_device(self) -> None:
        # A boosted model is where the placement put it; only the module before boosting moves.
        if self.model is not None and not isinstance(self.model, ChunkedModel):
            self.model.to(self.root_device)

    # --- setup: boost the module and its optimizer ------------------------------------------------
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None, "ChunkStrategy: no accelerator (the Trainer sets one before setup)"
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None, "ChunkStrategy: no LightningModule attached (the Trainer attaches it first)"
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self._boosted is not None:
            self._reuse_boosted(module, fitting)
            return
        self._refuse_unsupported(trainer, module)
        precision = chunk_precision(self.precision_plugin)
        if self._loss_scale is not None and precision != "fp16":
            raise NotSupportedError(
                f"ChunkStrategy(loss_scale=...) applies to fp16 only, and Trainer(precision="
                f"{self.precision_plugin.precision!r}) computes in {precision}, which has no loss scaling: use "
                "Trainer(precision='16-mixed') to scale fp16 gradients, or leave loss_scale unset"
            )
        self.model_to_device()
        optimizer = None
        if fitting:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise NotSupportedError(
                    f"configure_optimizers returned {len(self.optimizers)} optimizers; ChunkStrategy boosts exactly "
                    "one optimizer over the module's parameters (automatic optimization steps one optimizer)"
                )
            optimizer = self.optimizers[0]
        settings = self._settings
        self._booster = Booster(
            ChunkPlugin(
                placement=settings.placement,
                precision=precision,
                chunk_size=settings.chunk_size,
                loss_scale=self._loss_scale,
                check_plans=settings.check_plans,
                # The Trainer's device, over the default process group when there is one.
                process_group=Communicator(None, self.root_device, check_plans=settings.check_plans),
                gradient_accumulation=trainer.accumulate_grad_batches > 1,
                host_step=settings.host_step,
                disk_dir=settings.disk_dir,
                compile=settings.compile,
            )
        )
        chunked, boosted, *_ = self._booster.boost(module, optimizer)
        self._boosted = (module, chunked, boosted)
        self._install(chunked, boosted)

    def _install(self, chunked: ChunkedModel, optimizer: ChunkOptimizer | None) -> None:
        assert self._booster is not None, "ChunkStrategy: the module is not boosted yet (setup boosts it)"
        self.model = chunked
        if optimizer is not None:
            self.optimizers = [optimizer]
        self.precision_plugin = ChunkPrecision(self.precision_plugin.precision, self._booster, optimizer)

    def _reuse_boosted(self, module: LightningModule, fitting: bool) -> None:
        """``validate`` / ``test`` / ``predict`` after ``fit`` use the model that fit boosted."""
        boosted_module, chunked, optimizer = self._boosted  # type: ignore[misc]
        if module is not boosted_module:
            raise NotSupportedError(
                "this ChunkStrategy already boosted another LightningModule: build one ChunkStrategy per module"
            )
        if fitting:
            raise NotSupportedError(
                "a second trainer.fit with a ChunkStrategy that already boosted this module refused: its parameters "
                "live in chunks now, so configure_optimizers cannot build a new optimizer over them. Resume with a "
                "new module, Trainer and ChunkStrategy and ckpt_path= instead."
            )
        self._install(chunked, optimizer)

    def _refuse_unsupported(self, trainer: Trainer, module: LightningModule) -> None:
        """What Lightning would do differently from what chunkmem does, refused before anything moves."""
        if not module.automatic_optimization:
            raise NotSupportedError(
                "manual optimization (automatic_optimization = False) refused by ChunkStrategy: chunkmem's no_sync, "
                "backward and clipping are wired into Lightning's automatic loop only. Use automatic optimization."
            )
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value":
            raise value_clipping_refused()
        if is_overridden("backward", module, LightningModule):
            raise NotSupportedError(
                f"{type(module).__name__}.backward overridden: refused by ChunkStrategy, whose backward applies "
                "fp16 loss scaling and finishes chunkmem's gradient reduction; remove the override"
            )
        if layer_sync(self) is not None:
            raise NotSupportedError(
                "Trainer(sync_batchnorm=True) refused by ChunkStrategy: it would replace modules whose parameters "
                "are in chunks; convert BatchNorm layers to SyncBatchNorm before building the Trainer"
            )

    # --- the training loop ---------------------------------------------------------------------
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation micro-batches communicate no gradients (chunkmem's ``no_sync``)."""
        assert self._booster is not None and isinstance(self.model, ChunkedModel), (
            "ChunkStrategy.block_backward_sync before setup boosted the module"
        )
        with self._booster.no_sync(self.model):
            yield

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, name: str | None = None) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.world_size == 1 or not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def teardown(self) -> None:
        # Lightning's default moves the module and optimizer states to the CPU: the chunks stay where
        # the placement put them, and the boosted model stays usable (save_checkpoint after fit).
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        assert self.accelerator is not None, "ChunkStrategy: no accelerator (the Trainer sets one before setup)"
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # --- checkpoints: a directory in chunkmem's formats ----------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # into the boosted model and optimizer

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # written by save_checkpoint in chunkmem's format, never gathered into the trainer state

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # likewise

    def _sharded(self) -> bool:
        return self._sharded_checkpoint if self._sharded_checkpoint is not None else self.world_size > 1

    def _boosted_parts(self, what: str) -> tuple[ChunkedModel, ChunkOptimizer | None]:
        if self._boosted is None or self._booster is None:
            raise NotSupportedError(f"{what} before the Trainer set ChunkStrategy up: nothing is boosted yet")
        return self._boosted[1], self._boosted[2]

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Every rank calls it (``Trainer.save_checkpoint`` does): the model and optimizer are
        collectives; rank 0 writes Lightning's state."""
        if storage_options is not None:
            raise NotSupportedError("storage_options refused by ChunkStrategy: its checkpoints are local directories")
        directory = _local_directory(filepath)
        chunked, optimizer = self._boosted_parts("save_checkpoint")
        assert self._booster is not None, "ChunkStrategy: the module is not boosted yet (setup boosts it)"
        directory.mkdir(parents=True, exist_ok=True)
        shard = self._sharded()
        self._booster.save_model(chunked, directory / MODEL, shard=shard)
        if "optimizer_states" in checkpoint and optimizer is not None:  # not a weights_only save
            self._booster.save_optimizer(optimizer, directory / OPTIMIZER, shard=shard)
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, directory / TRAINER_STATE)
        self.barrier("ChunkStrategy.save_checkpoint")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's state, after loading the model (and, when fitting from a full checkpoint,
        the optimizer) into the boosted ones; chunkmem verifies both and that they are of one step."""
        directory = _local_directory(checkpoint_path)
        if not (directory / TRAINER_STATE).is_file():
            raise CheckpointError(
                f"{directory} is not a ChunkStrategy checkpoint (a directory holding {TRAINER_STATE}, {MODEL} and "
                f"{OPTIMIZER}). To start from plain weights, load them into the module before trainer.fit."
            )
        state = self.checkpoint_io.load_checkpoint(directory / TRAINER_STATE, weights_only=weights_only)
        chunked, optimizer = self._boosted_parts("loading a checkpoint")
        assert self._booster is not None, "ChunkStrategy: the module is not boosted yet (setup boosts it)"
        module = self.lightning_module
        assert module is not None, "ChunkStrategy: no LightningModule attached (the Trainer attaches it first)"
        self._booster.load_model(chunked, directory / MODEL, strict=module.strict_loading)
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        if fitting and optimizer is not None and "optimizer_states" in state:
            self._booster.load_optimizer(optimizer, directory / OPTIMIZER)
        return state

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # loaded by load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # loaded by load_checkpoint


def _local_directory(path: Any) -> Path:
    text = str(path)
    if "://" in text:
        raise NotSupportedError(f"checkpoint path {text!r} refused by ChunkStrategy: only local directories")
    return Path(text)
