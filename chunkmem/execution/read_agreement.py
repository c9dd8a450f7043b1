"""The ranks agree whether a read failed on any of them in a forward or a backward
(``ranks.local_failures``: a read in place from the weights files, saved activations read back
from the disk tier): a rank whose read failed went on with zeros, so every rank raises the same
``DiskTierError`` before those values change anything."""

from __future__ import annotations

from typing import NoReturn

import torch
import torch.distributed as dist

from ..errors import DiskTierError
from ..ranks.comm import Communicator
from ..ranks.local_failures import LocalFailures

__all__ = ["agree_reads", "raise_read_failure", "read_failed"]


def read_failed(failures: LocalFailures) -> int:
    """1 when a read failed on this rank, else 0 (a flag to reduce with MAX)."""
    return int(bool(failures.kept))


def raise_read_failure(comm: Communicator, failures: LocalFailures) -> NoReturn:
    """Some rank's read failed (the ranks agreed a flag): every rank raises the same error, naming
    each failing rank's error and the fix. A collective (one small exchange)."""
    kept = failures.kept
    own = [(failure.what, str(failure.error)) for failure in kept]
    everyone: list[list[tuple[str, str]]] = comm.all_gather_object(own)
    failed = "; ".join(
        f"{what} failed on rank {rank}: {text}" for rank, texts in enumerate(everyone) for what, text in texts
    )
    error = DiskTierError(
        f"{failed}. Every rank raises this error; no optimizer step used the values read (that rank went on with "
        "zeros in their place)"
    )
    failures.agreed(error)
    raise error from (kept[0].error if kept else None)


def agree_reads(comm: Communicator, failures: LocalFailures) -> None:
    """After a forward that returned: raise on every rank if a read failed on any (one all-reduce
    of a flag)."""
    flag = torch.tensor([read_failed(failures)], dtype=torch.int64, device=comm.tensor_device)
    comm.all_reduce(flag, dist.ReduceOp.MAX)
    if int(flag.item()):
        raise_read_failure(comm, failures)
