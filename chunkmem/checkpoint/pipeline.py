"""One pipeline for every kind of state, in two formats: a single file (:mod:`.files`) or a sharded
directory (:mod:`.sharded`, which imports ``torch.distributed.checkpoint``: it is imported only when
a sharded checkpoint is saved or loaded). What a state is, how it is checked and installed, is the
caller's (the verbs of :mod:`chunkmem.checkpoint`); everything else is the same for every state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import CheckpointError, CheckpointWriteError
from ..ranks.agreement import agree, on_first_rank
from .files import read_checkpoint, write_checkpoint
from .kept import check_pairing, drop_kept
from .loadable import check_loadable
from .manifest import Kind, Manifest, Record, TensorEntry, model_fingerprint
from .workspace import interrupted_saves

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from ..boosted.progress import TrainingProgress
    from ..chunks.manager import ChunkManager
    from ..ranks.comm import Communicator
    from .dcp_layout import Entry
    from .sharded import Reading

__all__ = ["load", "save"]

S = TypeVar("S")
R = TypeVar("R")
_NOUN = {"model": "model", "optimizer": "optimizer", "lr_scheduler": "LR scheduler"}
_STATE = {kind: f"{kind.removeprefix('lr_')}.state_dict()" for kind in _NOUN}


def save(
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


def load(
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
