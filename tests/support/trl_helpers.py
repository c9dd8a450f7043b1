"""Pieces of ``integration/trainers/test_trl.py`` that other tests use too."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def torchrun_rank(rank: int, world_size: int) -> Iterator[None]:
    """Inside a pooled rank of ``run_ranks``: the environment torchrun sets, so that the trainers
    (through Accelerate) join the process group that exists; Accelerate's state is reset after."""
    from accelerate.state import AcceleratorState

    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": "2"}
    )
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
