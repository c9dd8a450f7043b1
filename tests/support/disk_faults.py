"""A disk that fills up while chunkmem writes parameter shards (and only those): the I/O thread's
``pwritev`` of a parameter shard fails with ``ENOSPC``; every other write goes through."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from chunkmem.tiers.disk import DiskFile


@contextmanager
def parameter_writes_fail() -> Iterator[None]:
    """Within the block, writes of parameter shards fail as on a full disk."""
    real_pwritev, real_transfer = os.pwritev, DiskFile._transfer
    writing = threading.local()  # the I/O thread is writing a parameter shard

    def full(fd: int, buffers: Any, offset: int) -> int:
        if getattr(writing, "param", False):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(fd, buffers, offset)

    def transfer(file: DiskFile, tensor: torch.Tensor, offset: int, write: bool, then: Any, param: bool) -> None:
        writing.param = write and param
        try:
            real_transfer(file, tensor, offset, write, then, param)
        finally:
            writing.param = False

    os.pwritev, DiskFile._transfer = full, transfer  # type: ignore[method-assign]
    try:
        yield
    finally:
        os.pwritev, DiskFile._transfer = real_pwritev, real_transfer  # type: ignore[method-assign]
