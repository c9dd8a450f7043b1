"""Checkpoints you can trust, in plain PyTorch's own formats (README.md, "Training loop").

The model file is the wrapped module's full fp32 ``state_dict``, the optimizer file a full
``Optimizer.state_dict`` over the original parameters (gathered to rank 0 chunk by chunk); with
``shard=True`` either is a ``torch.distributed.checkpoint`` directory to which every rank writes its
own pieces (:mod:`.sharded`). Both load at any world size, chunk size or placement, verified against
their manifest (:mod:`.manifest`), and a refused load changes nothing.

The verbs here say what each kind of state is (how it is gathered or listed in pieces, checked,
staged and installed); :mod:`.pipeline` does the rest, the same for every kind and both formats.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import StateDictMismatchError
from ..execution.gather import Destination
from ..optim import ChunkOptimizer
from ..optim.state_dict import full_optimizer_state, stage_optimizer_state
from .files import atomic_save
from .manifest import (
    Manifest,
    check_saved_for_model,
    check_saved_for_optimizer,
    manifest_path,
    model_fingerprint,
    model_tensors,
    optimizer_tensors,
    read_manifest,
)
from .pipeline import load, save

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from ..boosted.model import ChunkedModel
    from ..boosted.model_state import StagedModelLoad
    from ..optim.state_dict import StagedOptimizerState
    from .dcp_layout import Entry
    from .sharded import Reading

__all__ = [
    "Manifest",
    "atomic_save",
    "load_lr_scheduler",
    "load_model",
    "load_optimizer",
    "manifest_path",
    "model_fingerprint",
    "read_manifest",
    "save_lr_scheduler",
    "save_model",
    "save_optimizer",
]


def _check_shard(shard: object) -> None:
    if not isinstance(shard, bool):
        raise TypeError(f"shard must be True (a directory, each rank writing its pieces) or False, got {shard!r}")


# The sharded format's modules import torch.distributed.checkpoint: they are imported by the
# functions that need them, so that DCP loads only when a sharded checkpoint is saved or loaded.


# --- model ------------------------------------------------------------------------------------
def save_model(model: ChunkedModel, path: str | os.PathLike[str], shard: bool = False) -> None:
    """Full fp32 weights and buffers under the module's own names, gathered to rank 0 chunk by
    chunk and written there, with its manifest; with ``shard=True``, a directory to which every
    rank writes its own pieces (nothing is gathered). A collective: every rank calls it."""
    _check_shard(shard)

    def pieces() -> Mapping[str, Entry]:
        from .sharded_model import model_save_entries

        return model_save_entries(model)

    if shard:
        model.runtime.enter_state_access("saving a sharded model checkpoint")
        model.runtime.finish_backward()
    save(
        "model",
        Path(path),
        model.manager,
        model.progress,
        model_tensors(model),
        lambda: model.full_state_dict(Destination.FIRST_RANK),
        pieces if shard else None,
    )


def load_model(model: ChunkedModel, path: str | os.PathLike[str], strict: bool = True, verify: bool = True) -> Any:
    """Load full weights into the master shards and buffers: every rank reads and verifies the file
    (only the slices it holds are read), the ranks agree, then every rank writes. A directory is a
    sharded checkpoint: each rank reads the parts of the saved pieces that fall in its own. A
    checkpoint without chunkmem's manifest loads only with ``verify=False``. A collective."""
    target = Path(path)
    model.runtime.finish_backward()

    def saved_for(manifest: Manifest) -> None:
        if strict:
            check_saved_for_model(manifest, model, target)

    def plan(metadata: Metadata) -> Reading[StagedModelLoad]:
        from .sharded_model import plan_model_load

        return plan_model_load(model, strict, target, metadata)

    return load(
        "model",
        target,
        verify,
        model.manager.comm,
        model.progress,
        saved_for,
        lambda contents: model.stage_load(contents, strict, str(target)),
        model.apply_load,
        plan,
    )


# --- optimizer --------------------------------------------------------------------------------
def save_optimizer(optimizer: ChunkOptimizer, path: str | os.PathLike[str], shard: bool = False) -> None:
    """The full optimizer state in PyTorch's format (with the fp16 loss scale), gathered to rank 0
    chunk by chunk and written there, with its manifest; with ``shard=True``, a directory to which
    every rank writes the state of its own pieces. A collective."""
    _check_shard(shard)

    def pieces() -> Mapping[str, Entry]:
        from .sharded_optimizer import optimizer_save_entries

        return optimizer_save_entries(optimizer)

    if shard:
        optimizer.runtime.enter_state_access("saving a sharded optimizer checkpoint")
    save(
        "optimizer",
        Path(path),
        optimizer.manager,
        optimizer.progress,
        optimizer_tensors(optimizer),
        lambda: full_optimizer_state(optimizer, Destination.FIRST_RANK),
        pieces if shard else None,
    )


def load_optimizer(optimizer: ChunkOptimizer, path: str | os.PathLike[str], verify: bool = True) -> None:
    """Load a full optimizer state (from ``save_optimizer``, or plain PyTorch with
    ``verify=False``), cut down to this rank's pieces; verified and agreed on every rank before
    anything changes. A directory is a sharded checkpoint (``save_optimizer(..., shard=True)``). A
    collective."""
    target = Path(path)

    def plan(metadata: Metadata) -> Reading[StagedOptimizerState]:
        from .sharded_optimizer import plan_optimizer_load

        return plan_optimizer_load(optimizer, target, metadata)

    load(
        "optimizer",
        target,
        verify,
        optimizer.communicator,
        optimizer.progress,
        lambda manifest: check_saved_for_optimizer(manifest, optimizer, target),
        lambda contents: stage_optimizer_state(optimizer, contents, str(target)),
        lambda staged: staged.install(optimizer),
        plan,
    )


# --- LR scheduler -----------------------------------------------------------------------------
def save_lr_scheduler(scheduler: Any, path: str | os.PathLike[str], optimizer: ChunkOptimizer) -> None:
    """Write a scheduler's state dict with its manifest (every rank calls it; rank 0 writes)."""
    save("lr_scheduler", Path(path), optimizer.manager, optimizer.progress, [], scheduler.state_dict)


def _stage_scheduler(scheduler: Any, obj: Any, source: str) -> Mapping[str, Any]:
    name = type(scheduler).__name__
    if not isinstance(obj, Mapping):
        raise StateDictMismatchError(f"{source} holds a {type(obj).__name__}, not an LR scheduler state dict")
    current = scheduler.state_dict()
    if set(obj) != set(current):
        raise StateDictMismatchError(
            f"{source} was saved by another LR scheduler class: its keys {sorted(obj)} differ from {name}'s "
            f"{sorted(current)} (nothing was changed). Build the same scheduler class before loading."
        )
    nested = current.get("_schedulers")
    if isinstance(nested, list) and len(obj.get("_schedulers") or []) != len(nested):
        raise StateDictMismatchError(
            f"{source} holds {len(obj.get('_schedulers') or [])} chained schedulers, this {name} has {len(nested)}"
        )
    return obj


def _install_scheduler(scheduler: Any, staged: Mapping[str, Any], target: Path) -> None:
    """Load ``staged``; a scheduler whose own ``load_state_dict`` refuses it is restored."""
    snapshot = copy.deepcopy(scheduler.state_dict())
    try:
        scheduler.load_state_dict(dict(staged))
    except Exception as error:
        scheduler.load_state_dict(snapshot)
        raise StateDictMismatchError(
            f"{type(scheduler).__name__}.load_state_dict refused {target} ({type(error).__name__}: {error}); the "
            "scheduler was restored to its state before the load"
        ) from error


def load_lr_scheduler(
    scheduler: Any, path: str | os.PathLike[str], optimizer: ChunkOptimizer | None = None, verify: bool = True
) -> None:
    """Load a scheduler state written by ``save_lr_scheduler`` (or plain PyTorch, with
    ``verify=False``). Checked before anything changes; a scheduler whose own ``load_state_dict``
    fails is restored. With the boosted optimizer known (``optimizer``, or the one the scheduler
    was built on) every rank agrees and the step is checked against the model and optimizer loaded
    with it."""
    candidates = (optimizer, getattr(scheduler, "optimizer", None))
    boosted = next((c for c in candidates if isinstance(c, ChunkOptimizer)), None)
    target = Path(path)
    load(
        "lr_scheduler",
        target,
        verify,
        boosted.communicator if boosted is not None else None,
        boosted.progress if boosted is not None else None,
        lambda manifest: None,
        lambda contents: _stage_scheduler(scheduler, contents, str(target)),
        lambda staged: _install_scheduler(scheduler, staged, target),
    )
