"""transformers' internals that chunkmem relies on. Checked on transformers 5.24 (and TRL 1.16,
whose trainers subclass ``Trainer``).

Classes recognised by name, without importing transformers (``import chunkmem`` must not load it);
the private ``_from_config``; and the private ``Trainer`` methods ``ChunkTrainer`` calls or
overrides. Importing this module imports nothing of transformers: ``TrainerCheckpointHooks`` is a
plain mixin placed in front of ``Trainer``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["TrainerCheckpointHooks", "config_builder", "is_cache", "is_pretrained_model", "set_signature_columns"]


def _has_transformers_base(obj: object, name: str) -> bool:
    return any(cls.__name__ == name and cls.__module__.startswith("transformers.") for cls in type(obj).__mro__)


def is_cache(value: object) -> bool:
    """Whether ``value`` is a ``transformers.cache_utils.Cache`` (a KV cache handed to a block)."""
    return _has_transformers_base(value, "Cache")


def is_pretrained_model(module: object) -> bool:
    """Whether ``module`` is a ``transformers.PreTrainedModel``."""
    return _has_transformers_base(module, "PreTrainedModel")


def config_builder(cls: type) -> Callable[..., Any] | None:
    """``cls._from_config``: what ``from_config`` calls to build a model from its config, applying
    ``dtype=`` (``None`` for a class without one, built as ``cls(config)``)."""
    return cls._from_config if hasattr(cls, "_from_config") else None  # type: ignore[attr-defined]


def set_signature_columns(trainer: Any) -> None:
    """``Trainer._set_signature_columns_if_needed()``: Trainer reads the dataset columns to keep from
    its model's ``forward`` signature; ``ChunkTrainer`` has it read them from the user's module
    before the model is boosted (the boosted model's forward takes ``*args, **kwargs``)."""
    trainer._set_signature_columns_if_needed()


class TrainerCheckpointHooks:
    """The private ``Trainer`` methods through which Trainer saves and resumes the optimizer, the LR
    scheduler and the model, forwarded to ``ChunkTrainerMixin``'s own: chunkmem's checkpoints replace
    Trainer's files inside its ``checkpoint-N`` directories (Trainer has no public hook for them).

    * ``_save_optimizer_and_scheduler(output_dir)`` -> ``_chunkmem_save_optimizer_and_scheduler``
    * ``_load_from_checkpoint(resume_from_checkpoint, model=None)`` -> ``_chunkmem_load_model``
    * ``_load_optimizer_and_scheduler(checkpoint)`` -> ``_chunkmem_load_optimizer_and_scheduler``
    """

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self._chunkmem_save_optimizer_and_scheduler(output_dir)  # type: ignore[attr-defined]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        self._chunkmem_load_model(resume_from_checkpoint, model)  # type: ignore[attr-defined]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        self._chunkmem_load_optimizer_and_scheduler(checkpoint)  # type: ignore[attr-defined]
