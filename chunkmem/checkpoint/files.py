"""The single-file format: a plain ``torch.save`` file and its manifest beside it
(``<file>.chunkmem.json``), replaced together.

A save writes and flushes both in a workspace (:mod:`.workspace`), then renames the manifest into
place, then the file. The new manifest also describes the file it replaces (``previous``), so a
reader between the two renames, or a save killed between them, finds the old file verified; before
them the old pair is untouched, after them the new pair is whole. Reads use
``torch.load(weights_only=True)`` and check the same inode they load.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointCorruptedError, CheckpointMismatchError
from .kept import keep_file
from .manifest import (
    FileDigest,
    Kind,
    Manifest,
    Record,
    check_digest,
    check_kind,
    digest_of,
    manifest_for_load,
    manifest_path,
    read_manifest,
)
from .workspace import (
    Pinned,
    Workspace,
    fsync_directory,
    open_workspace,
    read_error,
    read_while_replaced,
    write_durably,
    write_error,
)

__all__ = ["atomic_save", "read_checkpoint", "write_checkpoint"]


# --- writing ----------------------------------------------------------------------------------
class _HashingWriter(io.RawIOBase):
    """Passes bytes to a file while hashing and counting them."""

    def __init__(self, file: Any) -> None:
        super().__init__()
        self._file = file
        self._hash = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        written = self._file.write(data)
        self._hash.update(memoryview(data)[:written])
        self.size += written
        return written

    def flush(self) -> None:
        self._file.flush()

    def digest(self) -> FileDigest:
        return FileDigest(size=self.size, sha256=self._hash.hexdigest())


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(_nbytes(v) for v in obj)
    return 0


def _write_into(obj: Any, path: Path) -> FileDigest:
    """``torch.save`` into ``path`` (a workspace entry), durably; its size and SHA-256."""
    with open(path, "wb") as f:
        writer = _HashingWriter(f)
        torch.save(obj, writer)
        writer.flush()
        os.fsync(f.fileno())
    return writer.digest()


def write_checkpoint(obj: Any, path: str | os.PathLike[str], record: Record | None) -> None:
    """``torch.save`` ``obj`` into a fresh workspace of ``path`` and, with a ``record``, its manifest,
    then rename them into place (the manifest first: see the module's docstring) and flush the
    directory. Failures name ``path``; the workspace goes."""
    target = Path(path)
    workspace: Workspace | None = None
    try:
        workspace = open_workspace(target)
        digest = _write_into(obj, workspace / "data")
        if record is not None:
            previous = _current_manifest(target)
            keep_file(target, record.step, previous)
            manifest = record.manifest(file=target.name, digest=digest, previous=previous)
            write_durably(workspace / "manifest", manifest.model_dump_json(indent=1))
            os.replace(workspace / "manifest", manifest_path(target))
        os.replace(workspace / "data", target)
        fsync_directory(target.parent)
    except (OSError, RuntimeError) as error:
        raise write_error(target, error, "checkpoint file", _nbytes(obj)) from error
    finally:
        if workspace is not None:
            workspace.remove()


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to ``path`` so that readers see either the old file or the whole new one.
    Raises :class:`CheckpointWriteError` (an ``OSError``) naming the file when the write fails."""
    write_checkpoint(obj, path, None)
    return Path(path)


def _current_manifest(target: Path) -> Manifest | None:
    """The manifest now beside ``target`` (without its own ``previous``), to describe the file a
    save replaces. Not checked against the file: a pair that does not match now is refused in the
    window as it is now, and hashing the old file would cost a full read per save."""
    try:
        manifest = read_manifest(target)
    except CheckpointCorruptedError:
        manifest = None
    return None if manifest is None else manifest.model_copy(update={"previous": None, "checksum": None, "version": 2})


# --- reading ----------------------------------------------------------------------------------
def _load(target: Path) -> Any:
    try:
        try:
            return torch.load(target, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            return torch.load(target, map_location="cpu", weights_only=True)
    except Exception as error:
        raise read_error(
            f"checkpoint file {target}", error, "it is truncated, damaged or not a torch.save file"
        ) from error


def read_checkpoint(path: str | os.PathLike[str], kind: Kind, verify: bool = True) -> tuple[Any, Manifest | None]:
    """Verify ``path`` against its manifest (:func:`manifest_for_load`), then load it memory-mapped
    (a rank reads only the slices it uses). A save that replaces it meanwhile is not damage: the
    file checked is the one loaded (the same inode, held open), or the read starts again."""
    target = Path(path)

    def attempt(pinned: Pinned) -> tuple[Any, Manifest | None]:
        if pinned.fd is None or not target.is_file():
            raise CheckpointCorruptedError(
                f"checkpoint file {target} does not exist or is not a file"
                + (" (it is a directory)" if target.is_dir() else "")
            )
        manifest = manifest_for_load(target, verify)
        if manifest is None:
            return _load(target), None
        actual = digest_of(pinned.fd)
        chosen = manifest
        if actual != manifest.digest and manifest.previous is not None and actual == manifest.previous.digest:
            chosen = manifest.previous  # a save is between renaming its manifest and its file
        check_kind(target, chosen, kind)
        if chosen.file != target.name:
            raise CheckpointMismatchError(
                f"the manifest beside {target} describes the file '{chosen.file}': the files were renamed or "
                "swapped. Rename them back together (a file and its .chunkmem.json keep the same base name)."
            )
        assert chosen.digest is not None, "a file's manifest has its digest"
        check_digest(target, actual, chosen.digest, manifest_path(target), target)
        return _load(target), chosen

    return read_while_replaced(target, f"checkpoint file {target}", attempt)
