"""Which tier of the suite is running.

The everyday command, ``python -m pytest -m "not slow"``, is the **fast tier**: ``conftest.py``
sees the marker expression and sets ``CHUNKMEM_TEST_TIER=fast`` before any test module is
imported, and property tests then draw fewer examples (``examples``). The full suite (CI, README's
test command) draws them all.
"""

from __future__ import annotations

import os

__all__ = ["FAST", "examples"]

FAST = os.environ.get("CHUNKMEM_TEST_TIER") == "fast"


def examples(full: int, fast: int | None = None) -> int:
    """A property test's example budget: ``full`` in the full suite, ``fast`` (default a tenth,
    at least 5) in the fast tier."""
    if not FAST:
        return full
    return fast if fast is not None else max(5, full // 10)
