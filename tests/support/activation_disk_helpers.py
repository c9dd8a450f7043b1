"""Pieces of ``integration/activations/test_activation_disk.py`` that other tests use too."""

from __future__ import annotations


def _to_disk(sizes: list[int], budget: int) -> int:
    """The README's rule: in the order saved, a storage is copied to host memory while the copies
    fit the budget less the staging window (two pieces of an eighth of it, rounded down to 8
    bytes); the others go to disk."""
    window = 2 * (budget // 8 // 8 * 8)
    held = disk = 0
    for nbytes in sizes:
        if held + nbytes <= budget - window:
            held += nbytes
        else:
            disk += nbytes
    return disk
