"""``record_init``: a model's own initialisation, recorded on the meta device so that each parameter
and buffer can later be computed on its own, with the values a CPU construction would have given.

What "the model's own initialisation" is, module by module, in construction order (children before
the parent that creates them, as ``__init__`` runs):

* a ``transformers`` model (``PreTrainedModel``): its construction from its config, run again on
  the meta device: every layer's ``reset_parameters`` as its ``__init__`` calls it, what
  ``__init__`` itself draws (GPT-2's ``Conv1D``), then ``post_init`` (``_init_weights`` over every
  module, nested models first, and weight tying), with the same generator draws in the same order;
  buffers computed in ``__init__`` (rotary frequencies) are recomputed the same way. The rebuilt
  model must have the given model's parameter names, shapes and ties.
* a PEFT tuner (``get_peft_model``'s ``LoraModel``, one adapter) over a ``transformers`` model: the
  model's construction as above, then PEFT's injection of the adapter into it, run again from the
  tuner's config, as ``get_peft_model`` ran it after the model was built (its layers' own
  initialisation and PEFT's ``reset_lora_parameters``, with the same generator draws, and its cast
  to the base layer's dtype, which PEFT skips on meta: ``peft_cast``; a rebuilt layer shows PEFT
  the ``compute_dtype`` its given layer has, a bitsandbytes 4-bit layer's). When the
  base's values come from a checkpoint (``base_from_weights``), its construction draws nothing, as
  ``from_pretrained`` skips it: the adapter's draws are those of ``get_peft_model`` after it.
* any other module: its ``reset_parameters()`` (``_reset_parameters()`` for ``MultiheadAttention``
  and ``Transformer``), which torch's layers call at the end of their ``__init__``. A parameter
  held by several modules (tied) belongs to the first that registered it; the others initialise a
  stand-in, as their own parameter was replaced after construction.

Everything that cannot be reproduced exactly is refused with :class:`MaterializeError`, naming the
parameter or buffer and its module: a value no recorded op fully wrote (a parameter no
``reset_parameters`` covers, a buffer computed in a plain module's ``__init__``), a rebuilt model
that differs from the given one.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from ..compat.torch import own_reset_method
from ..compat.transformers import config_builder, is_pretrained_model
from ..errors import MaterializeError
from .graph import OpGraph, TensorRef
from .peft_cast import adapters_cast_as_on_the_cpu
from .recorder import GraphRecorder
from .replay import Replayer
from .weight_names import is_peft_tuner

__all__ = ["RecordedInit", "is_transformers_model", "record_init"]

_DEVICE_CHECK = "get_torch_context_manager_or_global_device"
_FIX = "Otherwise build the model on the CPU, or boost it with weights=<a safetensors checkpoint of it>."


def is_transformers_model(module: torch.nn.Module) -> bool:
    """A ``transformers.PreTrainedModel`` (checked without importing transformers)."""
    return is_pretrained_model(module)


def _reset_method(module: torch.nn.Module) -> Any:
    """What the module's ``__init__`` calls to initialise its own parameters, if anything."""
    own = own_reset_method(module)
    if own is not None:
        return own
    reset = getattr(module, "reset_parameters", None)
    return reset if callable(reset) else None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass(frozen=True)
class _Target:
    """A parameter or buffer of the given model and the recorded tensor that holds its init."""

    name: str
    kind: str
    """``"parameter"`` or ``"buffer"``."""
    ref: TensorRef
    module: str
    """Which module's initialisation gives it values, for messages."""
    plain: bool
    """Initialised by a plain module's reset (not by a rebuilt transformers model)."""


class RecordedInit:
    """The recorded initialisation of one model: values for its meta parameters and buffers."""

    def __init__(self, graph: OpGraph, params: dict[int, _Target], buffers: dict[str, _Target]) -> None:
        self._graph = graph
        self._params = params
        self._buffers = buffers
        self._replayer = Replayer(graph)

    def covers(self, param: torch.Tensor) -> bool:
        return id(param) in self._params

    def check(self, params: list[torch.Tensor], buffers: list[str]) -> None:
        """Raise, naming every one, if the given parameters (those it covers) or the named buffers
        would get values that no recorded op fully wrote."""
        targets = [self._params[id(p)] for p in params if id(p) in self._params] + [self._buffers[n] for n in buffers]
        bad = [t for t in targets if not self._graph.is_defined(t.ref)]
        if not bad:
            return
        listed = "; ".join(f"{t.kind} '{t.name}' (shape {t.ref.size}) of {t.module}" for t in bad[:8])
        more = f" (and {len(bad) - 8} more)" if len(bad) > 8 else ""
        if any(t.plain for t in bad):
            why = (
                "a plain nn.Module's __init__ cannot be run again: chunkmem replays each module's reset_parameters() "
                "in construction order (torch's own layers call theirs in __init__), and none writes all of these. "
                "Fix: give the module a reset_parameters() that initialises them, or create such tensors on the CPU "
                "explicitly inside the meta context (device='cpu')."
            )
        else:
            why = (
                "the model's construction from its config, replayed on the meta device, never fully writes them "
                "(e.g. they come from torch.empty and no init touches them)."
            )
        raise MaterializeError(
            f"cannot give exact values to tensors on the meta device: {listed}{more}. The meta device holds only "
            f"shapes, and {why} {_FIX}"
        )

    def param_value(self, param: torch.Tensor, out: torch.UntypedStorage | None = None) -> torch.Tensor:
        """The full parameter as its initialisation computes it, on the CPU (built in ``out``
        when given and possible; see ``Replayer.value``)."""
        target = self._params[id(param)]
        try:
            return self._replayer.value(target.ref, out)
        except MaterializeError as error:
            raise MaterializeError(f"parameter '{target.name}' of {target.module}: {error}. {_FIX}") from None

    def param_nbytes(self, param: torch.Tensor) -> int:
        """Bytes of the storage the parameter is replayed in."""
        return self._graph.storage(self._params[id(param)].ref.storage).nbytes

    def buffer_value(self, name: str) -> torch.Tensor:
        target = self._buffers[name]
        try:
            return self._replayer.value(target.ref)
        except MaterializeError as error:
            raise MaterializeError(f"buffer '{name}' of {target.module}: {error}. {_FIX}") from None


@contextmanager
def _compute_dtypes_as_given(model: torch.nn.Module, rebuilt: torch.nn.Module) -> Iterator[None]:
    """Within the block, each layer of ``rebuilt`` whose counterpart in ``model`` (under a PEFT
    tuner: the same name without its ``base_layer`` segment) has a ``compute_dtype`` has it too: what
    PEFT casts an adapter to over a quantized layer (``peft_cast``), which rebuilding from the
    config does not make."""
    layers = dict(rebuilt.named_modules())
    given: dict[str, torch.dtype | None] = {}
    for name, module in model.named_modules():
        dtype = getattr(module, "compute_dtype", False)
        if dtype is None or isinstance(dtype, torch.dtype):
            given.setdefault(name.replace(".base_layer", ""), dtype)
    marked: list[torch.nn.Module] = []
    for name, dtype in given.items():
        layer = layers.get(name)
        if layer is not None and not hasattr(layer, "compute_dtype"):
            layer.compute_dtype = dtype
            marked.append(layer)
    try:
        yield
    finally:
        for layer in marked:
            del layer.compute_dtype


def _describe(name: str, module: torch.nn.Module) -> str:
    return f"{type(module).__name__} '{name}'" if name else f"{type(module).__name__} (the model)"


def _dominant_dtype(module: torch.nn.Module) -> torch.dtype:
    counts = Counter(p.dtype for p in module.parameters() if p.is_floating_point())
    return counts.most_common(1)[0][0] if counts else torch.get_default_dtype()


def _ties(named: list[tuple[str, torch.Tensor]]) -> set[frozenset[str]]:
    groups: dict[int, set[str]] = {}
    for name, tensor in named:
        groups.setdefault(id(tensor), set()).add(name)
    return {frozenset(g) for g in groups.values() if len(g) > 1}


class _Recording:
    """One traversal of the model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, draw_random: bool, base_from_weights: bool) -> None:
        self.graph = OpGraph()
        self.recorder = GraphRecorder(self.graph, draw_random)
        self.base_from_weights = base_from_weights
        self.model = model
        self.params: dict[int, _Target] = {}
        self.buffers: dict[str, _Target] = {}
        self._visited: set[int] = set()
        self._owner: dict[int, int] = {}
        for _, module in model.named_modules():
            for _, param in module.named_parameters(recurse=False):
                self._owner.setdefault(id(param), id(module))

    def run(self) -> None:
        with self.recorder, torch.no_grad():
            self._visit("", self.model)
        # Parameters and buffers initialised by plain modules' resets: the given model's own tensors.
        for name, module in self.model.named_modules():
            for pname, param in module.named_parameters(recurse=False):
                if param.is_meta and id(param) not in self.params and self._owner[id(param)] == id(module):
                    where = _describe(name, module)
                    self.params[id(param)] = _Target(
                        _join(name, pname), "parameter", self.graph.ref(param), where, plain=True
                    )
            for bname, buffer in module.named_buffers(recurse=False):
                full = _join(name, bname)
                if buffer is not None and buffer.is_meta and full not in self.buffers:
                    where = _describe(name, module)
                    self.buffers[full] = _Target(full, "buffer", self.graph.ref(buffer), where, plain=True)

    def _visit(self, name: str, module: torch.nn.Module) -> None:
        if id(module) in self._visited:
            return
        self._visited.add(id(module))
        if is_transformers_model(module):
            self._rebuild(name, module)
            return
        if is_peft_tuner(module):
            self._rebuild_tuned(name, module)
            return
        for child_name, child in module.named_children():
            self._visit(_join(name, child_name), child)
        reset = _reset_method(module)
        if reset is None:
            return
        label = f"{type(module).__name__}.{getattr(reset, '__name__', 'reset_parameters')}() of '{name or 'the model'}'"
        with self._stand_ins(module), self.recorder.refusing_real_writes(label):
            reset()

    @contextmanager
    def _stand_ins(self, module: torch.nn.Module) -> Iterator[None]:
        """Parameters another module registered first are replaced, for this module's reset, by
        meta stand-ins: in a CPU construction it initialised its own, replaced later (tying)."""
        swapped: list[tuple[str, torch.nn.Parameter]] = []
        for name, param in list(module.named_parameters(recurse=False)):
            if self._owner[id(param)] != id(module):
                stand_in = torch.nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
                swapped.append((name, param))
                setattr(module, name, stand_in)
        try:
            yield
        finally:
            for name, param in swapped:
                setattr(module, name, param)

    def _rebuild(self, prefix: str, module: torch.nn.Module) -> None:
        """Construct the transformers model again from its config on the meta device, recording,
        with its weight initialisation switched on (transformers skips it on meta)."""
        with self._on_meta():
            rebuilt = self._build_again(prefix, module)
        self._match(prefix, module, rebuilt)

    def _rebuild_tuned(self, prefix: str, tuner: torch.nn.Module) -> None:
        """The transformers model a PEFT tuner wraps, built again as ``_rebuild`` does, then the
        tuner's adapter injected into it again from the tuner's config (module docstring)."""
        model = getattr(tuner, "model", None)
        configs = getattr(tuner, "peft_config", {})
        where = f"{type(tuner).__name__} at '{prefix or 'the model'}'"
        if model is None or not is_transformers_model(model) or len(configs) != 1:
            raise MaterializeError(
                f"cannot replay the initialisation of {where}: chunkmem replays PEFT's injection of one adapter into "
                f"a transformers model (this tuner has {len(configs)} adapters over "
                f"{type(model).__name__ if model is not None else 'no model'}). {_FIX}"
            )
        ((adapter, config),) = configs.items()
        with self._on_meta():
            with self.recorder.not_drawing() if self.base_from_weights else nullcontext():
                rebuilt = self._build_again(_join(prefix, "model"), model)
            try:
                with adapters_cast_as_on_the_cpu(), _compute_dtypes_as_given(model, rebuilt):
                    type(tuner)(rebuilt, copy.deepcopy(config), adapter)
            except MaterializeError:
                raise
            except Exception as error:
                raise MaterializeError(
                    f"cannot replay the initialisation of {where}: injecting its adapter '{adapter}' again into the "
                    f"rebuilt model on the meta device failed ({type(error).__name__}: {error}). {_FIX}"
                ) from error
        self._match(_join(prefix, "model"), model, rebuilt)

    @contextmanager
    def _on_meta(self) -> Iterator[None]:
        """Build on the meta device, with transformers' weight initialisation switched on."""
        import transformers.modeling_utils as modeling_utils

        with ExitStack() as stack:
            stack.enter_context(torch.device("meta"))
            # transformers decides "initialise or not" from the device context; on the CPU it would.
            if hasattr(modeling_utils, _DEVICE_CHECK):
                stack.enter_context(mock.patch.object(modeling_utils, _DEVICE_CHECK, lambda: None))
            yield

    @staticmethod
    def _build_again(prefix: str, module: torch.nn.Module) -> torch.nn.Module:
        cls = type(module)
        config = copy.deepcopy(module.config)
        try:
            build = config_builder(cls)
            if build is not None:  # applies config.dtype, as from_config does
                return build(config, dtype=_dominant_dtype(module))
            return cls(config)
        except MaterializeError:
            raise
        except Exception as error:
            raise MaterializeError(
                f"cannot replay the initialisation of {cls.__name__} at '{prefix or 'the model'}': building it "
                f"again from its config on the meta device failed ({type(error).__name__}: {error}). {_FIX}"
            ) from error

    def _match(self, prefix: str, module: torch.nn.Module, rebuilt: torch.nn.Module) -> None:
        cls = type(module).__name__
        given = list(module.named_parameters(remove_duplicate=False))
        again = dict(rebuilt.named_parameters(remove_duplicate=False))
        problems = [f"'{n}' is not in the rebuilt model" for n, _ in given if n not in again]
        problems += [f"the rebuilt model has '{n}' too" for n in again if n not in dict(given)]
        problems += [
            f"'{n}' has shape {tuple(p.shape)}, rebuilt {tuple(again[n].shape)}"
            for n, p in given
            if n in again and p.shape != again[n].shape
        ]
        if not problems and _ties(given) != _ties(list(again.items())):
            problems.append(f"tied parameters differ: {sorted(map(sorted, _ties(given)))} given")
        if problems:
            raise MaterializeError(
                f"cannot replay the initialisation of {cls} at '{prefix or 'the model'}': {cls}(config) built again "
                f"differs from the model given ({'; '.join(problems[:6])}). Its own init therefore cannot be "
                f"reproduced exactly (was it changed after construction?). {_FIX}"
            )
        where = f"{cls} (built again from its config)"
        for name, param in given:
            if param.is_meta and id(param) not in self.params:
                self.params[id(param)] = _Target(
                    _join(prefix, name), "parameter", self.graph.ref(again[name]), where, plain=False
                )
        rebuilt_buffers = dict(rebuilt.named_buffers(remove_duplicate=False))
        for name, buffer in module.named_buffers(remove_duplicate=False):
            if not buffer.is_meta:
                continue
            if name not in rebuilt_buffers:
                raise MaterializeError(
                    f"buffer '{_join(prefix, name)}' of {cls} is on the meta device but {cls}(config) built again has "
                    f"no such buffer, so its value cannot be recomputed. {_FIX}"
                )
            self.buffers[_join(prefix, name)] = _Target(
                _join(prefix, name), "buffer", self.graph.ref(rebuilt_buffers[name]), where, plain=False
            )


def record_init(model: torch.nn.Module, draw_random: bool, base_from_weights: bool = False) -> RecordedInit:
    """Record ``model``'s own initialisation (module docstring). With ``draw_random`` the global
    generator (and any generator the init is given) moves exactly as a CPU construction would
    have moved it from its current state, and parameters can be replayed; without, nothing is
    drawn and only values that need no random numbers can be replayed (buffers). With
    ``base_from_weights`` the transformers model under a PEFT tuner draws nothing (its values are
    read from a checkpoint, as ``from_pretrained`` + ``get_peft_model`` would): only the adapter."""
    recording = _Recording(model, draw_random, base_from_weights)
    recording.run()
    return RecordedInit(recording.graph, recording.params, recording.buffers)
