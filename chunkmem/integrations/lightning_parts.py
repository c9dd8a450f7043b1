"""What ``ChunkStrategy`` hands Lightning besides itself: the precision plugin that routes backward
and clipping through chunkmem's optimizer, and the cluster environment of a process group formed
before the ``Trainer`` (ranks started by the caller, as in the tests)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from ..booster import Booster
from ..errors import NotSupportedError
from ..optim import ChunkOptimizer
from ..plugin import Precision as ChunkPrecisionName

__all__ = ["ChunkPrecision", "ProcessGroupEnvironment", "chunk_precision"]

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
