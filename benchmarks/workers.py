"""Persistent rank processes that a benchmark drives one command at a time, with a time limit.

A :class:`RankPool` starts ``world_size`` processes, forked from a server process that only
imported torch, transformers and chunkmem (``forkserver``): each starts clean, in well under a
second, and its peak RSS is its own (a spawned process's ``ru_maxrss`` starts at its parent's size,
as fork comes before exec), lets them form a process group (gloo on the CPU, NCCL on GPUs), and
then runs commands: ``pool.call(timeout, fn, *args)`` runs ``fn(ctx, *args)`` on every rank and
returns the results in rank order. ``ctx`` (:class:`RankContext`) carries the rank, the device and
a ``state`` dict that lives as long as the process, so one command can build a model that later
commands train.

A command that raises on any rank, a rank that dies, or a call that outlives its timeout (a hang in
a collective) ends the pool: its processes are killed and :class:`CallFailure` says what happened
on which rank. The caller decides what to do next (mark a row failed, start a new pool); nothing
waits forever. :class:`LocalRanks` runs the same commands in this process at world size 1.

A caller that runs a benchmark in a process already like that server (the tests) may set
``BENCH_START_METHOD=fork`` to fork the processes from it instead (:func:`forked_context`).

Commands and initialisers must be importable functions (defined at module level).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import socket
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

__all__ = [
    "START_METHOD_VARIABLE",
    "CallFailure",
    "LocalRanks",
    "RankContext",
    "RankPool",
    "fork_problem",
    "forked_context",
    "free_port",
    "init_torch_group",
    "run_in_fresh_process",
]

FailureKind = Literal["error", "timeout", "died"]


@dataclass
class RankContext:
    """What a command sees in its process."""

    rank: int
    world_size: int
    device: torch.device
    state: dict[str, Any] = field(default_factory=dict)
    """Objects a command keeps for later commands in the same process (models, optimizers)."""


class CallFailure(RuntimeError):
    """A command did not complete on every rank."""

    def __init__(self, kind: FailureKind, message: str, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.out_of_memory = out_of_memory

    def summary(self) -> str:
        """One line for a table: the kind and the last line of the first rank's report."""
        if self.out_of_memory:
            return "out of memory"
        lines = [line.strip() for line in str(self).splitlines() if line.strip()]
        last = next((line for line in reversed(lines) if not line.startswith("rank ")), lines[-1] if lines else "")
        return f"{self.kind}: {last}"[:160]


GroupInit = Callable[[RankContext, str], None]


def init_torch_group(ctx: RankContext, backend: str) -> None:
    """``torch.distributed.init_process_group`` from the environment the pool set (MASTER_ADDR,
    MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=float(os.environ.get("BENCH_PG_TIMEOUT", "120")))
    if ctx.device.type == "cuda":
        dist.init_process_group(backend, init_method="env://", timeout=timeout, device_id=ctx.device)
    else:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)


START_METHOD_VARIABLE = "BENCH_START_METHOD"
"""Environment variable choosing how benchmark processes start: ``forkserver`` (the default) or
``fork``. ``fork`` is for a caller that runs a benchmark script in a process that is already what
the fork server would be (forked from a server that imported torch, transformers and chunkmem, as
the tests do): its processes are then forked from the script's own process instead of from a new
server that imports everything again (seconds on a small machine, for each script run). Only
where the processes compute on the CPU: see :func:`fork_problem`."""


def _threads() -> int:
    """How many threads this process runs now (the kernel's count: OpenMP's and torch's pools too)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:  # no procfs: Python's own threads are all that can be counted
        import threading

        return threading.active_count()


def fork_problem() -> str | None:
    """Why forking this process now would give children that cannot work, or ``None``: a thread
    beside the main one (its locks would stay held forever in the child), or children that could
    use CUDA (once a process asked CUDA anything, even how many devices it has, a forked child
    cannot initialise it: a torch built with CUDA is safe only with the GPUs hidden)."""
    if torch.cuda.is_initialized():
        return "it initialised CUDA"
    if torch.backends.cuda.is_built() and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        return "its processes could use CUDA (hide the GPUs with CUDA_VISIBLE_DEVICES= to fork)"
    threads = _threads()
    return f"{threads} threads run in it" if threads > 1 else None


def forked_context() -> Any:
    """Multiprocessing's ``forkserver`` start, its server preloaded with what every benchmark
    process imports (one server a process: the first caller's preload list is the one used); or,
    where ``BENCH_START_METHOD=fork``, a plain fork of this process, refused (``RuntimeError``)
    where :func:`fork_problem` finds one."""
    import torch.multiprocessing as mp

    method = os.environ.get(START_METHOD_VARIABLE, "forkserver")
    if method == "fork":
        problem = fork_problem()
        if problem is not None:
            raise RuntimeError(
                f"{START_METHOD_VARIABLE}=fork, but this process (pid {os.getpid()}) cannot be forked safely: "
                f"{problem}. Start benchmark processes before this process computes with torch or starts "
                f"threads, or unset {START_METHOD_VARIABLE} to start them from a fork server."
            )
        return mp.get_context("fork")
    if method != "forkserver":
        raise ValueError(f"{START_METHOD_VARIABLE} must be 'forkserver' or 'fork', got {method!r}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama", "chunkmem"]
    )
    return ctx


def _report(target: Callable[[dict[str, Any]], dict[str, Any]], spec: dict[str, Any], results: Any) -> None:
    try:
        results.put(("ok", target(spec)))
    except BaseException as error:  # reported to the caller; the process then exits
        results.put(("failed", f"{type(error).__name__}: {error}"))


def run_in_fresh_process(
    target: Callable[[dict[str, Any]], dict[str, Any]], spec: dict[str, Any], timeout: float
) -> tuple[Literal["ok", "failed"], Any]:
    """``target(spec)`` in a process of its own, forked from the preloaded server or from this
    process (:func:`forked_context`): its peak RSS, threads and process group are its own, and it
    starts in well under a second, where a fresh interpreter takes seconds to import torch.
    Returns ``("ok", result)``, or ``("failed", reason)`` when it raised, died (killed, out of
    memory) or outlived ``timeout`` seconds."""
    ctx = forked_context()
    results = ctx.Queue()
    process = ctx.Process(target=_report, args=(target, spec, results), daemon=True)
    process.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                return results.get(timeout=1.0)
            except queue.Empty:
                if not process.is_alive() and results.empty():
                    return "failed", f"exit code {process.exitcode} (killed or out of memory)"
                if time.monotonic() > deadline:
                    return "failed", f"timeout after {timeout:.0f} s"
    finally:
        if process.is_alive():
            process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()


def free_port() -> int:
    """A TCP port on the loopback interface that is free now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def _rank_device(rank: int) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _serve(
    rank: int,
    world_size: int,
    env: dict[str, str],
    threads: int,
    backend: str,
    init: GroupInit | None,
    device_memory: int | None,
    inbox: Any,
    outbox: Any,
) -> None:
    # Frameworks' own deprecation notices (DeepSpeed calls renamed collectives) are not results.
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use.*", category=FutureWarning)
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    try:
        ctx = RankContext(rank, world_size, _rank_device(rank))
        if device_memory is not None and ctx.device.type == "cuda":
            total = torch.cuda.get_device_properties(ctx.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, device_memory / total), ctx.device)
        if init is not None:
            init(ctx, backend)
    except BaseException as error:
        outbox.put((rank, "error", traceback.format_exc(), _out_of_memory(error)))
        return
    outbox.put((rank, "ok", None, False))
    while True:
        message = inbox.get()
        if message is None:
            break
        fn, args = message
        try:
            outbox.put((rank, "ok", fn(ctx, *args), False))
        except BaseException as error:
            outbox.put((rank, "error", traceback.format_exc(), _out_of_memory(error)))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class RankPool:
    """``world_size`` forked processes in one process group, run command by command.

    Args:
        world_size: number of ranks.
        backend: ``"gloo"`` or ``"nccl"``.
        threads: torch intra-op threads per rank.
        init: forms the process group in each rank (``init_torch_group``, or a framework's own
            initialiser); ``None`` forms none (world size 1 without torch.distributed).
        env: extra environment variables for the ranks.
        device_memory: cap on each rank's CUDA allocations in bytes (emulates a smaller card).
        start_timeout: seconds the ranks may take to start and form the group.
        wait: wait for the ranks here; with ``False`` the first ``call`` (or ``wait_ready``) does,
            so that several pools can start at once.
        error_grace: seconds the other ranks get to report their own error once one rank raised
            (they may be stuck in a collective it never joined) before they are killed.
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        threads: int = 1,
        init: GroupInit | None = init_torch_group,
        env: dict[str, str] | None = None,
        device_memory: int | None = None,
        start_timeout: float = 300.0,
        wait: bool = True,
        error_grace: float = 10.0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        ctx = forked_context()
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        full_env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "OMP_NUM_THREADS": str(threads),
            **(env or {}),
        }
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(
                    rank,
                    world_size,
                    full_env,
                    threads,
                    backend,
                    init,
                    device_memory,
                    self._inboxes[rank],
                    self._outbox,
                ),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        self._closed = False
        self._started = False
        self._start_timeout = start_timeout
        self._error_grace = error_grace
        for proc in self._procs:
            proc.start()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until every rank has started and formed the group (raises :class:`CallFailure`)."""
        if not self._started:
            self._started = True
            self._collect(self._start_timeout, "starting the ranks")

    @property
    def pids(self) -> list[int | None]:
        return [proc.pid for proc in self._procs]

    @property
    def alive(self) -> bool:
        return not self._closed

    def call(self, timeout: float, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(ctx, *args)`` on every rank; the results in rank order. Raises :class:`CallFailure`
        (and ends the pool) when a rank raises, dies, or the call takes longer than ``timeout``."""
        if self._closed:
            raise CallFailure("died", "the rank pool was closed after an earlier failure")
        self.wait_ready()
        for inbox in self._inboxes:
            inbox.put((fn, args))
        return self._collect(timeout, getattr(fn, "__name__", repr(fn)))

    def _collect(self, timeout: float, what: str) -> list[Any]:
        replies: dict[int, tuple[str, Any, bool]] = {}
        deadline = time.monotonic() + timeout
        first_error: float | None = None
        while len(replies) < self.world_size:
            now = time.monotonic()
            # After one rank raised, the others may be stuck in a collective it never joined:
            # give them a moment to report their own error, not the whole timeout.
            limit = deadline if first_error is None else min(deadline, first_error + self._error_grace)
            if now >= limit:
                break
            try:
                rank, status, value, oom = self._outbox.get(timeout=min(1.0, limit - now))
            except queue.Empty:
                if any(not proc.is_alive() for proc in self._procs):
                    dead = [r for r, proc in enumerate(self._procs) if not proc.is_alive() and r not in replies]
                    if dead and self._outbox.empty():
                        break
                continue
            replies[rank] = (status, value, oom)
            if status != "ok" and first_error is None:
                first_error = time.monotonic()
        if len(replies) == self.world_size and all(status == "ok" for status, _, _ in replies.values()):
            return [replies[rank][1] for rank in range(self.world_size)]
        hung = [proc.is_alive() for proc in self._procs]
        self.close(force=True)
        problems = []
        kind: FailureKind = "error"
        for rank in range(self.world_size):
            if rank in replies and replies[rank][0] != "ok":
                problems.append(f"rank {rank} raised in {what}:\n{replies[rank][1]}")
            elif rank not in replies:
                if hung[rank]:
                    problems.append(f"rank {rank}: no answer to {what} within {timeout:.0f} s (hung; killed)")
                    kind = "timeout" if not any(r[0] != "ok" for r in replies.values()) else kind
                else:
                    code = self._procs[rank].exitcode
                    problems.append(f"rank {rank}: died during {what} (exit code {code})")
                    kind = "died" if not any(r[0] != "ok" for r in replies.values()) else kind
        oom = any(oom for _, _, oom in replies.values())
        raise CallFailure(kind, "\n".join(problems), out_of_memory=oom)

    def close(self, force: bool = False) -> None:
        """Stop the ranks (politely unless ``force``); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if not force:
            for inbox in self._inboxes:
                inbox.put(None)
            for proc in self._procs:
                proc.join(timeout=30)
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        # Each inbox a command went into runs a feeder thread in this process until it is closed:
        # ended here, so that the next pool forks a process that runs no other thread. What no
        # rank read is drained first: a feeder still writing a command larger than the pipe holds
        # to a rank that is gone would block the join.
        for box in (*self._inboxes, self._outbox):
            with contextlib.suppress(queue.Empty, OSError, EOFError):
                while True:
                    box.get(timeout=0.05)
            box.close()
            box.join_thread()

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(force=exc[0] is not None)


class LocalRanks:
    """The same interface at world size 1 in this process: no spawn, no process group, no time
    limit (nothing can hang waiting for another rank)."""

    world_size = 1

    def __init__(self, device: torch.device) -> None:
        self._ctx = RankContext(0, 1, device)

    @property
    def alive(self) -> bool:
        return True

    def call(self, timeout: float, fn: Callable[..., Any], *args: Any) -> list[Any]:
        try:
            return [fn(self._ctx, *args)]
        except Exception as error:
            raise CallFailure(
                "error", f"rank 0 raised in {fn.__name__}:\n{traceback.format_exc()}", _out_of_memory(error)
            ) from error

    def close(self, force: bool = False) -> None:
        self._ctx.state.clear()

    def __enter__(self) -> LocalRanks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
