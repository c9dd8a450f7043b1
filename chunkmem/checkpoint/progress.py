"""Which training step a boosted model's state belongs to, and which files it was loaded from.

The step of a save is the number of optimizer ``step()`` calls behind the state (skipped fp16
steps count: they are iterations of the loop), continued across a resume from the step recorded in
the loaded file. Loads are recorded per boosted model (its runtime): a model file and an
optimizer or scheduler file loaded together, with no step in between, must come from the same
step, or the second load is refused before it writes anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

from ..errors import CheckpointMismatchError
from .files import Kind

if TYPE_CHECKING:
    from ..runtime import ChunkRuntime

__all__ = ["check_pairing", "current_step", "record_load"]


@dataclass
class _Progress:
    base_step: int = 0
    counter_at_base: int = 0
    loaded: dict[Kind, tuple[int, Path]] = field(default_factory=dict)
    """Files loaded since the last step: kind -> (step, file)."""


_PROGRESS: WeakKeyDictionary[ChunkRuntime, _Progress] = WeakKeyDictionary()


def _counter(runtime: ChunkRuntime) -> int:
    stats = runtime.stats_counters
    return stats.optimizer_steps + stats.skipped_steps


def _progress(runtime: ChunkRuntime) -> _Progress:
    progress = _PROGRESS.get(runtime)
    if progress is None:
        progress = _PROGRESS[runtime] = _Progress()
    if _counter(runtime) != progress.counter_at_base:
        progress.loaded.clear()  # training went on since those loads
    return progress


def current_step(runtime: ChunkRuntime) -> int:
    """Optimizer steps behind the model's current state."""
    progress = _progress(runtime)
    return progress.base_step + _counter(runtime) - progress.counter_at_base


def check_pairing(runtime: ChunkRuntime, kind: Kind, step: int, path: Path) -> None:
    """Refuse a file whose step differs from another kind of file loaded just before it."""
    for other_kind, (other_step, other_path) in _progress(runtime).loaded.items():
        if other_kind != kind and other_step != step:
            raise CheckpointMismatchError(
                f"{kind} file {path} was saved at step {step}, but the {other_kind} state was just loaded from "
                f"{other_path}, saved at step {other_step}: they belong to different checkpoints. Load the "
                f"{kind} file saved together with {other_path.name} (same step)."
            )


def record_load(runtime: ChunkRuntime, kind: Kind, step: int, path: Path) -> None:
    """After a successful load: the state continues from ``step``."""
    progress = _progress(runtime)
    progress.base_step = step
    progress.counter_at_base = _counter(runtime)
    progress.loaded[kind] = (step, path)
