"""Every rank learns whether an action (a save, a load, a step of states on disk) worked on every
other rank.

A write that fails on rank 0 (disk full, an unwritable path) or a file that is unreadable on one
rank must not leave the other ranks waiting in a barrier, nor let them go on with a state the
failing rank does not have. Each rank runs its part, catches what it raised, and the ranks
exchange outcomes (one small ``all_gather_object``); if any rank failed, every rank raises the same
error, naming the ranks and their reasons.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from .. import errors
from ..errors import ChunkmemError
from .comm import Communicator

__all__ = ["agree", "on_first_rank"]

T = TypeVar("T")
_Outcome = tuple[str, str] | None


def _describe(error: BaseException) -> str:
    return str(error).strip() or type(error).__name__


def _error_class(names: list[str], fallback: type[ChunkmemError]) -> type[ChunkmemError]:
    """The chunkmem error class every failing rank raised, if they agree on one, else ``fallback``."""
    if len(set(names)) == 1:
        known = getattr(errors, names[0], None)
        if isinstance(known, type) and issubclass(known, ChunkmemError):
            return known
    return fallback


def agree(
    comm: Communicator,
    what: str,
    action: Callable[[], T],
    fallback: type[ChunkmemError],
    subject: str = "",
    changes_nothing: bool = True,
) -> T:
    """Run ``action`` on this rank, then raise on every rank if it raised on any. ``what`` says
    what was attempted (``"saving model checkpoint"``) and ``subject`` on what (a path, which may
    differ between ranks); ``fallback`` is the class raised for errors that are not chunkmem's own.
    ``changes_nothing``: a rank whose part succeeded says that it changed nothing (false for an
    action whose parts are kept, such as an optimizer step; the caller says what was).
    A collective: every rank calls it, and the ranks first agree that they are all at ``what``."""
    if comm.checks is not None:
        comm.checks.entry(what, shown=f"{what} {subject}".strip())
    what = f"{what} {subject}".strip()
    result: T | None = None
    failure: BaseException | None = None
    try:
        result = action()
    except Exception as error:
        failure = error
    if comm.world_size == 1:
        if failure is None:
            return result  # type: ignore[return-value]
        if isinstance(failure, ChunkmemError):
            raise failure
        raise fallback(f"{what} failed: {_describe(failure)}") from failure
    outcome: _Outcome = None if failure is None else (type(failure).__name__, _describe(failure))
    outcomes: list[_Outcome] = comm.all_gather_object(outcome)
    failed = [(rank, o) for rank, o in enumerate(outcomes) if o is not None]
    if not failed:
        return result  # type: ignore[return-value]
    cls = _error_class([o[0] for _, o in failed], fallback)
    messages = {o[1] for _, o in failed}
    if len(messages) == 1 and len(failed) == comm.world_size:
        detail = f"on every rank: {messages.pop()}"
    else:
        detail = "; ".join(f"on rank {rank}: {o[1]}" for rank, o in failed)
    text = f"{what} failed {detail}"
    if failure is not None:
        raise cls(text) from failure
    unchanged = ", nothing was changed here" if changes_nothing else ""
    raise cls(f"{text} (rank {comm.rank} did its part; every rank raises this error{unchanged})")


def on_first_rank(
    comm: Communicator, what: str, action: Callable[[], None], fallback: type[ChunkmemError], subject: str = ""
) -> None:
    """Run ``action`` on rank 0 only (a write), then raise on every rank if it failed there."""

    def first_only() -> None:
        if comm.rank == 0:
            action()

    agree(comm, what, first_only, fallback, subject)
