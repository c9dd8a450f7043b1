"""``CheckpointNames``: the one place that decides, for every parameter of a model boosted with
``weights``, whether its value comes from the checkpoint (and under which keys it may be stored
there) or from the model's own initialisation replayed.

* A parameter of a ``transformers`` model: from the checkpoint, under its own name, with or without
  the model's base-model prefix (a base model's checkpoint in a model with a head, or the reverse),
  or the legacy LayerNorm names ``gamma`` / ``beta``.
* A parameter of a PEFT tuner (``get_peft_model``): the checkpoint is the base model's (what
  ``save_pretrained`` of the model PEFT wrapped wrote), as ``from_pretrained`` + ``get_peft_model``
  would use it. A base parameter is looked up under the name it has in the base model: the tuner's
  path (``base_model.model.``) and PEFT's ``.base_layer`` segment stripped
  (``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`` ->
  ``model.layers.0.self_attn.q_proj.weight``). An adapter parameter (under a module named with the
  tuner's ``prefix``, ``lora_`` for LoRA: what PEFT itself marks trainable) is not in a base
  checkpoint: it comes from PEFT's own initialisation, replayed, with the draws ``get_peft_model``
  makes after ``from_pretrained``.
* A module PEFT copies to train in full (``modules_to_save``): both the frozen original
  (``lm_head.original_module.weight``) and the trainable copy (``lm_head.modules_to_save.default.weight``)
  start as the base's ``lm_head.weight``, as ``get_peft_model`` copies the loaded module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..compat.peft import is_peft_class

__all__ = ["CheckpointNames", "WeightSource", "is_peft_tuner"]

_BASE_LAYER = "base_layer"
# A ``ModulesToSaveWrapper`` holds the base module under ``original_module`` and one trainable copy
# per adapter under ``modules_to_save.<adapter>``: segments the base model's names do not have.
_ORIGINAL = "original_module"
_COPIES = "modules_to_save"


def is_peft_tuner(module: torch.nn.Module) -> bool:
    """A PEFT tuner model (``peft.tuners.tuners_utils.BaseTuner``, checked without importing peft)."""
    return _is_peft_class(module, "BaseTuner")


@dataclass(frozen=True)
class WeightSource:
    """Where one parameter's value comes from: the checkpoint keys to try, in order (``from_file``),
    or PEFT's adapter initialisation (``keys`` empty)."""

    keys: tuple[str, ...]
    base_name: str
    """Its name in the model the checkpoint was saved from, for messages."""

    @property
    def from_file(self) -> bool:
        return bool(self.keys)


def _candidates(name: str, prefix: str) -> tuple[str, ...]:
    names = [name]
    if prefix:
        names.append(name[len(prefix) + 1 :] if name.startswith(prefix + ".") else f"{prefix}.{name}")
    legacy = {".weight": ".gamma", ".bias": ".beta"}
    for suffix, old in legacy.items():
        names += [n[: -len(suffix)] + old for n in list(names) if n.endswith(suffix)]
    return tuple(names)


def _is_peft_class(module: torch.nn.Module, name: str) -> bool:
    return is_peft_class(module, name)


def _base_segments(segments: list[str], wrapped: set[int]) -> list[str]:
    """``segments`` without PEFT's own: ``base_layer``, and after a module-to-save wrapper (the
    indices in ``wrapped`` are of the segment naming one) ``original_module`` or
    ``modules_to_save.<adapter>``."""
    kept, skip = [], 0
    for i, segment in enumerate(segments):
        if skip:
            skip -= 1
        elif i - 1 in wrapped and segment in (_ORIGINAL, _COPIES):
            skip = 1 if segment == _COPIES else 0
        elif segment != _BASE_LAYER:
            kept.append(segment)
    return kept


def _prefix(model: torch.nn.Module) -> str:
    return getattr(model, "base_model_prefix", "") or ""


def _tuners(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Each PEFT tuner's wrapped model as (its path with a trailing dot, the tuner)."""
    found = []
    for path, module in model.named_modules():
        inner = getattr(module, "model", None)
        if is_peft_tuner(module) and isinstance(inner, torch.nn.Module):
            found.append((f"{path}.model." if path else "model.", module))
    return found


class CheckpointNames:
    """Where each parameter of ``model`` gets its value from a checkpoint (module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._prefix = _prefix(model)
        self._tuners = _tuners(model)
        self._wrappers = {path for path, m in model.named_modules() if _is_peft_class(m, "ModulesToSaveWrapper")}

    def source(self, name: str) -> WeightSource:
        for path, tuner in self._tuners:
            if not name.startswith(path):
                continue
            segments = name[len(path) :].split(".")
            adapter_prefix = getattr(tuner, "prefix", None)
            if adapter_prefix and any(s.startswith(adapter_prefix) for s in segments):
                return WeightSource((), name)
            wrapped = {i for i in range(len(segments)) if path + ".".join(segments[: i + 1]) in self._wrappers}
            base_name = ".".join(_base_segments(segments, wrapped))
            return WeightSource(_candidates(base_name, _prefix(tuner.model)), base_name)
        return WeightSource(_candidates(name, self._prefix), name)
