"""Run a test function on several gloo ranks in spawned processes.

``run_ranks(fn, world_size=2, args=...)`` calls ``fn(rank, world_size, *args)`` on every rank of a
gloo process group and returns every rank's result. A rank that raises, dies or hangs past
``timeout`` fails the test with every rank's report, never blocks CI. ``fn`` must be importable
(defined at module level in a test module).

Spawning ranks costs most of a small test (each process imports torch and transformers and forms a
process group: about eight seconds on a 2-core machine), so ranks are kept in a **pool** per world
size and reused by later tests. A pooled call runs in a process that earlier tests used, so:

* what a call changes in the process (environment variables, torch's default dtype and thread
  count) is put back after it;
* after each call the ranks meet in a ``monitored_barrier``: a call that left the group's
  collectives out of step (a rank issued one the others did not) fails that check, and the pool is
  closed, as it is after any error, timeout or death. The next call starts a new one.

``fresh=True`` runs the call in new processes that exit after it, as every call did before the
pool: for tests that measure a process's memory, set a process-group timeout of their own, or make
ranks depart from each other on purpose (a failed collective leaves a group unusable).

Ranks are forked from a **fork server** that imported torch, transformers and chunkmem once (a
``forkserver`` start, not ``spawn``): a new rank then starts in well under a second instead of
re-importing them (about 10 s for two ranks, 20 s for four on a 2-core machine). The server is a
clean process of its own (nothing but imports ran in it: no threads, no process group), so what a
fork inherits is what a spawned rank would have built. Like a spawned rank, a forked one does not
see environment variables the test process set after the server started.

Where the machine has no GPU, the server is not a new interpreter importing all that again
(seconds, once in every pytest-xdist worker): ``serve_forks_from_here()``, which ``conftest.py``
calls once collection has imported the test modules and before any test runs, forks the test
process itself into the server (``multiprocessing``'s own fork-server loop, started from a fork
instead of an ``exec``). Nothing but imports has run in it then either, and the server also holds
the test modules a rank's call would otherwise import. Where torch sees a GPU the server stays a
fresh interpreter: CUDA, once queried in the test process, does not work in its forks. Either
server freezes what its imports made (``gc.freeze``, ``frozen_heap.py``): a rank's garbage
collections skip it.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import itertools
import os
import queue
import socket
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

__all__ = ["RankFailure", "forked_context", "free_port", "run_ranks", "serve_forks_from_here"]

_POOL_PG_TIMEOUT = 60.0
_HEALTH_TIMEOUT = datetime.timedelta(seconds=20)
_GRACE = 10.0  # seconds to wait for the other ranks' reports once one rank failed


# Imported once in the fork server (one a process, shared with tests/support/forked.py); a module a rank's
# call needs beyond these is imported by the rank.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "chunkmem",
    "chunkmem.checkpoint",
    "support.frozen_heap",  # last: freezes what the imports above made
]


def forked_context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def serve_forks_from_here() -> bool:
    """Make a fork of this process ``multiprocessing``'s fork server, where it is safe (see the
    module docstring); call it before any test ran. Returns whether it did; if not, the server
    starts as a fresh interpreter at its first use, as ``forkserver`` starts it."""
    from multiprocessing import connection, forkserver, resource_tracker

    import torch

    server = forkserver._forkserver
    # The stdlib's server as of Python 3.10-3.13 (3.14 adds an authentication key it sends to it).
    if torch.cuda.is_available() or not hasattr(server, "_forkserver_pid") or hasattr(server, "_forkserver_authkey"):
        return False
    with server._lock:
        if server._forkserver_pid is not None:
            return False
        resource_tracker.ensure_running()
        listener = socket.socket(socket.AF_UNIX)
        address = connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        # Every client (this process, each process the server forks) holds the write end: the
        # server exits once all of them are gone, as forkserver's does.
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                # The lock this process held while forking stays held in the fork: a fork server
                # started from the server or its children (a script's own) would wait on it forever.
                server._lock = threading.Lock()
                os.close(alive_w)
                _detach_inherited_fds(keep={0, 1, 2, listener.fileno(), alive_r})
                from support import frozen_heap  # noqa: F401  (what the preload's last entry does in a fresh server)

                forkserver.main(listener.fileno(), alive_r, [])
                code = 0
            finally:
                os._exit(code)
        os.close(alive_r)
        listener.close()
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return True


def _detach_inherited_fds(keep: set[int]) -> None:
    """Point every inherited descriptor but ``keep`` at /dev/null: the server must not hold this
    process's pipes open (a pytest-xdist worker's channel to its controller would not reach EOF
    when the worker dies). /dev/null rather than closing: the numbers stay owned by the objects
    that own them here, so a late close of one does not close a descriptor the server opened."""
    null = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep and fd != null:
            with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
                os.dup2(null, fd)
    os.close(null)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailure(AssertionError):
    pass


def _init(rank: int, world_size: int, port: int, pg_timeout: float) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )


def _call(rank: int, world_size: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[str, Any]:
    """Run one call, putting back what it may have changed in the process."""
    import torch

    environment = dict(os.environ)
    dtype = torch.get_default_dtype()
    try:
        return "ok", fn(rank, world_size, *args)
    except BaseException:
        return "error", traceback.format_exc()
    finally:
        os.environ.clear()
        os.environ.update(environment)
        torch.set_default_dtype(dtype)
        torch.set_num_threads(1)


def _serve(rank: int, world_size: int, port: int, pg_timeout: float, inbox: Any, outbox: Any) -> None:
    """A pooled rank: run calls until told to stop, or until one fails (then exit, so that the
    other ranks' collectives fail at once instead of waiting for the group timeout)."""
    try:
        _init(rank, world_size, port, pg_timeout)
    except BaseException:
        outbox.put((-1, rank, "error", traceback.format_exc()))
        return
    import torch.distributed as dist

    while True:
        message = inbox.get()
        if message is None:
            break
        call_id, fn, args = message
        status, value = _call(rank, world_size, fn, args)
        if status == "ok":
            try:
                dist.monitored_barrier(timeout=_HEALTH_TIMEOUT, wait_all_ranks=True)
            except RuntimeError as error:
                status, value = "unhealthy", f"the ranks' collectives were out of step after the call: {error}"
        outbox.put((call_id, rank, status, value))
        if status != "ok":
            break
    dist.destroy_process_group()


def _fresh(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    pg_timeout: float,
) -> None:
    try:
        _init(rank, world_size, port, pg_timeout)
    except BaseException:
        results.put((0, rank, "error", traceback.format_exc()))
        return
    import torch.distributed as dist

    status, value = _call(rank, world_size, fn, args)
    try:
        dist.destroy_process_group()
    finally:
        results.put((0, rank, status, value))


class _Ranks:
    """Processes forming one process group; a pool serves many calls, fresh ranks one."""

    def __init__(self, procs: list[Any], results: Any, inboxes: list[Any] | None) -> None:
        self.procs = procs
        self.results = results
        self.inboxes = inboxes
        self.calls = itertools.count(1)

    def collect(self, call_id: int, world_size: int, timeout: float) -> dict[int, tuple[str, Any]]:
        reports: dict[int, tuple[str, Any]] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(reports) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                break
            try:
                got_id, rank, status, value = self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in self.procs) and self.results.empty():
                    break
                continue
            if got_id in (call_id, -1):
                reports[rank] = (status, value)
                if status != "ok":  # the others fail soon (the failed rank left the group)
                    grace = datetime.datetime.now() + datetime.timedelta(seconds=_GRACE)
                    deadline = min(deadline, grace)
        return reports

    def close(self) -> None:
        if self.inboxes is not None:
            for inbox in self.inboxes:
                inbox.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


_POOLS: dict[int, _Ranks] = {}


def _start_pool(world_size: int) -> _Ranks:
    ctx = forked_context()
    results = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(world_size)]
    port = free_port()
    procs = [
        ctx.Process(target=_serve, args=(rank, world_size, port, _POOL_PG_TIMEOUT, inboxes[rank], results), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    return _Ranks(procs, results, inboxes)


def _start_fresh(
    world_size: int, fn: Callable[..., Any], args: tuple[Any, ...], pg_timeout: float, spawn: bool
) -> tuple[_Ranks, int]:
    ctx = mp.get_context("spawn") if spawn else forked_context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_fresh, args=(rank, world_size, port, fn, args, results, pg_timeout), daemon=True)
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    return _Ranks(procs, results, None), 0


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple[Any, ...] = (),
    timeout: float = 240.0,
    pg_timeout: float | None = None,
    fresh: bool = False,
    spawn: bool = False,
) -> list[Any]:
    """Return ``fn``'s results in rank order; raise ``RankFailure`` naming every failed rank. A
    ``pg_timeout`` (seconds) of its own implies fresh processes; pooled ranks use 60 s. ``spawn``
    starts fresh ranks as new interpreters that import everything themselves, for a test that
    compares a whole process's resident set (a forked rank's counts the library pages it touched,
    not those its server loaded)."""
    if fresh or pg_timeout is not None or spawn:
        ranks, call_id = _start_fresh(world_size, fn, args, pg_timeout or _POOL_PG_TIMEOUT, spawn)
    else:
        ranks = _POOLS.get(world_size)
        if ranks is None:
            ranks = _POOLS[world_size] = _start_pool(world_size)
        call_id = next(ranks.calls)
        assert ranks.inboxes is not None, "a pool has inboxes"
        for inbox in ranks.inboxes:
            inbox.put((call_id, fn, args))
    try:
        reports = ranks.collect(call_id, world_size, timeout)
    except BaseException:
        _POOLS.pop(world_size, None)
        ranks.close()
        raise
    healthy = len(reports) == world_size and all(status == "ok" for status, _ in reports.values())
    if ranks.inboxes is None or not healthy:
        if _POOLS.get(world_size) is ranks:
            del _POOLS[world_size]
        if ranks.inboxes is not None:
            for p in ranks.procs:  # a failed pool may have ranks stuck in a collective
                p.terminate()
        ranks.close()
    problems = []
    for rank in range(world_size):
        if rank not in reports:
            code = ranks.procs[rank].exitcode
            problems.append(f"rank {rank}: no result (exit code {code}; hung past {timeout}s or died)")
        elif reports[rank][0] == "error":
            problems.append(f"rank {rank} raised:\n{reports[rank][1]}")
        elif reports[rank][0] == "unhealthy":
            problems.append(f"rank {rank}: {reports[rank][1]}")
    if problems:
        raise RankFailure("\n\n".join(problems))
    return [reports[rank][1] for rank in range(world_size)]
