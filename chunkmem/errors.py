"""chunkmem's exceptions: one hierarchy under :class:`ChunkmemError`, so ``except ChunkmemError``
catches every refusal and failure chunkmem raises on purpose. Each class also derives from the
builtin a caller would expect (``ValueError`` for bad input, ``RuntimeError`` for a state that
cannot go on), so existing ``except ValueError`` / ``except RuntimeError`` code keeps working."""

from __future__ import annotations

import placement

__all__ = [
    "BudgetExceededError",
    "BudgetTooSmallError",
    "ChunkmemError",
    "CollectiveMismatchError",
    "IllegalTransition",
    "TraceDivergenceError",
    "UnmanageableParameter",
]


class ChunkmemError(Exception):
    """Base of every exception chunkmem raises on purpose."""


class BudgetTooSmallError(ChunkmemError, placement.BudgetTooSmallError):
    """The device budget cannot hold one op's working set under the decided placement (raised when
    boosting; ``budget`` and ``minimum`` are in bytes). Also a ``placement.BudgetTooSmallError``."""

    @classmethod
    def from_placement(cls, error: placement.BudgetTooSmallError) -> BudgetTooSmallError:
        return cls(str(error), error.budget, error.minimum)


class BudgetExceededError(ChunkmemError, RuntimeError):
    """An op cannot run within the device budget even after evicting everything evictable."""


class TraceDivergenceError(ChunkmemError, RuntimeError):
    """Ranks ran different ops on managed parameters in the same iteration."""


class CollectiveMismatchError(ChunkmemError, RuntimeError):
    """A chunk collective failed or timed out, and the ranks have compared what they ran."""


class UnmanageableParameter(ChunkmemError, ValueError):
    """A parameter chunkmem cannot put in a chunk."""


class IllegalTransition(ChunkmemError, RuntimeError):
    """A parameter was asked to move between states the table does not connect."""
