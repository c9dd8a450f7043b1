"""The fast tier is chosen by what the ``-m`` expression selects, not by how it is spelt."""

from __future__ import annotations

import pytest
from conftest import is_fast_tier


@pytest.mark.parametrize(
    ("markexpr", "fast"),
    [
        ("not slow", True),
        ("not   slow", True),
        ("not (slow or cuda)", True),  # the spelling a text match missed: full budgets in a fast run
        ("not slow and not cuda", True),
        ("simulated or not slow", True),
        ("(not slow)", True),
        ("", False),  # the full suite
        ("slow", False),
        ("not cuda", False),  # keeps the slow tests
        ("simulated", False),  # keeps no unmarked test: one marker's tests, not a tier
        ("not slow and simulated", False),
        ("not slowly", False),  # another marker's name
    ],
)
def test_the_tier_follows_what_the_marker_expression_selects(markexpr: str, fast: bool) -> None:
    assert is_fast_tier(markexpr) is fast
