"""Which training step a boosted model's state belongs to, and which checkpoints it was loaded from.

The step is the number of optimizer ``step()`` calls behind the state (skipped fp16 steps count:
they are iterations of the loop), continued across a resume from the step a loaded checkpoint
recorded. A boosted model owns one :class:`TrainingProgress` and its optimizer shares it (the
plugin hands the model's to the optimizer): the optimizer advances it, checkpoints read and set it.
Loads since the last step are remembered: a model, optimizer or scheduler checkpoint loaded with
another kind, with no step in between, must come from the same step, or it is refused before it
writes anything. Saves are remembered as sets (the kinds saved at one step), so that the checkpoints
a set's saves replaced are kept until the set is whole again.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

__all__ = ["TrainingProgress"]


class TrainingProgress:
    """The step of the model's state and the checkpoints loaded since the last step; changed by
    :meth:`advance` (a step) and :meth:`loaded` (a checkpoint)."""

    def __init__(self) -> None:
        self._step = 0
        self._loaded: dict[str, tuple[int, Path]] = {}
        """Checkpoints loaded since the last step: kind -> (its step, its path)."""
        self._resumed: set[str] = set()
        """Kinds of checkpoint this process loaded (the set it resumed from)."""
        self._set: list[tuple[str, Path]] = []
        """Saves (kind, path) at step ``_set_step``: the set being saved."""
        self._set_step = -1
        self._whole: Counter[str] | None = None
        """Kinds the previous set saved: the current set is whole when it has them all."""

    @property
    def step(self) -> int:
        """Optimizer steps behind the model's current state."""
        return self._step

    def advance(self) -> None:
        """The optimizer took (or skipped) a step: the state is one step on from the checkpoints
        loaded so far."""
        self._step += 1
        self._loaded.clear()

    def pairing_conflicts(self, kind: str, step: int) -> list[tuple[str, int, Path]]:
        """The other kinds just loaded from another step than ``step`` (kind, step, path): a
        ``kind`` checkpoint of ``step`` does not belong with them."""
        return [
            (other_kind, other_step, other_path)
            for other_kind, (other_step, other_path) in self._loaded.items()
            if other_kind != kind and other_step != step
        ]

    def reloading(self, kind: str) -> bool:
        """Whether a ``kind`` checkpoint was loaded already since the last step."""
        return kind in self._loaded

    def saved(self, kind: str, path: Path) -> list[Path]:
        """A ``kind`` checkpoint of the current step was saved to ``path``. Returns the paths whose
        kept checkpoints (those the saves replaced) are no longer needed: every path of this step's
        set once its saves cover every kind of the previous set (or of the checkpoints this
        process resumed from), and every path of an earlier step's set once a later step saves."""
        done: list[Path] = []
        if self._set_step != self._step:
            # The earlier set is finished; what this save kept of its own path stays.
            done, self._set_step = [p for _, p in self._set if p != path], self._step
            if self._set:
                self._whole = Counter(k for k, _ in self._set)
            self._set = []
        self._set.append((kind, path))
        whole = self._whole if self._whole is not None else Counter(set(self._resumed))
        if whole and Counter(k for k, _ in self._set) >= whole:
            done += [path for _, path in self._set]
        return done

    def loaded(self, kind: str, step: int, path: Path) -> None:
        """A ``kind`` checkpoint saved at ``step`` was loaded: the state continues from ``step``."""
        self._step = step
        self._loaded[kind] = (step, path)
        self._resumed.add(kind)
