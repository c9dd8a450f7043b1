"""Accelerate's internals that chunkmem relies on. Checked on accelerate 1.15."""

from __future__ import annotations

from typing import Any

__all__ = ["prepared_models", "prepared_optimizers"]


def prepared_models(accelerator: Any) -> list[Any]:
    """``accelerator._models``: the models ``prepare`` has seen, the list itself (``prepare_model``
    appends a boosted model to it, as Accelerate's own does for the models it wraps)."""
    return accelerator._models


def prepared_optimizers(accelerator: Any) -> list[Any]:
    """``accelerator._optimizers``: the optimizers ``prepare`` has wrapped, to find the one boosted
    optimizer that backward and clipping go to."""
    return accelerator._optimizers
