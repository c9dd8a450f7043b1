"""Collectives on the simulated asynchronous device, as NCCL and gloo order them.

Every process group's collectives run on an actor of their own. The group the device computes for
(``SimulatedLayer.collective_waits``: the communicator's chunk group) has NCCL's semantics by
default, its **collective stream**: a collective issued there runs after the work queued so far on
the current stream (NCCL's stream waits for it), reads its inputs and writes its outputs there,
and ``work.wait()`` orders the waiting thread's current stream after it (a stream wait: the host
goes on). What reads the outputs on the host must wait for a stream that waited (``item()``
does). Other groups (the cross-rank checks' gloo groups, on the host on a GPU too) have gloo's:
a collective runs on gloo's thread after the work queued so far (as gloo waits for the current
stream with device tensors), and ``work.wait()`` makes the host go on after it.

The bytes move as gloo moves them (the real wait blocks, as gloo's does): what the simulation
checks is the order the waits give, on every schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..compat.distributed import C10D_WRITTEN_ARGUMENTS, c10d_bindings
from ..compat.torch import op_schema

__all__ = ["CollectiveOp", "collective_op", "process_group", "work_class", "work_of"]


@dataclass(frozen=True, slots=True)
class CollectiveOp:
    """What a c10d op touches: the positions of the arguments it writes, and of its process group."""

    written: tuple[int, ...] | None
    """``None``: an op this table does not know, every tensor counted as written."""
    group: int | None


def collective_op(func: Any) -> CollectiveOp | None:
    """The c10d facts of ``func`` (``None``: not a collective)."""
    if func.namespace != "c10d":
        return None
    schema = op_schema(func)
    group = next((i for i, a in enumerate(schema.arguments) if "ProcessGroup" in str(a.type)), None)
    return CollectiveOp(C10D_WRITTEN_ARGUMENTS.get(str(func.overloadpacket.__name__)), group)


def process_group(value: Any) -> Any | None:
    """The ``ProcessGroup`` a c10d op's argument stands for (``None`` without torch.distributed)."""
    c10d = c10d_bindings()
    if c10d is None:
        return None
    try:
        return c10d.ProcessGroup.unbox(value)
    except (RuntimeError, TypeError):
        return None


def work_of(value: Any) -> Any | None:
    """The ``Work`` a c10d op returned (as a ScriptObject), as Python code sees it."""
    c10d = c10d_bindings()
    if c10d is None:
        return None
    try:
        return c10d.Work.unbox(value)
    except (RuntimeError, TypeError):
        return None


def work_class() -> type | None:
    c10d = c10d_bindings()
    return getattr(c10d, "Work", None) if c10d is not None else None
