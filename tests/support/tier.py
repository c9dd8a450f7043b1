"""Which tier of the suite is running.

The everyday command, ``python -m pytest -m "not slow"``, is the **fast tier**: ``conftest.py``
evaluates the marker expression (``is_fast_tier``: it keeps unmarked tests and leaves out those
marked ``slow``, however it is spelt) and sets ``CHUNKMEM_TEST_TIER=fast`` before any test module is
imported, and property tests then draw fewer examples (``examples``). The full suite (CI, README's
test command) draws them all. ``slow_cases`` leaves some cases of a parametrized test to the full
suite, the fast tier keeping one representative of the path.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import pytest

__all__ = ["FAST", "examples", "slow_cases"]

FAST = os.environ.get("CHUNKMEM_TEST_TIER") == "fast"


def examples(full: int, fast: int | None = None) -> int:
    """A property test's example budget: ``full`` in the full suite, ``fast`` (default a tenth,
    at least 5) in the fast tier."""
    if not FAST:
        return full
    return fast if fast is not None else max(5, full // 10)


def slow_cases(values: Iterable[Any], *slow: Any) -> list[Any]:
    """``values`` for ``pytest.mark.parametrize`` with those in ``slow`` marked ``slow``: the fast
    tier keeps the others (the cheapest case that exercises the path), the full suite runs all. For
    several argument names a value is a tuple (one element an argument), as pytest takes them."""
    return [pytest.param(*_args(v), marks=pytest.mark.slow) if v in slow else v for v in values]


def _args(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)
