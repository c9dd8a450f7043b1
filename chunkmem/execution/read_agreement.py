"""The ranks agree whether a gather's read in place from the weights files failed on any of them
(``chunks.values_in_place``): a rank whose read failed took part in the gather with zeros, so
every rank raises the same ``DiskTierError`` before those values change anything."""

from __future__ import annotations

from typing import NoReturn

import torch
import torch.distributed as dist

from ..chunks.values_in_place import WeightFiles
from ..errors import DiskTierError
from ..ranks.comm import Communicator

__all__ = ["agree_reads", "raise_read_failure", "read_failed"]


def read_failed(files: WeightFiles | None) -> int:
    """1 when a gather's read in place failed on this rank, else 0 (a flag to reduce with MAX)."""
    return int(files is not None and files.failure is not None)


def raise_read_failure(comm: Communicator, files: WeightFiles | None) -> NoReturn:
    """Some rank's read failed (the ranks agreed a flag): every rank raises the same error, naming
    each failing rank's file and the fix. A collective (one small exchange)."""
    own = files.failure if files is not None else None
    messages: list[str | None] = comm.all_gather_object(str(own) if own is not None else None)
    failed = "; ".join(f"on rank {rank}: {text}" for rank, text in enumerate(messages) if text is not None)
    error = DiskTierError(
        f"reading the frozen weights in place failed {failed}. Every rank raises this error; no optimizer step used "
        "the values read (that rank gathered zeros)"
    )
    raise error from own


def agree_reads(comm: Communicator, files: WeightFiles | None) -> None:
    """After a forward that returned: raise on every rank if a read in place failed on any (one
    all-reduce of a flag)."""
    flag = torch.tensor([read_failed(files)], dtype=torch.int64, device=comm.tensor_device)
    comm.all_reduce(flag, dist.ReduceOp.MAX)
    if int(flag.item()):
        raise_read_failure(comm, files)
