"""``Booster``: the user-facing entry point, as in ColossalAI."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from . import checkpoint
from .boosted.model import ChunkedModel
from .optim import ChunkOptimizer
from .plugin import ChunkPlugin

__all__ = ["Booster"]


class Booster:
    """Turns a model and optimizer into chunked ones with a plugin, and runs what needs both
    (backward with loss scaling, gradient accumulation without communication, checkpoints).
    """

    def __init__(self, plugin: ChunkPlugin) -> None:
        if not isinstance(plugin, ChunkPlugin):
            raise TypeError(f"Booster needs a ChunkPlugin, got {type(plugin).__name__}")
        self.plugin = plugin

    def boost(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Any = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
        *,
        weights: str | os.PathLike[str] | None = None,
        frozen: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
    ) -> tuple[ChunkedModel, ChunkOptimizer | None, Any, Any, Any]:
        """Put the model's parameters in chunks and point the optimizer at the master shards. The
        optimizer must be built over ``model.parameters()``. The returned optimizer is a
        ``torch.optim.Optimizer`` sharing the given optimizer's param groups, so an LR scheduler
        built before or after boosting works; the given optimizer object itself must not be stepped
        any more (it raises).

        A model built on the meta device (``with torch.device("meta"): ...``) is given values one
        parameter at a time, each rank keeping only its shards: the model's own initialisation,
        exactly as a CPU construction would have run it from torch's generator as it is now, or,
        with ``weights`` (a transformers model directory or a safetensors file), the checkpoint's
        values, each rank reading only its slices. The optimizer may be built over the meta model
        before boosting, without state.

        ``frozen``: one model or several that a training step runs but never trains (a reference
        model for DPO or GRPO, a reward model), boosted beside ``model`` under the same budget::

            policy, optimizer, *_ = booster.boost(policy, optimizer, frozen=reference)
            (reference,) = policy.frozen_models

        One placement policy places the chunks of all of them, from one recorded order spanning
        every model's ops in a step, and evicts by next use across models (the reference's chunks
        leave when the policy's backward needs room and come back ahead of the next reference
        forward). A frozen model keeps only its values in the compute dtype (its parameters are
        frozen and cast to it: no fp32 master, gradient or optimizer state), on the device, the
        host or the disk, as the placement puts them. Its forward while ``model`` is in training
        mode is part of the training step (under ``torch.no_grad()`` as usual); while ``model`` is
        in eval mode it is an inference forward of its own. Each frozen model must hold its own
        parameters (a ``copy.deepcopy`` of the policy taken before training, not the policy
        itself) and its weights in memory (not the meta device; ``weights=`` with frozen models is
        not supported yet)."""
        if frozen is None:
            frozen = ()
        elif isinstance(frozen, torch.nn.Module):
            frozen = (frozen,)
        boosted_model, boosted_optimizer = self.plugin.configure(model, optimizer, weights, frozen=tuple(frozen))
        return boosted_model, boosted_optimizer, criterion, dataloader, lr_scheduler

    def backward(self, loss: torch.Tensor, optimizer: ChunkOptimizer) -> None:
        """``loss.backward()`` with loss scaling and the end-of-backward gradient reduction."""
        if not isinstance(optimizer, ChunkOptimizer):
            raise TypeError("Booster.backward needs the optimizer returned by Booster.boost")
        optimizer.backward(loss)

    @contextmanager
    def no_sync(self, model: ChunkedModel, optimizer: ChunkOptimizer | None = None) -> Iterator[None]:
        """Gradient accumulation: backward passes inside the block communicate no gradients; the
        first backward outside it reduces everything accumulated."""
        if not isinstance(model, ChunkedModel):
            raise TypeError("Booster.no_sync needs the model returned by Booster.boost")
        with model.runtime.no_sync():
            yield

    # --- checkpoints (see chunkmem.checkpoint: PyTorch formats, verified, transactional) --------
    def save_model(self, model: ChunkedModel, path: str | os.PathLike[str], shard: bool = False) -> None:
        """Write the full fp32 state dict and its manifest (every rank calls it; the state is
        gathered to rank 0 chunk by chunk and written there). With ``shard=True``, ``path`` is a
        directory (``torch.distributed.checkpoint``) to which every rank writes its own pieces,
        gathering nothing; it replaces the previous one atomically."""
        checkpoint.save_model(model, path, shard=shard)

    def load_model(
        self, model: ChunkedModel, path: str | os.PathLike[str], strict: bool = True, verify: bool = True
    ) -> Any:
        """Load full weights saved by ``save_model`` (a file or a sharded directory) on every rank,
        at any world size, chunk size or placement; a corrupted or mismatched checkpoint is refused
        before anything is written. A plain PyTorch ``state_dict`` file or DCP checkpoint has no
        chunkmem manifest to verify it by: pass ``verify=False`` (the load is logged as unverified)."""
        return checkpoint.load_model(model, path, strict=strict, verify=verify)

    def save_optimizer(self, optimizer: ChunkOptimizer, path: str | os.PathLike[str], shard: bool = False) -> None:
        """Write the full optimizer state in PyTorch's format (every rank calls it; rank 0 writes).
        With ``shard=True``, a directory to which every rank writes the state of its own pieces."""
        checkpoint.save_optimizer(optimizer, path, shard=shard)

    def load_optimizer(self, optimizer: ChunkOptimizer, path: str | os.PathLike[str], verify: bool = True) -> None:
        """Load an optimizer state saved by ``save_optimizer`` (a file or a sharded directory), or by
        plain PyTorch with ``verify=False``, on every rank, at any world size, chunk size or placement."""
        checkpoint.load_optimizer(optimizer, path, verify=verify)

    def save_lr_scheduler(self, lr_scheduler: Any, path: str | os.PathLike[str], optimizer: ChunkOptimizer) -> None:
        """Write the scheduler's state (every rank calls it; rank 0 writes)."""
        checkpoint.save_lr_scheduler(lr_scheduler, path, optimizer)

    def load_lr_scheduler(
        self,
        lr_scheduler: Any,
        path: str | os.PathLike[str],
        optimizer: ChunkOptimizer | None = None,
        verify: bool = True,
    ) -> None:
        """Load a scheduler state written by ``save_lr_scheduler`` (plain PyTorch's with
        ``verify=False``). Pass the boosted ``optimizer`` when the scheduler was built on the
        optimizer object given to ``boost``, so the ranks agree and the file's step is checked
        against the model and optimizer loaded with it."""
        checkpoint.load_lr_scheduler(lr_scheduler, path, optimizer, verify=verify)
