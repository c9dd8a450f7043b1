"""Checkpoints you can trust, in plain PyTorch's own formats.

* The model file is the wrapped module's full fp32 ``state_dict`` and the optimizer file a full
  ``Optimizer.state_dict`` over the original parameters: they load into chunkmem at any world size,
  chunk size or placement, and into plain PyTorch (``torch.load`` + ``load_state_dict``).
* Saving is a collective: the state is gathered chunk by chunk to rank 0 only (other ranks never
  hold more than one chunk), rank 0 writes atomically, and every rank raises if the write failed.
* Beside each file, a manifest (``<file>.chunkmem.json``) records its checksum, the step and a
  fingerprint of the model. Loading verifies them and refuses a corrupted, truncated or swapped
  file, a file saved for another model, or model and optimizer files from different steps, with a
  message naming the file and the fix. A file without a manifest (from plain PyTorch) loads unverified.
* Loads are transactional: every rank reads and checks its file, the ranks agree, and only then is
  anything written. A refused load leaves model, optimizer and scheduler exactly as they were.
* Sharded checkpoints (``shard=True``) are directories written with ``torch.distributed.checkpoint``:
  every rank writes its own pieces (no rank gathers anything), with a manifest (``chunkmem.json``)
  holding every file's checksum, the step and the model's fingerprint; the directory replaces the
  previous one atomically. A load recognises a directory and reads it at any world size, chunk size
  or placement, with the same verification and the same transaction (see ``sharded``).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, CheckpointMismatchError, CheckpointWriteError, StateDictMismatchError
from .agreement import agree, on_first_rank
from .directory import is_sharded
from .files import (
    Manifest,
    TensorEntry,
    atomic_save,
    manifest_path,
    read_checkpoint,
    read_manifest,
    write_checkpoint,
)
from .gather import Destination
from .identity import describe_difference, model_fingerprint, optimizer_entries
from .optimizer_state import full_optimizer_state, stage_optimizer_state
from .progress import check_pairing, current_step, record_load
from .sharded import SaveRequest, load_directory, save_directory
from .sharded_model import install_model, model_entries, plan_model_load
from .sharded_optimizer import optimizer_save_entries, plan_optimizer_load

if TYPE_CHECKING:
    from ..comm import Communicator
    from ..manager import ChunkManager
    from ..model import ChunkedModel
    from ..optim import ChunkOptimizer

__all__ = [
    "Destination",
    "Manifest",
    "atomic_save",
    "current_step",
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

log = logging.getLogger("chunkmem")


def _check_model(path: Path, manifest: Manifest, manager: ChunkManager, here: list[TensorEntry]) -> None:
    if manifest.model_fingerprint != model_fingerprint(manager):
        raise CheckpointMismatchError(
            f"{path} was saved for another model ({describe_difference(manifest.tensors, here)}). Load a checkpoint of "
            "this model, or boost the model the checkpoint was saved from."
        )


# --- model ------------------------------------------------------------------------------------
def _check_shard(shard: object) -> None:
    if not isinstance(shard, bool):
        raise TypeError(f"shard must be True (a directory, each rank writing its pieces) or False, got {shard!r}")


def save_model(model: ChunkedModel, path: str | os.PathLike[str], shard: bool = False) -> None:
    """Full fp32 weights and buffers under the module's own names, gathered to rank 0 chunk by
    chunk and written there, with its manifest; with ``shard=True``, a directory to which every
    rank writes its own pieces (nothing is gathered). A collective: every rank calls it."""
    _check_shard(shard)
    runtime = model.runtime
    comm = model.manager.comm
    target = Path(path)
    if shard:
        what = "saving a sharded model checkpoint"
        runtime.enter_state_access(what)
        runtime.finish_backward()
        request = SaveRequest("model", current_step(runtime), model_fingerprint(model.manager), model.state_spec())
        save_directory(comm, target, request, lambda: model_entries(model))
        return
    state = model.full_state_dict(Destination.FIRST_RANK)
    step = current_step(runtime)
    fp = model_fingerprint(model.manager)
    spec = model.state_spec()
    on_first_rank(
        comm,
        "saving model checkpoint",
        lambda: write_checkpoint(state, target, "model", step, fp, comm.world_size, spec),
        CheckpointWriteError,
        str(target),
    )


def load_model(model: ChunkedModel, path: str | os.PathLike[str], strict: bool = True, verify: bool = True) -> Any:
    """Load full weights into the master shards and buffers: every rank reads and verifies the file
    (only the slices it holds are read), the ranks agree, then every rank writes. A directory is a
    sharded checkpoint: each rank reads the parts of the saved pieces that fall in its own. A
    checkpoint without chunkmem's manifest loads only with ``verify=False``. A collective."""
    runtime = model.runtime
    target = Path(path)
    runtime.finish_backward()
    if is_sharded(target):
        staged_pieces, directory_manifest = load_directory(
            model.manager.comm, target, "model", plan_model_load(model, strict, target), verify
        )
        result = install_model(model, staged_pieces)
        if directory_manifest is not None:
            record_load(runtime, "model", directory_manifest.step, target)
        return result

    def stage() -> tuple[Any, Manifest | None]:
        obj, manifest = read_checkpoint(target, "model", verify)
        if manifest is not None:
            if strict:
                _check_model(target, manifest, model.manager, model.state_spec())
            check_pairing(runtime, "model", manifest.step, target)
        return model.stage_load(obj, strict, str(target)), manifest

    staged, manifest = agree(model.manager.comm, "loading model checkpoint", stage, CheckpointError, str(target))
    result = model.apply_load(staged)
    if manifest is not None:
        record_load(runtime, "model", manifest.step, target)
    return result


# --- optimizer --------------------------------------------------------------------------------
def save_optimizer(optimizer: ChunkOptimizer, path: str | os.PathLike[str], shard: bool = False) -> None:
    """The full optimizer state in PyTorch's format (with the fp16 loss scale), gathered to rank 0
    chunk by chunk and written there, with its manifest; with ``shard=True``, a directory to which
    every rank writes the state of its own pieces. A collective."""
    _check_shard(shard)
    runtime = optimizer.runtime
    comm = optimizer.manager.comm
    target = Path(path)
    if shard:
        runtime.enter_state_access("saving a sharded optimizer checkpoint")
        request = SaveRequest(
            "optimizer", current_step(runtime), model_fingerprint(optimizer.manager), optimizer_entries(optimizer)
        )
        save_directory(comm, target, request, lambda: optimizer_save_entries(optimizer))
        return
    state = full_optimizer_state(optimizer, Destination.FIRST_RANK)
    step = current_step(runtime)
    fp = model_fingerprint(optimizer.manager)
    entries = optimizer_entries(optimizer)
    on_first_rank(
        comm,
        "saving optimizer checkpoint",
        lambda: write_checkpoint(state, target, "optimizer", step, fp, comm.world_size, entries),
        CheckpointWriteError,
        str(target),
    )


def load_optimizer(optimizer: ChunkOptimizer, path: str | os.PathLike[str], verify: bool = True) -> None:
    """Load a full optimizer state (from ``save_optimizer``, or plain PyTorch with
    ``verify=False``), cut down to this rank's pieces; verified and agreed on every rank before
    anything changes. A directory is a sharded checkpoint (``save_optimizer(..., shard=True)``). A
    collective."""
    runtime = optimizer.runtime
    target = Path(path)
    if is_sharded(target):
        staged_state, directory_manifest = load_directory(
            optimizer.manager.comm, target, "optimizer", plan_optimizer_load(optimizer, target), verify
        )
        staged_state.install(optimizer)
        if directory_manifest is not None:
            record_load(runtime, "optimizer", directory_manifest.step, target)
        return

    def stage() -> tuple[Any, Manifest | None]:
        obj, manifest = read_checkpoint(target, "optimizer", verify)
        if manifest is not None:
            here = optimizer_entries(optimizer)
            if manifest.model_fingerprint != model_fingerprint(optimizer.manager) or manifest.tensors != here:
                raise CheckpointMismatchError(
                    f"optimizer file {target} was saved for an optimizer over other parameters "
                    f"({describe_difference(manifest.tensors, here)}). Load the optimizer file saved with this model."
                )
            check_pairing(runtime, "optimizer", manifest.step, target)
        return stage_optimizer_state(optimizer, obj, str(target)), manifest

    staged, manifest = agree(
        optimizer.manager.comm, "loading optimizer checkpoint", stage, CheckpointError, str(target)
    )
    staged.install(optimizer)
    if manifest is not None:
        record_load(runtime, "optimizer", manifest.step, target)


# --- LR scheduler -----------------------------------------------------------------------------
def _boosted_of(scheduler: Any, optimizer: ChunkOptimizer | None) -> ChunkOptimizer | None:
    from ..optim import ChunkOptimizer

    for candidate in (optimizer, getattr(scheduler, "optimizer", None)):
        if isinstance(candidate, ChunkOptimizer):
            return candidate
    return None


def save_lr_scheduler(scheduler: Any, path: str | os.PathLike[str], optimizer: ChunkOptimizer) -> None:
    """Write a scheduler's state dict with its manifest (every rank calls it; rank 0 writes)."""
    runtime = optimizer.runtime
    comm: Communicator = optimizer.manager.comm
    target = Path(path)
    state = scheduler.state_dict()
    step = current_step(runtime)
    fp = model_fingerprint(optimizer.manager)
    on_first_rank(
        comm,
        "saving LR scheduler checkpoint",
        lambda: write_checkpoint(state, target, "lr_scheduler", step, fp, comm.world_size, []),
        CheckpointWriteError,
        str(target),
    )


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


def load_lr_scheduler(
    scheduler: Any, path: str | os.PathLike[str], optimizer: ChunkOptimizer | None = None, verify: bool = True
) -> None:
    """Load a scheduler state written by ``save_lr_scheduler`` (or plain PyTorch, with
    ``verify=False``). Checked before
    anything changes; a scheduler whose own ``load_state_dict`` fails is restored. With the boosted
    optimizer known (``optimizer``, or the one the scheduler was built on) every rank agrees and
    the step is checked against the model and optimizer loaded with it."""
    boosted = _boosted_of(scheduler, optimizer)
    runtime = boosted.runtime if boosted is not None else None
    target = Path(path)

    def stage() -> tuple[Mapping[str, Any], Manifest | None]:
        obj, manifest = read_checkpoint(target, "lr_scheduler", verify)
        if manifest is not None and runtime is not None:
            check_pairing(runtime, "lr_scheduler", manifest.step, target)
        return _stage_scheduler(scheduler, obj, str(target)), manifest

    if boosted is None:
        staged, manifest = stage()
    else:
        staged, manifest = agree(
            boosted.communicator, "loading LR scheduler checkpoint", stage, CheckpointError, str(target)
        )
    snapshot = copy.deepcopy(scheduler.state_dict())
    try:
        scheduler.load_state_dict(dict(staged))
    except Exception as error:
        scheduler.load_state_dict(snapshot)
        raise StateDictMismatchError(
            f"{type(scheduler).__name__}.load_state_dict refused {target} ({type(error).__name__}: {error}); the "
            "scheduler was restored to its state before the load"
        ) from error
    if manifest is not None and runtime is not None:
        record_load(runtime, "lr_scheduler", manifest.step, target)
