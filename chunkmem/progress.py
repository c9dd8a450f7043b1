"""Which training step a boosted model's state belongs to, and which checkpoints it was loaded from.

The step is the number of optimizer ``step()`` calls behind the state (skipped fp16 steps count:
they are iterations of the loop), continued across a resume from the step a loaded checkpoint
recorded. A boosted model owns one :class:`TrainingProgress` and its optimizer shares it (the
plugin hands the model's to the optimizer): the optimizer advances it, checkpoints read and set it.
Loads since the last step are remembered: a model, optimizer or scheduler checkpoint loaded with
another kind, with no step in between, must come from the same step, or it is refused before it
writes anything.
"""

from __future__ import annotations

from pathlib import Path

from .errors import CheckpointMismatchError

__all__ = ["TrainingProgress"]


class TrainingProgress:
    """The step of the model's state and the checkpoints loaded since the last step; changed by
    :meth:`advance` (a step) and :meth:`loaded` (a checkpoint)."""

    def __init__(self) -> None:
        self._step = 0
        self._loaded: dict[str, tuple[int, Path]] = {}
        """Checkpoints loaded since the last step: kind -> (its step, its path)."""

    @property
    def step(self) -> int:
        """Optimizer steps behind the model's current state."""
        return self._step

    def advance(self) -> None:
        """The optimizer took (or skipped) a step: the state is one step on from the checkpoints
        loaded so far."""
        self._step += 1
        self._loaded.clear()

    def check_pairing(self, kind: str, step: int, path: Path) -> None:
        """Refuse a ``kind`` checkpoint saved at ``step`` when another kind, just loaded, was saved
        at another step."""
        for other_kind, (other_step, other_path) in self._loaded.items():
            if other_kind != kind and other_step != step:
                raise CheckpointMismatchError(
                    f"{kind} file {path} was saved at step {step}, but the {other_kind} state was just loaded from "
                    f"{other_path}, saved at step {other_step}: they belong to different checkpoints. Load the "
                    f"{kind} file saved together with {other_path.name} (same step)."
                )

    def loaded(self, kind: str, step: int, path: Path) -> None:
        """A ``kind`` checkpoint saved at ``step`` was loaded: the state continues from ``step``."""
        self._step = step
        self._loaded[kind] = (step, path)
