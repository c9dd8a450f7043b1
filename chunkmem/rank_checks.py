"""``RankChecks``: ranks that depart from each other get an error on every rank, not a hang.

Every chunk collective must be issued by every rank in the same order. Three cheap checks, on a
small gloo group of their own (``side``), keep it so or say clearly where it broke:

* **Entries.** At each forward, each backward pass and each optimizer step (and before a state
  dict or checkpoint collective), the ranks agree a small fingerprint: which kind of iteration,
  its number, the phase and whether grad is enabled. An extra forward on one rank (evaluation,
  ``generate``), or a save on one rank only, meets a different fingerprint on the others.
* **Collectives while recording.** When no trace is followed (the first iteration, and after a
  divergence) nothing says what comes next, so each chunk collective is first agreed (what it is,
  on which chunk, how big). A module skipped on one rank meets a different collective.
* **Alarms while following.** A rank whose ops depart from the frozen trace knows it at once. It
  sends an alarm to every other rank (point to point on a second small group, read by a listener
  thread, so checking for one costs a flag read per op) and waits for them at a check. A rank that
  sees the alarm joins the check as soon as it has reached the same point (or is blocked waiting
  for a collective): if every rank departed the same way (a branch taken on all ranks), training
  goes on and records a new trace; otherwise every rank raises, naming each rank's position.

Check mode (``check_plans``) adds a fingerprint of every placement plan, agreed before it is
carried out: a rank-local input to a decision becomes a test failure instead of a hang.
"""

from __future__ import annotations

import datetime
import enum
import hashlib
import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from placement import FetchPlan, Phase

from .errors import TraceDivergenceError
from .iteration import IterationKind, Where

__all__ = ["CheckKind", "RankChecks"]

log = logging.getLogger("chunkmem")

_FIX = (
    "Every rank must run the same operations on the boosted model in the same order: run evaluation, "
    "generate() and save_pretrained() on every rank, or do rank-local work on a plain module with the full "
    "weights (model.plain_copy() on every rank returns one on rank 0); save with booster.save_model() on every "
    "rank; keep rank-dependent branches out of the model."
)


class CheckKind(enum.IntEnum):
    ENTRY = 1
    COLLECTIVE = 2
    DIVERGED = 3
    FOLLOWING = 4
    PLAN = 5


def fingerprint(text: str) -> int:
    """A 62-bit fingerprint of ``text``, the same in every process."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2


class RankChecks:
    """See the module docstring. Built by the communicator at world size > 1."""

    def __init__(self, ranks: Sequence[int], rank: int, timeout: datetime.timedelta, check_plans: bool) -> None:
        self._rank = rank
        self._world_size = len(ranks)
        self._ranks = list(ranks)
        self._side = dist.new_group(ranks=self._ranks, backend="gloo", timeout=timeout)
        self._alarm_group = dist.new_group(ranks=self._ranks, backend="gloo", timeout=timeout)
        self._check_plans = check_plans
        self._where: Callable[[], Where] | None = None
        self._recording: Callable[[], bool] = lambda: False
        self._alarms: queue.Queue[tuple[int, ...]] = queue.Queue()
        self._pending: list[tuple[int, ...]] = []  # alarms received, not yet acted on
        self._failed: str | None = None
        self._listener = threading.Thread(target=self._listen, name="chunkmem-alarms", daemon=True)
        self._listener.start()

    @property
    def side_group(self) -> Any:
        return self._side

    @property
    def check_plans(self) -> bool:
        return self._check_plans

    def follow(self, where: Callable[[], Where], recording: Callable[[], bool]) -> None:
        """Where the run is (for fingerprints and messages) and whether it records a trace."""
        self._where = where
        self._recording = recording

    def _now(self) -> Where:
        return self._where() if self._where is not None else Where(IterationKind.TRAINING, -1, -1)

    # --- the three checks ---------------------------------------------------------------------
    def entry(self, name: str, detail: str = "", where: Where | None = None, shown: str | None = None) -> None:
        """At a forward, backward, optimizer step or state-dict entry (``where`` it leads, by
        default where the run is): agree with the others on ``name`` and ``detail``. ``shown`` is
        what messages say instead (it may name things that differ between ranks, such as paths)."""
        where = where if where is not None else self._now()
        self.poll()
        text = f"{shown or name}{f' ({detail})' if detail else ''} at {where.describe()}"
        self._agree(CheckKind.ENTRY, where, fingerprint(f"{name}|{detail}"), text)

    def collective(self, what: str, numel: int) -> None:
        """Before a chunk collective: agreed first while no trace is followed."""
        if not self._recording():
            return
        where = self._now()
        self.poll()
        self._agree(CheckKind.COLLECTIVE, where, fingerprint(f"{what}|{numel}"), f"{what} at {where.describe()}")

    def check_plan(
        self, position: int, phase: Phase, chunk_ids: tuple[int, ...], device_bytes: int, plan: FetchPlan
    ) -> None:
        """Check mode: agree the fingerprint of a placement plan and what it was decided from."""
        if not self._check_plans:
            return
        where = self._now()
        text = (
            f"{phase.value} op on chunks {chunk_ids} at position {position} with {device_bytes} device bytes: "
            f"evict {plan.evict}, flush {plan.flush}, prefetch {plan.prefetch}"
        )
        self._agree(CheckKind.PLAN, where, fingerprint(text), f"plan for {text} ({where.describe()})")

    def diverged(self, description: str) -> None:
        """This rank departed from the frozen trace: alarm the others, then agree with them
        whether every rank departed the same way (then training goes on)."""
        where = self._now()
        message = torch.tensor(
            [self._rank, int(where.kind is IterationKind.INFERENCE), where.iteration, where.position]
        )
        sends = [
            dist.isend(message, dst=peer, group=self._alarm_group)
            for index, peer in enumerate(self._ranks)
            if index != self._rank
        ]
        text = f"departed from the trace at {where.describe()}: {description}"
        self._agree(CheckKind.DIVERGED, where, fingerprint(description), text)
        # Every rank departed the same way: each sent its alarm, all of which are on their way.
        for send in sends:
            send.wait()
        for _ in range(self._world_size - 1):
            self._take_alarm_matching(where)

    def poll(self) -> None:
        """Act on an alarm from another rank once this rank has reached the point it names. A rank
        behind that point only waits for collectives the alarming rank issued before departing,
        which complete, so it goes on until it gets there."""
        while True:
            try:
                self._pending.append(self._alarms.get_nowait())
            except queue.Empty:
                break
        if not self._pending:
            return
        where = self._now()
        _, inference, iteration, position = min(self._pending, key=lambda a: (a[2], a[3]))
        kind = IterationKind.INFERENCE if inference else IterationKind.TRAINING
        if kind is where.kind and (where.iteration, where.position) < (iteration, position):
            return
        self._agree(
            CheckKind.FOLLOWING, where, fingerprint("following"), f"followed the trace up to {where.describe()}"
        )
        self._fail(f"rank {self._rank}: an alarm from another rank was not matched by any departure. {_FIX}")

    @property
    def alarmed(self) -> bool:
        """An alarm is waiting (cheap: a queue length)."""
        return bool(self._pending) or not self._alarms.empty()

    # --- machinery ------------------------------------------------------------------------------
    def _listen(self) -> None:
        buffer = torch.zeros(4, dtype=torch.int64)
        while True:
            try:
                dist.irecv(buffer, src=None, group=self._alarm_group).wait()
            except Exception:  # the group is gone (shutdown): stop listening
                return
            self._alarms.put(tuple(int(v) for v in buffer.tolist()))

    def _take_alarm_matching(self, where: Where) -> None:
        inference = int(where.kind is IterationKind.INFERENCE)
        for index, alarm in enumerate(self._pending):
            if alarm[1:] == (inference, where.iteration, where.position):
                del self._pending[index]
                return
        while True:
            alarm = self._alarms.get(timeout=60)
            if alarm[1:] == (inference, where.iteration, where.position):
                return
            self._pending.append(alarm)

    def _agree(self, kind: CheckKind, where: Where, value: int, text: str) -> None:
        if self._failed is not None:
            raise TraceDivergenceError(self._failed)
        payload = torch.tensor(
            [int(kind), int(where.kind is IterationKind.INFERENCE), where.iteration, where.position, value],
            dtype=torch.int64,
        )
        everyone = [torch.empty_like(payload) for _ in range(self._world_size)]
        try:
            dist.all_gather(everyone, payload, group=self._side)
        except RuntimeError as error:
            self._fail(
                f"rank {self._rank}: the other ranks did not reach a cross-rank check ({text}) "
                f"({str(error).strip().splitlines()[0]}); a rank departed, stopped or is still busy with rank-local "
                f"work past the process-group timeout. {_FIX}"
            )
        if all(torch.equal(p, payload) for p in everyone):
            return
        texts: list[Any] = [None] * self._world_size
        dist.all_gather_object(texts, text, group=self._side)
        values = [tuple(p.tolist()) for p in everyone]
        departed = [r for r, v in enumerate(values) if v[0] == CheckKind.DIVERGED]
        common, count = Counter(values).most_common(1)[0]
        if departed:
            who = f"ranks {departed} departed from the compute trace the other ranks followed"
        elif 2 * count > self._world_size:
            who = f"ranks {[r for r, v in enumerate(values) if v != common]} departed from the others"
        else:
            who = "the ranks are at different points"
        lines = "; ".join(f"rank {r}: {t}" for r, t in enumerate(texts))
        self._fail(f"rank {self._rank}: {who} ({lines}). {_FIX}")

    def _fail(self, message: str) -> None:
        self._failed = message
        raise TraceDivergenceError(message)
