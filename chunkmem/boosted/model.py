"""``ChunkedModel``: the user's module with its parameters in chunks.

Forward casts floating inputs to the compute dtype, moves tensors to the compute device and delimits
the iteration for the runtime.

State: ``state_dict()`` returns full fp32 values under the module's own names on every rank (as
DDP-like wrappers do; a collective), gathered one chunk at a time; checkpoint saves use the same
gather to rank 0 only (``chunkmem.checkpoint``). ``load_state_dict`` is transactional: every key,
shape and dtype is checked on every rank, and the ranks agree, before any value is written.

Plain-module interop: ``plain_copy()`` builds an ordinary ``nn.Module`` with full fp32 weights (on
rank 0, chunk by chunk) for evaluation or export; ``save_pretrained`` and ``generate`` work on a
boosted Hugging Face model. What cannot apply to chunked parameters is refused with the way to do
it: ``.to()`` / ``.half()`` / ``.cuda()``, and reading per-parameter gradient values (see
``chunkmem.boosted.grad_markers``).
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from chunkmem.placement import ActivationPlacement, ActivationPlan

from ..activations import ActivationBlocks
from ..activations.meter import SavedMeter
from ..chunks.chunk import Chunk
from ..chunks.chunk_layout import ShardPiece
from ..chunks.manager import ChunkManager
from ..chunks.tensor_state import TensorInfo
from ..compat.torch import IncompatibleKeys, ModuleConversionHook, parse_to, tree_map
from ..device import gpu_device
from ..device.moves import to_device, to_host
from ..errors import CheckpointWriteError, NotSupportedError, StateDictMismatchError
from ..execution.gather import Destination, gather_full
from ..execution.runtime import ChunkRuntime
from ..quantized import QuantizedBase
from ..ranks.agreement import agree, on_first_rank
from ..usage.stats import Stats
from .compiled_blocks import CompiledBlocks
from .generation import generate_under_budget
from .grad_markers import GradientMarkers, clear_markers
from .model_state import StagedModelLoad, check_model_state
from .peft_adapter import adapter_entries
from .progress import TrainingProgress

__all__ = ["ChunkedModel"]


def _compile_refused() -> NotSupportedError:
    return NotSupportedError(
        "torch.compile of a boosted model is not supported: chunkmem gathers and releases parameter chunks in "
        "Python hooks around every op, which a compiled graph would skip (or run on fake tensors while tracing, "
        "issuing real collectives). Compile its repeated blocks instead, with the hooks eager at their boundaries: "
        "boost with ChunkPlugin(compile=CompileBlocks()) and run the boosted model itself eagerly; torch.compile "
        "the model before boosting is not supported either, as its parameters become chunk views."
    )


def _refuse_compiling(compiling: bool) -> bool:
    """Raise ``_compile_refused()`` where ``compiling``. Marked ``assume_constant_result`` (by
    ``_mark_compile_refusal``), Dynamo runs it for real while it traces (to take its result as a
    constant), so the error ends the compile before any graph is built. A ``raise`` in traced code
    would only break the graph: ``forward`` would run eagerly and Dynamo compile what it calls (the
    inputs' casts: on CUDA a Triton kernel and Inductor's pool of compile workers, a minute and more
    under load) until the op hooks refused."""
    if compiling:
        raise _compile_refused()
    return False


@functools.cache
def _mark_compile_refusal() -> None:
    """Mark ``_refuse_compiling`` for Dynamo, once, when the first model is boosted: marking imports
    Dynamo (about two seconds), which ``import chunkmem`` should not pay. Nothing can trace a
    boosted model's forward before one is built."""
    global _refuse_compiling
    _refuse_compiling = torch.compiler.assume_constant_result(_refuse_compiling)


def _check_values_in_place(pieces: list[tuple[Chunk, ShardPiece, torch.Tensor]], source: str) -> None:
    """Chunks read in place from the weights files keep those values (the files are never
    written): a state with other values for them is refused before anything is written."""
    chunks = {chunk.chunk_id: chunk for chunk, _, _ in pieces if chunk.store.reads_in_place}
    by_chunk: dict[int, list[tuple[ShardPiece, torch.Tensor]]] = {}
    for chunk, piece, values in pieces:
        if chunk.chunk_id in chunks:
            by_chunk.setdefault(chunk.chunk_id, []).append((piece, values))
    differ = [chunks[i] for i, loaded in by_chunk.items() if not chunks[i].store.holds_in_place(loaded)]
    if differ:
        names = [info.name for chunk in differ for info in chunk.layout.tensors]
        raise StateDictMismatchError(
            f"{source} gives frozen parameters {names} other values than the weights files they are read in place "
            "from (weights=); chunkmem never writes those files. Boost with weights= pointing at the weights this "
            "state holds (save them with save_pretrained first)"
        )


def _holding_values(value: Any) -> torch.Tensor | str:
    """A state dict's entry, or what it is instead of a tensor with values."""
    if not isinstance(value, torch.Tensor):
        return f"is a {type(value).__name__}, not a tensor"
    if value.device.type == "meta":
        return "is on the meta device: it holds no values"
    return value


def _refuse_placeholder_state(module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
    """On the wrapped module: its parameters hold placeholders (their values live in chunks), so
    its own ``state_dict()`` would silently save garbage. ``keep_vars=True`` (the parameter
    objects, which chunkmem itself reads) is allowed."""
    if not keep_vars:
        raise NotSupportedError(
            f"state_dict() of the {type(module).__name__} inside a boosted model refused: its parameters live "
            "sharded in chunks and hold placeholders. Use model.state_dict() (full values on every rank; a "
            "collective), booster.save_model(model, path), model.save_pretrained(directory) or model.plain_copy()."
        )


class ChunkedModel(ModuleConversionHook, torch.nn.Module):
    """What ``Booster.boost`` returns for the model: call it like the original module; attribute
    lookups that the wrapper does not answer go to the module (``model.config``...)."""

    def __init__(
        self,
        module: torch.nn.Module,
        runtime: ChunkRuntime,
        manager: ChunkManager,
        compute_dtype: torch.dtype,
        buffer_dtypes: Mapping[str, torch.dtype],
        activations: ActivationBlocks | None = None,
        meter: SavedMeter | None = None,
        compiled: CompiledBlocks | None = None,
        quantized: QuantizedBase | None = None,
        *,
        beside: ChunkedModel | None = None,
    ) -> None:
        """``meter``: what measures the saved activations no budget governs (with ``activations``:
        the one it counts its ``offload`` blocks' in); ``None``: they are not measured. ``quantized``:
        the model's 4-bit base, whose layers plain copies give back as bitsandbytes holds them.
        ``beside``: this is a frozen model boosted beside that trained one, in the same chunks'
        manager, runtime and budget (``Booster.boost(..., frozen=...)``); its optimizer steps
        advance both."""
        super().__init__()
        _mark_compile_refusal()
        self.module = module
        self._runtime = runtime
        self._manager = manager
        self._compute_dtype = compute_dtype
        self._device = manager.comm.device
        self._buffer_dtypes = dict(buffer_dtypes)
        # The manager may hold other models' chunks too (several models under one budget): this
        # model's own parameters are those its module holds; each chunk holds one model's.
        own = {id(p) for p in module.parameters()}
        if quantized is not None:  # a 4-bit weight's scales are chunk tensors, not module parameters
            own |= {id(t) for t in quantized.tensors}
        self._infos = tuple(info for info in manager.infos if id(info.param) in own)
        self._chunks = tuple(manager.chunk(i) for i in sorted({info.chunk_id for info in self._infos}))
        self._markers = GradientMarkers((info.name, info.param) for info in self._infos)
        self._guard_inner_state = module.register_state_dict_pre_hook(_refuse_placeholder_state)
        self._progress = beside.progress if beside is not None else TrainingProgress()
        self._activations = activations
        self._meter = meter
        self._compiled = compiled
        self._quantized = quantized
        self._beside = beside
        self._frozen: list[ChunkedModel] = []
        if beside is not None:
            beside._frozen.append(self)
        # When the module goes (with this wrapper, which holds it), and every other model sharing
        # the runtime too, the runtime lets go of its parameters: the hook table holds the runtime
        # for each of them, so nothing else would.
        runtime.held_by(module)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)

    @property
    def runtime(self) -> ChunkRuntime:
        return self._runtime

    @property
    def manager(self) -> ChunkManager:
        """This model's chunks, the parameter -> chunk map and the byte ledger."""
        return self._manager

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        """This model's chunks (the manager's may include other models' beside it)."""
        return self._chunks

    @property
    def param_infos(self) -> tuple[TensorInfo, ...]:
        """This model's parameters as the manager holds them, in registration order."""
        return self._infos

    @property
    def frozen_models(self) -> tuple[ChunkedModel, ...]:
        """The frozen models boosted beside this trained one (``Booster.boost(..., frozen=...)``),
        in the order given: their chunks are placed under the same budget by the same policy, from
        one trace spanning every model's ops of a step."""
        return tuple(self._frozen)

    @property
    def is_frozen(self) -> bool:
        """Boosted beside a trained model, without an optimizer: its values never change."""
        return self._beside is not None

    @property
    def progress(self) -> TrainingProgress:
        """The step of the model's state (its optimizer advances it) and the checkpoints loaded
        since the last step."""
        return self._progress

    @property
    def compute_device(self) -> torch.device:
        """Where ops run (inputs are moved there)."""
        return self._device

    def _prepare(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        dtype = self._compute_dtype if value.is_floating_point() else value.dtype
        return to_device(value, self._device, dtype)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module: floating tensors in the compute dtype, all tensors on the device."""
        _refuse_compiling(torch.compiler.is_compiling())
        self._refuse_parameters_added_after_boost()
        args, kwargs = tree_map(self._prepare, (args, kwargs))
        if self._activations is not None:
            kwargs = self._activations.training_kwargs(self.module, kwargs)
        # A frozen model's forward while the trained model trains is part of the training step
        # (a reference model's in DPO, under no_grad): it joins the step's trace, so that one
        # order spans both models and eviction plans by next use across them.
        self._runtime.begin_forward(in_step=self._beside is not None and self._beside.training)
        try:
            if self._activations is not None:  # after the ranks agreed this forward (check mode)
                self._activations.begin_forward()
            outside = self._activations.outside_blocks() if self._activations is not None else nullcontext()
            # The meter's hooks beneath every other (outermost): it counts what none of them places.
            measured = self._meter.forward(self._device) if self._meter is not None else nullcontext()
            with measured, self._runtime.forward_context(), outside:
                out = self.module(*args, **kwargs)
            self._runtime.agree_reads()
            if self._activations is not None:  # every rank's forward returned: agreed over ranks
                self._activations.end_forward()
            return out
        finally:
            self._runtime.end_forward()

    def _refuse_parameters_added_after_boost(self) -> None:
        """A parameter in no chunk would train (or not) outside chunkmem's optimizer, on one rank's
        values: ``peft.get_peft_model`` on a boosted model, or a layer replaced after boosting."""
        manager = self._manager
        if all(manager.manages(p) for p in self.module.parameters()):
            return
        added = [name for name, p in self.module.named_parameters() if not manager.manages(p)]
        shown = ", ".join(repr(n) for n in added[:3]) + (f" and {len(added) - 3} more" if len(added) > 3 else "")
        raise NotSupportedError(
            f"rank {manager.comm.rank}: {type(self.module).__name__} holds parameters that were added after boosting "
            f"({shown}), which no chunk and no optimizer hold, as when peft.get_peft_model wraps a boosted model or a "
            "layer is replaced after boosting. Chunks, gradients and optimizer pieces are built when boosting: apply "
            "peft.get_peft_model(model, config) (or any change to the layers) to the plain model first, then boost it "
            "with an optimizer over its parameters."
        )

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Refused: see ``_compile_refused``."""
        raise _compile_refused()

    @property
    def activation_placement(self) -> ActivationPlacement | None:
        """The ``ActivationPlacement`` the blocks run under: the plugin's, with the class a
        ``RepeatedBlocks()`` found in its place (``None`` without one)."""
        return self._activations.config if self._activations is not None else None

    @property
    def activation_plan(self) -> ActivationPlan | None:
        """Where the saved activations of each ``ActivationPlacement(auto=...)`` block call go
        (``placement.ActivationPlan``: per call of a forward, keep, offload or recompute), decided
        after the first training step; ``None`` before, or without auto blocks."""
        return self._activations.plan if self._activations is not None else None

    def stats(self) -> Stats:
        """Counters since boosting; see :class:`chunkmem.Stats`."""
        stats = self._runtime.stats()
        if self._activations is not None:
            self._activations.counts(stats)
        if self._meter is not None:
            stats.unbudgeted_activation_bytes = self._meter.bytes
            stats.peak_unbudgeted_activation_bytes = self._meter.peak_bytes
        return stats

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients in the chunks (what ``optimizer.zero_grad()`` does): gradients would
        otherwise keep accumulating across steps. A frozen model has none: nothing to drop (the
        trained model's gradients, in the same runtime, are left alone)."""
        if self._beside is not None:
            return
        self._runtime.zero_grad()
        if set_to_none:
            clear_markers(self.parameters())

    # --- moves and casts are the plugin's ---------------------------------------------------
    def _same_device(self, device: torch.device) -> bool:
        return self._manager.comm.layer.same_device(device)

    def _refuse_conversion(self, call: str) -> NotSupportedError:
        return NotSupportedError(
            f"{call} on a boosted model refused: chunkmem decides where each parameter lives (fp32 master shards "
            f"spread over the ranks, placed on the device or the host by the placement policy) and computes in the "
            f"precision the plugin chose ({str(self._compute_dtype).removeprefix('torch.')} on {self._device}). "
            "Inputs are moved to the compute device by the model itself. To compute in another dtype, boost with "
            "ChunkPlugin(precision=...); the compute device is the local GPU (LOCAL_RANK) or the CPU. For an ordinary "
            "module with full weights on a device or dtype of your choice, use model.plain_copy(device=...)."
        )

    def to(self, *args: Any, **kwargs: Any) -> ChunkedModel:  # type: ignore[override]
        """Accepted only when it changes nothing (the compute device and dtype already); anything
        else raises ``NotSupportedError`` saying what to do."""
        device, dtype, _, _ = parse_to(*args, **kwargs)
        if (device is None or self._same_device(torch.device(device))) and dtype in (None, self._compute_dtype):
            return self
        shown = ", ".join([*(repr(a) for a in args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        raise self._refuse_conversion(f"model.to({shown})")

    def cpu(self) -> ChunkedModel:
        return self.to("cpu")

    def cuda(self, device: int | torch.device | None = None) -> ChunkedModel:
        return self.to(gpu_device(device))

    def half(self) -> ChunkedModel:
        return self.to(torch.float16)

    def float(self) -> ChunkedModel:
        return self.to(torch.float32)

    def double(self) -> ChunkedModel:
        return self.to(torch.float64)

    def bfloat16(self) -> ChunkedModel:
        return self.to(torch.bfloat16)

    def _chunkmem_apply(self, fn: Any, recurse: bool = True) -> ChunkedModel:
        raise self._refuse_conversion(f"a conversion of every parameter ({getattr(fn, '__name__', 'fn')})")

    # --- full state -------------------------------------------------------------------------
    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of every ``state_dict`` entry (parameters as fp32 masters, a frozen
        chunk's parameters in the compute dtype when that is their own and all it stores, buffers
        in their original dtype), without gathering anything."""
        manager = self._manager
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            if manager.manages(tensor):
                info = manager.info(tensor)
                out[name] = (tuple(info.shape), manager.chunk(info.chunk_id).store.values_dtype)
            else:
                out[name] = (tuple(tensor.shape), self._buffer_dtypes.get(name, tensor.dtype))
        return out

    def _gather_params(
        self, destination: Destination, what: str, only: set[int] | None = None
    ) -> dict[int, torch.Tensor]:
        """Each parameter's full fp32 values on the CPU, keyed by ``id(param)``, on the ranks
        ``destination`` names (empty elsewhere); one chunk at a time, only the chunks holding a
        parameter of ``only`` (ids) when given. A collective."""
        self._runtime.enter_state_access(what)
        self._runtime.finish_backward()
        runtime = self._runtime
        values: dict[int, torch.Tensor] = {}
        for chunk in self._chunks:
            if only is not None and not any(id(info.param) in only for info in chunk.layout.tensors):
                continue
            with chunk.store.resident_master() as master:  # one at a time when masters are on disk
                full = gather_full(runtime, self._manager.comm, chunk, master, destination, what)
                if full is None:
                    continue
                for info in chunk.layout.tensors:  # copies: ``full`` may be the master itself
                    values[id(info.param)] = full[info.offset : info.offset + info.numel].view(info.shape).clone()
        runtime.agree_reads()
        return values

    def full_state_dict(
        self, destination: Destination = Destination.EVERY_RANK, names: set[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Full fp32 parameters and buffers (original dtypes) under the module's own names, on
        the CPU, on the ranks ``destination`` names (``{}`` elsewhere); only the entries ``names``
        when given. A collective."""
        own = self.module.state_dict(keep_vars=True)
        if names is not None:
            own = {name: tensor for name, tensor in own.items() if name in names}
        only = None if names is None else {id(tensor) for tensor in own.values()}
        values = self._gather_params(destination, "gathering a state dict", only)
        if not destination.receives(self._manager.comm.rank):
            return {}
        out: dict[str, torch.Tensor] = {}
        for name, tensor in own.items():
            if id(tensor) in values:
                out[name] = values[id(tensor)]
            else:
                out[name] = to_host(tensor.detach(), self._buffer_dtypes.get(name, tensor.dtype)).clone()
        return out

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """Full fp32 parameters and buffers under the wrapped module's own names, on the CPU, on
        every rank (a collective: call it on all ranks). ``booster.save_model`` gathers the same
        on rank 0 only."""
        out = {} if destination is None else destination
        for name, value in self.full_state_dict(Destination.EVERY_RANK).items():
            out[prefix + name] = value
        return out

    def stage_load(self, state_dict: Any, strict: bool, source: str) -> StagedModelLoad:
        """Check every key, shape and dtype of ``state_dict`` against the model; raise
        :class:`StateDictMismatchError` listing every problem. Writes nothing."""
        model_name = type(self.module).__name__
        if not isinstance(state_dict, Mapping):
            raise StateDictMismatchError(f"{source} is a {type(state_dict).__name__}, not a state dict")
        own = self.module.state_dict(keep_vars=True)
        if {"state", "param_groups"} <= set(state_dict) and not set(own) & set(state_dict):
            raise StateDictMismatchError(
                f"{source} holds an optimizer state (keys 'state' and 'param_groups'), not a model state: load it "
                "with booster.load_optimizer / optimizer.load_state_dict"
            )
        saved = {name: _holding_values(value) for name, value in state_dict.items()}
        missing, unexpected = check_model_state(model_name, self.state_shapes(), saved, strict, source)
        manager = self._manager
        pieces: list[tuple[Chunk, ShardPiece, torch.Tensor]] = []
        buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, target in own.items():
            if name not in state_dict:
                continue
            if not manager.manages(target):
                buffers.append((target, state_dict[name]))
                continue
            info = manager.info(target)
            chunk = manager.chunk(info.chunk_id)
            piece = chunk.layout.piece(info)
            if piece is not None:
                pieces.append((chunk, piece, state_dict[name].reshape(-1)[piece.param]))
        _check_values_in_place(pieces, source)
        return StagedModelLoad(pieces, buffers, missing, unexpected)

    def apply_load(self, staged: StagedModelLoad) -> IncompatibleKeys:
        """Write a validated state into this rank's master shards and the buffers."""
        self._runtime.cancel_early_steps()
        manager = self._manager
        manager.prepare_master_writes()
        with torch.no_grad():
            by_chunk: dict[int, list[tuple[ShardPiece, torch.Tensor]]] = {}
            for chunk, piece, values in staged.pieces:
                by_chunk.setdefault(chunk.chunk_id, []).append((piece, values))
            for chunk_id, pieces in by_chunk.items():  # one chunk in memory at a time when masters are on disk
                with manager.chunk(chunk_id).store.resident_master(write_back=True) as master:
                    for piece, values in pieces:
                        master[piece.shard].copy_(values)
            for target, value in staged.buffers:
                target.copy_(value)
        self._runtime.masters_loaded()
        return IncompatibleKeys(staged.missing, staged.unexpected)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load full values (as produced by ``state_dict`` or by the unwrapped module) into the
        master shards and buffers. Checked on every rank before anything is written; a refused
        state leaves the model as it was. A collective: call it on every rank."""
        if assign:
            raise ValueError("ChunkedModel.load_state_dict does not support assign=True; values are copied in")
        self._runtime.finish_backward()
        staged = agree(
            self._manager.comm,
            f"loading a state dict into {type(self.module).__name__}",
            lambda: self.stage_load(state_dict, strict, "the state dict"),
            StateDictMismatchError,
        )
        return self.apply_load(staged)

    # --- plain modules and Hugging Face -----------------------------------------------------
    def plain_copy(self, every_rank: bool = False, device: str | torch.device = "cpu") -> torch.nn.Module | None:
        """An ordinary ``nn.Module`` (no chunks, no hooks) with the full fp32 weights and the
        buffers in their original dtypes, on ``device``: on rank 0 (``None`` on the others), or
        on every rank with ``every_rank=True``. Built chunk by chunk; ranks that receive nothing
        hold one chunk at a time. For evaluation, export, or anything that needs whole weights.
        A collective: call it on every rank."""
        destination = Destination.EVERY_RANK if every_rank else Destination.FIRST_RANK
        values = self._gather_params(destination, "building a plain copy")
        if not destination.receives(self._manager.comm.rank):
            return None
        memo: dict[int, Any] = {}
        for info in self._infos:
            memo[id(info.param)] = torch.nn.Parameter(to_device(values.pop(id(info.param)), device), info.trainable)
        if self._quantized is not None:  # 4-bit weights as bitsandbytes holds them
            self._quantized.plain_weights(memo)
        self._guard_inner_state.remove()  # the copy holds real values: no guard there
        try:
            with self._forwards_detached():
                plain = copy.deepcopy(self.module, memo)
        finally:
            self._guard_inner_state = self.module.register_state_dict_pre_hook(_refuse_placeholder_state)
        for module_name, module in plain.named_modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                if buf is not None:
                    full_name = f"{module_name}.{name}" if module_name else name
                    dtype = self._buffer_dtypes.get(full_name, buf.dtype)
                    setattr(module, name, to_device(buf.detach(), device, dtype).clone())
        return plain

    @contextmanager
    def _forwards_detached(self) -> Iterator[None]:
        """The blocks run their classes' own forward (no activation placement, nothing compiled, the
        4-bit layers as bitsandbytes runs them): the activation blocks first, since their wrappers
        hold the compiled blocks'."""
        with (
            self._activations.detached() if self._activations is not None else nullcontext(),
            self._compiled.detached() if self._compiled is not None else nullcontext(),
            self._quantized.detached() if self._quantized is not None else nullcontext(),
        ):
            yield

    def save_pretrained(self, save_directory: str | os.PathLike[str], **kwargs: Any) -> None:
        """Hugging Face ``save_pretrained`` with the full fp32 weights: rank 0 writes (from a plain
        copy built chunk by chunk); every rank raises if the write fails. A collective. A PEFT
        model writes its adapter, and only the chunks holding the adapter are gathered for it."""
        entries = adapter_entries(self.module, self.state_shapes(), kwargs)
        if entries is not None:
            state = self.full_state_dict(Destination.FIRST_RANK, entries)

            def write_adapter() -> None:
                self.module.save_pretrained(save_directory, state_dict=state, **kwargs)

            on_first_rank(
                self._manager.comm, "save_pretrained", write_adapter, CheckpointWriteError, f"to {save_directory}"
            )
            return
        plain = self.plain_copy()
        if plain is not None and not hasattr(plain, "save_pretrained"):
            raise AttributeError(f"{type(self.module).__name__} has no save_pretrained (not a transformers model)")

        def write() -> None:
            assert plain is not None, "rank 0 builds the plain copy"
            plain.save_pretrained(save_directory, **kwargs)

        on_first_rank(self._manager.comm, "save_pretrained", write, CheckpointWriteError, f"to {save_directory}")

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Hugging Face ``generate`` on the chunked weights, under the device budget
        (``chunkmem.boosted.generation``): the KV cache is reserved in the ledger for the whole call
        (refused before decoding where it cannot fit beside the model's working set), and each
        forward it runs is an inference iteration, the decode steps prefetching their chunks in the
        order the first one recorded. Tensors are moved to the compute device. With several ranks
        every rank must call it (each forward is collective); ``synced_gpus`` defaults to True so
        ranks that finish early keep stepping."""
        generate = getattr(self.module, "generate", None)
        if generate is None:
            raise AttributeError(f"{type(self.module).__name__} has no generate (not a transformers model)")
        comm = self._manager.comm
        if comm.world_size > 1:
            kwargs.setdefault("synced_gpus", True)
        device = self._device
        args, kwargs = tree_map(lambda v: to_device(v, device) if isinstance(v, torch.Tensor) else v, (args, kwargs))
        chunk_ids = {chunk.chunk_id for chunk in self._chunks}
        return generate_under_budget(
            self.module, self._runtime, comm, chunk_ids, self._compute_dtype, generate, args, kwargs
        )
