"""``DepartureSearch``: while a cross-rank agreement waits, find the ranks that will never come
because they wait in a collective of the user's own that this rank will not join.

After a short grace the waiting rank asks the others what their main thread is doing
(``thread_activity``): waiting in the agreement too, blocked in a collective of
``torch.distributed`` outside chunkmem, or anything else. It asks again a second after an answer
that needs confirming, and less and less often otherwise (at most every eight seconds). A rank is
found departed when two answers a second or more apart find it blocked in the same operation of a
process group this rank belongs to, which this rank has not issued (it has issued fewer operations
on the group than the blocked rank's number): the blocked rank waits for this rank, which waits for
it in the agreement, so neither ever goes on. (Operation numbers count a point-to-point call on its
own side only, so sends and receives on the group can skew them between ranks; the second answer a
second later is what keeps a rank that merely lags in a collective this rank already finished from
being found departed.) A rank that is merely slow (computing, sleeping, loading data, in another
chunkmem call, or in a collective whose other ranks have not all arrived yet) is never departed: it
reaches the agreement later, or a collective that settles it then.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
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
        global_rank: int,
        world_size: int,
        text: str,
        first_round: int,
        start: float,
    ) -> None:
        self._ask = ask
        self._rank = rank
        self._global_rank = global_rank
        self._world_size = world_size
        self._text = text
        self._first_round = first_round
        self._round = first_round - 1
        self._next = start + _GRACE
        self._pause = _CONFIRM  # doubles after each question; a new answer to confirm asks again sooner
        self._latest: dict[int, tuple[Answer, float]] = {}
        self._blocked_since: dict[int, tuple[UserCollective, float]] = {}
        self._departed: list[int] = []

    @property
    def rounds(self) -> int:
        """Questions asked so far (each rank's answers name theirs)."""
        return self._round - self._first_round + 1

    def answered(self, answer: Answer, now: float) -> None:
        if answer.round < self._first_round or answer.rank in self._departed:
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
            return
        if now - seen[1] >= _CONFIRM and self._waits_for_me(collective):
            self._departed.append(answer.rank)

    def _waits_for_me(self, collective: UserCollective) -> bool:
        if self._global_rank not in collective.group_ranks:
            return False
        issued = own_operations(collective.group_name)
        return issued is not None and issued < collective.operation

    def step(self, now: float) -> str | None:
        if self._departed:
            return self._message()
        if now >= self._next:
            self._round += 1
            for other in range(self._world_size):
                if other != self._rank:
                    self._ask(other, self._round)
            self._next = now + self._pause
            self._pause = min(self._pause * 2, _LONGEST)
        return None

    def _message(self) -> str:
        agreeing = [self._rank] + [r for r, (answer, _) in self._latest.items() if answer.activity is Activity.AGREEING]
        lines = []
        for r in range(self._world_size):
            if r == self._rank:
                lines.append(f"rank {r}: {self._text}")
            elif r in self._latest:
                lines.append(f"rank {r}: {self._latest[r][0].describe()}")
            else:
                lines.append(f"rank {r}: did not answer")
        departed = sorted(self._departed)
        return (
            f"ranks {departed} wait in a torch.distributed collective of their own that ranks {sorted(agreeing)} "
            f"will not join: those are in a chunkmem call that every rank must make ({'; '.join(lines)})."
        )
