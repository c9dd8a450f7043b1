"""``EarlySteps``: host optimizer steps run during the backward, kept or undone exactly.

With ``StepDuringBackward`` the runtime hands over each chunk whose master is on the host as soon
as its last gradient of the iteration is reduced and on its way to the host (``submit``). A worker
thread then waits for the gradient to land, copies the chunk's master and optimizer state aside
(the restore point), and steps the chunk's runs with the user's optimizer, while the device goes
on with the backward.

Whether that step is the one ``optimizer.step()`` would have taken is only known there: the loop
may instead clip the gradients, find fp16 inf/nan, change a hyperparameter, run another forward or
backward, call ``zero_grad``, load or save. So the early steps stay pending until
``optimizer.step()`` keeps them (``commit``), or anything that would see or change what they
computed puts the restore points back first (``undo``), after which the step runs as if nothing
had happened early. Keeping a step costs nothing; the restore point costs a copy of the master and
states, bounded by ``backup_budget``.

Putting them back is one obligation with one verb, ``cancel``, and the package enforces it where
it owns the data: ``StepRuns`` cancels before any read or change of the optimizer state other than
the worker's (a state dict, a load, a new param group), and ``GradScaling`` before it changes the
gradients the steps read (clipping, fp16 inf/nan). The runtime cancels, through the optimizer's
``EarlyStepListener``, before what reads or writes masters outside the optimizer (a forward, an op
outside it, a departure from the trace, ``zero_grad``, a model state dict or load).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..usage.stats import Stats
from .runs import Run, StepRuns, same_value

if TYPE_CHECKING:
    from ..chunks.chunk import Chunk
    from ..execution.runtime import ChunkRuntime
    from .optimizer_state import OptimizerState
    from .stepper import RunStepper

__all__ = ["EarlySteps", "group_settings", "same_settings"]

log = logging.getLogger("chunkmem")


# Not settings of a step's values: the parameters, and the kernel, which the stepper sets for the
# host runs while a step runs (an early step on the worker, while the backward queues the next).
_NOT_SETTINGS = frozenset({"params", "fused"})


def group_settings(groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each param group's settings (everything but its parameters and kernel), copied."""
    return [
        {key: (value.clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)) for key, value in g.items()}
        for g in ({k: v for k, v in group.items() if k not in _NOT_SETTINGS} for group in groups)
    ]


def same_settings(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(same_value(x[k], y[k]) for k in x) for x, y in zip(a, b, strict=True)
    )


@dataclass
class _Saved:
    """One run's restore point: its master values and its state (``None``: it had none)."""

    run: Run
    master: torch.Tensor
    state: dict[str, Any] | None


@dataclass
class _Record:
    """A chunk stepped early in this iteration."""

    chunk: Chunk
    flags: tuple[bool, ...]
    """Which of its parameters had a gradient (the runs were stepped accordingly)."""
    nbytes: int
    settings: list[dict[str, Any]] = field(default_factory=list)
    """The hyperparameters the step used."""
    saved: list[_Saved] = field(default_factory=list)
    started_in_backward: bool = False


class EarlySteps:
    """See the module docstring. ``state``: the user's optimizer's; ``stepper`` runs it over runs
    whose gradients are set; ``runtime`` says whether the backward is still running (for
    ``Stats``); ``unscale`` gives the fp16 loss scale's inverse (``None`` without loss scaling)."""

    def __init__(
        self,
        budget: int,
        runs: StepRuns,
        state: OptimizerState,
        stepper: RunStepper,
        runtime: ChunkRuntime,
        unscale: Callable[[], float | None],
        stats: Stats,
    ) -> None:
        self._budget = budget
        self._runs = runs
        self._state = state
        self._stepper = stepper
        self._runtime = runtime
        self._unscale = unscale
        self._stats = stats
        self._worker: ThreadPoolExecutor | None = None
        self._futures: list[Future[None]] = []
        self._records: dict[int, _Record] = {}
        self._held = 0
        self._spare: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}

    @property
    def pending(self) -> bool:
        """Early steps were taken (or queued) that neither ``commit`` nor ``undo`` has settled."""
        return bool(self._records)

    def cancel(self, reason: str) -> None:
        """Put back the early steps still pending: ``reason`` is about to read or change what they
        read or computed (``undo``). Nothing to do when none is pending."""
        if self.pending:
            log.debug("chunkmem: early host steps undone: %s", reason)
            self.undo()

    def keep_if_unchanged(self, chunks: Sequence[Chunk]) -> frozenset[int]:
        """At the step: keep the early steps when they are the ones this step takes (the same
        hyperparameters, the same parameters with gradients as agreed over ranks), else put them
        back. Returns the chunks they stepped (the step leaves them out). What the steps used was
        recorded when they were queued, so the choice waits for none of them: ``commit`` or
        ``undo`` does."""
        if not self.pending:
            return frozenset()
        now = group_settings(self._state.groups)
        records = self._records
        same = all(same_settings(record.settings, now) for record in records.values()) and all(
            chunk.chunk_id not in records or records[chunk.chunk_id].flags == chunk.grads.params_with_grad
            for chunk in chunks
            if chunk.layout.trainable
        )
        if same:
            return self.commit()
        failure = self.undo()
        if failure is not None:
            raise failure
        return frozenset()

    # --- the worker ---------------------------------------------------------------------------
    def submit(self, chunk: Chunk) -> bool:
        """Step ``chunk`` early (its gradient final and on its way to the host). Returns whether it
        was taken: not when its restore point would overflow the budget."""
        if chunk.chunk_id in self._records:
            return False
        nbytes = self._restore_bytes(chunk)
        if self._held + nbytes > self._budget:
            self._stats.early_steps_declined += 1
            return False
        self._held += nbytes
        # The hyperparameters the step uses are those now: nothing changes them while the backward
        # that queues it runs.
        record = _Record(chunk, chunk.grads.params_with_grad, nbytes, group_settings(self._state.groups))
        self._records[chunk.chunk_id] = record
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunkmem-host-step")
        self._futures.append(self._worker.submit(self._run, record))
        return True

    def _restore_bytes(self, chunk: Chunk) -> int:
        """An upper bound of what ``chunk``'s restore point holds: its master shard and, per state
        tensor a run keeps now (or the state a first step creates, measured like the master)."""
        master = chunk.layout.shard_numel * chunk.store.master.element_size()
        states = 0
        for run in self._runs.runs():
            if run.chunk is chunk:
                state = self._state.table.get(run.tensor) or {}
                states += sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))
        return master + max(states, 2 * master)

    def _run(self, record: _Record) -> None:
        """On the worker: wait for the gradient, save the restore point, step."""
        begin = time.perf_counter()
        record.started_in_backward = self._runtime.in_backward
        chunk = record.chunk
        shard = chunk.grads.shard  # waits for the copy that brings it to the host
        pieces = {
            id(p.tensor): record.flags[p.info.index]
            for run in self._runs.runs()
            if run.chunk is chunk
            for p in run.pieces
        }
        self._runs.split_by_gradient(pieces, only=lambda other: other is chunk)
        runs = [run for run in self._runs.runs() if run.chunk is chunk and record.flags[run.pieces[0].info.index]]
        record.saved = [self._save(run) for run in runs]
        inverse = self._unscale()
        grads = shard if inverse is None else self._scratch(shard).copy_(shard).mul_(inverse)
        try:
            for run in runs:
                run.tensor.grad = grads[run.start : run.stop]
            self._stepper.step(runs)
        finally:
            for run in runs:
                run.tensor.grad = None
            if inverse is not None:
                self._give_back(grads)
        self._stats.early_steps += 1
        self._stats.early_steps_in_backward += int(record.started_in_backward)
        self._stats.host_step_seconds += time.perf_counter() - begin

    def _save(self, run: Run) -> _Saved:
        state = self._state.table.get(run.tensor)
        saved_state = None
        if state:
            saved_state = {
                key: self._take_copy(value) if isinstance(value, torch.Tensor) else copy.deepcopy(value)
                for key, value in state.items()
            }
        return _Saved(run, self._take_copy(run.tensor), saved_state)

    def _take_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        spare = self._spare.get((tensor.numel(), tensor.dtype, tensor.device))
        out = spare.pop() if spare else torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        return out.copy_(tensor.reshape(-1)).view(tensor.shape)

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        spare = self._spare.get((like.numel(), like.dtype, like.device))
        return spare.pop() if spare else torch.empty_like(like)

    def _give_back(self, tensor: torch.Tensor) -> None:
        self._spare.setdefault((tensor.numel(), tensor.dtype, tensor.device), []).append(tensor.reshape(-1))

    # --- settling -----------------------------------------------------------------------------
    def settle(self) -> None:
        """Wait for every early step queued; a failure in one is raised here (every restore point
        put back first)."""
        failure = self._wait()
        if failure is not None:
            self.undo()
            raise failure

    def _wait(self) -> BaseException | None:
        """Wait for every early step queued; the first failure among them."""
        futures, self._futures = self._futures, []
        errors = [f.exception() for f in futures]  # a failed step restores what it had saved too
        return next((e for e in errors if e is not None), None)

    def commit(self) -> frozenset[int]:
        """Keep every early step: returns the chunks they stepped (``optimizer.step()`` leaves
        them out). They were settled by the step's checks (``GradScaling.prepare``)."""
        if self._futures:
            raise RuntimeError("EarlySteps.commit: early steps still running; settle() them first")
        done = frozenset(self._records)
        for record in self._records.values():
            self._release(record)
        self._records.clear()
        return done

    def undo(self) -> BaseException | None:
        """Put every restore point back: masters and optimizer states as before the early steps.
        Returns the first failure of a step (its restore point is put back like the others)."""
        failure = self._wait()
        table = self._state.table
        for record in self._records.values():
            for saved in record.saved:
                saved.run.tensor.copy_(saved.master)
                if saved.state is None:
                    table.pop(saved.run.tensor, None)
                    continue
                current = table.get(saved.run.tensor)
                if current is None:
                    current = table[saved.run.tensor] = {}
                for key in [k for k in current if k not in saved.state]:
                    del current[key]
                for key, value in saved.state.items():
                    if isinstance(value, torch.Tensor) and isinstance(current.get(key), torch.Tensor):
                        current[key].copy_(value)
                    elif isinstance(value, torch.Tensor):
                        current[key] = value.clone()
                    else:
                        current[key] = copy.deepcopy(value)
            self._stats.early_steps_undone += 1
            self._release(record)
        self._records.clear()
        return failure

    def _release(self, record: _Record) -> None:
        for saved in record.saved:
            self._give_back(saved.master)
            for value in (saved.state or {}).values():
                if isinstance(value, torch.Tensor):
                    self._give_back(value)
        record.saved = []
        self._held -= record.nbytes
