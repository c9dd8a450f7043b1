"""A small state machine: an enum state changed only by named verbs through a transition table.

Each verb names the states it may start from and the state it leads to; asking for a verb from any
other state raises an error that names the owner (a chunk on a rank), the verb, the state, what the
verb needs, and what can be done from here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from ..errors import IllegalTransition

__all__ = ["StateMachine", "Transition"]

S = TypeVar("S", bound=enum.Enum)


class Transition(Generic[S]):
    """One verb's moves, ``{from: to}``; ``fix`` tells a caller who asked from another state what to
    do instead."""

    __slots__ = ("fix", "moves")

    def __init__(self, moves: Mapping[S, S], fix: str = "") -> None:
        self.moves = dict(moves)
        self.fix = fix


class StateMachine(Generic[S]):
    """The current state of an owner and the verbs that change it."""

    __slots__ = ("_kind", "_owner", "_state", "_table")

    def __init__(
        self, initial: S, table: Mapping[str, Transition[S]], owner: Callable[[], str], kind: str = "state"
    ) -> None:
        self._state = initial
        self._table = table
        self._owner = owner
        self._kind = kind

    @property
    def state(self) -> S:
        return self._state

    def require(self, verb: str, subject: str = "") -> None:
        """Raise unless ``verb`` may run now (``subject`` names what the verb acts on, for the message)."""
        move = self._table[verb]
        if self._state in move.moves:
            return
        needs = " or ".join(sorted(s.value for s in move.moves))
        legal = sorted(v for v, m in self._table.items() if self._state in m.moves)
        fix = f" {move.fix}" if move.fix else ""
        raise IllegalTransition(
            f"{self._owner()}: cannot {verb}{f' {subject}' if subject else ''} in {self._kind} {self._state.value}; "
            f"it needs {self._kind} {needs}.{fix} "
            f"From {self._state.value} it can: {', '.join(legal) or 'nothing'}."
        )

    def move(self, verb: str) -> None:
        """Check that ``verb`` may run now and take its transition."""
        self.require(verb)
        self._state = self._table[verb].moves[self._state]
