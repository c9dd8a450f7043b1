"""Sharded checkpoint directories on disk: the manifest, atomic replacement, verification.

A sharded checkpoint is a directory written by ``torch.distributed.checkpoint`` (DCP: one data
file per saving rank and DCP's ``.metadata``) plus ``chunkmem.json`` (a
:class:`DirectoryManifest`): what kind of state it holds, the size and SHA-256 of every other file
in it, the step it was saved at and a fingerprint of the model. Loading verifies the files (the
ranks share the work) before DCP reads anything, so a corrupted, truncated or swapped file, a
directory of another model, or a model and optimizer from different steps are refused as for
single files.

Saving is atomic at the directory level. The ranks write into ``checkpoint/`` of a workspace rank 0
creates beside the target (:class:`~chunkmem.checkpoint.workspace.Workspace`: a random name, a
marker, a lock held while it lives), rank 0 writes the manifest last, then swaps the new directory
into place in one ``renameat2(RENAME_EXCHANGE)`` (Linux; the previous checkpoint comes out inside
the workspace, which is deleted). Where the filesystem cannot exchange, the previous directory is
first moved into the workspace, then the new one into place; a save killed between the two renames
leaves the previous checkpoint there, and the next save to the target moves it back.
Workspaces of killed saves are removed by the next save to the same target; nothing else beside
the target is touched. Only an empty directory or a chunkmem checkpoint of the same kind holding
nothing but its own files is ever replaced: another kind's checkpoint, or a directory holding
anything else, is refused, never deleted.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import CheckpointCorruptedError, CheckpointMismatchError, CheckpointWriteError
from .files import (
    FileDigest,
    TensorEntry,
    check_seal,
    digest_of,
    fsync_directory,
    plain_name,
    seal,
)
from .workspace import PREVIOUS, Workspace, interrupted_saves, remove_dead_workspaces

__all__ = [
    "DCP_METADATA",
    "MANIFEST_NAME",
    "WRITE_INTO",
    "DirectoryManifest",
    "ShardedKind",
    "check_kind",
    "check_replaceable",
    "inside",
    "install",
    "is_sharded",
    "make_workspace",
    "read_directory_manifest",
    "verify_files",
]

MANIFEST_NAME = "chunkmem.json"
DCP_METADATA = ".metadata"
ShardedKind = Literal["model", "optimizer"]
_LOAD_WITH = {"model": "load_model", "optimizer": "load_optimizer"}
_SAVE_WITH = {"model": "save_model", "optimizer": "save_optimizer"}


class DirectoryManifest(BaseModel):
    """What ``<directory>/chunkmem.json`` records about a sharded checkpoint directory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["chunkmem-sharded-checkpoint"] = "chunkmem-sharded-checkpoint"
    version: Literal[1, 2] = 2
    """2: sealed by ``checksum``; 1: written before manifests were sealed (still loaded)."""
    checksum: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """SHA-256 of every other field: an edited step, digest or file list is refused."""
    layout: Literal["torch.distributed.checkpoint"] = "torch.distributed.checkpoint"
    """How the state is stored: a DCP checkpoint of the module's (optimizer's) state dict."""
    kind: ShardedKind
    """Which save wrote it: a model or an optimizer state."""
    files: dict[str, FileDigest]
    """Size and SHA-256 of every other file of the directory, by name."""
    step: int = Field(ge=0)
    """Optimizer steps (``step()`` calls, skipped fp16 steps included) behind the saved state."""
    model_fingerprint: str
    """SHA-256 of the model's parameters (names, shapes, fp32) in registration order."""
    world_size: int = Field(ge=1)
    """World size of the run that saved it (informative: directories load at any world size)."""
    tensors: list[TensorEntry]
    """For a model, every state-dict entry; for an optimizer, its parameters in param group order."""

    @field_validator("files")
    @classmethod
    def _names_inside(cls, files: dict[str, FileDigest]) -> dict[str, FileDigest]:
        outside = [name for name in files if not plain_name(name)]
        if outside:
            raise ValueError(f"{outside[:3]} are not file names inside the directory (no '/', '..' or absolute paths)")
        return files


def read_directory_manifest(directory: Path) -> DirectoryManifest | None:
    """The manifest of ``directory``, or ``None`` when it has none (a DCP checkpoint written
    without chunkmem)."""
    side = directory / MANIFEST_NAME
    try:
        text = side.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise CheckpointCorruptedError(
            f"cannot read the manifest {side} of checkpoint directory {directory}: {error}"
        ) from error
    try:
        manifest = DirectoryManifest.model_validate_json(text)
    except ValidationError as error:
        raise CheckpointCorruptedError(
            f"the manifest {side} of checkpoint directory {directory} is damaged ({error.error_count()} problem(s): "
            f"{error.errors()[0]['msg']}). Restore it from the same checkpoint, or delete it and load {directory} "
            "with verify=False."
        ) from error
    check_seal(manifest, side, f"checkpoint directory {directory}")
    return manifest


# --- writing ----------------------------------------------------------------------------------
WRITE_INTO = "checkpoint"
"""The entry of a save's workspace that the ranks write the new directory into."""


def is_sharded(target: Path) -> bool:
    """Whether ``target`` names a sharded checkpoint: a directory, or a path a directory save was
    interrupted at (its previous checkpoint waits in the save's workspace)."""
    if target.is_dir():
        return True
    return not target.exists() and bool(interrupted_saves(target))


def check_replaceable(target: Path, kind: ShardedKind) -> None:
    """Refuse a target that is a file, or a directory that is not empty and not exactly a chunkmem
    checkpoint of the same kind (a save replaces the whole directory, so it never deletes what an
    earlier save of this kind did not write: another kind's checkpoint, files put there since)."""
    if not target.exists():
        return
    if not target.is_dir() or target.is_symlink():
        raise CheckpointWriteError(
            f"cannot write a sharded checkpoint at {target}: a file is there (a sharded checkpoint is a directory). "
            "Choose another path, or remove the file."
        )
    present = {entry.name for entry in target.iterdir()}
    if not present:
        return
    if MANIFEST_NAME not in present:
        raise CheckpointWriteError(
            f"cannot write a sharded checkpoint at {target}: the directory holds files that are not a chunkmem "
            f"checkpoint (it has no {MANIFEST_NAME}), and saving replaces the whole directory. Choose another path, "
            "or empty it."
        )
    try:
        manifest = read_directory_manifest(target)
    except CheckpointCorruptedError as error:
        raise CheckpointWriteError(
            f"cannot replace the checkpoint at {target}: {error}. Remove the directory to save there."
        ) from error
    assert manifest is not None, f"{MANIFEST_NAME} is present"
    if manifest.kind != kind:
        raise CheckpointWriteError(
            f"cannot write a sharded {kind} checkpoint at {target}: it holds a {manifest.kind} checkpoint, which this "
            f"save would replace. Give each state its own directory (e.g. {target / kind})."
        )
    extra = sorted(present - set(manifest.files) - {MANIFEST_NAME})
    if extra:
        raise CheckpointWriteError(
            f"cannot replace the checkpoint at {target}: it also holds {extra[:3]}, which the checkpoint does not list "
            "and saving would delete. Move them elsewhere, or save to another path."
        )


def make_workspace(target: Path, kind: ShardedKind) -> Workspace:
    """On the first rank: clean up after killed saves to ``target``, check that it may be replaced
    by a ``kind`` checkpoint, and create the workspace whose ``checkpoint/`` the ranks write into."""
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_workspaces(target)
    check_replaceable(target, kind)
    workspace = Workspace(target)
    (workspace / WRITE_INTO).mkdir()
    return workspace


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


def install(workspace: Workspace, target: Path, manifest: DirectoryManifest) -> None:
    """On the first rank: write the manifest into the new directory (durably), then put it in
    place of ``target`` atomically and delete the previous checkpoint with the workspace."""
    check_replaceable(target, manifest.kind)
    new = workspace / WRITE_INTO
    with open(new / MANIFEST_NAME, "w") as f:
        f.write(seal(manifest).model_dump_json(indent=1))
        f.flush()
        os.fsync(f.fileno())
    fsync_directory(new)
    if not target.exists():
        os.rename(new, target)
    elif not _exchange(new, target):
        os.rename(target, workspace / PREVIOUS)
        try:
            os.rename(new, target)
        except OSError:
            os.rename(workspace / PREVIOUS, target)
            raise
    fsync_directory(target.parent)
    workspace.remove()


# --- reading ----------------------------------------------------------------------------------
def check_kind(directory: Path, manifest: DirectoryManifest, kind: ShardedKind) -> None:
    if manifest.kind != kind:
        raise CheckpointMismatchError(
            f"{directory} holds a {manifest.kind} state (written by {_SAVE_WITH[manifest.kind]}), not a {kind} state; "
            f"load it with {_LOAD_WITH[manifest.kind]}"
        )


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


def _verify_file(directory: Path, name: str, expected: FileDigest) -> None:
    path = inside(directory, name)
    try:
        actual = digest_of(path)
    except FileNotFoundError:
        raise CheckpointCorruptedError(
            f"checkpoint file {path} is missing: the manifest of {directory} lists it. The directory was damaged or "
            "partly copied; load an intact copy or an earlier checkpoint."
        ) from None
    except OSError as error:
        raise CheckpointCorruptedError(f"cannot read checkpoint file {path}: {error}") from error
    if actual.size != expected.size:
        what = "truncated" if actual.size < expected.size else "longer than saved"
        raise CheckpointCorruptedError(
            f"checkpoint file {path} is {what}: {actual.size} bytes, the manifest of {directory} says {expected.size}. "
            "It was damaged after saving or the copy was interrupted; load an intact copy or an earlier checkpoint."
        )
    if actual.sha256 != expected.sha256:
        raise CheckpointCorruptedError(
            f"checkpoint file {path} is corrupted: its SHA-256 {actual.sha256[:16]}... differs from the "
            f"{expected.sha256[:16]}... recorded when it was saved. Load an intact copy or an earlier checkpoint; if "
            f"you replaced files on purpose, delete {directory / MANIFEST_NAME} and load the directory with "
            "verify=False."
        )


def verify_files(directory: Path, manifest: DirectoryManifest, rank: int, world_size: int) -> None:
    """Check this rank's share of the files against the manifest: DCP's ``.metadata`` on every
    rank (each unpickles it), the data files round robin, so that together the ranks read each
    file once."""
    if DCP_METADATA not in manifest.files:
        raise CheckpointCorruptedError(
            f"the manifest of {directory} lists no {DCP_METADATA}: it is not a DCP checkpoint"
        )
    _verify_file(directory, DCP_METADATA, manifest.files[DCP_METADATA])
    data = sorted(name for name in manifest.files if name != DCP_METADATA)
    for name in data[rank::world_size]:
        _verify_file(directory, name, manifest.files[name])
