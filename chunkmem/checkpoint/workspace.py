"""Where a save writes before its result replaces the target, and what both formats share: durable
writes, the errors of a failed write or read, and reading again while saves replace what a load reads.

A save to ``<dir>/<name>`` writes into ``<dir>/.<name>.chunkmem-tmp-<token>/``, a directory chunkmem
owns (:mod:`chunkmem.tiers.owned_dir`: only a dead one, whose save was killed, is ever removed). It
also holds the previous checkpoint (:data:`PREVIOUS`) while a save swaps a directory in without an
atomic exchange; a save killed between its two renames leaves it there, and the next save to the
same target puts it back.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ..errors import CheckpointCorruptedError, CheckpointError, CheckpointWriteError, ChunkmemError
from ..tiers.owned_dir import OwnedDir, if_dead, in_use, remove_if_dead

if TYPE_CHECKING:
    from ..ranks.comm import Communicator

__all__ = [
    "KEEP_READING",
    "PREVIOUS",
    "Pinned",
    "Workspace",
    "first_line",
    "fsync_directory",
    "interrupted_saves",
    "open_workspace",
    "read_error",
    "read_while_replaced",
    "write_durably",
    "write_error",
]

T = TypeVar("T")
_INFIX = ".chunkmem-tmp-"
_MARKER = ".chunkmem-workspace"
PREVIOUS = "previous"
"""The entry of a workspace that holds the checkpoint a save is replacing."""


def _marker_text(target_name: str, token: str) -> bytes:
    return json.dumps({"chunkmem": "save workspace", "target": target_name, "token": token}).encode()


class Workspace(OwnedDir):
    """A locked directory beside ``target`` that a save writes into; :meth:`remove` when done."""

    def __init__(self, target: Path) -> None:
        token = secrets.token_hex(8)
        self.target = target
        super().__init__(target.parent / f".{target.name}{_INFIX}{token}", _MARKER, _marker_text(target.name, token))

    def __truediv__(self, name: str) -> Path:
        return self.path / name


def _workspaces(target: Path) -> list[Path]:
    """Entries beside ``target`` named like its workspaces (a name is not proof of anything)."""
    if not target.parent.is_dir():
        return []
    pattern = re.compile(re.escape(f".{target.name}{_INFIX}") + r"([0-9a-f]{16})")
    return sorted(p for p in target.parent.iterdir() if pattern.fullmatch(p.name))


def _marker_of(candidate: Path, target: Path) -> bytes:
    """What the marker of ``candidate``, named like a workspace of ``target``, must say."""
    return _marker_text(target.name, candidate.name.rsplit(_INFIX, 1)[1])


def _check_only_saver(workspace: Workspace) -> None:
    """Refuse a save while another save to the same target runs (another job saving to the same
    path): their renames would interleave, mixing one's manifest with the other's file. Checked
    once this save's workspace exists and is locked, so of two saves starting together at least
    one sees the other."""
    others = [
        w
        for w in _workspaces(workspace.target)
        if w != workspace.path and in_use(w, _MARKER, _marker_of(w, workspace.target))
    ]
    if others:
        raise CheckpointWriteError(
            f"another save to {workspace.target} is running (its workspace {others[0].name} is locked by its process): "
            "two jobs saving to one path would replace each other's files mid-save, and whoever loads it would "
            "read one job's manifest beside the other's files. This save wrote nothing; the other one goes on. "
            "Give each job its own checkpoint path, or stop the other job."
        )


def interrupted_saves(target: Path) -> list[Path]:
    """Previous checkpoints of ``target`` that a killed save left in its workspace."""
    return [w / PREVIOUS for w in _workspaces(target) if (w / PREVIOUS).exists() and not (w / PREVIOUS).is_symlink()]


def _remove_dead_workspaces(target: Path) -> list[Path]:
    """Where ``target`` is missing because a save was killed between moving the previous checkpoint
    into its workspace and the new one into place, move the previous one back; then delete the
    workspaces of ``target`` whose saves are gone. Returns what was deleted."""
    for previous in [] if target.exists() or target.is_symlink() else interrupted_saves(target):
        with if_dead(previous.parent, _MARKER, _marker_of(previous.parent, target)) as dead:
            if dead and previous.exists() and not target.exists():
                os.rename(previous, target)
    return [w for w in _workspaces(target) if remove_if_dead(w, _MARKER, _marker_of(w, target))]


def open_workspace(target: Path, check: Callable[[], None] = lambda: None, entry: str | None = None) -> Workspace:
    """A new workspace for a save to ``target`` (with the empty directory ``entry`` in it, if
    named), once killed saves to it are cleaned up after and ``check`` passed; refused while another
    save to ``target`` runs (:func:`_check_only_saver`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_workspaces(target)
    check()
    workspace = Workspace(target)
    try:
        _check_only_saver(workspace)
        if entry is not None:
            (workspace / entry).mkdir()
    except BaseException:
        workspace.remove()
        raise
    return workspace


def fsync_directory(directory: Path) -> None:
    """Make the entries of ``directory`` (files created or renamed in it) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    """Write ``text`` to the new file ``path`` and flush it to disk."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def write_error(target: Path, error: BaseException, what: str, need: int | None = None) -> ChunkmemError:
    """The error for a write of ``what`` (``"checkpoint file"``, ``"the sharded checkpoint"``) to
    ``target`` that failed with ``error``, with the space left on its disk (against the ``need``
    bytes of what was written, when known). chunkmem's own errors are raised as they are."""
    if isinstance(error, ChunkmemError):
        return error
    try:
        free: int | None = shutil.disk_usage(target.parent).free
    except OSError:
        free = None
    full = isinstance(error, OSError) and error.errno == errno.ENOSPC
    hint = ""
    if free is not None and need is not None and (full or free < need):
        hint = (
            f" The disk holding it has {free} bytes free and the file needs about {need}: free space or save elsewhere."
        )
    elif free is not None:
        hint = f" ({free} bytes free on its disk.)"
    return CheckpointWriteError(
        f"could not write {what} {target}: {type(error).__name__}: {first_line(error)}.{hint} The previous "
        f"checkpoint at {target}, if any, is unchanged."
    )


def read_error(what: str, error: BaseException, meaning: str) -> ChunkmemError:
    """The error for a read of ``what`` (``"checkpoint file x.pt"``) that failed with ``error``, with
    what that ``meaning`` is. chunkmem's own errors are raised as they are."""
    if isinstance(error, ChunkmemError):
        return error
    return CheckpointCorruptedError(
        f"cannot read {what} ({type(error).__name__}: {first_line(error)}); {meaning}. Load an intact copy or an "
        "earlier checkpoint."
    )


KEEP_READING = 120.0
"""Seconds a load reads a checkpoint again while saves keep replacing it, before giving up."""


class Pinned:
    """Holds what ``path`` names open, a file or a directory (its inode cannot be reused), to tell
    afterwards whether the path still names it: a save puts a new one in place with a rename."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self.fd: int | None = None
        with contextlib.suppress(OSError):
            self.fd = os.open(path, os.O_RDONLY)

    def replaced(self) -> bool:
        try:
            now = os.stat(self._path)
        except OSError:
            return self.fd is not None
        if self.fd is None:
            return True
        held = os.fstat(self.fd)
        return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read_while_replaced(path: Path, what: str, attempt: Callable[[Pinned], T], comm: Communicator | None = None) -> T:
    """``attempt`` with ``path`` pinned, again while saves replace what ``path`` names during it (a
    replaced checkpoint is not a damaged one), for up to :data:`KEEP_READING` seconds. With ``comm``
    the ranks decide together (a collective: no two ranks read different saves), and ``attempt``
    raises the same ``CheckpointError`` on every rank or on none."""
    deadline = time.monotonic() + KEEP_READING
    attempts = 0
    while True:
        attempts += 1
        failure: CheckpointError | None = None
        pinned = Pinned(path)
        try:
            result = attempt(pinned)
        except CheckpointError as error:
            failure = error
        finally:
            replaced, expired = pinned.replaced(), time.monotonic() > deadline
            pinned.close()
        if comm is not None and comm.world_size > 1:
            everyone = comm.all_gather_object((replaced, expired))
            replaced, expired = any(r for r, _ in everyone), any(e for _, e in everyone)
        if not replaced:
            if failure is not None:
                raise failure
            return result
        if expired:
            raise CheckpointError(
                f"{what} was replaced by a save during each of {attempts} reads in {KEEP_READING:.0f} s: another "
                "process keeps saving to it. Nothing was loaded; load it when those saves stop, or load a copy."
            )
