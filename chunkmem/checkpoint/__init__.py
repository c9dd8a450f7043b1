"""Checkpoints you can trust, in plain PyTorch's own formats (the manual's "Checkpoints" page).

The model file is the wrapped module's full fp32 ``state_dict``, the optimizer file a full
``Optimizer.state_dict`` over the original parameters (gathered to rank 0 chunk by chunk); with
``shard=True`` either is a ``torch.distributed.checkpoint`` directory to which every rank writes its
own pieces (``sharded``, which imports DCP: it is imported only when a sharded checkpoint is
saved or loaded). Both load at any world size, chunk size or placement, verified against their
manifest (``manifest``), and a refused load changes nothing.

The verbs say what each kind of state is (how it is gathered or listed in pieces, checked, staged
and installed); ``_save`` and ``_load`` do the rest, the same for every kind and both formats.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..compat.torch import CHAINED_SCHEDULERS_KEY
from ..errors import CheckpointError, CheckpointWriteError, StateDictMismatchError
from ..execution.gather import Destination
from ..optim import ChunkOptimizer
from ..optim.state_dict import full_optimizer_state, stage_optimizer_state
from ..ranks.agreement import agree, on_first_rank
from .files import atomic_save, read_checkpoint, write_checkpoint
from .kept import check_pairing, drop_kept
from .loadable import check_loadable
from .manifest import (
    Kind,
    Manifest,
    Record,
    TensorEntry,
    check_saved_for_model,
    check_saved_for_optimizer,
    manifest_path,
    model_fingerprint,
    model_tensors,
    optimizer_tensors,
    read_manifest,
)
from .workspace import interrupted_saves

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from ..boosted.model import ChunkedModel
    from ..boosted.model_state import StagedModelLoad
    from ..boosted.progress import TrainingProgress
    from ..chunks.manager import ChunkManager
    from ..optim.state_dict import StagedOptimizerState
    from ..ranks.comm import Communicator
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


# --- the save and load every kind runs, in either format ---------------------------------------
S = TypeVar("S")
R = TypeVar("R")
_NOUN = {"model": "model", "optimizer": "optimizer", "lr_scheduler": "LR scheduler"}
_STATE = {kind: f"{kind.removeprefix('lr_')}.state_dict()" for kind in _NOUN}


def _save(
    kind: Kind,
    target: Path,
    manager: ChunkManager,
    progress: TrainingProgress,
    tensors: list[TensorEntry],
    full_state: Callable[[], Any],
    pieces: Callable[[], Mapping[str, Entry]] | None = None,
) -> None:
    """Save a ``kind`` state of the model ``manager`` holds, at the step ``progress`` is at: the
    file ``target`` of ``full_state()`` (gathered to rank 0, which writes it) or, with ``pieces``,
    the sharded directory ``target`` of what each rank lists. A collective: every rank calls it."""
    comm = manager.comm
    record = Record(kind, progress.step, model_fingerprint(manager), comm.world_size, tensors)
    if pieces is not None:
        from .sharded import save_directory

        save_directory(comm, target, record, pieces)
    else:
        state = full_state()

        def write() -> None:
            check_loadable(state, _STATE[kind], f"{_NOUN[kind]} checkpoint {target}")
            write_checkpoint(state, target, record)

        on_first_rank(comm, f"saving {_NOUN[kind]} checkpoint", write, CheckpointWriteError, str(target))
    for whole in progress.saved(kind, target):
        if comm.rank == 0:
            drop_kept(whole)


def _load(
    kind: Kind,
    target: Path,
    verify: bool,
    comm: Communicator | None,
    progress: TrainingProgress | None,
    saved_for: Callable[[Manifest], None],
    stage: Callable[[Any], S],
    install: Callable[[S], R],
    plan: Callable[[Metadata], Reading[S]] | None = None,
) -> R:
    """Load the ``kind`` checkpoint ``target``: read and verify it (a checkpoint without a
    manifest only with ``verify=False``), check that it was ``saved_for`` this owner and at the
    step of what was loaded with it (``progress``), check and stage its state (``stage`` of a
    file's contents; ``plan`` of a directory's DCP metadata, a directory being read only when a
    ``plan`` is given), agree over ``comm`` (``None``: this process alone), then ``install`` what
    was staged and continue from its step. Nothing changes unless every rank staged it."""

    def check(manifest: Manifest | None) -> None:
        if manifest is not None:
            saved_for(manifest)
            if progress is not None:
                conflicts = progress.pairing_conflicts(kind, manifest.step)
                check_pairing(_NOUN[kind], manifest.step, target, conflicts, progress.reloading(kind))

    # a directory, or a path a directory save was interrupted at (its previous checkpoint waits in
    # the save's workspace)
    sharded = target.is_dir() or (not target.exists() and bool(interrupted_saves(target)))
    if plan is not None and sharded:
        from .sharded import load_directory

        assert comm is not None, "a model and an optimizer have their ranks"

        def checked_plan(manifest: Manifest | None, metadata: Metadata) -> Reading[S]:
            check(manifest)
            return plan(metadata)

        staged, manifest = load_directory(comm, target, kind, checked_plan, verify)
    else:

        def read() -> tuple[S, Manifest | None]:
            contents, manifest = read_checkpoint(target, kind, verify)
            check(manifest)
            return stage(contents), manifest

        what = f"loading {_NOUN[kind]} checkpoint"
        staged, manifest = read() if comm is None else agree(comm, what, read, CheckpointError, str(target))
    result = install(staged)
    if manifest is not None and progress is not None:
        progress.loaded(kind, manifest.step, target)
    return result


# --- model ------------------------------------------------------------------------------------
def _check_shard(shard: object) -> None:
    if not isinstance(shard, bool):
        raise TypeError(f"shard must be True (a directory, each rank writing its pieces) or False, got {shard!r}")


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
    _save(
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

    return _load(
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
    _save(
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

    _load(
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
    _save("lr_scheduler", Path(path), optimizer.manager, optimizer.progress, [], scheduler.state_dict)


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
    nested = current.get(CHAINED_SCHEDULERS_KEY)
    saved = obj.get(CHAINED_SCHEDULERS_KEY) or []
    if isinstance(nested, list) and len(saved) != len(nested):
        raise StateDictMismatchError(f"{source} holds {len(saved)} chained schedulers, this {name} has {len(nested)}")
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
    _load(
        "lr_scheduler",
        target,
        verify,
        boosted.communicator if boosted is not None else None,
        boosted.progress if boosted is not None else None,
        lambda manifest: None,
        lambda contents: _stage_scheduler(scheduler, contents, str(target)),
        lambda staged: _install_scheduler(scheduler, staged, target),
    )
