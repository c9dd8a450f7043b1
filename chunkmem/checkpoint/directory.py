"""Sharded checkpoint directories on disk: atomic replacement and verification.

A sharded checkpoint is a directory written by ``torch.distributed.checkpoint`` (DCP: one data
file per saving rank and DCP's ``.metadata``) plus its manifest, ``chunkmem.json`` (see
:mod:`~chunkmem.checkpoint.manifest`), which records the size and SHA-256 of every other file in
it. Loading verifies the files (the ranks share the work) before DCP reads anything, so a
corrupted, truncated or swapped file is refused as for single files.

Saving is atomic at the directory level. The ranks write into ``checkpoint/`` of a workspace rank 0
creates beside the target (:class:`~chunkmem.checkpoint.workspace.Workspace`: a random name, a
marker, a lock held while it lives), rank 0 writes the manifest last, then swaps the new directory
into place in one ``renameat2(RENAME_EXCHANGE)`` (Linux; the previous checkpoint comes out inside
the workspace, which is deleted). Where the filesystem cannot exchange, the previous directory is
first moved into the workspace, then the new one into place; a save killed between the two renames
leaves the previous checkpoint there, and the next save to the target moves it back. Only an
empty directory or a chunkmem checkpoint of the same kind holding nothing but its own files is
ever replaced: another kind's checkpoint, or a directory holding anything else, is refused, never
deleted.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from pathlib import Path

from ..errors import CheckpointCorruptedError, CheckpointWriteError
from .kept import check_keepable, keep_directory
from .manifest import MANIFEST_NAME, Kind, Manifest, a_kind, check_digest, digest_of, plain_name, read_manifest
from .workspace import PREVIOUS, Workspace, fsync_directory, interrupted_saves, open_workspace, write_durably

__all__ = [
    "DCP_METADATA",
    "WRITE_INTO",
    "check_replaceable",
    "inside",
    "install",
    "is_sharded",
    "make_workspace",
    "verify_files",
]

DCP_METADATA = ".metadata"
# --- writing ----------------------------------------------------------------------------------
WRITE_INTO = "checkpoint"
"""The entry of a save's workspace that the ranks write the new directory into."""


def is_sharded(target: Path) -> bool:
    """Whether ``target`` names a sharded checkpoint: a directory, or a path a directory save was
    interrupted at (its previous checkpoint waits in the save's workspace)."""
    if target.is_dir():
        return True
    return not target.exists() and bool(interrupted_saves(target))


def check_replaceable(target: Path, kind: Kind) -> Manifest | None:
    """Refuse a target that is a file, or a directory that is not empty and not exactly a chunkmem
    checkpoint of the same kind (a save replaces the whole directory, so it never deletes what an
    earlier save of this kind did not write: another kind's checkpoint, files put there since).
    Returns the manifest of the checkpoint it would replace, if any."""
    if not target.exists():
        return None
    if not target.is_dir() or target.is_symlink():
        raise CheckpointWriteError(
            f"cannot write a sharded checkpoint at {target}: a file is there (a sharded checkpoint is a directory). "
            "Choose another path, or remove the file."
        )
    present = {entry.name for entry in target.iterdir()}
    if not present:
        return None
    if MANIFEST_NAME not in present:
        raise CheckpointWriteError(
            f"cannot write a sharded checkpoint at {target}: the directory holds files that are not a chunkmem "
            f"checkpoint (it has no {MANIFEST_NAME}), and saving replaces the whole directory. Choose another path, "
            "or empty it."
        )
    try:
        manifest = read_manifest(target, directory=True)
    except CheckpointCorruptedError as error:
        raise CheckpointWriteError(
            f"cannot replace the checkpoint at {target}: {error}. Remove the directory to save there."
        ) from error
    assert manifest is not None and manifest.files is not None, f"{MANIFEST_NAME} is present"
    if manifest.kind != kind:
        raise CheckpointWriteError(
            f"cannot write a sharded {kind} checkpoint at {target}: it holds {a_kind(manifest.kind)} checkpoint, "
            f"which this save would replace. Give each state its own directory (e.g. {target / kind})."
        )
    extra = sorted(present - set(manifest.files) - {MANIFEST_NAME})
    if extra:
        raise CheckpointWriteError(
            f"cannot replace the checkpoint at {target}: it also holds {extra[:3]}, which the checkpoint does not list "
            "and saving would delete. Move them elsewhere, or save to another path."
        )
    return manifest


def make_workspace(target: Path, kind: Kind) -> Workspace:
    """On the first rank: clean up after killed saves to ``target``, check that it may be replaced
    by a ``kind`` checkpoint, and create the workspace whose ``checkpoint/`` the ranks write into."""
    return open_workspace(target, lambda: check_replaceable(target, kind), WRITE_INTO)


def _exchange(first: Path, second: Path) -> bool:
    """Swap two directories in one step (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where
    the system or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(second))


def install(workspace: Workspace, target: Path, manifest: Manifest) -> None:
    """On the first rank: write the manifest into the new directory (durably), then put it in
    place of ``target`` atomically; the previous checkpoint is kept (:mod:`.kept`) when it holds
    another step, else deleted with the workspace."""
    replaced = check_replaceable(target, manifest.kind)
    if replaced is not None and replaced.step != manifest.step:
        check_keepable(target)
    new = workspace / WRITE_INTO
    write_durably(new / MANIFEST_NAME, manifest.model_dump_json(indent=1))
    fsync_directory(new)
    old = new
    if not target.exists():
        os.rename(new, target)
    elif not _exchange(new, target):
        old = workspace / PREVIOUS
        os.rename(target, old)
        try:
            os.rename(new, target)
        except OSError:
            os.rename(old, target)
            raise
    fsync_directory(target.parent)
    keep_directory(target, old, replaced, manifest.step)
    workspace.remove()


# --- reading ---------------------------------------------------------------------------------
def inside(directory: Path, name: str) -> Path:
    """``directory / name``, refused when it leads out of ``directory`` (a path or a link)."""
    path = directory / name
    if not plain_name(name) or (path.is_symlink() and path.resolve().parent != directory.resolve()):
        raise CheckpointCorruptedError(
            f"checkpoint directory {directory} refers to {name!r}, which is not a file of the directory (a path or a "
            "link leading out of it); nothing outside a checkpoint is read. Load an intact copy or an earlier "
            "checkpoint."
        )
    return path


def verify_files(directory: Path, manifest: Manifest, rank: int, world_size: int) -> None:
    """Check this rank's share of the files against the manifest: DCP's ``.metadata`` on every
    rank (each unpickles it), the data files round robin, so that together the ranks read each
    file once."""
    files = manifest.files or {}
    if DCP_METADATA not in files:
        raise CheckpointCorruptedError(
            f"the manifest of {directory} lists no {DCP_METADATA}: it is not a DCP checkpoint"
        )
    data = sorted(name for name in files if name != DCP_METADATA)
    for name in [DCP_METADATA, *data[rank::world_size]]:
        path = inside(directory, name)
        try:
            actual = digest_of(path)
        except FileNotFoundError:
            raise CheckpointCorruptedError(
                f"checkpoint file {path} is missing: the manifest of {directory} lists it. The directory was damaged "
                "or partly copied; load an intact copy or an earlier checkpoint."
            ) from None
        except OSError as error:
            raise CheckpointCorruptedError(f"cannot read checkpoint file {path}: {error}") from error
        check_digest(path, actual, files[name], directory / MANIFEST_NAME, directory)
