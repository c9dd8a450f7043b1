"""``torch.distributed``'s private names that chunkmem reads. Checked on torch 2.13 (gloo, NCCL).

The process group's timeout, the default group and the group names (``distributed_c10d``'s
module state), a group's count of issued operations, the C++ bindings' module, and the names of
the c10d ops a dispatch mode sees. Imports nothing of ``torch.distributed`` itself until asked
(the simulated device reads the op table on a torch that may have none).
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = [
    "C10D_WRITTEN_ARGUMENTS",
    "c10d_bindings",
    "default_group",
    "named_groups",
    "operations_issued",
    "process_group_timeout",
]


def process_group_timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    """The timeout the group's collectives wait for: ``group._get_backend(cpu).options._timeout``
    (the options the backend was built with; torch keeps no public reader). Raises
    ``AttributeError`` or ``RuntimeError`` where this torch or this group cannot say."""
    return group._get_backend(torch.device("cpu")).options._timeout


def default_group() -> dist.ProcessGroup:
    """``distributed_c10d._get_default_group()``: the group a collective called without ``group=``
    runs on (raises when there is none)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_group()


def named_groups() -> Iterator[tuple[dist.ProcessGroup, str]]:
    """Every process group of this process with its name: ``distributed_c10d._world.pg_names``."""
    from torch.distributed import distributed_c10d as c10d

    yield from c10d._world.pg_names.items()


def operations_issued(group: dist.ProcessGroup) -> int:
    """``group._get_sequence_number_for_group()``: how many collectives this process has issued on
    ``group`` (the same count on every member that issued the same ones)."""
    return int(group._get_sequence_number_for_group())


def c10d_bindings() -> Any | None:
    """``torch._C._distributed_c10d``, the C++ bindings' module (its ``ProcessGroup`` and ``Work``
    unbox a dispatch mode's ScriptObjects), when torch.distributed has been imported; else ``None``."""
    return sys.modules.get("torch._C._distributed_c10d")


# Which arguments each c10d op writes (its schema does not say: they are annotated as inputs), by
# the op's name in the ``c10d`` namespace (two of them private: ``_allgather_base_`` and
# ``_reduce_scatter_base_``, what ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` dispatch
# to). Read-modify-write ones (all-reduce, broadcast) count as writes; every other tensor is read.
C10D_WRITTEN_ARGUMENTS: dict[str, tuple[int, ...]] = {
    "_allgather_base_": (0,),
    "allgather_": (0,),
    "allgather_coalesced_": (0,),
    "allgather_into_tensor_coalesced_": (0,),
    "allreduce_": (0,),
    "allreduce_coalesced_": (0,),
    "_reduce_scatter_base_": (0,),
    "reduce_scatter_": (0,),
    "reduce_scatter_tensor_coalesced_": (0,),
    "reduce_": (0,),
    "broadcast_": (0,),
    "alltoall_base_": (0,),
    "alltoall_": (0,),
    "gather_": (0,),
    "scatter_": (0,),
    "recv_": (0,),
    "recv_any_source_": (0,),
    "send": (),
    "barrier": (),
    "monitored_barrier_": (),
}
