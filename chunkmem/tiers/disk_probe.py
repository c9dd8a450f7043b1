"""How fast a disk tier directory is: a file written and read back the way the disk tier does
(``os.pwritev`` / ``os.preadv`` in a scratch directory chunkmem owns under ``disk_dir``), timed.

The write is timed to its ``fsync`` (to the disk, not to the page cache), and the file's pages are
then dropped from the page cache (``POSIX_FADV_DONTNEED``) before it is read, so the read is timed
from the disk too where the kernel honours the advice; ``cached_read`` says whether it could be
asked. A small file on a machine with much free memory still measures the disk's burst speed,
not what a long run sustains; the report says so."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import DiskTierError
from .disk import DISK_BLOCK, ScratchDir

__all__ = ["DiskSpeed", "probe_disk"]


@dataclass(frozen=True)
class DiskSpeed:
    """One probe of ``directory``: what was written and read, how long each took, the free space."""

    directory: str
    nbytes: int
    write_seconds: float | None
    read_seconds: float | None
    free_bytes: int | None
    dropped_cache: bool
    """Whether the page cache was asked to drop the file before the read (Linux: ``posix_fadvise``)."""
    error: str | None
    """Why the directory could not be probed (missing, not writable, full), as the disk tier says it."""

    def write_bytes_per_second(self) -> float | None:
        return self.nbytes / self.write_seconds if self.write_seconds else None

    def read_bytes_per_second(self) -> float | None:
        return self.nbytes / self.read_seconds if self.read_seconds else None


def _transfer(fd: int, view: memoryview, write: bool) -> None:
    done = 0
    while done < len(view):
        piece = view[done:]
        moved = os.pwritev(fd, [piece], done) if write else os.preadv(fd, [piece], done)
        if moved <= 0:
            raise OSError(f"{'write' if write else 'read'} stopped at {done} of {len(view)} bytes")
        done += moved


def probe_disk(directory: str | os.PathLike[str], nbytes: int) -> DiskSpeed:
    """Write ``nbytes`` (rounded up to the disk tier's block) to a new file in a scratch directory
    under ``directory``, ``fsync`` it, drop it from the page cache, read it back; the directory is
    removed afterwards."""
    nbytes = max(DISK_BLOCK, -(-nbytes // DISK_BLOCK) * DISK_BLOCK)
    free = shutil.disk_usage(directory).free if Path(directory).is_dir() else None
    try:
        scratch = ScratchDir(directory, rank=0)
    except DiskTierError as error:
        return DiskSpeed(os.fspath(directory), nbytes, None, None, free, False, str(error))
    data = bytearray(os.urandom(DISK_BLOCK) * (nbytes // DISK_BLOCK))
    view = memoryview(data)
    dropped = False
    try:
        fd = os.open(scratch.path / "probe.bin", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            begin = time.perf_counter()
            _transfer(fd, view, write=True)
            os.fsync(fd)
            write_seconds = time.perf_counter() - begin
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
                dropped = True
            back = bytearray(nbytes)
            begin = time.perf_counter()
            _transfer(fd, memoryview(back), write=False)
            read_seconds = time.perf_counter() - begin
        finally:
            os.close(fd)
    except OSError as error:
        return DiskSpeed(os.fspath(directory), nbytes, None, None, free, dropped, f"{scratch.path}: {error}")
    finally:
        scratch.close()
    if back != data:
        return DiskSpeed(
            os.fspath(directory), nbytes, write_seconds, read_seconds, free, dropped, "read back other bytes"
        )
    return DiskSpeed(os.fspath(directory), nbytes, write_seconds, read_seconds, free, dropped, None)
