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
* **Ranks that never come.** An agreement waits with a timed poll. After a short grace it asks the
  missing ranks (on the same point-to-point group) what their main thread is doing: one blocked in
  a ``torch.distributed`` collective of the user's own that this rank will not join (a
  ``dist.barrier()`` after ``if rank == 0: booster.save_model(...)``) never comes, and every rank
  raises within seconds (``DepartureSearch``): the waiting ranks at once, the blocked one logs the
  error at once and raises it from its collective when that fails (the waiting ranks' processes
  end), or else at its next chunkmem call. A rank that is merely slow is waited for, up to the
  process-group timeout; one whose process ended fails the agreement at once.

Check mode (``check_plans``) adds a fingerprint of every placement plan, agreed before it is
carried out: a rank-local input to a decision becomes a test failure instead of a hang.
"""

from __future__ import annotations

import datetime
import enum
import hashlib
import logging
import os
import queue
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from chunkmem.placement import FetchPlan, Phase

from ..errors import TraceDivergenceError
from .agreed_values import AgreedValues
from .departure_search import Activity, Answer, DepartureSearch
from .rank_channel import Message, RankChannel
from .thread_activity import blocked_in_user_collective, raise_in, where_thread_is
from .where import IterationKind, Where

__all__ = ["CheckKind", "RankChecks"]

log = logging.getLogger("chunkmem")

PEER_ENDED_FIX = "see that rank's log, then restart every rank from the last checkpoint"
"""What to do when another rank's process ended (killed, out of memory, an error) under a collective."""
_FIX = (
    "Every rank must run the same operations on the boosted model in the same order: run evaluation, "
    "generate() and save_pretrained() on every rank, or do rank-local work on a plain module with the full "
    "weights (model.plain_copy() on every rank returns one on rank 0); save with booster.save_model() on every "
    "rank; call optimizer.clip_grad_norm() and enter booster.no_sync() on every rank; keep rank-dependent "
    "branches out of the model."
)


class CheckKind(enum.IntEnum):
    ENTRY = 1
    COLLECTIVE = 2
    DIVERGED = 3
    FOLLOWING = 4
    PLAN = 5


class _Note(enum.IntEnum):
    """Kinds of messages between the ranks' listeners."""

    ALARM = 1  # departed from the trace at (inference, iteration, position)
    QUESTION = 2  # what is your main thread doing? (round)
    ANSWER = 3  # (round, activity) and a text
    VERDICT = 4  # ranks were found departed: the error's message
    RECORDED = 5  # the verdict is recorded here


_POLL = datetime.timedelta(milliseconds=200)  # an agreement's wait looks at answers this often
_RECORDED = 5.0  # seconds a rank that found ranks departed waits for the others to record it


def _at(where: Where) -> str:
    """``at training iteration 2, op 5`` or ``after training iteration 2``."""
    return where.describe() if where.between else f"at {where.describe()}"


def _done(work: Any) -> bool:
    """Wait up to ``_POLL`` for ``work``: whether it completed (a failure raises)."""
    try:
        work.wait(timeout=_POLL)
    except RuntimeError as error:
        if "timed out" not in str(error).lower():
            raise
        if not work.is_completed():
            return False
        # It completed between the timeout and the look: waiting again returns at once, and
        # raises only if it failed.
        work.wait()
    return True


def _close_in(creator: int, channel: RankChannel, side: Any) -> None:
    """Close ``channel`` and ``side`` with it, in the process that made them."""
    if os.getpid() == creator:
        channel.close((side,))


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
        self._check_plans = check_plans
        self._where: Callable[[], Where] | None = None
        self._recording: Callable[[], bool] = lambda: False
        self._alarms: queue.Queue[tuple[int, ...]] = queue.Queue()
        self._pending: list[tuple[int, ...]] = []  # alarms received, not yet acted on
        self._answers: queue.Queue[Answer] = queue.Queue()
        self._recorded: queue.Queue[int] = queue.Queue()  # ranks that recorded this rank's verdict
        self._rounds = 0  # questions asked by every agreement so far (answers name theirs)
        self._failed: str | None = None
        # What the listener says this rank's main thread does: the agreement it waits in, and the
        # thread that makes chunkmem's calls.
        self._agreeing: str | None = None
        self._thread = threading.get_ident()
        self._channel = RankChannel(self._ranks, rank, timeout, self._receive)
        # Once nothing can ask for a check (the boosted model and its optimizer are collected), the
        # two groups and the listener go: a process that boosts again and again keeps none of them.
        # Only in this process: a forked child (a data loader's worker) shares the sockets, not the ranks.
        finalizer = weakref.finalize(self, _close_in, os.getpid(), self._channel, self._side)
        finalizer.atexit = False  # a process's end frees them

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
    def entry(
        self,
        name: str,
        detail: str = "",
        where: Where | None = None,
        shown: str | None = None,
        values: AgreedValues | None = None,
    ) -> None:
        """At a forward, backward, optimizer step or state-dict entry (``where`` it leads, by
        default where the run is): agree with the others on ``name``, ``detail`` and ``values``
        (in the same fingerprint). ``shown`` is what messages say instead of ``name`` (it may name
        things that differ between ranks, such as paths)."""
        where = where if where is not None else self._now()
        self.poll()
        text = f"{shown or name}{f' ({detail})' if detail else ''} {_at(where)}"
        agreed = values.fingerprint_text() if values is not None else ""
        self._agree(CheckKind.ENTRY, where, fingerprint(f"{name}|{detail}|{agreed}"), text, values)

    def collective(self, what: str, numel: int) -> None:
        """Before a chunk collective: agreed first while no trace is followed."""
        if not self._recording():
            return
        where = self._now()
        self.poll()
        self._agree(CheckKind.COLLECTIVE, where, fingerprint(f"{what}|{numel}"), f"{what} {_at(where)}")

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
        numbers = (int(where.kind is IterationKind.INFERENCE), where.iteration, where.position)
        sends = [
            work
            for index in range(self._world_size)
            if index != self._rank
            for work in self._channel.send(index, _Note.ALARM, numbers)
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
        which complete, so it goes on until it gets there. After a failed check (here, or found by
        another rank while this one waited elsewhere) it raises that error."""
        if self._failed is not None:
            raise TraceDivergenceError(self._failed)
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
    def _receive(self, message: Message) -> None:
        """On the listener thread: every message from another rank."""
        if message.kind == _Note.ALARM:
            self._alarms.put((message.sender, *message.numbers[:3]))
        elif message.kind == _Note.QUESTION:
            self._answer(message.sender, message.numbers[0])
        elif message.kind == _Note.ANSWER:
            self._answers.put(Answer.decode(message))
        elif message.kind == _Note.VERDICT:
            if self._failed is None:
                self._failed = f"rank {self._rank}: {message.text}"
                if self._agreeing is None:  # an agreement raises it itself; elsewhere nothing would say it
                    blocked = blocked_in_user_collective(self._thread) is not None
                    if blocked:  # it raises there once the collective fails (the others' processes end)
                        blocked = raise_in(self._thread, TraceDivergenceError, self._failed)
                    log.error(
                        "%s %s",
                        self._failed,
                        "The collective this rank waits in raises this error when it fails (when the other ranks' "
                        "processes end, or at the process-group timeout)."
                        if blocked
                        else "This rank's next chunkmem call raises this error.",
                    )
            self._channel.post(message.sender, _Note.RECORDED)
        elif message.kind == _Note.RECORDED:
            self._recorded.put(message.sender)

    def _answer(self, asker: int, round_: int) -> None:
        """What this rank's main thread is doing, for a rank whose agreement waits for it."""
        agreeing = self._agreeing
        if agreeing is not None:
            answer = Answer(self._rank, round_, Activity.AGREEING, agreeing)
        elif (collective := blocked_in_user_collective(self._thread)) is not None:
            answer = Answer(self._rank, round_, Activity.IN_USER_COLLECTIVE, "", collective)
        else:
            answer = Answer(self._rank, round_, Activity.ELSEWHERE, where_thread_is(self._thread))
        numbers, text = answer.encode()
        self._channel.post(asker, _Note.ANSWER, numbers, text)

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

    def _agree(self, kind: CheckKind, where: Where, value: int, text: str, values: AgreedValues | None = None) -> None:
        if self._failed is not None:
            raise TraceDivergenceError(self._failed)
        payload = torch.tensor(
            [int(kind), int(where.kind is IterationKind.INFERENCE), where.iteration, where.position, value],
            dtype=torch.int64,
        )
        everyone = [torch.empty_like(payload) for _ in range(self._world_size)]
        try:
            self._wait(dist.all_gather(everyone, payload, group=self._side, async_op=True), text)
        except TraceDivergenceError:
            raise
        except RuntimeError as error:
            first_line = str(error).strip().splitlines()[0]
            reason = (
                "a rank departed, stopped or is still busy with rank-local work past the process-group timeout. " + _FIX
                if "timed out" in first_line.lower()
                else "another rank's process ended, or lost its connection, before reaching it. If it was killed or "
                f"failed, {PEER_ENDED_FIX}. If its script ended without reaching it: {_FIX}"
            )
            self._fail(
                f"rank {self._rank}: the other ranks did not reach a cross-rank check ({text}) ({first_line}); {reason}"
            )
        if all(torch.equal(p, payload) for p in everyone):
            return
        gathered: list[Any] = [None] * self._world_size
        try:
            dist.all_gather_object(gathered, (text, dict(values.values) if values else {}), group=self._side)
        except RuntimeError as error:  # a rank ended after its part of the fingerprints
            self._fail(
                f"rank {self._rank}: the ranks are at different points (this rank: {text}), and the others could not "
                f"say where ({str(error).strip().splitlines()[0]}). {_FIX}"
            )
        texts = [t for t, _ in gathered]
        differences = AgreedValues.differences([v for _, v in gathered])
        if values is not None and len(set(texts)) == 1 and differences:
            self._fail(f"rank {self._rank}: {values.fix} The ranks hold different values at {text}: {differences}.")
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

    def _wait(self, work: Any, text: str) -> None:
        """Wait for the agreement's all-gather, looking for ranks that will never come."""
        self._thread = threading.get_ident()
        self._agreeing = text
        search = DepartureSearch(
            lambda to, round_: self._channel.post(to, _Note.QUESTION, (round_,)),
            self._rank,
            self._ranks,
            text,
            self._rounds,
            time.monotonic(),
        )
        try:
            while not _done(work):
                if self._failed is not None:  # another rank found ranks departed
                    raise TraceDivergenceError(self._failed)
                while not self._answers.empty():
                    search.answered(self._answers.get_nowait(), time.monotonic())
                verdict = search.step(time.monotonic())
                if verdict is not None:
                    self._announce(verdict)
                    self._fail(f"rank {self._rank}: {verdict}")
        finally:
            self._agreeing = None
            self._rounds += search.rounds

    def _announce(self, verdict: str) -> None:
        """Tell every other rank that ranks were found departed, and wait until each has recorded
        it (up to ``_RECORDED`` seconds): a rank whose collective fails when this process ends
        must find the error recorded when its next chunkmem call begins."""
        while not self._recorded.empty():
            self._recorded.get_nowait()
        others = {r for r in range(self._world_size) if r != self._rank}
        waiting = {r for r in others if self._channel.post(r, _Note.VERDICT, (), verdict)}
        deadline = time.monotonic() + _RECORDED
        while waiting and (left := deadline - time.monotonic()) > 0:
            try:
                waiting.discard(self._recorded.get(timeout=left))
            except queue.Empty:
                break

    def _fail(self, message: str) -> None:
        self._failed = message
        raise TraceDivergenceError(message)
