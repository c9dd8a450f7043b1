"""``model_values``: where the parameters of a model being boosted get their values.

* A model on a real device, without ``weights``: its own data (``LiveValues``).
* A model with parameters on the meta device, without ``weights``: its own initialisation, recorded
  once (``record_init``) and replayed one parameter at a time, only for the parameters that have
  elements in this rank's shard (each parameter's random draws come from the generator state saved
  for it, so skipping the others changes nothing).
* With ``weights`` (a safetensors checkpoint): every parameter is read from it, this rank's slice
  only; buffers it holds are loaded too, as ``from_pretrained`` does, and meta buffers it lacks
  (non-persistent ones, such as rotary frequencies) are recomputed by the model's own
  initialisation, without drawing random numbers. A PEFT model's checkpoint is its base model's:
  its adapter parameters are replayed from PEFT's init, drawing what ``get_peft_model`` draws
  after ``from_pretrained`` (``CheckpointNames`` decides which parameter comes from where); a base
  parameter missing from the files is refused, never left to its init.

Everything is checked when the source is built (names, shapes, what can be replayed), before any
parameter moves.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..chunks.chunk_layout import ShardPiece
from ..chunks.param_values import LiveValues, ParamValues
from ..chunks.tensor_state import TensorInfo
from ..errors import MaterializeError, UnmanageableParameter
from .model_init import RecordedInit, record_init
from .safetensors_weights import SafetensorsWeights
from .weight_names import CheckpointNames

__all__ = ["MetaModelValues", "model_values"]

_MAX_LISTED = 8


def _has_meta(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in model.parameters()) or any(t.is_meta for t in model.buffers())


class MetaModelValues:
    """Values for a model built on the meta device, or boosted with ``weights`` (module docstring)."""

    def __init__(self, model: torch.nn.Module, weights: SafetensorsWeights | None) -> None:
        self._weights = weights
        self._keys: dict[int, str] = {}
        self._buffer_keys: dict[str, str] = {}
        if weights is not None:
            self._match_weights(model, weights)
        meta_buffers = [
            name for name, buffer in model.named_buffers() if buffer.is_meta and name not in self._buffer_keys
        ]
        from_init = [p for p in model.parameters() if p.is_meta and id(p) not in self._keys]
        needs_params = bool(from_init)
        # Parameters are replayed into this one buffer, grown to the largest: a fresh tensor per
        # parameter, freed between the master shards being allocated, would fragment the heap
        # and keep memory long after boosting.
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._init: RecordedInit | None = None
        if needs_params or meta_buffers:
            # Random numbers are drawn only when parameters come from the init: a model read from
            # a checkpoint leaves the generator alone, as from_pretrained does.
            self._init = record_init(model, draw_random=needs_params, base_from_weights=weights is not None)
            self._init.check(params=from_init, buffers=meta_buffers)

    def _match_weights(self, model: torch.nn.Module, weights: SafetensorsWeights) -> None:
        """Each parameter's checkpoint key, as ``CheckpointNames`` says; a parameter it gives to
        the init (a PEFT adapter) gets none. Every other one must be found, or nothing is boosted."""
        aliases: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(param), []).append(name)
        checkpoint = CheckpointNames(model)
        problems: list[str] = []
        for param in model.parameters():
            names = aliases[id(param)]
            sources = [checkpoint.source(n) for n in names]
            if not any(s.from_file for s in sources):
                continue
            key = next((k for s in sources for k in s.keys if k in weights), None)
            if key is None:
                base = sources[0].base_name
                problems.append(
                    f"no tensor for parameter '{names[0]}'" + (f" (looked up as '{base}')" if base != names[0] else "")
                )
            elif weights.shape(key) != tuple(param.shape):
                problems.append(f"'{key}' has shape {weights.shape(key)}, parameter '{names[0]}' {tuple(param.shape)}")
            else:
                self._keys[id(param)] = key
        persistent = set(model.state_dict(keep_vars=True))
        for name, buffer in model.named_buffers():
            if name not in persistent:
                continue
            key = next((k for k in checkpoint.source(name).keys if k in weights), None)
            if key is not None and weights.shape(key) == tuple(buffer.shape):
                self._buffer_keys[name] = key
        if problems:
            more = f" (and {len(problems) - _MAX_LISTED} more)" if len(problems) > _MAX_LISTED else ""
            raise MaterializeError(
                f"weights={str(weights.path)!r} does not fit {type(model).__name__}: "
                f"{'; '.join(problems[:_MAX_LISTED])}{more}. Nothing was changed. Pass the checkpoint of this model "
                "(what save_pretrained wrote for it; for a PEFT model, for the base model it wraps), or boost without "
                "weights= to initialise it."
            )

    # --- ParamValues ------------------------------------------------------------------------
    def check(self, param: torch.nn.Parameter, where: str) -> None:
        if id(param) in self._keys or not param.is_meta:
            return
        if self._init is None or not self._init.covers(param):
            raise UnmanageableParameter(
                f"{where} is on the meta device and was not found in the model it was boosted with; pass the model's "
                "own parameters"
            )

    def read(self, info: TensorInfo, piece: ShardPiece) -> torch.Tensor:
        param = info.param
        key = self._keys.get(id(param))
        if key is not None:
            assert self._weights is not None, "a checkpoint key implies weights"
            values = self._weights.read(key, piece.param.start, piece.param.stop)
        elif param.is_meta:
            assert self._init is not None, "check() admitted a meta parameter without an init"
            scratch = self._scratch_for(self._init.param_nbytes(param))
            values = self._init.param_value(param, scratch).reshape(-1)[piece.param]
        else:
            values = param.data.reshape(-1)[piece.param]
        return values.to(param.dtype)

    def location(self, info: TensorInfo, piece: ShardPiece) -> tuple[Path, int] | None:
        """In the checkpoint, when it stores the parameter in its own dtype (bytes usable as they
        are); ``None`` for a parameter replayed from its init or stored in another dtype."""
        key = self._keys.get(id(info.param))
        if key is None or self._weights is None or self._weights.stored_dtype(key) != info.param.dtype:
            return None
        return self._weights.location(key, piece.param.start)

    def _scratch_for(self, nbytes: int) -> torch.UntypedStorage:
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(0, dtype=torch.uint8)  # free the old one first
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch.untyped_storage()

    def release(self) -> None:
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._init = None

    def prepare_buffers(self, model: torch.nn.Module) -> None:
        for module_name, module in model.named_modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                full = f"{module_name}.{name}" if module_name else name
                key = self._buffer_keys.get(full)
                if key is not None:
                    assert self._weights is not None, "a buffer key implies weights"
                    value = self._weights.read_all(key)
                elif buffer is not None and buffer.is_meta:
                    assert self._init is not None, "meta buffers were checked against the init"
                    value = self._init.buffer_value(full)
                else:
                    continue
                setattr(module, name, value.to(buffer.dtype))


def model_values(model: torch.nn.Module, weights: str | os.PathLike[str] | None) -> ParamValues:
    """The values source for boosting ``model`` (module docstring)."""
    if weights is None and not _has_meta(model):
        return LiveValues()
    return MetaModelValues(model, SafetensorsWeights(weights) if weights is not None else None)
