"""The disk tier's files: scratch space chunkmem owns, preallocated at boost, read and written by a
pool of I/O threads.

Each rank keeps the optimizer sides (and parameter shards) it puts on disk in one file,
``<disk_dir>/.chunkmem-scratch-<token>-rank<r>/sides.bin``, preallocated to the size the placement
needs (so a disk that fills up later cannot take those blocks). The directory is one chunkmem owns
(:mod:`chunkmem.tiers.owned_dir`, as a checkpoint save's workspace): its marker file, locked before its
text is written, says what the directory's name says, and this process holds the lock for as long as
it uses the directory. It is removed when the process exits or the model is collected; one left by a
killed run is removed by the next boost into the same ``disk_dir`` (ranks may share one), which
removes only dead ones (marker as its name says, lock held by nobody), never one being created,
never anything else. The files are scratch, not checkpoints: they mean nothing after the run.

Reads and writes copy between a tensor's own memory and its region of the file (``os.preadv`` /
``os.pwritev`` into the tensor's bytes, no intermediate buffer); they run on I/O threads and return
futures, counted and timed in ``Stats``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import multiprocessing.util
import os
import re
import secrets
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from chunkmem.placement import DISK_WINDOW

from ..errors import DiskTierError
from ..usage.stats import Stats
from .owned_dir import OwnedDir, remove_if_dead

__all__ = ["DISK_BLOCK", "DiskFile", "PlannedDiskFile", "ScratchDir", "SidesFile", "remove_stale_scratch"]

_PREFIX = ".chunkmem-scratch-"
_NAME = re.compile(re.escape(_PREFIX) + r"([0-9a-f]{16})-rank(\d+)")
_MARKER = "chunkmem-scratch.json"
DISK_BLOCK = 4096
"""Regions of the disk tier's files start on a multiple of this."""
_ALIGN = DISK_BLOCK
_FREE_SPACE = "free space there, pass another disk_dir, or keep more in host memory (host_budget)"


def _marker_text(token: str, rank: int) -> bytes:
    return json.dumps({"chunkmem": "disk tier scratch", "token": token, "rank": rank}).encode()


def remove_stale_scratch(disk_dir: Path) -> list[Path]:
    """Remove the scratch directories in ``disk_dir`` that nobody uses any more (a killed run's):
    named as chunkmem names them, their marker as the name says, its lock held by nobody.
    Returns what was removed."""
    removed = []
    for candidate in sorted(disk_dir.glob(f"{_PREFIX}*")):
        named = _NAME.fullmatch(candidate.name)
        if named and remove_if_dead(candidate, _MARKER, _marker_text(named[1], int(named[2]))):
            removed.append(candidate)
    return removed


def _remove_if_creator(owned: OwnedDir, creator: int) -> None:
    """A child made by a bare ``os.fork()`` inherits the finalizer and runs it when it leaves
    normally (atexit): the directory is its parent's, still in use there."""
    if os.getpid() == creator:
        owned.remove()


class ScratchDir:
    """This process's scratch directory under ``disk_dir``; see the module docstring."""

    def __init__(self, disk_dir: str | os.PathLike[str], rank: int) -> None:
        parent = Path(disk_dir)
        if not parent.is_dir():
            raise DiskTierError(
                f"rank {rank}: disk_dir {parent} does not exist or is not a directory; create it (a fast local disk) "
                "or pass another disk_dir"
            )
        if not os.access(parent, os.W_OK | os.X_OK):
            raise DiskTierError(
                f"rank {rank}: disk_dir {parent} is not writable by this process; pass another disk_dir"
            )
        remove_stale_scratch(parent)
        token = secrets.token_hex(8)
        try:
            owned = OwnedDir(parent / f"{_PREFIX}{token}-rank{rank}", _MARKER, _marker_text(token, rank))
        except OSError as error:
            raise DiskTierError(f"rank {rank}: cannot create scratch space in disk_dir {parent}: {error}") from error
        self._path = owned.path
        self._finalizer = weakref.finalize(self, _remove_if_creator, owned, os.getpid())
        # A rank started by multiprocessing's fork or forkserver (Lightning's ddp_fork, a
        # start_processes(start_method="fork")) leaves through os._exit, which skips the atexit
        # call of weakref.finalize; multiprocessing runs its own finalizers there. Calling the
        # finalizer a second time does nothing; a child forked later does not inherit this one.
        multiprocessing.util.Finalize(self, self._finalizer, exitpriority=0)

    @property
    def path(self) -> Path:
        return self._path

    def close(self) -> None:
        """Remove the directory and everything in it."""
        self._finalizer()


class _Regions:
    """A file's ``size`` bytes, cut into aligned regions one after the other."""

    def __init__(self, name: str, size: int) -> None:
        self._name = name
        self._size = max(_ALIGN, -(-size // _ALIGN) * _ALIGN)
        self._next = 0
        self.gradient_slots = threading.BoundedSemaphore(DISK_WINDOW)
        """Gradient shards on their way to this file (``GradOnDisk``): at most ``DISK_WINDOW``
        are in host memory at once, so a disk slower than the backward holds the backward up
        instead of filling host memory."""

    @property
    def size(self) -> int:
        return self._size

    def region(self, nbytes: int) -> int:
        """A new region of ``nbytes`` (aligned): its offset in the file."""
        offset = self._next
        end = offset + -(-nbytes // _ALIGN) * _ALIGN
        if end > self._size:
            raise DiskTierError(
                f"the disk tier's file {self._name} has {self._size - offset} bytes left, not the {nbytes} asked for: "
                "the placement reserved less than the optimizer keeps (an optimizer whose state grows?)"
            )
        self._next = end
        return offset


class DiskFile(_Regions):
    """One preallocated file of ``size`` bytes in a scratch directory, cut into regions, read and
    written by ``threads`` I/O threads."""

    def __init__(self, scratch: ScratchDir, name: str, size: int, stats: Stats, threads: int = 2) -> None:
        super().__init__(str(scratch.path / name), size)
        self._scratch = scratch
        self._path = scratch.path / name
        self._stats = stats
        self._counting = threading.Lock()
        try:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as error:
            raise DiskTierError(f"cannot create the disk tier's file {self._path}: {error}") from error
        try:
            os.posix_fallocate(self._fd, 0, self._size)
        except OSError as error:
            os.close(self._fd)
            free = shutil.disk_usage(scratch.path).free
            reason = "the disk is full" if error.errno == errno.ENOSPC else str(error)
            raise DiskTierError(
                f"cannot reserve {self._size} bytes for the disk tier in {scratch.path} ({reason}; {free} bytes "
                f"free): {_FREE_SPACE}"
            ) from error
        self._mapped: torch.Tensor | None = None
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="chunkmem-disk")
        self._closer = weakref.finalize(self, _close_file, self._fd, self._pool)

    @property
    def path(self) -> Path:
        return self._path

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The ``numel`` values at ``offset`` as a tensor mapped from the file (read-only use: a
        checkpoint reads them without bringing the whole region into memory at once). Writes
        must have landed (the pipeline waits for its own)."""
        if self._mapped is None:
            try:
                self._mapped = torch.from_file(str(self._path), shared=False, size=self._size, dtype=torch.uint8)
            except (RuntimeError, OSError) as error:
                raise DiskTierError(
                    f"cannot map the disk tier's file {self._path} to read the optimizer states it holds ({error}); "
                    "was its scratch directory removed while the run uses it? The states on disk cannot be saved: "
                    "leave the .chunkmem-scratch-* directories of a running job alone"
                ) from error
        return self._mapped[offset : offset + numel * dtype.itemsize].view(dtype)

    def staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``numel`` values backed by a new file of the scratch directory, its space
        reserved now (a load stages what goes to disk there, not in memory); the file goes with
        the tensor."""
        nbytes = max(1, numel * dtype.itemsize)
        path = self._scratch.path / f"staging-{secrets.token_hex(4)}.bin"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            finally:
                os.close(fd)
            mapped = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
        except OSError as error:
            raise DiskTierError(
                f"cannot stage {nbytes} bytes in {self._scratch.path} ({error.strerror or error}): a load stages what "
                "goes to disk there; free space on that disk"
            ) from error
        finally:
            path.unlink(missing_ok=True)  # the mapping keeps the space until the tensor goes
        return mapped[: numel * dtype.itemsize].view(dtype)

    def read(self, tensor: torch.Tensor, offset: int, param: bool = False) -> Future[None]:
        """Fill ``tensor`` (contiguous, on the CPU) from the file at ``offset``, on an I/O thread;
        ``param``: a parameter shard read for a gather (counted apart as well)."""
        return self._pool.submit(self._transfer, tensor, offset, False, None, param)

    def write(
        self, tensor: torch.Tensor, offset: int, then: Callable[[], None] | None = None, param: bool = False
    ) -> Future[None]:
        """Write ``tensor`` to the file at ``offset``, on an I/O thread; ``then`` runs after it
        (there, once the bytes are out of ``tensor``); ``param``: what gathers read (counted apart as
        well)."""
        return self._pool.submit(self._transfer, tensor, offset, True, then, param)

    def read_with(self, tensor: torch.Tensor, fill: Callable[[memoryview], int]) -> Future[None]:
        """Fill ``tensor`` (contiguous, on the CPU) with ``fill`` on an I/O thread: given the
        tensor's bytes, it reads them from files of its own and returns how many it read, counted
        and timed as a parameter read (a frozen chunk read in place from the user's weights)."""

        def run() -> None:
            begin = time.perf_counter()
            nbytes = fill(_bytes_of(tensor))
            seconds = time.perf_counter() - begin
            with self._counting:
                _count(self._stats, nbytes, False, True)
                self._stats.disk_read_seconds += seconds

        return self._pool.submit(run)

    def _transfer(
        self,
        tensor: torch.Tensor,
        offset: int,
        write: bool,
        then: Callable[[], None] | None = None,
        param: bool = False,
    ) -> None:
        view = _bytes_of(tensor)
        nbytes = len(view)
        begin = time.perf_counter()
        done = 0
        try:
            while done < nbytes:
                chunk = view[done:]
                moved = (
                    os.pwritev(self._fd, [chunk], offset + done)
                    if write
                    else os.preadv(self._fd, [chunk], offset + done)
                )
                if moved <= 0:
                    raise OSError(errno.EIO, f"{'write' if write else 'read'} of {nbytes} bytes stopped at {done}")
                done += moved
        except OSError as error:
            what = "write to" if write else "read from"
            full = error.errno in (errno.ENOSPC, errno.EDQUOT)
            fix = f": the disk holding disk_dir {self._scratch.path.parent} is full; {_FREE_SPACE}" if full else ""
            raise DiskTierError(
                f"could not {what} the disk tier's file {self._path} ({error.strerror or error}, {nbytes} bytes at "
                f"offset {offset}){fix}"
            ) from error
        seconds = time.perf_counter() - begin
        with self._counting:  # several I/O threads add to the same counters
            _count(self._stats, nbytes, write, param)
            if write:
                self._stats.disk_write_seconds += seconds
            else:
                self._stats.disk_read_seconds += seconds
        if then is not None:
            then()

    def close(self) -> None:
        self._closer()


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor``'s memory, for ``os.preadv`` / ``os.pwritev`` to fill or send."""
    nbytes = tensor.numel() * tensor.element_size()
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError("the disk tier reads and writes contiguous CPU tensors")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _count(stats: Stats, nbytes: int, write: bool, param: bool) -> None:
    """The bytes of one read or write, in the totals and, for a parameter shard, in its part."""
    if write:
        stats.disk_write_bytes += nbytes
        stats.disk_param_write_bytes += nbytes if param else 0
    else:
        stats.disk_read_bytes += nbytes
        stats.disk_param_read_bytes += nbytes if param else 0


def _close_file(fd: int, pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=True)
    with contextlib.suppress(OSError):
        os.close(fd)


class PlannedDiskFile(_Regions):
    """A disk file for a plan (``chunkmem.plan``): regions and traffic counted as a run would
    count them, nothing read or written (the tensors are on the meta device)."""

    def __init__(self, size: int, stats: Stats) -> None:
        super().__init__("(planned)", size)
        self._stats = stats

    def _done(self, tensor: torch.Tensor, write: bool, then: Callable[[], None] | None, param: bool) -> Future[None]:
        _count(self._stats, tensor.numel() * tensor.element_size(), write, param)
        if then is not None:
            then()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device="meta")

    def staging(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device="meta")

    def read(self, tensor: torch.Tensor, offset: int, param: bool = False) -> Future[None]:
        return self._done(tensor, False, None, param)

    def write(
        self, tensor: torch.Tensor, offset: int, then: Callable[[], None] | None = None, param: bool = False
    ) -> Future[None]:
        return self._done(tensor, True, then, param)


SidesFile = DiskFile | PlannedDiskFile
"""Where optimizer sides on disk are read from and written to."""
