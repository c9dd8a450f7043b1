"""The happens-before checker of the simulated asynchronous device (``chunkmem.device.simulated``).

**Actors.** The host (the thread that drives the device), each stream, each process group's
collective stream (``sim_collectives``), and each task and done-callback of a thread pool
(``sim_threads``) are actors with a vector clock. An actor is ordered after another's work only
through an edge a GPU (or Python's futures) guarantees:

* work the host queues on a stream runs after everything the host did before (program order);
* ``wait_stream`` / ``wait_event`` order a stream after another's work; ``work.wait()`` orders the
  current stream after a collective;
* the host goes on after a stream's work only through an event's ``synchronize`` or an event whose
  ``query()`` said it completed (not through ``item()``, which synchronizes on a GPU: the simulation
  cannot tell a device tensor from host memory the layer did not allocate, so it asks for the wait);
* a task starts after its ``submit``; ``result()`` / ``exception()`` / a done-callback / ``shutdown``
  come after the task; a host buffer taken from a pool comes after whoever gave it back.

**Accesses.** A ``TorchDispatchMode`` sees every op on the threads it is entered on and records
which storages it reads and writes, on which actor: on the host, ops on host buffers (those the
layer allocated, and what host ops make from them) are the host's, except a copy between a host
buffer and device memory, which is the current stream's (as ``copy_(non_blocking=True)`` is on a
GPU); other ops are the current stream's. A pool task's ops are all its own (a host thread computes
on host memory). Two accesses to one storage, one of them a write, from actors that no edge orders,
raise :class:`UnorderedAccessError` naming both.

**Frees.** Device memory comes from a model of CUDA's caching allocator (``sim_allocator``): a
storage freed (its last reference gone, or ``untyped_storage().resize_(0)``) goes back to the pool
of the stream that allocated it, whose next op may get it. A free while another actor's use of the
memory is not ordered before that stream, and the memory was not ``record_stream``-ed to that
actor, raises; a ``record_stream``-ed block is held until the recorded stream passes the point of
the free. Pinned host buffers come from a model of the pinned host allocator (power-of-two sizes).

**Events.** An event completes once the host has waited for its point of its stream (or a later
one): until then ``query()`` is false and an elapsed time involving it raises
:class:`UnfinishedEventError`, as on CUDA. The device is never faster than the host knows.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..compat.torch import TorchDispatchMode, op_schema, storage_id, tree_flatten
from .layer import CollectiveWaits
from .sim_allocator import Block, CachingAllocator, MemoryFigures, PinnedAllocator
from .sim_collectives import CollectiveOp, collective_op, process_group, work_of
from .sim_threads import HostThreads

__all__ = [
    "COMPUTE",
    "HOST",
    "SimEvent",
    "SimStream",
    "SimulatedDeviceError",
    "Simulator",
    "UnfinishedEventError",
    "UnorderedAccessError",
]

HOST = "host"
COMPUTE = "compute stream"

Clock = dict[str, int]


class SimulatedDeviceError(RuntimeError):
    """What the simulated device found that a GPU would get wrong."""


class UnorderedAccessError(SimulatedDeviceError):
    """Two accesses to one buffer that a GPU could run in either order (a missing wait)."""


class UnfinishedEventError(SimulatedDeviceError):
    """An elapsed time asked of events a GPU may not have reached (CUDA raises there too)."""


@dataclass
class SimStream:
    """A stream of the simulated device; only its name identifies it."""

    name: str


@dataclass
class SimEvent:
    """A point of a stream: its tick there, and the clock of the stream then."""

    stream: str
    tick: int
    clock: Clock
    timing: bool = False


@dataclass(frozen=True, slots=True)
class _Use:
    """One access: the actor and its tick, the op, and the host actor that issued it (with its tick)."""

    actor: str
    tick: int
    op: str
    issuer: str
    issued: int


@dataclass(eq=False)
class _Storage:
    """What is known of one storage: its last write and the reads since, per actor; what it is."""

    ref: Any  # StorageWeakRef: tells a storage that died from a new one at the same address
    write: _Use | None = None
    reads: dict[str, _Use] = field(default_factory=dict)  # by actor
    streams: set[str] = field(default_factory=set)  # record_stream-ed to
    allocated_on: str = COMPUTE  # the stream whose pool the memory goes back to
    host: bool = False  # host memory: a buffer the layer allocated, or what host ops made
    pinned: bool = False
    block: Block | None = None
    freed_by: str | None = None  # its memory was freed (resize_(0)) by this actor, and not allocated again
    death: Any = None  # weakref.ref with the callback that frees the block

    def uses(self) -> list[tuple[str, int, str]]:
        used = [(use.actor, use.tick, use.op) for use in self.reads.values()]
        if self.write is not None:
            used.append((self.write.actor, self.write.tick, self.write.op))
        return used


def _merge(into: Clock, other: Clock) -> None:
    for actor, tick in other.items():
        if into.get(actor, 0) < tick:
            into[actor] = tick


def _key(tensor: torch.Tensor) -> int | None:
    if tensor.is_meta or tensor.device.type != "cpu" or tensor.layout is not torch.strided:
        return None
    return storage_id(tensor.untyped_storage())


@dataclass(frozen=True, slots=True)
class _OpInfo:
    """What an op's schema says, read once per op (every op of a run passes through the mode)."""

    name: str
    view: bool  # every result aliases an input, none written: no access of its own
    written_positions: frozenset[int]
    written_names: frozenset[str]
    collective: CollectiveOp | None


_OP_INFO: dict[Any, _OpInfo] = {}


def _op_info(func: Any) -> _OpInfo:
    info = _OP_INFO.get(func)
    if info is None:
        schema = op_schema(func)
        writes = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        returns = schema.returns
        info = _OP_INFO[func] = _OpInfo(
            name=str(func.overloadpacket.__name__),
            view=bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns),
            written_positions=frozenset(i for i, a in enumerate(schema.arguments) if a.name in writes),
            written_names=frozenset(writes),
            collective=collective_op(func),
        )
    return info


def _tensors(value: Any, write: bool, into: list[tuple[torch.Tensor, bool]]) -> None:
    """The tensors in an op's argument or result (a tensor, or lists and tuples of them: what
    an ATen schema's types hold), with ``write``."""
    if isinstance(value, torch.Tensor):
        into.append((value, write))
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, write, into)
    elif isinstance(value, dict):
        into.extend((t, write) for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


def _non_blocking(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``copy_``'s ``non_blocking``."""
    return bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))


class _Mode(TorchDispatchMode):
    def __init__(self, simulator: Simulator) -> None:
        super().__init__()
        self._simulator = simulator

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        return self._simulator.run_op(func, args, kwargs or {})


class Simulator:
    """The happens-before state of one simulated device (one per process); see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._clocks: dict[str, Clock] = {HOST: {HOST: 0}, COMPUTE: {COMPUTE: 0}}
        self._device_actors = {COMPUTE}  # streams and collective streams
        self._joins: dict[str, int] = {}  # host actor -> how often it was ordered after another's work
        self._queued_from: dict[str, tuple[str, int]] = {}  # stream -> (host actor, joins) it last merged
        self._reached: Clock = {}  # the points of the streams the host has waited for
        self._storages: dict[int, _Storage] = {}
        self._freed: deque[tuple[_Storage, str, Clock]] = deque()
        self._local = threading.local()
        self._streams = 0
        self._layers = 0
        self._groups: dict[int, tuple[Any, str, bool]] = {}  # id(process group) -> (group, its actor, NCCL's?)
        self._works: dict[int, tuple[Any, Clock, bool]] = {}  # id(Work) -> (Work, clock, on a collective stream)
        self.allocator = CachingAllocator()
        self.pinned = PinnedAllocator()
        self.threads = HostThreads(self)
        self.collective_waits = CollectiveWaits.STREAM  # what waiting for the chunk group's collectives does
        self.synchronous = False  # the CPU as it is: no streams, every op of the host is the host's
        self.errors: list[str] = []
        self.failures: list[SimulatedDeviceError] = []

    @property
    def layers(self) -> int:
        """How many device layers compute on this simulator (0: nothing ran on it)."""
        return self._layers

    def attach_layer(self) -> None:
        """A :class:`SimulatedLayer` computes on this simulator from now on."""
        with self._lock:
            self._layers += 1

    def mode(self) -> TorchDispatchMode:
        """The dispatch mode that records this thread's ops (enter it once per thread)."""
        return _Mode(self)

    @contextmanager
    def checking(self) -> Iterator[None]:
        """This thread's ops are checked within the block (it is the host)."""
        self._local.checking = True
        self._local.actor = HOST
        try:
            with _Mode(self):
                yield
        finally:
            self._local.checking = False
            del self._local.actor

    def check_for_good(self) -> None:
        """This thread's ops are checked from now on (``CHUNKMEM_DEVICE`` set outside ``simulated_device``)."""
        self._local.checking = True
        self._local.actor = HOST
        _Mode(self).__enter__()

    # --- actors -------------------------------------------------------------------------------
    def host_actor(self) -> str:
        """The host actor of this thread: the host, or the pool task or callback it runs."""
        return getattr(self._local, "actor", HOST)

    def current(self) -> str:
        return getattr(self._local, "stream", COMPUTE)

    def _issue(self, actor: str) -> int:
        """``actor`` does one more thing; work a stream does was queued by the host actor of this
        thread after all that actor did before."""
        clock = self._clocks[actor]
        if actor in self._device_actors:
            host = self.host_actor()
            queued = self._clocks[host]
            queued[host] = queued.get(host, 0) + 1  # queuing is the host's act, in its program order
            joined = (host, self._joins.get(host, 0))
            if self._queued_from.get(actor) != joined:
                _merge(clock, queued)
                self._queued_from[actor] = joined
            elif clock.get(host, 0) < queued[host]:
                clock[host] = queued[host]
        clock[actor] = clock.get(actor, 0) + 1
        return clock[actor]

    def _host_join(self, clock: Clock, reached: bool = True) -> None:
        """The host actor of this thread goes on after ``clock`` (with ``reached``, a point of the
        streams the host waited for: their events up to it have completed)."""
        host = self.host_actor()
        _merge(self._clocks[host], clock)
        self._joins[host] = self._joins.get(host, 0) + 1
        if reached:
            _merge(self._reached, clock)

    def _passed(self, points: Clock) -> bool:
        return all(self._reached.get(stream, 0) >= tick for stream, tick in points.items())

    # The threads' view (``sim_threads``).
    def snapshot(self) -> Clock:
        with self._lock:
            actor = self.host_actor()
            self._issue(actor)
            return dict(self._clocks[actor])

    def current_clock(self) -> Clock:
        with self._lock:
            return dict(self._clocks[self.host_actor()])

    def join(self, clock: Clock) -> None:
        with self._lock:
            self._host_join(clock, reached=False)

    @contextmanager
    def run_as(self, actor: str, clock: Clock) -> Iterator[None]:
        """Run the block as host actor ``actor`` (a pool task, a callback) starting from ``clock``,
        its ops checked."""
        local = self._local
        previous = getattr(local, "actor", None)
        with self._lock:
            start = dict(clock)
            start.setdefault(actor, 0)
            self._clocks[actor] = start
        local.actor = actor
        mode = None
        if not getattr(local, "checking", False):
            mode = _Mode(self)
            mode.__enter__()
            local.checking = True
        try:
            yield
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
                local.checking = False
            with self._lock:
                local.after = (actor, dict(self._clocks[actor]))
            if previous is None:
                del local.actor
            else:
                local.actor = previous

    # --- streams and events -------------------------------------------------------------------
    def new_stream(self) -> SimStream:
        with self._lock:
            self._streams += 1
            name = f"stream {self._streams}"
            self._clocks[name] = {name: 0}
            self._device_actors.add(name)
            return SimStream(name)

    @contextmanager
    def on_stream(self, stream: SimStream | None) -> Iterator[None]:
        previous = self.current()
        self._local.stream = stream.name if stream is not None else previous
        try:
            yield
        finally:
            self._local.stream = previous

    def wait_stream(self, waiter: str, waited: str) -> None:
        with self._lock:
            _merge(self._clocks[waiter], self._clocks[waited])

    def record_event(self, stream: str, timing: bool = False) -> SimEvent:
        with self._lock:
            tick = self._issue(stream)
            return SimEvent(stream, tick, dict(self._clocks[stream]), timing)

    def wait_event(self, event: SimEvent) -> None:
        with self._lock:
            _merge(self._clocks[self.current()], event.clock)

    def synchronize(self, event: SimEvent) -> None:
        with self._lock:
            self._host_join(event.clock)

    def query(self, event: SimEvent) -> bool:
        """Whether ``event`` completed: the host waited for its point of its stream or a later one
        (the host then goes on after it, as after a ``synchronize``)."""
        with self._lock:
            if self._reached.get(event.stream, 0) < event.tick:
                return False
            self._host_join(event.clock)
            return True

    def elapsed_seconds(self, begin: SimEvent, end: SimEvent) -> float:
        """0: the simulated device takes no time; raises where CUDA's ``elapsed_time`` does."""
        if not (begin.timing and end.timing):
            self._fail(
                "simulated device: an elapsed time between events not recorded for timing (CUDA: 'Both events "
                "must be recorded with enable_timing=True')",
                UnfinishedEventError,
            )
        if not (self.query(begin) and self.query(end)):
            self._fail(
                f"simulated device: an elapsed time between events on the {begin.stream} and the {end.stream} "
                "before the host waited for them (CUDA: 'Both events must be completed before calculating elapsed "
                "time'); synchronize the end event first",
                UnfinishedEventError,
            )
        return 0.0

    def record_stream(self, tensor: torch.Tensor, stream: str) -> None:
        key = _key(tensor)
        if key is not None:
            with self._lock:
                self._entry(key, tensor).streams.add(stream)

    # --- collectives --------------------------------------------------------------------------
    def adopt_group(self, group: Any, on_stream: bool) -> None:
        """``group``'s collectives run on an actor of their own: with ``on_stream`` a collective
        stream (NCCL's semantics: it waits for the current stream, and a wait orders the current
        stream after it), else gloo's thread (a wait makes the host go on after it)."""
        with self._lock:
            known = self._groups.get(id(group))
            if known is None or known[0] is not group:
                self._new_group(group, on_stream)
            elif known[2] != on_stream:
                self._groups[id(group)] = (group, known[1], on_stream)

    def _new_group(self, group: Any, on_stream: bool) -> tuple[Any, str, bool]:
        number = len(self._groups) + 1
        name = f"collective stream of process group {number}" if on_stream else f"gloo's work of process group {number}"
        known = self._groups[id(group)] = (group, name, on_stream)
        self._clocks[name] = {name: 0}
        self._device_actors.add(name)
        return known

    def _group_actor(self, op: CollectiveOp, args: tuple[Any, ...]) -> tuple[str, bool] | None:
        """The actor of the process group a collective runs on, and whether it has NCCL's semantics
        (a group nothing adopted has gloo's: the cross-rank checks' groups)."""
        if op.group is None or op.group >= len(args):
            return None
        group = process_group(args[op.group])
        if group is None:
            return None
        known = self._groups.get(id(group))
        if known is None or known[0] is not group:
            known = self._new_group(group, on_stream=False)
        return known[1], known[2]

    def _collective(self, func: Any, op: CollectiveOp, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        touched: list[tuple[torch.Tensor, bool]] = []
        for index, value in enumerate(args):
            _tensors(value, op.written is None or index in op.written, touched)
        name = f"{op_name(func)} (collective)"
        with self._lock:
            self._settle_frees()
            group = self._group_actor(op, args)
            current = self.current()
            actor, on_stream = group if group is not None else (current, True)
            self._issue(actor)
            if actor != current:  # NCCL's stream (and gloo, for device tensors) waits for the current one
                _merge(self._clocks[actor], self._clocks[current])
            for tensor, write in touched:
                self.access(tensor, actor, write, f"{name} ({'write' if write else 'read'})")
            clock = dict(self._clocks[actor])
        out = func(*args, **kwargs)
        work = work_of(out[-1]) if isinstance(out, tuple) and out and not isinstance(out[-1], torch.Tensor) else None
        if work is not None:
            with self._lock:
                if len(self._works) > 4096:  # works nobody holds any more cannot be waited for
                    self._works = {k: v for k, v in self._works.items() if _held_elsewhere(v[0])}
                self._works[id(work)] = (work, clock, on_stream)
        return out

    def waited(self, work: Any) -> None:
        """``work.wait()`` returned: with NCCL's semantics the current stream goes on after the
        collective (the host does not); with gloo's, the host does."""
        with self._lock:
            known = self._works.get(id(work))
            if known is None or known[0] is not work:
                return
            _, clock, on_stream = known
            if on_stream:
                _merge(self._clocks[self.current()], clock)
            else:
                self._host_join(clock)

    # --- host buffers -------------------------------------------------------------------------
    def register_host(self, tensor: torch.Tensor, pinned: bool) -> None:
        """``tensor`` is host memory the layer allocated (pinned: from the pinned allocator)."""
        key = _key(tensor)
        if key is None:
            return
        with self._lock:
            entry = self._fresh(key, tensor)
            entry.host, entry.pinned, entry.allocated_on = True, pinned, HOST
            nbytes = tensor.untyped_storage().nbytes()
            if pinned and nbytes:
                entry.block = self.pinned.allocate(nbytes, self._passed)
                self._watch_death(entry, tensor.untyped_storage())

    def is_host(self, tensor: torch.Tensor) -> bool:
        key = _key(tensor)
        entry = self._storages.get(key) if key is not None else None
        return entry is not None and entry.host and not entry.ref.expired()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        key = _key(tensor)
        entry = self._storages.get(key) if key is not None else None
        return entry is not None and entry.pinned and not entry.ref.expired()

    def host_buffer_free(self, tensor: torch.Tensor) -> None:
        """``tensor`` goes back to a pool: poisoned (a host write: a copy still using it is an
        error)."""
        if tensor.is_floating_point() and not tensor.is_meta:
            tensor.fill_(float("nan"))

    def host_buffer_taken(self, tensor: torch.Tensor) -> None:
        """``tensor`` comes out of a pool to a new user: whoever gave it back was done with it (the
        pool's lock orders the two), so its accesses so far are no longer the new user's to wait
        for. The lock orders nothing else: whether a buffer another thread gives back is in the
        pool yet when one is taken is a matter of timing, and a wait it made unneeded once is
        asked for."""
        key = _key(tensor)
        if key is not None:
            with self._lock:
                entry = self._entry(key, tensor)
                entry.write, entry.reads = None, {}

    # --- memory -------------------------------------------------------------------------------
    def device_memory(self) -> MemoryFigures:
        """What the caching allocator holds (``max_memory_reserved`` and kin, at block level)."""
        with self._lock:
            self._settle_frees()
            return self.allocator.figures()

    def reset_peaks(self) -> None:
        """The allocators' peaks from now on (``torch.cuda.reset_peak_memory_stats``)."""
        with self._lock:
            self._settle_frees()
            self.allocator.reset_peaks()
            self.pinned.reset_peaks()

    def pinned_memory(self) -> MemoryFigures:
        """What the pinned host allocator holds."""
        with self._lock:
            self._settle_frees()
            return self.pinned.figures()

    def _watch_death(self, entry: _Storage, storage: torch.UntypedStorage) -> None:
        """When ``storage`` dies its block is freed, on the host actor that dropped it (checked at
        the next op: the callback may run in the middle of anything)."""
        freed = self._freed

        def died(_: Any, entry: _Storage = entry) -> None:
            with self._lock:
                actor = getattr(self._local, "actor", None)
                if actor is None:  # a pool thread dropping its last task's arguments: after that task
                    actor, clock = getattr(self._local, "after", (HOST, self._clocks[HOST]))
                else:
                    clock = self._clocks[actor]
                freed.append((entry, actor, dict(clock)))

        entry.death = weakref.ref(storage, died)

    def _made(self, entry: _Storage, actor: str, op: str) -> None:
        """``entry``'s memory is ``actor``'s from now on: what made it wrote it there (on a stream,
        the allocator's block may be one the stream's earlier work used: another stream must wait
        for this point before it touches the memory)."""
        issuer = self.host_actor()
        tick = self._clocks[actor].get(actor, 0)
        entry.write = _Use(actor, tick, op, issuer, self._clocks[issuer].get(issuer, 0))

    def _allocated(self, tensor: torch.Tensor, stream: str, op: str) -> None:
        """``tensor``'s storage was just made by ``op`` on ``stream``."""
        key = _key(tensor)
        if key is None:
            return
        existing = self._storages.get(key)
        if existing is not None and not existing.ref.expired():
            return  # an op handing back a storage that exists already
        entry = self._fresh(key, tensor)
        entry.allocated_on = stream
        self._made(entry, stream, f"{op} (makes it)")
        nbytes = tensor.untyped_storage().nbytes()
        if nbytes:
            entry.block = self.allocator.allocate(nbytes, stream, self._passed)
            self._watch_death(entry, tensor.untyped_storage())

    def before_resize(self, storage: torch.UntypedStorage, size: int) -> None:
        """``storage.resize_(size)`` is about to run: a free under a host thread's unordered use
        raises here, before the memory goes (the thread's real access would land in freed memory,
        and corrupt what the process allocates next)."""
        if size != 0 or storage.device.type != "cpu" or storage.nbytes() == 0:
            return
        with self._lock:
            entry = self._storages.get(storage_id(storage))
            if entry is not None and not entry.ref.expired():
                self._check_host_uses_before_free(entry, self.host_actor(), self._clocks[self.host_actor()])

    def _check_host_uses_before_free(self, entry: _Storage, freer: str, clock: Clock) -> None:
        for actor, tick, op in entry.uses():
            if actor not in self._device_actors and actor != freer and clock.get(actor, 0) < tick:
                self._fail(
                    f"simulated device: a buffer that {op} on the {actor} uses was freed (resize_(0)) by the "
                    f"{freer} before that use is ordered before the free (wait for it: its future's result())"
                )

    def resized(self, storage: torch.UntypedStorage, before: int) -> None:
        """``storage.resize_`` changed its size from ``before`` bytes: to 0, a free (on this
        thread's host actor); from 0, an allocation on the current stream (or, for a host buffer,
        from its allocator)."""
        after = storage.nbytes()
        if storage.device.type != "cpu" or (before == 0) == (after == 0):
            return
        key = storage_id(storage)
        with self._lock:
            entry = self._storages.get(key)
            if entry is not None and entry.ref.expired():
                entry = None
            if after == 0:
                if entry is not None and (entry.block is not None or entry.uses()):
                    actor = self.host_actor()
                    self._free(entry, actor, dict(self._clocks[actor]), resized=True)
                    self._storages[key] = _Storage(
                        StorageWeakRef(storage), host=entry.host, pinned=entry.pinned, freed_by=actor
                    )
                return
            host, pinned = (entry.host, entry.pinned) if entry is not None else (False, False)
            fresh = self._storages[key] = _Storage(StorageWeakRef(storage), host=host, pinned=pinned)
            if host:
                fresh.allocated_on = HOST
                if pinned:
                    fresh.block = self.pinned.allocate(after, self._passed)
                # The memory is the allocating thread's from now on: a thread still using the
                # buffer from before the free (a write to disk nobody waited for) touches memory
                # handed out again, whether it ran before the free, between, or after this.
                actor = self.host_actor()
                self._issue(actor)
                self._made(fresh, actor, "resize_ (allocates it again)")
            else:
                fresh.allocated_on = self.current()
                fresh.block = self.allocator.allocate(after, fresh.allocated_on, self._passed)
                self._issue(fresh.allocated_on)
                self._made(fresh, fresh.allocated_on, "resize_ (allocates it)")
            if fresh.block is not None:
                self._watch_death(fresh, storage)

    def _settle_frees(self) -> None:
        while self._freed:
            entry, actor, clock = self._freed.popleft()
            self._free(entry, actor, clock, resized=False)

    def _free(self, entry: _Storage, freer: str, clock: Clock, resized: bool) -> None:
        """``entry``'s memory was freed by ``freer`` (its clock then ``clock``): its last reference
        went, or with ``resized`` its storage was resized to nothing. A host thread uses a tensor
        through a reference, so only such a resize can free memory under it: a stream's work runs
        after the host dropped its references."""
        block, entry.block = entry.block, None
        entry.death = None
        uses = entry.uses()
        if resized:
            self._check_host_uses_before_free(entry, freer, clock)
        if entry.host:
            # The pinned allocator holds a block until the copies that used it are done.
            if block is not None:
                self.pinned.free(block, {a: t for a, t, _ in uses if a in self._device_actors})
            return
        owner = dict(self._clocks[entry.allocated_on])  # the allocation stream's next op
        _merge(owner, clock)
        for actor, tick, op in uses:
            if actor in (freer, entry.allocated_on) or actor in entry.streams or actor not in self._device_actors:
                continue
            if owner.get(actor, 0) < tick:
                self._fail(
                    f"simulated device: a tensor allocated on the {entry.allocated_on} that {op} on the {actor} uses "
                    f"was freed by the {freer} before that use is ordered, and it was not record_stream-ed to the "
                    f"{actor}: the allocator may give its memory to the {entry.allocated_on}'s next op"
                )
        if block is not None:
            self.allocator.free(block, {s: self._clocks[s].get(s, 0) for s in entry.streams if s in self._clocks})

    # --- accesses -----------------------------------------------------------------------------
    def _entry(self, key: int, tensor: torch.Tensor) -> _Storage:
        entry = self._storages.get(key)
        if entry is None or entry.ref.expired():
            entry = self._storages[key] = _Storage(StorageWeakRef(tensor.untyped_storage()))
        return entry

    def _fresh(self, key: int, tensor: torch.Tensor) -> _Storage:
        """A new entry for ``tensor``'s storage (one made just now)."""
        entry = self._storages[key] = _Storage(StorageWeakRef(tensor.untyped_storage()))
        return entry

    def _fail(self, message: str, kind: type[SimulatedDeviceError] = UnorderedAccessError) -> None:
        error = kind(message)
        self.errors.append(message)
        self.failures.append(error)
        raise error

    def _check(self, actor: str, clock: Clock, entry: _Storage, earlier: _Use, what: str, op: str, did: str) -> None:
        if earlier.actor == actor or clock.get(earlier.actor, 0) >= earlier.tick:
            return
        # A host thread only ever touches host memory: a storage the layer did not allocate that one
        # touches (a loaded state) is host memory, which the stream op before ran on synchronously,
        # on a GPU, when its host actor issued it.
        host_memory = not entry.host and actor not in self._device_actors and earlier.actor in self._device_actors
        if host_memory and (earlier.issuer == actor or clock.get(earlier.issuer, 0) >= earlier.issued):
            return
        self._fail(
            f"simulated device: {op} on the {actor} {what} a buffer that {earlier.op} {did} on the {earlier.actor} may "
            "still be using: no wait orders them (a GPU could run them in either order)"
        )

    def access(self, tensor: torch.Tensor, actor: str, write: bool, op: str) -> None:
        key = _key(tensor)
        if key is None:
            return
        entry = self._entry(key, tensor)
        if entry.freed_by is not None:
            self._fail(
                f"simulated device: {op} on the {actor} uses a buffer whose memory the {entry.freed_by} freed "
                "(untyped_storage().resize_(0)) and did not allocate again: a use after free"
            )
        clock = self._clocks[actor]
        issuer = self.host_actor()
        use = _Use(actor, clock[actor], op, issuer, self._clocks[issuer].get(issuer, 0))
        if entry.write is not None:
            self._check(actor, clock, entry, entry.write, "uses", op, "writes")
        if write:
            for earlier in entry.reads.values():
                self._check(actor, clock, entry, earlier, "writes", op, "reads")
            entry.write = use
            entry.reads = {}
        else:
            entry.reads[actor] = use

    def _refuse_views_of_freed(self, name: str, args: tuple[Any, ...]) -> None:
        """A view PyTorch refused to make of memory freed by ``resize_(0)`` (one that needs the
        storage's bytes: a slice, ``as_strided``; ``detach`` or ``view`` still work) is a use after
        free: on a thread whose future nobody reads the refusal would otherwise pass unseen."""
        touched: list[tuple[torch.Tensor, bool]] = []
        for value in args:
            _tensors(value, False, touched)
        with self._lock:
            for tensor, _ in touched:
                key = _key(tensor)
                entry = self._storages.get(key) if key is not None and tensor.numel() else None
                if entry is not None and not entry.ref.expired() and entry.freed_by is not None:
                    self._fail(
                        f"simulated device: {name} (a view) on the {self.host_actor()} uses a buffer whose memory "
                        f"the {entry.freed_by} freed (untyped_storage().resize_(0)) and did not allocate again: a "
                        "use after free"
                    )

    def host_read(self, tensor: torch.Tensor, op: str) -> None:
        """The host reads ``tensor``'s values without an op the mode sees (``tolist()``,
        ``numpy()``): a read by the host (a host buffer, or on a pool task), else, as the blocking
        copy it is on a GPU, by the current stream."""
        with self._lock:
            self._settle_frees()
            actor = self.host_actor()
            if actor == HOST and not self.synchronous and not self.is_host(tensor):
                actor = self.current()
            self._issue(actor)
            self.access(tensor, actor, False, f"{op} (read)")

    def run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        info = _op_info(func)
        if info.view:
            try:
                return func(*args, **kwargs)
            except RuntimeError:
                self._refuse_views_of_freed(info.name, args)
                raise
        if info.collective is not None:
            return self._collective(func, info.collective, args, kwargs)
        touched: list[tuple[torch.Tensor, bool]] = []
        for index, value in enumerate(args):
            _tensors(value, index in info.written_positions, touched)
        for name, value in kwargs.items():
            _tensors(value, name in info.written_names, touched)
        with self._lock:
            self._settle_frees()
            host_actor = self.host_actor()
            host = [self.is_host(t) for t, _ in touched]
            name = info.name
            if host_actor != HOST or self.synchronous:
                # A pool task (or callback) computes on host memory: all its operands are its own;
                # so does the host of the synchronous CPU.
                actor, tracked = host_actor, [True] * len(touched)
            else:
                # Only an asynchronous copy between a host buffer and memory that is not one is the
                # stream's; a blocking one is the host's (the host waits for it, and its other side
                # may be host memory the layer did not allocate: a load's values).
                transfer = name == "copy_" and any(host) and not all(host) and _non_blocking(args, kwargs)
                actor = HOST if any(host) and not transfer else self.current()
                # A host op's other operands (a step count made on the compute stream, a load's
                # values) are the host's business and not tracked; a copy's device side is its
                # stream's.
                tracked = host if actor == HOST else [True] * len(touched)
            self._issue(actor)
            for (tensor, write), on in zip(touched, tracked, strict=True):
                if on:
                    self.access(tensor, actor, write, f"{name} ({'write' if write else 'read'})")
        out = func(*args, **kwargs)
        # An op bringing a value to the host (``item()``) makes the host wait for the stream on a GPU,
        # but the simulation cannot tell device memory from host memory the layer did not allocate
        # (a step count), and orders nothing by it: a wait that only ``item()`` made unneeded in
        # one run is asked for.
        on_device = actor in self._device_actors
        with self._lock:
            inputs = {_key(t) for t, _ in touched}
            results: list[tuple[torch.Tensor, bool]] = []
            _tensors(out, False, results)
            for result, _ in results:
                key = _key(result)
                if key is None or key in inputs:
                    continue
                inputs.add(key)
                if on_device:
                    self._allocated(result, actor, name)
                else:
                    existing = self._storages.get(key)
                    if existing is None or existing.ref.expired():
                        entry = self._fresh(key, result)
                        entry.host, entry.allocated_on = True, HOST
                        self._made(entry, actor, f"{name} (makes it)")
        return out


def op_name(func: Any) -> str:
    return str(func.overloadpacket.__name__)


def _held_elsewhere(work: Any) -> bool:
    import sys

    return sys.getrefcount(work) > 3
