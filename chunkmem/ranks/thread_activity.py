"""What a thread of this process is doing, read from another thread: blocked in a collective of
``torch.distributed`` called by the user's own code, or anything else (and where).

The cross-rank checks' listener answers with it when a rank waiting in an agreement asks why this
rank has not come: a thread blocked in a collective of the user's own will not reach chunkmem's
next call until that collective completes. It is read from the thread's Python stack
(``sys._current_frames``); the collective's process group comes from the frame of torch's own
function, and the group's sequence number says which of the group's operations it is (the number
of operations this process has issued on the group, the blocked one included), which the asking
rank compares with its own.

A rank found departed while blocked in such a collective gets chunkmem's error raised in that
thread (``raise_in``): Python raises it as soon as the thread runs Python code again, which is when
the collective fails (the other ranks' processes end), so the script dies with chunkmem's
explanation rather than only gloo's "Connection closed by peer".
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from chunkmem import hooks, placement

from ..compat.distributed import default_group, named_groups, operations_issued
from ..compat.python import current_frame

__all__ = ["UserCollective", "blocked_in_user_collective", "own_operations", "raise_in", "where_thread_is"]

_TORCH = str(Path(torch.__file__).resolve().parent) + os.sep
_C10D = str(Path(c10d.__file__).resolve())
_OURS = tuple(str(Path(path).resolve().parent) + os.sep for path in (placement.__file__, hooks.__file__, __file__))
# The functions of distributed_c10d that issue one collective and wait for it (the object
# collectives call these). Point-to-point calls are left out: the sequence number counts them on
# one side only, so it does not say which operation another rank is at.
_COLLECTIVES = frozenset(
    {
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_coalesced",
        "all_reduce",
        "all_reduce_coalesced",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "broadcast",
        "gather",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
    }
)


@dataclass(frozen=True, slots=True)
class UserCollective:
    """A collective a thread is blocked in, called from outside chunkmem."""

    call: str
    """The ``torch.distributed`` function the user called, e.g. ``torch.distributed.barrier()``."""
    site: str
    """Where the user's code called it (``train.py:57``)."""
    group_name: str
    group_ranks: tuple[int, ...]
    """Global ranks of the collective's process group."""
    operation: int
    """Operations this process has issued on the group so far, the blocked one included."""


@functools.lru_cache(maxsize=1024)
def _resolved(path: str) -> str:
    return str(Path(path).resolve())


def _file(frame: FrameType) -> str:
    return _resolved(frame.f_code.co_filename)


def _site(frame: FrameType) -> str:
    path = frame.f_code.co_filename
    try:
        relative = os.path.relpath(path)
        path = path if relative.startswith("..") else relative
    except ValueError:  # another drive (Windows)
        pass
    return f"{path}:{frame.f_lineno}"


def _stack(thread_id: int) -> list[FrameType]:
    """The thread's frames, innermost first (empty when it is gone)."""
    frame = current_frame(thread_id)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def blocked_in_user_collective(thread_id: int) -> UserCollective | None:
    """The collective of the user's the thread is in, if its innermost frame is one of
    ``torch.distributed``'s collectives and no frame of chunkmem's packages is on its stack."""
    frames = _stack(thread_id)
    if not frames or _file(frames[0]) != _C10D or frames[0].f_code.co_name not in _COLLECTIVES:
        return None
    files = [_file(frame) for frame in frames]
    if any(file.startswith(_OURS) for file in files):
        return None
    outside = next((i for i, file in enumerate(files) if not file.startswith(_TORCH)), None)
    if outside is None:
        return None
    called = [frames[i].f_code.co_name for i in range(outside) if files[i] == _C10D][-1]
    try:
        group = frames[0].f_locals.get("group")
        if group is None:
            group = default_group()
        if not isinstance(group, dist.ProcessGroup):
            return None
        return UserCollective(
            call=f"torch.distributed.{called}()",
            site=_site(frames[outside]),
            group_name=group.group_name,
            group_ranks=tuple(dist.get_process_group_ranks(group)),
            operation=operations_issued(group),
        )
    except Exception:  # a torch without these (or a group being destroyed): say nothing
        return None


def where_thread_is(thread_id: int) -> str:
    """The innermost place outside torch and chunkmem the thread runs (``train.py:80``), for
    messages."""
    for frame in _stack(thread_id):
        file = _file(frame)
        if not file.startswith((_TORCH, *_OURS)):
            return _site(frame)
    return "an unknown place"


def own_operations(group_name: str) -> int | None:
    """Operations this process has issued on the process group named ``group_name`` (``None``
    when it is not a member)."""
    try:
        for group, name in named_groups():
            if name == group_name and isinstance(group, dist.ProcessGroup):
                return operations_issued(group)
    except Exception:
        return None
    return None


def raise_in(thread_id: int, error: type[BaseException], message: str) -> bool:
    """Have the thread raise ``error(message)`` when it next runs Python code; returns whether
    the thread exists. CPython raises such an error by class, so a subclass carrying ``message``
    (with ``error``'s name) is raised."""
    carrying = type(error.__name__, (error,), {"__init__": lambda self, *_: error.__init__(self, message)})
    carrying.__module__ = error.__module__
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(carrying))
    return bool(done)
