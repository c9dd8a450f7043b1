"""Directories chunkmem makes among a user's files and removes again: a checkpoint save's workspace,
the disk tier's scratch space. One mechanism for both says which directories are chunkmem's and
which of those nobody uses any more.

An owned directory holds a marker file whose text follows from the directory's name (its random
token and what it is for). Its process creates the marker empty, takes an exclusive ``flock`` on
it, and only then writes the text, and holds the lock for as long as it uses the directory (a lock
dies with its process). So a directory is **dead** exactly when its marker is there, says what its
name says, and nobody holds its lock: its process was killed, or collected it without removing it.
A directory being created (no marker yet, an empty marker, a locked one) is never dead, and neither
is one that merely looks like chunkmem's (a marker ``{}`` beside a user's files): only dead
directories are ever removed, and the remover holds their lock while it removes them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import weakref
from collections.abc import Iterator
from pathlib import Path

__all__ = ["OwnedDir", "if_dead", "in_use", "remove_if_dead"]


def _release(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


class OwnedDir:
    """The new directory ``path``, owned by this process: ``marker`` inside it, locked, holding
    ``text``. Its lock is let go when the object is collected (the directory stays, dead, for the
    next reaper: a save's workspace may hold the previous checkpoint); :meth:`remove` deletes it."""

    def __init__(self, path: Path, marker: str, text: bytes) -> None:
        path.mkdir()
        try:
            fd = os.open(path / marker, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # Written once locked: a marker without its text is never taken for a dead directory.
            os.write(fd, text)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            shutil.rmtree(path, ignore_errors=True)
            raise
        self.path = path
        self._release = weakref.finalize(self, _release, fd)

    def remove(self) -> None:
        """Delete the directory and what is left in it, then let go of its lock."""
        shutil.rmtree(self.path, ignore_errors=True)
        self._release()


@contextlib.contextmanager
def if_dead(candidate: Path, marker: str, text: bytes) -> Iterator[bool]:
    """Yields whether ``candidate`` is a dead owned directory whose marker should hold ``text``,
    holding its lock meanwhile (so nobody else removes or reuses it in the block)."""
    fd = -1
    try:
        fd = _locked_if_dead(candidate, marker, text)
        yield fd >= 0
    finally:
        if fd >= 0:
            os.close(fd)


def _locked_if_dead(candidate: Path, marker: str, text: bytes) -> int:
    """The marker of ``candidate``, opened and locked, when it is dead; else -1."""
    if candidate.is_symlink() or not candidate.is_dir():
        return -1
    try:
        fd = os.open(candidate / marker, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return -1
    try:
        if os.read(fd, len(text) + 1) == text:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
    except OSError:  # BlockingIOError: its process is still running
        pass
    os.close(fd)
    return -1


def in_use(candidate: Path, marker: str, text: bytes) -> bool:
    """Whether ``candidate`` is an owned directory whose marker holds ``text`` and whose process
    still holds its lock (a shared probe of the lock fails)."""
    if candidate.is_symlink() or not candidate.is_dir():
        return False
    try:
        fd = os.open(candidate / marker, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if os.read(fd, len(text) + 1) != text:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_if_dead(candidate: Path, marker: str, text: bytes) -> bool:
    """Delete ``candidate`` when it is a dead owned directory (:func:`if_dead`); returns whether it was."""
    with if_dead(candidate, marker, text) as dead:
        if dead:
            shutil.rmtree(candidate, ignore_errors=True)
        return dead
