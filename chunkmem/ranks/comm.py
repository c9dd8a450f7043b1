"""Collectives and streams: the one place that talks to ``torch.distributed`` and owns the side
and copy streams (made by the device layer).
On the CPU the same calls run synchronously with gloo (or nothing at world size 1).

Tests substitute a subclass of :class:`Communicator` to delay or inspect collectives.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..compat.distributed import process_group_timeout
from ..device import CollectiveWaits, DeviceLayer, device_layer
from ..device.layer import Event, Stream
from ..errors import CollectiveMismatchError
from ..usage.memory import device_free, process_capacity
from .rank_checks import PEER_ENDED_FIX, RankChecks

__all__ = ["Communicator", "PendingGather"]

T = TypeVar("T")


class PendingGather:
    """What an asynchronous gather left to wait for: a collective ``Work`` and/or a device event
    recorded after the copy that fed it (``comm``'s device layer waits for it)."""

    def __init__(self, work: Any | None, event: Event | None, comm: Communicator, what: str = "gather") -> None:
        self._work = work
        self._event = event
        self._comm = comm
        self._what = what

    def is_completed(self) -> bool:
        """For statistics only: never base a decision on it (it differs between ranks)."""
        done = True
        if self._work is not None:
            done = bool(self._work.is_completed())
        if self._event is not None:
            done = done and self._comm.layer.query(self._event)
        return done

    def wait(self) -> None:
        """Make the current stream (and, on the CPU, this thread) wait for the gather."""
        if self._event is not None:
            self._comm.layer.wait_event(self._event)
        if self._work is not None:
            self._comm.wait(self._work, self._what)


_POLL = datetime.timedelta(seconds=1)


class _SlotOfAllReduce:
    """A reduce-scatter carried out as an in-place all-reduce of the whole buffer: waiting on it
    leaves this rank's slot of the sum in ``output`` (copied when ``output`` is not that slot)."""

    def __init__(self, work: Any, output: torch.Tensor, slot: torch.Tensor) -> None:
        self._work = work
        self._output = output
        self._slot = slot
        self._copied = output.data_ptr() == slot.data_ptr()

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        done = self._work.wait() if timeout is None else self._work.wait(timeout=timeout)
        if not self._copied:
            self._output.copy_(self._slot)
            self._copied = True
        return bool(done) if done is not None else True


def _timeout(group: dist.ProcessGroup) -> datetime.timedelta:
    """The process group's timeout (the cross-rank checks wait as long as its collectives would)."""
    try:
        return process_group_timeout(group)
    except (AttributeError, RuntimeError):
        return datetime.timedelta(minutes=30)


class Communicator:
    """The process group chunks are sharded over, and how collectives are issued on it.

    ``group`` ``None`` is the default group when ``torch.distributed`` is initialized, else a world
    of one. With ``world_size`` (and ``rank``) given, it is a world of that size seen from one rank
    with no process group behind it: nothing is asked of ``torch.distributed`` and no cross-rank
    checks run, and the collectives are a subclass's to provide (the planner's, which moves nothing,
    and tests' stand-ins)."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        check_plans: bool = False,
        *,
        world_size: int | None = None,
        rank: int = 0,
    ) -> None:
        self._group = group
        self._device = device
        initialized = world_size is None and dist.is_available() and dist.is_initialized()
        if group is not None and not initialized:
            raise ValueError(
                "Communicator: a process group was given but torch.distributed is not initialized"
                if world_size is None
                else "Communicator: a world_size of its own has no process group; pass group=None"
            )
        if world_size is not None and not 0 <= rank < world_size:
            raise ValueError(f"Communicator: rank {rank} is not in a world of {world_size}")
        self._rank = dist.get_rank(group) if initialized else rank
        self._world_size = dist.get_world_size(group) if initialized else (world_size or 1)
        self._layer = device_layer(device)
        self._side_stream = self._layer.new_stream()
        self._copy_stream = self._layer.new_stream()
        self._all_gather: Callable[..., Any] = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter: Callable[..., Any] = (
            getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        )
        # Cross-rank checks on small gloo groups of their own, on which ranks can still talk after
        # a chunk collective failed.
        self._checks: RankChecks | None = None
        self._divergence: str | None = None
        self._poll_waits = False
        self._reduce_by_all_reduce = False
        if initialized and self._world_size > 1:
            pg = group if group is not None else dist.group.WORLD
            ranks = dist.get_process_group_ranks(pg)
            self._checks = RankChecks(ranks, self._rank, _timeout(pg), check_plans)
            # Waits that block this thread (gloo) wake up now and then to look for alarms. NCCL
            # waits only order streams, so they never block here. The device layer says which
            # (the simulated device runs gloo with NCCL's meaning, so its runs take that branch).
            waits = self._layer.collective_waits(pg, dist.get_backend(pg))
            self._poll_waits = waits is CollectiveWaits.HOST
            # gloo's all-reduce is faster than its reduce-scatter at most sizes though it moves
            # twice the bytes (benchmarks/collectives.py, 2-core CPU: W=2, 0.8/8/32 MB: 0.95/7.4/22.9
            # ms against 1.7/10.7/34.3; W=4: 5.0/14.4/50.3 against 7.6/18.7/72.9; equal at 3.2 MB),
            # so on gloo a chunk's gradients are all-reduced in place and each rank keeps its slot.
            # NCCL's reduce-scatter is the better collective.
            self._reduce_by_all_reduce = dist.get_backend(pg) == "gloo"

    @property
    def checks(self) -> RankChecks | None:
        """The cross-rank checks (``None`` at world size 1)."""
        return self._checks

    def note_divergence(self, description: str | None) -> None:
        """What this rank reports if a collective of the current iteration fails: where it
        departed from the recorded trace (``None``: it did not)."""
        self._divergence = description

    def guard(self, call: Callable[[], T]) -> T:
        """Run a collective; if it fails (mismatched or timed out), ask every rank over the side
        group whether it departed from the trace and raise an error naming those ranks."""
        try:
            return call()
        except RuntimeError as error:
            raise self._explain(error) from error

    def _explain(self, error: RuntimeError) -> Exception:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        notes: list[Any] = [None] * self._world_size
        side = self._checks.side_group if self._checks is not None else None
        try:
            dist.all_gather_object(notes, self._divergence, group=side)
        except RuntimeError as side_error:
            return CollectiveMismatchError(
                f"rank {self._rank}: a chunk collective failed ({first_line}) and the other ranks could not be "
                f"reached to compare compute traces ({str(side_error).splitlines()[0]}). This rank "
                + ("departed from the recorded trace " + self._divergence if self._divergence else "followed the trace")
                + f". Another rank's process has likely ended (killed, out of memory, an error): {PEER_ENDED_FIX}"
            )
        odd = [r for r, note in enumerate(notes) if note is not None]
        detail = "; ".join(f"rank {r}: {notes[r]}" for r in odd)
        cause = (
            f"ranks {odd} departed from the recorded compute trace in this iteration ({detail})"
            if odd
            else "no rank reported departing from the recorded trace"
        )
        return CollectiveMismatchError(
            f"rank {self._rank}: a chunk collective failed ({first_line}); {cause}. All ranks must run the same "
            "operations on managed parameters in the same order (no rank-dependent branches in the model)."
        )

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def layer(self) -> DeviceLayer:
        """The device layer of the compute device: its streams, events and pinned memory."""
        return self._layer

    @property
    def host_device(self) -> torch.device:
        """Where host-side shard buffers live."""
        return torch.device("cpu")

    @property
    def tensor_device(self) -> torch.device:
        """Where small metadata tensors for collectives live (what the backend reduces)."""
        return self._device

    def agreed_capacity(self) -> int:
        """What this process may use of the compute device, smallest over ranks, so every rank's
        policy decides the same (``memory.process_capacity``)."""
        capacity = torch.tensor([process_capacity(self._device)], dtype=torch.int64, device=self.tensor_device)
        self.all_reduce(capacity, dist.ReduceOp.MIN)
        return int(capacity[0])

    def device_free(self) -> int:
        """Free bytes of the compute device now, on this rank."""
        return device_free(self._device)

    @contextmanager
    def side_stream(self) -> Iterator[None]:
        """Run the block on the side stream after everything already queued on the current stream
        (so buffers allocated there are safe to write). No-op on the CPU."""
        if self._side_stream is None:
            yield
            return
        self._layer.wait_stream(self._side_stream, self._layer.current_stream())
        with self._layer.on_stream(self._side_stream):
            yield

    @property
    def copy_stream(self) -> Stream | None:
        """The stream device-to-host copies run on, apart from compute and gathers (``None`` on
        the CPU)."""
        return self._copy_stream

    def record_side_event(self) -> Event | None:
        """An event after the work queued on the side stream (``None`` on the CPU)."""
        if self._side_stream is None:
            return None
        return self._layer.record_event(self._side_stream)

    def all_gather(self, output: torch.Tensor, local: torch.Tensor, async_op: bool, what: str = "gather") -> Any | None:
        """Gather every rank's ``local`` shard into ``output`` (rank order). ``local`` may be this
        rank's slot of ``output``. Returns the ``Work`` when ``async_op`` (wait on it with
        ``wait``)."""
        if self._checks is not None:
            self._checks.collective(what, output.numel())
        work = self.guard(lambda: self._all_gather(output, local, group=self._group, async_op=True))
        if async_op:
            return work
        self.wait(work, what)
        return None

    def reduce_scatter_sum(self, output: torch.Tensor, full: torch.Tensor, async_op: bool, what: str) -> Any | None:
        """``output`` = this rank's slot of the sum of ``full`` over ranks. ``output`` may be this
        rank's slot of ``full``. Returns the ``Work`` when ``async_op``. On gloo the rest of
        ``full`` is overwritten too (with the other ranks' slots of the sum)."""
        if self._checks is not None:
            self._checks.collective(what, full.numel())
        if self._reduce_by_all_reduce:
            slot = full.view(self._world_size, -1)[self._rank]
            reduce = self.guard(lambda: dist.all_reduce(full, op=dist.ReduceOp.SUM, group=self._group, async_op=True))
            work: Any = _SlotOfAllReduce(reduce, output, slot)
        else:
            work = self.guard(
                lambda: self._reduce_scatter(output, full, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
            )
        if async_op:
            return work
        self.wait(work, what)
        return None

    def wait(self, work: Any, what: str) -> None:
        """Wait for a collective started with ``async_op``; a failure names the ranks that departed.
        On gloo the wait wakes up every second to act on an alarm from a rank that departed from
        the trace (a collective it will never join would otherwise block until the timeout)."""
        if not self._poll_waits or self._checks is None:
            self.guard(work.wait)
            return
        while True:
            try:
                work.wait(timeout=_POLL)
                return
            except RuntimeError as error:
                if "timed out" not in str(error).lower() or work.is_completed():
                    raise self._explain(error) from error
            self._checks.poll()

    def _tag(self, what: str, numel: int) -> None:
        if self._checks is not None:
            self._checks.collective(what, numel)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        """In place over ranks (no-op at world size 1)."""
        if self._world_size > 1:
            self._tag(f"all_reduce {op}", tensor.numel())
            work = self.guard(lambda: dist.all_reduce(tensor, op=op, group=self._group, async_op=True))
            self.wait(work, "all_reduce")

    def all_gather_tensors(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's copy of a small tensor, in rank order."""
        if self._world_size == 1:
            return [tensor.clone()]
        out = [torch.empty_like(tensor) for _ in range(self._world_size)]
        self._tag("all_gather of small tensors", tensor.numel())
        work = self.guard(lambda: dist.all_gather(out, tensor, group=self._group, async_op=True))
        self.wait(work, "all_gather")
        return out

    def reduce_to_first(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over ranks into rank 0's copy (other ranks' copies are undefined after)."""
        if self._world_size > 1:
            first = dist.get_global_rank(self._group, 0) if self._group is not None else 0
            self._tag("reduce", tensor.numel())
            work = self.guard(lambda: dist.reduce(tensor, dst=first, group=self._group, async_op=True))
            self.wait(work, "reduce")

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order (small metadata only)."""
        if self._world_size == 1:
            return [obj]
        out: list[Any] = [None] * self._world_size
        self._tag("all_gather_object", 0)
        self.guard(lambda: dist.all_gather_object(out, obj, group=self._group))
        return out

    def barrier(self) -> None:
        """Wait for every rank (no-op at world size 1)."""
        if self._world_size > 1:
            self._tag("barrier", 0)
            self.guard(lambda: dist.barrier(group=self._group))

    def maybe_side_stream(self, use: bool) -> Any:
        """``side_stream()`` when ``use``, else a no-op context."""
        return self.side_stream() if use else nullcontext()
