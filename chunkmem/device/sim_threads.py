"""Host threads as actors of the simulated asynchronous device.

Each task a thread pool runs (an early host step, a disk read or write) is an actor with a clock
of its own, and so is each done-callback. The edges between them and the threads that wait are the
ones Python's ``concurrent.futures`` guarantees, and only those:

* ``submit``: the task starts after everything its submitter did before;
* ``result()`` / ``exception()`` (returning, or raising the task's error): the caller goes on after
  everything the task did;
* a done-callback runs after the task and after its registration (on an I/O thread, or at once on
  the registering thread when the task was done: an actor of its own either way, so that the
  outcome does not depend on which came first);
* ``shutdown(wait=True)`` joins every task the pool ran;
* a pool of one thread runs its tasks in submission order: each starts after the one before.

Which pool thread runs a task is not an edge (two tasks on one thread are ordered only by chance),
so a missing wait is an unordered access on every run, whatever the threads did.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..compat.python import executor_thread_prefix, executor_workers

__all__ = ["HostThreads"]

Clock = dict[str, int]


class _Actors(Protocol):
    """What the simulated device offers the threads."""

    def snapshot(self) -> Clock:
        """The current actor's clock after one more tick (what a thread it starts or signals sees)."""
        ...

    def run_as(self, actor: str, clock: Clock) -> AbstractContextManager[None]:
        """Run the block as ``actor`` starting from ``clock``, checked (on any thread)."""
        ...

    def current_clock(self) -> Clock:
        """The current actor's clock as it is (a copy)."""
        ...

    def join(self, clock: Clock) -> None:
        """The current actor goes on after ``clock``."""
        ...


@dataclass(eq=False)
class _Task:
    actor: str
    start: Clock
    end: Clock | None = None


@dataclass(eq=False)
class _Pool:
    """What is known of one executor: its last task (a pool of one thread runs them in order) and
    the merged end clocks of all its tasks (``shutdown`` joins them)."""

    serial: bool
    last: _Task | None = None
    ends: Clock = field(default_factory=dict)


def _merge(into: Clock, other: Clock) -> None:
    for actor, tick in other.items():
        if into.get(actor, 0) < tick:
            into[actor] = tick


class HostThreads:
    """The patches that make pool tasks actors (``install`` / ``uninstall``); see the module docstring."""

    def __init__(self, actors: _Actors) -> None:
        self._actors = actors
        self._tasks: weakref.WeakKeyDictionary[Future[Any], _Task] = weakref.WeakKeyDictionary()
        self._pools: weakref.WeakKeyDictionary[ThreadPoolExecutor, _Pool] = weakref.WeakKeyDictionary()
        self._numbers = itertools.count(1)
        self._real: dict[tuple[type, str], Any] = {}
        self._running: set[Future[Any]] = set()  # held until done: a task nobody waits for still runs

    # --- the edges ------------------------------------------------------------------------------
    def _submit(self, executor: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        pool = self._pools.get(executor)
        if pool is None:
            pool = self._pools[executor] = _Pool(serial=executor_workers(executor) == 1)
        prefix = executor_thread_prefix(executor) or "pool"
        task = _Task(f"{prefix} task {next(self._numbers)}", self._actors.snapshot())
        before = pool.last if pool.serial else None
        pool.last = task
        actors = self._actors

        def run(*run_args: Any, **run_kwargs: Any) -> Any:
            start = dict(task.start)
            if before is not None and before.end is not None:
                _merge(start, before.end)
            with actors.run_as(task.actor, start):
                try:
                    return fn(*run_args, **run_kwargs)
                finally:
                    task.end = actors.current_clock()
                    _merge(pool.ends, task.end)

        future = self._real[ThreadPoolExecutor, "submit"](executor, run, *args, **kwargs)
        self._tasks[future] = task
        self._running = {f for f in self._running if not f.done()} | {future}
        return future

    def _joined(self, future: Future[Any]) -> None:
        task = self._tasks.get(future)
        if task is not None and task.end is not None:
            self._actors.join(task.end)

    def _result(self, future: Future[Any], timeout: float | None = None) -> Any:
        try:
            value = self._real[Future, "result"](future, timeout)
        except (concurrent.futures.CancelledError, TimeoutError):
            raise
        except BaseException:
            self._joined(future)
            raise
        self._joined(future)
        return value

    def _exception(self, future: Future[Any], timeout: float | None = None) -> BaseException | None:
        error = self._real[Future, "exception"](future, timeout)
        self._joined(future)
        return error

    def _add_done_callback(self, future: Future[Any], fn: Callable[[Future[Any]], Any]) -> None:
        task = self._tasks.get(future)
        registered = self._actors.snapshot()
        name = f"callback of {task.actor}" if task is not None else "callback"
        actors = self._actors

        def call(done: Future[Any]) -> Any:
            start = dict(registered)
            if task is not None and task.end is not None:
                _merge(start, task.end)
            with actors.run_as(name, start):
                return fn(done)

        self._real[Future, "add_done_callback"](future, call)

    def _shutdown(self, executor: ThreadPoolExecutor, wait: bool = True, **kwargs: Any) -> None:
        self._real[ThreadPoolExecutor, "shutdown"](executor, wait, **kwargs)
        pool = self._pools.get(executor)
        if wait and pool is not None:
            self._actors.join(pool.ends)

    def drain(self, timeout: float = 30.0) -> None:
        """Wait (unchecked) for the tasks still running, so that what they touch is checked: a run
        that failed on the host before a task's access would otherwise pass or fail by timing."""
        running = [future for future in self._running if not future.done()]
        if running:
            concurrent.futures.wait(running, timeout=timeout)
        self._running = set()

    # --- installing -----------------------------------------------------------------------------
    def _patches(self) -> Iterator[tuple[type, str, Callable[..., Any]]]:
        yield ThreadPoolExecutor, "submit", self._submit
        yield ThreadPoolExecutor, "shutdown", self._shutdown
        yield Future, "result", self._result
        yield Future, "exception", self._exception
        yield Future, "add_done_callback", self._add_done_callback

    def install(self) -> None:
        """From now on pool tasks are actors (every ``ThreadPoolExecutor`` and ``Future`` in the process)."""
        for owner, name, patched in self._patches():
            self._real[owner, name] = owner.__dict__[name]
            setattr(owner, name, _method(patched))

    def uninstall(self) -> None:
        for (owner, name), real in self._real.items():
            setattr(owner, name, real)
        self._real.clear()


def _method(patched: Callable[..., Any]) -> Callable[..., Any]:
    """``patched`` (bound to the threads) as a method of the class it replaces a method of."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return patched(self, *args, **kwargs)

    return method
