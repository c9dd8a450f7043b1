"""Where the checkout and its tests are, for tests that read files or start scripts."""

from __future__ import annotations

from pathlib import Path

__all__ = ["ROOT", "TESTS"]

TESTS = Path(__file__).resolve().parent.parent
"""``tests/``: what is first on ``sys.path`` for ``import support``."""
ROOT = TESTS.parent
"""The checkout: ``chunkmem/``, ``docs/``, ``examples/``, ``benchmarks/``."""
