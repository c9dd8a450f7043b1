"""The checkpoint a save replaced, kept until the set it belongs to is whole again (README.md: a
model, an optimizer and a scheduler file of one step; a kill between their saves must not leave
only files of two steps). A save that replaces a checkpoint of another step keeps it, with its
manifest, in ``.<name>.chunkmem-kept/<name>`` beside the target (a directory chunkmem owns: a marker
names the target), a file by a hard link (no copy), a directory by a rename. The kept copies go once
the set is whole again (:meth:`~chunkmem.boosted.progress.TrainingProgress.saved`); a load that finds
files of two steps names the kept ones that make a set (:func:`check_pairing`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

from ..errors import CheckpointError, CheckpointMismatchError, CheckpointWriteError
from .manifest import Manifest, manifest_path, read_manifest
from .workspace import fsync_directory, write_durably

__all__ = ["check_keepable", "check_pairing", "drop_kept", "keep_directory", "keep_file", "kept_path"]

_SUFFIX = ".chunkmem-kept"
_MARKER = ".chunkmem-kept"


def _kept_dir(target: Path) -> Path:
    return target.parent / f".{target.name}{_SUFFIX}"


def kept_path(target: Path) -> Path:
    """Where the checkpoint a save to ``target`` replaced is kept (under its own name)."""
    return _kept_dir(target) / target.name


def _marker_text(target: Path) -> str:
    return json.dumps({"chunkmem": "kept checkpoint", "target": target.name})


def _owned(target: Path) -> bool:
    """Whether the kept directory of ``target`` is chunkmem's (its marker says so; no links)."""
    marker = _kept_dir(target) / _MARKER
    try:
        return (
            not _kept_dir(target).is_symlink()
            and not marker.is_symlink()
            and marker.read_text() == _marker_text(target)
        )
    except OSError:
        return False


def drop_kept(target: Path) -> None:
    """Delete what is kept for ``target``; a directory of that name that chunkmem did not make stays."""
    if _owned(target):
        shutil.rmtree(_kept_dir(target), ignore_errors=True)


def check_keepable(target: Path) -> None:
    """Refuse a save whose replaced checkpoint could not be kept: a directory of the kept one's name
    is there that chunkmem did not make (checked before anything is replaced)."""
    directory = _kept_dir(target)
    if (directory.exists() or directory.is_symlink()) and not _owned(target):
        raise CheckpointWriteError(
            f"cannot keep the checkpoint {target} replaces: {directory} is there and chunkmem did not make it. "
            "Move it away; nothing was written."
        )


def _fresh(target: Path) -> Path:
    """An empty kept directory of ``target`` (what it held before is dropped)."""
    check_keepable(target)
    drop_kept(target)
    directory = _kept_dir(target)
    directory.mkdir()
    write_durably(directory / _MARKER, _marker_text(target))
    return directory


def _link_or_copy(source: Path, destination: Path) -> None:
    try:
        os.link(source, destination)
    except OSError as error:
        if error.errno not in (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        shutil.copy2(source, destination)


def keep_file(target: Path, step: int, current: Manifest | None) -> None:
    """Before a save of ``step`` replaces the file ``target`` (described by the manifest ``current``;
    ``None`` when missing or damaged: its file would not load verified anyway): keep it, with its
    manifest, when it holds another step."""
    if current is None or current.step == step or not target.is_file():
        return
    directory = _fresh(target)
    _link_or_copy(manifest_path(target), directory / manifest_path(target).name)
    _link_or_copy(target, directory / target.name)
    fsync_directory(directory)


def keep_directory(target: Path, old: Path, replaced: Manifest | None, step: int) -> None:
    """After a save of ``step`` swapped the directory ``target`` in, the previous one being at
    ``old`` (described by ``replaced``): keep it when it holds another step."""
    if replaced is not None and replaced.step != step:
        directory = _fresh(target)
        os.rename(old, directory / target.name)
        fsync_directory(directory)


def _kept_step(path: Path) -> int | None:
    if not _owned(path):
        return None
    kept = kept_path(path)
    try:
        manifest = read_manifest(kept, directory=kept.is_dir())
    except CheckpointError:
        return None
    return None if manifest is None else manifest.step


def check_pairing(kind: str, step: int, path: Path, others: list[tuple[str, int, Path]], reloading: bool) -> None:
    """Refuse a ``kind`` checkpoint ``path`` of ``step`` when ``others`` (kind, step, path) were just
    loaded from another step, naming the kept checkpoints that make one set, where there are. A
    load that redoes one of the set's (``reloading``: this kind was loaded since the last step) is
    following that fix: a loaded checkpoint whose kept one is of ``step`` is loaded next."""
    if reloading:
        others = [other for other in others if _kept_step(other[2]) != step]
    if not others:
        return
    loaded = "; ".join(f"the {k} state was just loaded from {p}, saved at step {s}" for k, s, p in others)
    text = f"{kind} checkpoint {path} was saved at step {step}, but {loaded}: they belong to different checkpoints"
    steps = {other_step for _, other_step, _ in others}
    if len(steps) == 1 and _kept_step(path) in steps:
        fix = f"the {kind} checkpoint of step {steps.pop()} is kept: load {kept_path(path)} instead"
    elif all(_kept_step(other_path) == step for _, _, other_path in others):
        kept = ", then ".join(f"{kept_path(other_path)} ({other_kind})" for other_kind, _, other_path in others)
        fix = f"a save of the set was interrupted before {path.name}, and step {step} is kept: load {kept}, then this"
    else:
        fix = (
            "no checkpoints of one step are kept for these files: load the model, optimizer and scheduler from one "
            "set saved together (the same step in each)"
        )
    raise CheckpointMismatchError(f"{text}. Nothing was changed; {fix}.")
