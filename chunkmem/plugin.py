"""``ChunkPlugin``: how a model and optimizer are turned into chunked ones (what ``Booster.boost``
runs)."""

from __future__ import annotations

import copy
import functools
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from pydantic import BaseModel, TypeAdapter

import chunkmem.placement as placement_pkg
from chunkmem.placement import (
    ActivationPlacement,
    AutoPlacementConfig,
    ChunkPlacement,
    ChunkSpec,
    Layout,
    Location,
    StaticPlacementConfig,
    WorkingSet,
    load_placement_config,
    make_policy,
)

from .activations import ActivationBlocks, DeviceBudget, resolve_blocks
from .activations.meter import SavedMeter
from .boosted.backing import Backing, TrainingBacking
from .boosted.boosted_params import already_boosted, note_boosted, the_fix
from .boosted.compile_config import CompileBlocks
from .boosted.compiled_blocks import CompiledBlocks, block_working_sets, find_compiled_blocks
from .boosted.frozen_models import FrozenModels
from .boosted.model import ChunkedModel
from .chunks.chunk import Chunk
from .chunks.manager import ChunkManager
from .chunks.search import default_search_range, search_chunk_size, trainable_chunk_range
from .chunks.shard import MASTER_DTYPE
from .device import DeviceLayer, bf16_supported, compute_device
from .device.moves import to_device
from .device.probes import peak_allocated
from .errors import (
    AlreadyBoostedError,
    BudgetTooSmallError,
    DiskTierError,
    HostBudgetTooSmallError,
    MaterializeError,
    NotSupportedError,
)
from .execution.runtime import ChunkRuntime
from .optim import ChunkOptimizer, StateSize, check_elementwise, optimizer_state_size
from .optim.loss_scale import DynamicLossScaler, LossScaleConfig
from .optim.places import SidePlaces
from .optim.step_config import HostStepConfig, StepAfterBackward, StepDuringBackward
from .quantized import QuantizedBase, QuantizingValues
from .ranks.agreement import agree
from .ranks.comm import Communicator
from .tiers.disk import DISK_BLOCK, SidesFile
from .usage.stats import Stats

__all__ = ["ChunkPlugin", "Precision"]

log = logging.getLogger("chunkmem")
Precision = Literal["fp32", "bf16", "fp16"]
_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _check_optimizer(optimizer: torch.optim.Optimizer, named: list[tuple[str, torch.nn.Parameter]]) -> None:
    model_params = {id(p) for _, p in named}
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in model_params:
                raise ValueError(
                    f"param group {index} of {type(optimizer).__name__} holds a parameter of shape "
                    f"{tuple(p.shape)} that is not part of the boosted model; build the optimizer over "
                    "model.parameters() of the model you boost"
                )
    check_elementwise(optimizer)
    if optimizer.state and any(p.is_meta for _, p in named):
        raise MaterializeError(
            f"{type(optimizer).__name__} already holds state (loaded or stepped) for a model with parameters on the "
            "meta device, which have no values yet: chunkmem cannot tell which values that state belongs to. Build the "
            "optimizer over the meta model without state, boost, then load the state with booster.load_optimizer "
            "(or optimizer.load_state_dict on the optimizer boost returns)."
        )


def _check_host_budget_on_cpu(
    placement: StaticPlacementConfig | AutoPlacementConfig, device: torch.device, host_need: int
) -> None:
    """On a CPU compute device the "device" is host memory too: ``host_budget`` caps only what the
    placement offloads from the compute device. Where it offloads nothing (``host_need`` 0) and no
    ``device_budget`` caps the chunks kept on it, a ``host_budget`` would silently cap nothing."""
    if device.type != "cpu" or placement.host_budget is None or placement.device_budget is not None or host_need:
        return
    raise ValueError(
        f"host_budget={int(placement.host_budget)} caps nothing here: the compute device is the CPU, so the chunks "
        "kept on it are in host memory too, yet only device_budget caps them (host_budget caps what the placement "
        "offloads from the compute device, and this placement offloads nothing). Give a device_budget as well (chunks "
        "then take at most device_budget + host_budget of this machine's memory), offload (offload_optim_frac), or "
        "drop host_budget."
    )


def _default_precision(device: torch.device | None) -> Precision:
    """fp32 on a CPU (16-bit matmuls are emulated there, many times slower), bf16 on a GPU that
    supports it, else fp32: fp16 needs loss scaling, so it is never picked for the user.
    ``device`` ``None``: the one the plugin picks."""
    precision: Precision = "bf16" if bf16_supported(device) else "fp32"
    log.info("chunkmem: precision=%s (the default for this device)", precision)
    return precision


_HOST_STEP: TypeAdapter[StepAfterBackward | StepDuringBackward] = TypeAdapter(HostStepConfig)


def _host_step_config(value: StepAfterBackward | StepDuringBackward | Mapping[str, Any]) -> HostStepConfig:
    if isinstance(value, StepAfterBackward | StepDuringBackward):
        return value
    if isinstance(value, Mapping):
        return _HOST_STEP.validate_python(dict(value))
    raise TypeError(
        f"host_step must be a StepDuringBackward, a StepAfterBackward or a mapping with 'when' set to "
        f"'during_backward' or 'after_backward', got {type(value).__name__}"
    )


_Config = TypeVar("_Config", bound=BaseModel)


def _config(value: _Config | Mapping[str, Any], config: type[_Config], argument: str) -> _Config:
    """A config given as itself or as a mapping of its fields (validated, naming the field)."""
    if isinstance(value, config):
        return value
    if isinstance(value, Mapping):
        return config.model_validate(dict(value))
    article = "an" if config.__name__[0] in "AEIOU" else "a"
    raise TypeError(
        f"{argument} must be {article} {config.__name__} or a mapping of its fields "
        f"({', '.join(config.model_fields)}), got {type(value).__name__}"
    )


# Chunks are flat buffers indexed by a 32-bit offset in fused kernels; far below that, a chunk much
# larger than the model is mostly padding (see ``ChunkPlugin._check_chunk_size``).
MAX_CHUNK_SIZE = 2**31 - 1
_PADDING_FACTOR = 4


class ChunkPlugin:
    """Parameters in chunks sharded over the data-parallel group, placed by a policy.

    Args:
        placement: a ``StaticPlacementConfig`` / ``AutoPlacementConfig`` or a mapping with a
            ``policy`` key (validated into one).
        precision: compute dtype, ``"fp32"``, ``"bf16"`` or ``"fp16"``; master weights, gradients
            and optimizer states are fp32 in every case. ``None`` (default): fp32 on a CPU, bf16 on
            a GPU that supports it, else fp32.
        chunk_size: elements per chunk, at most 4x the model's parameter count (beyond that a
            chunk is mostly padding); ``None`` searches the size that wastes the least padding.
        process_group: the group to shard over (default: the default group when
            ``torch.distributed`` is initialized, else world size 1), or a ``Communicator``.
        loss_scale: fp16 dynamic loss scaling settings: a ``LossScaleConfig`` or a mapping of its
            fields (validated the same way). ``None`` (default): ``LossScaleConfig()`` under fp16.
            Refused with any other precision, where nothing would read it.
        check_plans: agree a fingerprint of every placement plan across ranks before carrying it
            out, and raise on the first difference (a debugging and testing aid: one small
            collective per op). ``None`` reads the ``CHUNKMEM_CHECK_PLANS`` environment variable.
        host_step: when the optimizer step of chunks whose master is on the host runs: a
            ``StepDuringBackward`` (each chunk's step starts on a worker thread as soon as its
            gradient is final, exact by restore points; the default on CUDA) or a
            ``StepAfterBackward`` (in ``optimizer.step()``; the default on a CPU, where nothing
            can overlap), or a mapping with ``when`` set to ``during_backward`` or
            ``after_backward`` (validated into one).
        disk_dir: a directory (a fast local disk) for the disk tier: optimizer sides the
            placement puts on disk (``offload_disk_frac``, or the auto policy under a
            ``host_budget``) live in files chunkmem creates there when boosting and removes when
            the run ends. ``None`` (default): nothing is written to disk, and a placement that
            needs the disk is refused.
        gradient_accumulation: a hint that ``booster.no_sync`` will be used: micro-batches
            accumulate full gradient buffers for every chunk until the synchronised backward, so
            the placement leaves room for all of them at once where the budget allows (the auto
            policy moves optimizer sides to the host until they fit), and nothing moves to the host
            then. Without it, or where no placement can, buffers move to the host inside
            ``no_sync`` when the device needs their room (added back at the reduction).
        activations: an ``ActivationPlacement`` (or a mapping of its fields, validated into one):
            the block classes whose saved tensors are recomputed in the backward or offloaded to
            host memory, or (``auto``) placed per call under ``device_budget``, which then covers
            them too. ``None`` (default): autograd keeps what it saves, as in plain PyTorch.
        compile: a ``CompileBlocks`` (or a mapping of its fields, validated into one): the block
            classes compiled with ``torch.compile`` (``CompileBlocks()``: the model's repeated
            layers, with Inductor), each call one op for chunkmem, its chunks gathered eagerly
            before it; the rest of the model runs eagerly. ``None`` (default): nothing is compiled
            (``torch.compile`` of a boosted model is refused).
    """

    def __init__(
        self,
        placement: StaticPlacementConfig | AutoPlacementConfig | Mapping[str, Any] | None = None,
        precision: Precision | None = None,
        chunk_size: int | None = None,
        process_group: dist.ProcessGroup | Communicator | None = None,
        loss_scale: LossScaleConfig | Mapping[str, Any] | None = None,
        check_plans: bool | None = None,
        gradient_accumulation: bool = False,
        host_step: StepAfterBackward | StepDuringBackward | Mapping[str, Any] | None = None,
        disk_dir: str | os.PathLike[str] | None = None,
        activations: ActivationPlacement | Mapping[str, Any] | None = None,
        compile: CompileBlocks | Mapping[str, Any] | None = None,
    ) -> None:
        # Left unset, the precision follows the device (``on_device`` picks it again for another).
        self._precision_is_default = precision is None
        if precision is None:
            precision = _default_precision(process_group.device if isinstance(process_group, Communicator) else None)
        if precision not in _DTYPES:
            raise ValueError(f"precision must be one of {sorted(_DTYPES)}, got {precision!r}")
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0
        ):
            raise ValueError(f"chunk_size must be a positive number of elements or None, got {chunk_size!r}")
        if chunk_size is not None and chunk_size > MAX_CHUNK_SIZE:
            raise ValueError(
                f"chunk_size={chunk_size} elements is above the limit of {MAX_CHUNK_SIZE}; chunks of a few million "
                "elements are typical. Pass chunk_size=None to search the size that wastes the least padding."
            )
        self.placement = load_placement_config(placement if placement is not None else StaticPlacementConfig())
        self.precision = precision
        self.chunk_size = chunk_size
        self._process_group = process_group
        self.loss_scale = None if loss_scale is None else _config(loss_scale, LossScaleConfig, "loss_scale")
        if self.loss_scale is not None and precision != "fp16":
            # Loss scaling exists for fp16's narrow range; accepting it elsewhere would let a user
            # believe a setting is in force that nothing reads.
            chosen = " (the default for this device)" if self._precision_is_default else ""
            raise ValueError(
                f"loss_scale applies to precision='fp16' only, and precision={precision!r}{chosen} has no loss "
                "scaling: pass precision='fp16' to scale fp16 gradients, or leave loss_scale unset"
            )
        if check_plans is None:
            check_plans = os.environ.get("CHUNKMEM_CHECK_PLANS", "") not in ("", "0")
        self.check_plans = check_plans
        self.gradient_accumulation = gradient_accumulation
        self.host_step = None if host_step is None else _host_step_config(host_step)
        self.disk_dir = None if disk_dir is None else os.fspath(disk_dir)
        self.activations = None if activations is None else _config(activations, ActivationPlacement, "activations")
        self.compile = None if compile is None else _config(compile, CompileBlocks, "compile")

    def with_process_group(self, process_group: dist.ProcessGroup | Communicator | None) -> ChunkPlugin:
        """The same settings over another process group (or communicator)."""
        other = copy.copy(self)
        other._process_group = process_group
        return other

    def on_device(self, device: torch.device) -> ChunkPlugin:
        """The same settings computing on ``device`` rather than on the device the plugin would
        pick (the local GPU where there is one): what a trainer that chose the device itself needs
        (``TrainingArguments(use_cpu=True)`` on a GPU machine computes on the CPU). A plugin built
        over a ``Communicator`` on another device is refused: its device was chosen already. A
        precision left unset is the default for ``device`` (fp32 on the CPU)."""
        device = torch.device(device)
        if isinstance(self._process_group, Communicator):
            if self._process_group.device != device:
                raise NotSupportedError(
                    f"the ChunkPlugin's Communicator computes on {self._process_group.device}, but the trainer "
                    f"computes on {device}: make them agree (build the Communicator on {device}, or pass the process "
                    "group itself as process_group and let the trainer's device decide)"
                )
            return self
        other = self.with_process_group(Communicator(self._process_group, device, check_plans=self.check_plans))
        if self._precision_is_default:
            other.precision = _default_precision(device)
        return other

    @property
    def compute_dtype(self) -> torch.dtype:
        return _DTYPES[self.precision]

    def configure(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        weights: str | os.PathLike[str] | None = None,
        *,
        backing: Backing | None = None,
        frozen: Sequence[torch.nn.Module] = (),
    ) -> tuple[ChunkedModel, ChunkOptimizer | None]:
        """Build the chunked model and optimizer. Everything that can be refused (parameters,
        optimizer, budget, weights) is checked before the model's parameters are moved into
        chunks, so a refused model is left as it was (and torch's generator too).

        Parameter values come from the model itself, or, for parameters on the meta device, from
        the model's own initialisation replayed piece by piece; with ``weights`` (a safetensors
        checkpoint: a transformers model directory or a file) every parameter is read from it,
        this rank's slices only (see ``chunkmem.materialize``). ``backing`` replaces where values
        come from and where the disk tier writes (the planner's, which moves nothing).

        ``frozen``: models boosted beside ``model`` without an optimizer, in the same chunks'
        manager, runtime and budget (see ``Booster.boost``); the returned model lists them in
        ``frozen_models``. Their parameters are frozen and cast to the compute dtype here (put back
        if boosting is refused)."""
        generator_state = torch.random.default_generator.get_state()
        kept = FrozenModels(model, optimizer, frozen)
        backing = backing or TrainingBacking()
        backing.check_frozen(kept, model, weights)
        try:
            kept.freeze(self.compute_dtype)
            return self._configure(model, optimizer, weights, backing, kept)
        except BaseException:
            kept.restore()
            torch.random.default_generator.set_state(generator_state)
            raise

    def _configure(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        weights: str | os.PathLike[str] | None,
        backing: Backing,
        frozen: FrozenModels,
    ) -> tuple[ChunkedModel, ChunkOptimizer | None]:
        already_boosted(model, optimizer, model.manager if isinstance(model, ChunkedModel) else None)
        if isinstance(optimizer, ChunkOptimizer):
            raise AlreadyBoostedError(
                "this optimizer is what booster.boost returned: an optimizer is boosted once, with its model. Build a "
                f"new model and optimizer and boost them together: {the_fix(None)}"
            )
        named = list(model.named_parameters())  # each shared parameter once, first name
        if not named:
            raise ValueError("the model has no parameters to manage")
        quantized = QuantizedBase.find(model)  # bitsandbytes 4-bit layers (other formats refused)
        if quantized is not None:
            _refuse_untested_with_a_4bit_base(self.compile, frozen.models)
        if optimizer is not None:
            _check_optimizer(optimizer, named)
            if quantized is not None:
                quantized.check_optimizer(optimizer)
        # A 4-bit weight goes in chunks as its packed bytes and its scales (chunkmem.quantized).
        named = quantized.registration(named) if quantized is not None else named
        quantized_tensors = quantized.tensors if quantized is not None else []
        comm = (
            self._process_group
            if isinstance(self._process_group, Communicator)
            else Communicator(self._process_group, compute_device(), check_plans=self.check_plans)
        )
        device = comm.device
        dtype = self.compute_dtype
        every = named + [pair for one in frozen.named for pair in one]
        if self.chunk_size is not None:
            self._check_chunk_size(every, comm.world_size)
        chunk_size, trainable_chunk_size, quantized_chunk_sizes = (
            (self.chunk_size, None, None)
            if self.chunk_size is not None
            else self._search(every, comm.world_size, quantized_tensors)
        )

        # Each rank reads weights files of its own (a copy on each node): one it cannot read is an
        # error on every rank, before the boost's first collective leaves the others waiting.
        values = (
            backing.values(model, weights)
            if weights is None
            else agree(comm, "opening the weights files", lambda: backing.values(model, weights), DiskTierError)
        )
        if quantized is not None:
            values = QuantizingValues(values, quantized.layers)  # weights quantized at boost, piece by piece
        stats = Stats()
        manager = ChunkManager(comm, dtype, stats, values)
        manager.register(named, chunk_size, trainable_chunk_size, quantized_tensors, quantized_chunk_sizes)
        for one in frozen.named:  # chunks of their own: each chunk holds one model's parameters
            manager.register(one, chunk_size)
        state = optimizer_state_size(optimizer) if optimizer is not None else StateSize(0, 0)
        specs = [self._spec(chunk, comm.world_size, state, comm.layer) for chunk in manager.chunks]
        policy = make_policy(self.placement, comm.agreed_capacity())
        if frozen.models and policy.needs_profile(None) and peak_allocated(device) is None:
            # Without allocator statistics the auto policy measures its first steps under saved-tensor
            # hooks, which hand a custom autograd Function's saved parameter back as a plain tensor
            # (activations.meter): its backward reads the chunk unguarded, and a frozen model's forward
            # between forward and backward (a reference's) may have evicted it (TRL's fused LM head).
            raise NotSupportedError(
                f"frozen models beside the trained model under {type(self.placement).__name__} on {device} are not "
                "supported yet: the auto policy measures its first steps there under saved-tensor hooks, and a custom "
                "autograd Function that saves a parameter (TRL's fused LM head) would read its chunk after the frozen "
                "model's forward evicted it. Use StaticPlacementConfig(device_budget=..., offload_param_frac=..., "
                "offload_optim_frac=...), or a GPU, where the allocator measures"
            )
        # RepeatedBlocks() becomes the class it finds (the same on every rank); the user's config stays as given.
        placed = resolve_blocks(model, self.activations, comm)[0] if self.activations is not None else None
        if placed is not None and placed.auto:
            if policy.budget is None:
                raise ValueError(
                    "ActivationPlacement(auto=...) places saved activations under the device budget, but the "
                    f"placement {type(self.placement).__name__} has no device_budget: give one "
                    "(device_budget='20GiB'), or name the blocks in recompute or offload instead"
                )
            policy.cover_activations()
        compiled = find_compiled_blocks(model, self.compile, placed, comm) if self.compile is not None else []
        try:
            working_sets = self._working_sets(model, manager, quantized)
            working_sets += [s for m in frozen.models for s in self._working_sets(m, manager, None)]
            working_sets += block_working_sets(compiled, manager)
            layout = policy.layout(specs, working_sets, accumulate=self.gradient_accumulation)
        except placement_pkg.BudgetTooSmallError as error:
            raise BudgetTooSmallError.from_placement(error) from None
        except placement_pkg.HostBudgetTooSmallError as error:
            raise HostBudgetTooSmallError.from_placement(error) from None
        _check_host_budget_on_cpu(self.placement, device, policy.host_need(layout))
        layout = self._fit_to_device(layout, specs, comm)
        policy.adopt_layout(layout)
        # Frozen chunks on disk whose values lie as they are in the weights files: read there, not copied.
        in_place = manager.choose_in_place([p.shard is Location.DISK for p in layout.placements])
        disk = self._open_disk(layout, specs, comm, stats, backing, set(in_place))

        places = SidePlaces(layout, disk)  # where each chunk's optimizer side lives, decided once
        values.prepare_buffers(model)
        if quantized is not None:  # every check passed: the 4-bit layers become chunkmem's
            quantized.install(device)
        manager.close_all(places.placement, places.disk_file, in_place.get)
        buffer_dtypes = self._place_buffers(model, device, dtype)
        frozen_buffer_dtypes = [self._place_buffers(m, device, dtype) for m in frozen.models]
        runtime = ChunkRuntime(manager, policy, specs, stats)
        # Before the activation blocks: they wrap the forward they find, here the compiled blocks'.
        compiled_blocks = (
            CompiledBlocks(compiled, functools.partial(backing.compile_block, config=self.compile))
            if self.compile is not None
            else None
        )
        # Measured where an ActivationPlacement already places saved tensors: saved-tensor hooks hand a
        # custom autograd Function's saved parameter back as a plain tensor (see activations.meter).
        meter = SavedMeter(model) if placed is not None else None
        activations = (
            ActivationBlocks(
                model,
                placed,
                comm,
                stats,
                DeviceBudget(manager.ledger, runtime.transient_room, policy),
                manager.ledger,
                backing.activation_disk_dir(self.disk_dir, comm) if placed.host_budget is not None else None,
                manager.failures,
                meter=meter,
            )
            if placed is not None
            else None
        )
        scaler = DynamicLossScaler(self.loss_scale or LossScaleConfig()) if self.precision == "fp16" else None
        host_step = self.host_step or (StepDuringBackward() if comm.layer.asynchronous else StepAfterBackward())
        boosted = ChunkedModel(
            model, runtime, manager, dtype, buffer_dtypes, activations, meter, compiled_blocks, quantized
        )
        for module, dtypes in zip(frozen.models, frozen_buffer_dtypes, strict=True):
            ChunkedModel(module, runtime, manager, dtype, dtypes, beside=boosted)  # listed in boosted.frozen_models
        wrapped_optim = (
            ChunkOptimizer(optimizer, runtime, manager, boosted.progress, places, scaler, state, host_step)
            if optimizer is not None
            else None
        )
        note_boosted(manager, (optimizer, wrapped_optim))
        return boosted, wrapped_optim

    def _open_disk(
        self,
        layout: Layout,
        specs: list[ChunkSpec],
        comm: Communicator,
        stats: Stats,
        backing: Backing,
        in_place: set[int],
    ) -> SidesFile | None:
        """The disk tier's file for this rank, when the layout puts optimizer sides on disk; the
        shards of the chunks ``in_place``, read from the weights files, take no room there (its I/O
        threads read them)."""
        nbytes = layout.disk_bytes(tuple(specs))
        if nbytes == 0:
            return None
        nbytes -= sum(specs[i].shard_copy_bytes for i in in_place)
        chunks = sum(1 for p in layout.placements if p.optim is Location.DISK)
        trained = sum(
            1 for p, s in zip(layout.placements, specs, strict=True) if p.optim is Location.DISK and s.trainable
        )
        params = sum(1 for p in layout.placements if p.shard is Location.DISK)
        # Each chunk's master (a frozen chunk's values), gradient, states and 16-bit parameter shard
        # get a region of their own, each rounded up to a block; a frozen chunk has only the first,
        # none when read in place.
        nbytes += DISK_BLOCK * (chunks + 2 * trained + params - 2 * len(in_place))
        return backing.disk_file(nbytes, chunks, comm, stats, self.disk_dir)

    @staticmethod
    def _fit_to_device(layout: Layout, specs: list[ChunkSpec], comm: Communicator) -> Layout:
        """Chunks are built one at a time, so a model larger than the device still wraps: a chunk
        whose placement puts data on the device stays on the host when the device has no room for
        it (measured now, with a 2x margin). Ranks agree on the outcome: the same chunks go to the
        host everywhere, so every rank issues the same collectives."""
        free = comm.device_free()
        fits = []
        for place, spec in zip(layout.placements, specs, strict=True):
            need = place.at_rest_bytes(spec)
            fits.append(need == 0 or free > 2 * need)
            if fits[-1]:
                free -= need
        agreed = torch.tensor(fits, dtype=torch.int64, device=comm.tensor_device)
        comm.all_reduce(agreed, dist.ReduceOp.MIN)
        host = ChunkPlacement(Location.HOST, Location.HOST)
        placements = []
        for place, spec, ok in zip(layout.placements, specs, agreed.tolist(), strict=True):
            if not ok:
                log.warning(
                    "chunkmem: rank %d: no room on the device for chunk %d (%d bytes at rest); it lives on the host",
                    comm.rank,
                    spec.chunk_id,
                    place.at_rest_bytes(spec),
                )
            placements.append(place if ok else host)
        return Layout(tuple(placements))

    # --- pieces of configure ----------------------------------------------------------------
    def _check_chunk_size(self, named: list[tuple[str, torch.nn.Parameter]], world_size: int) -> None:
        """A chunk is allocated in full on every rank. One much larger than the whole model (and its
        largest parameter) is nearly all padding, a typo rather than a choice (``10**9`` for a
        million-parameter model allocates gigabytes): refuse it before allocating anything."""
        assert self.chunk_size is not None, "only an explicit chunk_size is checked"
        total = sum(p.numel() for _, p in named)
        model = max(total, max(p.numel() for _, p in named))
        if self.chunk_size > _PADDING_FACTOR * model:
            nbytes = self.chunk_size * (MASTER_DTYPE.itemsize + self.compute_dtype.itemsize)
            raise ValueError(
                f"chunk_size={self.chunk_size} elements is more than {_PADDING_FACTOR}x the whole model ({total} "
                f"parameter elements): most of every chunk would be padding, yet each is allocated in full (about "
                f"{nbytes / 2**30:.2f} GiB). Use a chunk_size of at most {model}, or chunk_size=None to search the "
                "size that wastes the least padding."
            )

    def _search(
        self, named: list[tuple[str, torch.nn.Parameter]], world_size: int, quantized: list[torch.nn.Parameter]
    ) -> tuple[int, int | None, dict[torch.dtype, int]]:
        """The chunk sizes that waste the least padding: for the model, for trainable parameters
        that all fit in less than one such chunk beside frozen ones (a LoRA adapter: a size of their
        own, ``trainable_chunk_range``; in a chunk of the model's size their gradient buffers, fp32
        masters, optimizer states and disk writes would be mostly padding; ``None``: the model's),
        and for each dtype of a quantized base's stored tensors (``quantized``: the packed bytes, and
        their scales, an eighth of their bytes, each searched over themselves)."""
        stored = {id(p) for p in quantized}
        plain = [(n, p) for n, p in named if id(p) not in stored]
        quantized_sizes: dict[torch.dtype, int] = {}
        for dtype in dict.fromkeys(p.dtype for p in quantized):
            group = [p for p in quantized if p.dtype == dtype]
            low, high = default_search_range(sum(p.numel() for p in group), 1024, dtype.itemsize)
            result = search_chunk_size(group, low, high, 1024, world_size, dtype.itemsize)
            log.info("chunkmem: searched %s (quantized, %s)", result.describe(), dtype)
            quantized_sizes[dtype] = result.chunk_size
        if not plain:
            return max(quantized_sizes.values()), None, quantized_sizes
        return (*self._search_plain(plain, world_size), quantized_sizes)

    def _search_plain(self, named: list[tuple[str, torch.nn.Parameter]], world_size: int) -> tuple[int, int | None]:
        params = [p for _, p in named]
        itemsize = self.compute_dtype.itemsize
        low, high = default_search_range(sum(p.numel() for p in params), 1024, itemsize)
        result = search_chunk_size(params, low, high, 1024, world_size, itemsize)
        trainable = [p for p in params if p.requires_grad]
        frozen = [p for p in params if not p.requires_grad]
        if not trainable or not frozen or sum(p.numel() for p in trainable) >= result.chunk_size:
            log.info("chunkmem: searched %s", result.describe())
            return result.chunk_size, None
        low, high = default_search_range(sum(p.numel() for p in frozen), 1024, itemsize)
        base = search_chunk_size(frozen, low, high, 1024, world_size, itemsize)
        low, high = trainable_chunk_range(sum(p.numel() for p in trainable), base.chunk_size, 1024, itemsize)
        adapter = search_chunk_size(trainable, low, high, 1024, world_size, itemsize)
        log.info("chunkmem: searched %s (frozen), %s (trainable)", base.describe(), adapter.describe())
        return base.chunk_size, adapter.chunk_size

    def _spec(self, chunk: Chunk, world_size: int, state: StateSize, layer: DeviceLayer) -> ChunkSpec:
        shard = chunk.layout.shard_numel
        kind = chunk.layout.shard_kind
        gathered = chunk.layout.compute_dtype  # the compute dtype; a quantized chunk's own
        # The master: fp32, or a frozen chunk's values alone in the dtype gathers read (FROZEN_VALUES, QUANTIZED).
        master = shard * kind.values_dtype(gathered).itemsize
        master_is_compute = kind.values_dtype(gathered) == gathered
        trainable = kind.has_grad
        states = state.reserved(shard, len(chunk.layout.tensors)) if trainable else 0
        grad = shard * MASTER_DTYPE.itemsize if trainable else 0
        optim_side = master + grad + states
        # What leaves host memory for disk: the states, the gradient shard, and a master gathers do
        # not read.
        disk_side = states + grad + (0 if master_is_compute else master)
        copy = shard * gathered.itemsize

        def slack(nbytes: int) -> int:  # what a pinned host buffer of nbytes holds beyond them
            return layer.host_held_bytes(nbytes) - nbytes

        return ChunkSpec(
            chunk_id=chunk.chunk_id,
            label=chunk.layout.tensors[0].name,
            trainable=chunk.layout.trainable,
            gathered_bytes=chunk.layout.gathered_bytes,
            grad_bytes=chunk.layout.grad_bytes,
            optim_side_bytes=optim_side,
            shard_copy_bytes=copy,
            gathered_is_shard=world_size == 1,
            master_is_compute=master_is_compute,
            disk_side_bytes=disk_side,
            master_pin_slack=slack(master),
            grad_pin_slack=slack(grad),
            copy_pin_slack=slack(copy),
        )

    @staticmethod
    def _working_sets(
        model: torch.nn.Module, manager: ChunkManager, quantized: QuantizedBase | None
    ) -> list[WorkingSet]:
        sets = []
        for name, module in model.named_modules():
            params = list(module.parameters(recurse=False))
            if quantized is not None:  # a 4-bit layer's op reads its scales too
                params += quantized.module_tensors(module)
            chunks = sorted({manager.info(p).chunk_id for p in params if manager.manages(p)})
            if chunks:
                sets.append(WorkingSet(name or type(model).__name__, tuple(chunks)))
        return sets

    @staticmethod
    def _place_buffers(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> dict[str, torch.dtype]:
        """Move buffers to the compute device, floating ones in the compute dtype; return their
        original dtypes by state-dict name."""
        original: dict[str, torch.dtype] = {}
        for module_name, module in model.named_modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                if buf is None:
                    continue
                original[f"{module_name}.{name}" if module_name else name] = buf.dtype
                target = dtype if buf.is_floating_point() else buf.dtype
                setattr(module, name, to_device(buf, device, target))
        return original


def _refuse_untested_with_a_4bit_base(compile: CompileBlocks | None, frozen: Sequence[torch.nn.Module]) -> None:
    """What no test has run beside a 4-bit base yet is refused, not left to chance."""
    if compile is not None:
        raise NotSupportedError(
            "compile=CompileBlocks(...) with a 4-bit (bitsandbytes) base is not supported yet: the compiled blocks "
            "would hold the 4-bit layers' dequantization, which no test covers. Boost with compile=None (the 4-bit "
            "layers run eagerly)"
        )
    if frozen:
        raise NotSupportedError(
            f"frozen models beside a model with a 4-bit (bitsandbytes) base are not supported yet ({len(frozen)} "
            "given): "
            "for a DPO/GRPO reference of a QLoRA model, use the base with the adapter off (TRL does so when "
            "ref_model is None) instead of a second model"
        )
