"""``DepartureSearch``: while a cross-rank agreement waits, find the ranks that will never come
because they wait in a collective of the user's own that this rank will not join.

After a short grace the waiting rank asks the others what their main thread is doing
(``thread_activity``): waiting in the agreement too, blocked in a collective of
``torch.distributed`` outside chunkmem, or anything else. It asks again a second after an answer
that needs confirming, and less and less often otherwise (at most every eight seconds). A rank is
found departed when

* two answers a second or more apart find it blocked in the same operation of a process group this
  rank belongs to, which this rank has not issued (it has issued fewer operations on the group than
  the blocked rank's number), and
* every other member of that group has arrived where it waits for good: in this agreement, or
  blocked in a collective of the same group (answers no older than the first that found the rank
  blocked). A member that has not (computing, sleeping, anywhere else, or outside the ranks that can
  be asked) may still come to the collective and settle it.

Then the blocked rank waits for this rank, which waits for it in the agreement, so neither ever goes
on. Operation numbers count a point-to-point call on its own side only (``dist.send``,
``dist.monitored_barrier``), so they do not say alone which collective another rank is at: after
ranks 0 and 1 exchanged messages, rank 0 waiting as root of a ``gather`` for a slow rank 2 has a
higher number than rank 1, which gave its part and went on into an agreement; the second rule is
what keeps it from being found departed. (The same skew can hide a real departure; the wait then
ends at the process-group timeout.) The second answer a second later keeps a rank that merely lags
in a collective this rank already finished from being found departed.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from .rank_channel import Message
from .thread_activity import UserCollective, own_operations

__all__ = ["Activity", "Answer", "DepartureSearch"]

_GRACE = 1.0  # seconds in an agreement before asking (ranks a little apart agree well within it)
_CONFIRM = 1.0  # seconds between two answers that must find a rank in the same collective
_LONGEST = 8.0  # the longest pause between questions while nothing needs confirming


class Activity(enum.IntEnum):
    AGREEING = 1  # the main thread waits in a cross-rank agreement
    IN_USER_COLLECTIVE = 2  # blocked in a torch.distributed collective outside chunkmem
    ELSEWHERE = 3


@dataclass(frozen=True, slots=True)
class Answer:
    rank: int
    round: int
    activity: Activity
    text: str
    """The agreement it waits in, or where its main thread is."""
    collective: UserCollective | None = None

    def encode(self) -> tuple[tuple[int, ...], str]:
        """Numbers and text of the message that carries it."""
        text = self.text if self.collective is None else json.dumps(asdict(self.collective))
        return (self.round, int(self.activity)), text

    @classmethod
    def decode(cls, message: Message) -> Answer:
        round_, activity = message.numbers[0], Activity(message.numbers[1])
        if activity is not Activity.IN_USER_COLLECTIVE:
            return cls(message.sender, round_, activity, message.text)
        fields = json.loads(message.text)
        collective = UserCollective(**{**fields, "group_ranks": tuple(fields["group_ranks"])})
        return cls(
            message.sender, round_, activity, f"waits in {collective.call} called at {collective.site}", collective
        )

    def describe(self) -> str:
        if self.activity is Activity.IN_USER_COLLECTIVE:
            return f"{self.text}, outside chunkmem"
        if self.activity is Activity.ELSEWHERE:
            return f"has not reached it (its main thread is at {self.text})"
        return self.text


class DepartureSearch:
    """One agreement's search. ``ask(to, round)`` sends a question to the rank with index ``to``;
    answers are handed to ``answered``; ``step`` asks when it is time and returns the message of
    the error once ranks are found departed (without the leading ``rank r:``)."""

    def __init__(
        self,
        ask: Callable[[int, int], None],
        rank: int,
        ranks: Sequence[int],
        text: str,
        first_round: int,
        start: float,
    ) -> None:
        self._ask = ask
        self._rank = rank
        self._global_rank = ranks[rank]
        self._index = {global_rank: index for index, global_rank in enumerate(ranks)}
        self._world_size = len(ranks)
        self._text = text
        self._first_round = first_round
        self._round = first_round - 1
        self._next = start + _GRACE
        self._pause = _CONFIRM  # doubles after each question; a new answer to confirm asks again sooner
        self._latest: dict[int, tuple[Answer, float]] = {}
        self._blocked_since: dict[int, tuple[UserCollective, float]] = {}

    @property
    def rounds(self) -> int:
        """Questions asked so far (each rank's answers name theirs)."""
        return self._round - self._first_round + 1

    def answered(self, answer: Answer, now: float) -> None:
        if answer.round < self._first_round:
            return  # an answer to an earlier agreement's question
        self._latest[answer.rank] = (answer, now)
        collective = answer.collective
        if collective is None:
            self._blocked_since.pop(answer.rank, None)
            return
        seen = self._blocked_since.get(answer.rank)
        if seen is None or seen[0] != collective:
            self._blocked_since[answer.rank] = (collective, now)
            self._next = min(self._next, now + _CONFIRM)  # confirm it soon

    def _departed(self) -> list[int]:
        """The ranks found departed by the answers so far (module docstring)."""
        return [
            rank
            for rank, (collective, since) in sorted(self._blocked_since.items())
            if self._latest[rank][1] - since >= _CONFIRM
            and self._waits_for_me(collective)
            and self._all_arrived(rank, collective, since)
        ]

    def _waits_for_me(self, collective: UserCollective) -> bool:
        if self._global_rank not in collective.group_ranks:
            return False
        issued = own_operations(collective.group_name)
        return issued is not None and issued < collective.operation

    def _all_arrived(self, blocked: int, collective: UserCollective, since: float) -> bool:
        """Every member of ``collective``'s group other than this rank and ``blocked`` answered,
        no earlier than ``since``, that it waits in this agreement or in a collective of the group."""
        for global_rank in collective.group_ranks:
            member = self._index.get(global_rank)
            if member is None:
                return False  # not one of the ranks that can be asked: it may still come
            if member in (self._rank, blocked):
                continue
            answer, at = self._latest.get(member, (None, 0.0))
            if answer is None or at < since:
                return False
            arrived = answer.activity is Activity.AGREEING or (
                answer.collective is not None and answer.collective.group_name == collective.group_name
            )
            if not arrived:
                return False
        return True

    def step(self, now: float) -> str | None:
        departed = self._departed()
        if departed:
            return self._message(departed)
        if now >= self._next:
            self._round += 1
            for other in range(self._world_size):
                if other != self._rank:
                    self._ask(other, self._round)
            self._next = now + self._pause
            self._pause = min(self._pause * 2, _LONGEST)
        return None

    def _message(self, departed: list[int]) -> str:
        """The fix first (make the call on every rank), then where each rank is."""
        agreeing = [self._rank] + [r for r, (answer, _) in self._latest.items() if answer.activity is Activity.AGREEING]
        lines = []
        for r in range(self._world_size):
            if r == self._rank:
                lines.append(f"rank {r}: {self._text}")
            elif r in self._latest:
                lines.append(f"rank {r}: {self._latest[r][0].describe()}")
            else:
                lines.append(f"rank {r}: did not answer")
        return (
            f"make the chunkmem call that ranks {sorted(agreeing)} are in ({self._text}) on every rank: ranks "
            f"{departed} wait in a torch.distributed collective of their own instead, which ranks {sorted(agreeing)} "
            f"will not join ({'; '.join(lines)}). chunkmem's saves, loads, state dicts and plain copies are "
            "collectives: call them on every rank (they write on rank 0 only)."
        )
