"""Predict a run without running it: will this model fit under this budget, and how much will it
move per step?

``plan`` boosts the model with the real chunkmem stack - the same chunk manager, placement policy,
device residency and its executor, gradient reductions and ``ChunkOptimizer`` as a training run - over a
:class:`PlanningCommunicator`: world size ``W`` seen from rank 0, every tensor on the meta device
(no memory, no arithmetic) and collectives that move nothing. It then runs a few training steps on
the example inputs, so the compute trace is recorded by the model's own forward and backward and
every placement decision is taken by the code that takes it in a real run. The counters a real run
reports (bytes gathered, moved host-to-device and back, peak accounted device bytes) are therefore
the counters of the prediction: one implementation, not a model of it.

What cannot run on the meta device is stood in for, with the same byte counts: the optimizer's
arithmetic (its state is created with the shapes and dtypes a probe of the optimizer class
showed), and fp16 loss scaling (planned as bf16: the same bytes). Non-model memory (activations),
which the auto policy measures in its first step, is measured the way it is on a CPU (bytes that
autograd saves for backward), which on a GPU leaves out the temporaries inside ops. The blocks an
``ActivationPlacement`` names are counted per call by one more forward of a meta copy of the model
(``chunkmem.activations.forecast``): their saved bytes, an offload's copies, the recomputations, and
the minimum budget of ``auto`` blocks; the ``auto`` choice needs timings a meta run cannot take
(``Plan.auto_choice``).

The device's own behaviour is planned by its type (``plan(..., device=)``): on a GPU, copies to and
from pinned host memory run while the host goes on (``PlannedAccelerator``), and what a run
decides by that (host steps during the backward by default, when gradient buffers are freed) is
decided as a GPU run decides it; on the CPU, as the CPU does.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from chunkmem.placement import ActivationPlacement, RepeatedBlocks
from chunkmem.placement.activation_plan import activation_minimum
from chunkmem.placement.activations import BlockPlacement
from chunkmem.placement.policy import format_bytes

from ..activations.detect import RepeatedBlock, resolve_blocks
from ..activations.forecast import BlockForecast, forecast
from ..boosted.compile_config import CompileBlocks
from ..boosted.frozen_models import FrozenModels
from ..boosted.model import ChunkedModel
from ..chunks.param_values import LiveValues, ParamValues
from ..device import PLANNED_DEVICES, DeviceLayer
from ..device.layer import Stream
from ..device.moves import to_device
from ..errors import BudgetExceededError, BudgetTooSmallError, ChunkmemError, HostBudgetTooSmallError
from ..optim import ChunkOptimizer
from ..optim.probe import hyperparameters
from ..plugin import ChunkPlugin
from ..quantized import QuantizedBase
from ..ranks.comm import Communicator
from ..tiers.disk import PlannedDiskFile, SidesFile
from ..usage.stats import Stats
from .meta_cache import MetaResults
from .plan_fixes import FixKind, PlanFix, describe_all
from .plan_report import Plan, StepCounters

__all__ = ["Plan", "PlanningBacking", "PlanningCommunicator", "StepCounters", "plan"]

log = logging.getLogger("chunkmem")
T = TypeVar("T")
_META = torch.device("meta")
_CPU = torch.device("cpu")


class PlannedAccelerator(DeviceLayer):
    """The device a plan is for: an accelerator whose copies to and from pinned host memory return
    before the bytes have moved (a GPU). What a run decides by that is decided as on a GPU: host
    optimizer steps run during the backward by default, and a reduced gradient slot leaves for a
    host master while the backward goes on, its device buffer freed when the reductions are waited
    for. On the meta device nothing moves, so every stream, event and wait is nothing."""

    asynchronous = True

    def __init__(self) -> None:
        super().__init__(_META)
        self._stream = object()  # the copy stream: a handle the transfers hold, never run on

    def new_stream(self) -> Stream:
        return self._stream

    @property
    def pins(self) -> bool:
        return True  # as on a GPU: host buffers that cross to the device are pinned, and kept

    def host_empty(self, numel: int, dtype: torch.dtype, host: torch.device, pinned: bool = True) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=host)  # on the meta device: pinned in name only

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return True  # a run's host buffers that cross to the device are pinned


class PlanningCommunicator(Communicator):
    """Rank 0 of ``world_size`` ranks with nothing behind it: tensors on the meta device,
    collectives that move nothing (every rank holds what this one holds, which is what chunkmem
    keeps true in a real run), and a device of ``capacity`` bytes of type ``device``: a GPU
    (``PlannedAccelerator``) or the CPU (synchronous)."""

    def __init__(self, world_size: int, capacity: int, device: str = PLANNED_DEVICES[0]) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if capacity <= 0:
            raise ValueError(f"device capacity must be a positive byte count, got {capacity}")
        if device not in PLANNED_DEVICES:
            raise ValueError(f"a plan is for a device of type {' or '.join(PLANNED_DEVICES)}, got {device!r}")
        super().__init__(None, _META, world_size=world_size)
        self._capacity = capacity
        self._planned = PlannedAccelerator() if device != "cpu" else DeviceLayer(_META)

    @property
    def layer(self) -> DeviceLayer:
        return self._planned

    @property
    def host_device(self) -> torch.device:
        return _META

    @property
    def tensor_device(self) -> torch.device:
        return _CPU

    def agreed_capacity(self) -> int:
        return self._capacity

    def device_free(self) -> int:
        return self._capacity

    def all_gather(self, output: torch.Tensor, local: torch.Tensor, async_op: bool, what: str = "gather") -> None:
        return None

    def reduce_scatter_sum(self, output: torch.Tensor, full: torch.Tensor, async_op: bool, what: str) -> None:
        return None

    def wait(self, work: Any, what: str) -> None:
        return None

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        if op == dist.ReduceOp.SUM and self._world_size > 1:
            tensor.mul_(self._world_size)

    def all_gather_tensors(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor.clone() for _ in range(self._world_size)]

    def reduce_to_first(self, tensor: torch.Tensor) -> None:
        if self._world_size > 1:
            tensor.mul_(self._world_size)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [copy.deepcopy(obj) for _ in range(self._world_size)]

    def barrier(self) -> None:
        return None


class _MetaValues(LiveValues):
    """A plan's parameter values: the meta parameters themselves (nothing is computed or read)."""

    def check(self, param: torch.nn.Parameter, where: str) -> None:
        return None  # every parameter of a plan is on the meta device


class PlanningBacking:
    """Where a plan's data comes from: the meta parameters as they are, and a disk file that
    counts what a run would read and write (``chunkmem.boosted.backing``)."""

    def values(self, model: torch.nn.Module, weights: Any) -> ParamValues:
        return _MetaValues()

    def disk_file(self, nbytes: int, chunks: int, comm: Communicator, stats: Stats, disk_dir: str | None) -> SidesFile:
        return PlannedDiskFile(nbytes, stats)

    def activation_disk_dir(self, disk_dir: str | None, comm: Communicator) -> str:
        """A plan writes no activations (its tensors are meta): any directory will do, none is checked."""
        return disk_dir or "(planned)"

    def compile_block(self, forward: Callable[..., Any], config: CompileBlocks) -> Callable[..., Any]:
        """The function itself: a meta run computes nothing to compile, and the chunk traffic it counts
        is the compiled run's (one op per block call either way)."""
        return forward

    def check_frozen(self, frozen: FrozenModels, trained: torch.nn.Module, weights: Any) -> None:
        """A plan reads no values: its frozen models are on the meta device, as its trained model is."""
        return None


def _meta_inputs(example_inputs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: to_device(v, _META) if isinstance(v, torch.Tensor) else v for k, v in example_inputs.items()}


def _loss(output: Any) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor):
        return output.float().sum()
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0].float().sum()
    raise TypeError(
        f"plan: the model returned {type(output).__name__}; chunkmem.plan takes output.loss when there is one, "
        "else sums the output tensor"
    )


class _StateTemplate:
    """The state an optimizer class creates for a parameter, learned from one step on a probe:
    per key, whether it is shaped like the parameter and its dtype (else its shape)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._by_group: list[list[tuple[str, bool, torch.dtype, torch.Size]]] = []
        for group in optimizer.param_groups:
            probe = torch.zeros(8, requires_grad=True)
            trial = type(optimizer)([probe], **hyperparameters(optimizer, group))
            probe.grad = torch.full_like(probe, 1e-3)
            trial.step()
            entries = []
            for key, value in trial.state[probe].items():
                if isinstance(value, torch.Tensor):
                    entries.append((key, value.shape == probe.shape, value.dtype, value.shape))
            self._by_group.append(entries)

    def emulate_step(self, optimizer: torch.optim.Optimizer) -> None:
        """What ``optimizer.step`` leaves behind on the meta device: state for every parameter
        with a gradient (values are not computed)."""
        for group, entries in zip(optimizer.param_groups, self._by_group, strict=True):
            for p in group["params"]:
                if p.grad is None or optimizer.state.get(p):
                    continue
                optimizer.state[p] = {
                    key: torch.zeros(p.shape if like else shape, dtype=dtype, device=_META)
                    for key, like, dtype, shape in entries
                }


def _planned_plugin(plugin: ChunkPlugin, comm: PlanningCommunicator, budget: int | None) -> ChunkPlugin:
    planned = plugin.with_process_group(comm)
    if planned.precision == "fp16":
        planned.precision = "bf16"  # loss scaling does arithmetic; the bytes are bf16's
    planned.check_plans = False
    if budget is not None:
        planned.placement = planned.placement.model_copy(update={"device_budget": budget})
    return planned


@dataclass(frozen=True)
class _Target:
    """What a plan is for: ``world_size`` ranks, each with ``capacity`` bytes of a ``device``."""

    world_size: int
    capacity: int
    device: str

    def communicator(self) -> PlanningCommunicator:
        return PlanningCommunicator(self.world_size, self.capacity, self.device)


def _run(
    model: torch.nn.Module,
    plugin: ChunkPlugin,
    make_optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
    inputs: Mapping[str, Any],
    target: _Target,
    steps: int,
    budget: int | None,
    grad_accum: int = 1,
    frozen: Sequence[torch.nn.Module] = (),
) -> tuple[ChunkedModel, list[StepCounters]]:
    """Boost a copy of the meta model (and of each frozen model beside it) over a planning
    communicator and train ``steps`` steps of ``grad_accum`` micro-batches each (all but the last
    under ``no_sync``); before each micro-batch's forward, each frozen model's forward under
    ``no_grad`` on the inputs without ``labels``."""
    comm = target.communicator()
    # One copy of all the models together: a model handed twice, or parameters shared between them,
    # stay so in the copy, and the boost refuses them as it refuses a run's. (The memo: bitsandbytes'
    # 4-bit weights on the meta device cannot be deep-copied.)
    memo: dict[int, Any] = {}
    for one in (model, *frozen):
        for key, copied in QuantizedBase.deepcopy_memo(one).items():
            memo.setdefault(key, copied)
    local, *beside = copy.deepcopy((model, *frozen), memo)
    optimizer = make_optimizer(local.parameters())
    template = _StateTemplate(optimizer)
    optimizer.step = lambda closure=None: template.emulate_step(optimizer)  # type: ignore[method-assign]
    chunked, chunk_optimizer = _planned_plugin(plugin, comm, budget).configure(
        local, optimizer, backing=PlanningBacking(), frozen=beside
    )
    assert isinstance(chunk_optimizer, ChunkOptimizer), "configure returns the optimizer it was given, wrapped"
    ledger = chunked.manager.ledger
    counters = []
    forward_reads = [0]
    unlabelled = {k: v for k, v in inputs.items() if k != "labels"}

    def forward() -> Any:  # counts the parameter shards read from disk while it runs
        start = chunked.stats().disk_param_read_bytes
        with torch.no_grad():
            for beside in chunked.frozen_models:
                beside(**unlabelled)
        output = chunked(**inputs)
        forward_reads[0] += chunked.stats().disk_param_read_bytes - start
        return output

    for _ in range(steps):
        before = chunked.stats()
        ledger.reset_peak()
        forward_reads[0] = 0
        with chunked.runtime.no_sync():
            for _ in range(grad_accum - 1):
                chunk_optimizer.backward(_loss(forward()))
        chunk_optimizer.backward(_loss(forward()))
        chunk_optimizer.step()
        chunk_optimizer.zero_grad()
        step = StepCounters.between(before, chunked.stats(), ledger.peak_device_bytes, ledger.peak_host_bytes)
        counters.append(dataclasses.replace(step, disk_param_forward_read_bytes=forward_reads[0]))
    return chunked, counters


def _with_host_budget(plugin: ChunkPlugin, host_budget: int | None) -> ChunkPlugin:
    other = copy.copy(plugin)
    other.placement = plugin.placement.model_copy(update={"host_budget": host_budget})
    return other


def _minimum_budget(
    model: torch.nn.Module,
    plugin: ChunkPlugin,
    make_optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
    inputs: Mapping[str, Any],
    target: _Target,
    grad_accum: int,
    frozen: Sequence[torch.nn.Module],
) -> int:
    """The smallest budget a run accepts: what the placement needs under a budget of one byte,
    raised until two training steps run (ops overlap where a working set alone does not say).
    Without the host budget: it moves optimizer sides between host and disk, never onto the
    device, and a one-byte device budget would leave more on the host than the real one."""
    plugin = _with_host_budget(plugin, None)
    try:
        _run(model, plugin, make_optimizer, inputs, target, 0, 1, frozen=frozen)
    except BudgetTooSmallError as refused:
        minimum = refused.minimum
    else:  # pragma: no cover - a one-byte budget holds nothing
        return 1
    for _ in range(8):
        try:
            _run(model, plugin, make_optimizer, inputs, target, 2, minimum, grad_accum, frozen)
            return minimum
        except BudgetTooSmallError as refused:
            minimum = max(minimum + 1, refused.minimum)
        except BudgetExceededError as exceeded:
            if exceeded.minimum is None or exceeded.minimum <= minimum:
                raise
            minimum = exceeded.minimum
    return minimum


def _activation_calls(
    model: torch.nn.Module, plugin: ChunkPlugin, inputs: Mapping[str, Any], layer: DeviceLayer
) -> tuple[tuple[BlockForecast, ...], RepeatedBlock | None]:
    """The named blocks' calls in one forward of a meta copy of ``model`` in the compute dtype (the
    dtype its parameters have when a run computes), with their host copies as ``layer`` (the device
    planned for) holds them, and the class a ``RepeatedBlocks()`` found."""
    if plugin.activations is None:
        return (), None
    local = copy.deepcopy(model).to(plugin.compute_dtype)
    config, found = resolve_blocks(local, plugin.activations)
    with torch.enable_grad():
        return forecast(local, config, lambda: local(**inputs), layer.host_held_bytes), found


def _capacity_fixes(
    model: torch.nn.Module,
    plugin: ChunkPlugin,
    inputs: Mapping[str, Any],
    non_model: int,
    capacity: int,
    minimum: int,
    budget: int | None,
) -> list[PlanFix]:
    """What would bring chunk data and activations within the device's capacity: recomputing the
    model's repeated layers (where no activation placement is given: estimated from their calls'
    saved bytes, all but one call's leave the device), a device budget that leaves room for the
    activations (where the placement's minimum allows one), a smaller micro-batch."""
    fixes = []
    if plugin.activations is None:
        local = copy.deepcopy(model).to(plugin.compute_dtype)
        try:
            config, found = resolve_blocks(local, ActivationPlacement(recompute=[RepeatedBlocks()]))
        except ValueError:  # no repeated layers: nothing to name
            found = None
        if found is not None:
            with torch.enable_grad():
                saved = [call.saved_bytes for call in forecast(local, config, lambda: local(**inputs))]
            spared = sum(saved) - max(saved, default=0)
            detail = f"{format_bytes(spared)} of saved activations leave the device: all but one of its calls'"
            fixes.append(PlanFix(FixKind.RECOMPUTE_BLOCKS, found.cls.__name__, detail))
    room = capacity - non_model
    if minimum <= room and (budget is None or budget > room):
        fixes.append(PlanFix(FixKind.LOWER_DEVICE_BUDGET, room))
    fixes.append(PlanFix(FixKind.SMALLER_BATCH))
    return fixes


def _activation_host_budget(plugin: ChunkPlugin) -> int | None:
    activations = plugin.activations
    return None if activations is None or activations.host_budget is None else int(activations.host_budget)


def _auto_minimum(calls: tuple[BlockForecast, ...], model_need: int) -> int | None:
    """The refusal's minimum with ``auto`` blocks: model data's need and the largest call's saved
    bytes (the stretches outside the blocks too, with ``offload_outside``: calls of the plan), and
    the small storages the stretches leave on the device."""
    if not any(c.how is BlockPlacement.AUTO for c in calls):
        return None
    placed = [c for c in calls if c.how in (BlockPlacement.AUTO, BlockPlacement.OUTSIDE)]
    outside_small = sum(c.small_bytes for c in placed if c.how is BlockPlacement.OUTSIDE)
    return activation_minimum([c.saved_bytes for c in placed], model_need, outside_small)


def plan(
    model: torch.nn.Module,
    plugin: ChunkPlugin,
    example_inputs: Mapping[str, Any],
    world_size: int = 1,
    *,
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
    device_capacity: int | None = None,
    bandwidth: float = 25e9,
    disk_bandwidth: float = 2e9,
    steps: int = 3,
    grad_accum: int = 1,
    device: str = PLANNED_DEVICES[0],
    frozen: Sequence[torch.nn.Module] = (),
) -> Plan:
    """Predict a training run of ``model`` (on the meta device; nothing is allocated) boosted with
    ``plugin`` at ``world_size`` ranks, each step a forward on ``example_inputs`` (the keyword
    arguments of one rank's micro-batch), backward of ``output.loss`` (or the output summed) and an
    optimizer step (``optimizer(params)``, AdamW by default). ``device_capacity`` is what each
    rank may use of its device (default 80 GiB, an H100's); ``bandwidth`` the
    host-device copy speed for the modelled transfer time, ``disk_bandwidth`` the disk's for the
    disk tier's (the defaults: a PCIe 4 x16 link, an NVMe drive). With ``grad_accum`` N, a step is
    N micro-batches, all but the last under ``no_sync`` (as ``booster.no_sync`` runs them), then the
    optimizer step; pass the ``ChunkPlugin(gradient_accumulation=...)`` the run will use. ``device``
    is the type of device the run computes on, one of ``PLANNED_DEVICES`` (a GPU's, then the CPU's):
    what a run decides by whether its copies are asynchronous is decided as there (on a GPU host
    masters step during the backward by default, and gradient buffers of chunks whose optimizer side
    is on disk are freed as their early step reads them, which lowers the peak). A host budget below
    what the placement needs is reported as not fitting (``why_not``), planned at the minimum, as a
    device budget is. ``frozen``: models boosted beside ``model`` (``booster.boost(..., frozen=...)``,
    on the meta device too), each run forward under ``no_grad`` on ``example_inputs`` without
    ``labels`` before each of the trained model's forwards, as a DPO step computes its reference's
    log-probabilities first; the plan counts every model's chunks (``parameters`` is their sum). See
    the module docstring."""
    if steps < 2:
        raise ValueError(f"plan: steps must be at least 2 (the first records the trace), got {steps}")
    if device not in PLANNED_DEVICES:
        raise ValueError(f"plan: device must be {' or '.join(map(repr, PLANNED_DEVICES))}, got {device!r}")
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"plan: grad_accum must be a whole number of micro-batches of at least 1, got {grad_accum!r}")
    for name, speed in (("bandwidth", bandwidth), ("disk_bandwidth", disk_bandwidth)):
        if not speed > 0 or speed == float("inf"):
            raise ValueError(f"plan: {name} must be a positive, finite number of bytes per second, got {speed!r}")
    for what, one in [("the model", model), *((f"frozen model {i}", m) for i, m in enumerate(frozen))]:
        if any(p.device.type != "meta" for p in one.parameters()):
            raise ValueError(
                f"plan: build {what} on the meta device (with torch.device('meta'): model = ...); a model that "
                "holds real weights can be measured by training it"
            )
    make_optimizer = optimizer or (lambda params: torch.optim.AdamW(params))
    budget = plugin.placement.device_budget
    budget = None if budget is None else int(budget)
    capacity = device_capacity or 80 * 2**30
    target = _Target(world_size, capacity, device)
    inputs = _meta_inputs(example_inputs)
    quiet = log.level
    log.setLevel(logging.ERROR)  # the search runs at budgets nobody asked for: say nothing of them
    results = MetaResults()  # every pass below computes the shapes of the first again
    try:
        with results:
            minimum = _minimum_budget(model, plugin, make_optimizer, inputs, target, grad_accum, frozen)
    finally:
        log.setLevel(quiet)
    refusals: list[str] = []
    fixes: list[PlanFix] = []
    planned_budget = budget
    for _ in range(3):  # a host budget and a device budget may each be refused once
        try:
            with results:
                chunked, counters = _run(
                    model, plugin, make_optimizer, inputs, target, steps, planned_budget, grad_accum, frozen
                )
            break
        except HostBudgetTooSmallError as refused:
            # What it would need: plan at the minimum, and say it does not fit.
            refusals.append(str(refused))
            fixes += [PlanFix(FixKind.RAISE_HOST_BUDGET, refused.minimum), PlanFix(FixKind.RAISE_DEVICE_BUDGET)]
            plugin = _with_host_budget(plugin, refused.minimum)
        except (BudgetTooSmallError, BudgetExceededError) as refused:
            refusals.append(str(refused))
            fixes.insert(0, PlanFix(FixKind.RAISE_DEVICE_BUDGET, minimum))
            fixes.append(PlanFix(FixKind.SMALLER_CHUNK_SIZE))
            planned_budget = minimum
    else:  # pragma: no cover - each budget is raised to its minimum once
        raise ChunkmemError(f"plan: no placement runs: {'; '.join(refusals)}")
    why_not = "; ".join(refusals)
    last = counters[-1]
    peak = max(c.peak_device_bytes for c in counters)
    policy = chunked.runtime.policy
    profile = getattr(policy, "non_model_profile", ())
    non_model = max(profile, default=0)
    if not why_not and peak + non_model > capacity:
        fixes = _capacity_fixes(model, plugin, inputs, non_model, capacity, minimum, budget)
        why_not = (
            f"chunk data peaks at {format_bytes(peak)} and activations at {format_bytes(non_model)}, more than the "
            f"{format_bytes(capacity)} device capacity. {describe_all(tuple(fixes))}"
        )
    calls, repeated = _activation_calls(model, plugin, inputs, target.communicator().layer)
    model_need = policy.placement_need().minimum
    auto_minimum = _auto_minimum(calls, model_need)
    if not why_not and auto_minimum is not None and budget is not None and budget < auto_minimum:
        fixes = [PlanFix(FixKind.RAISE_DEVICE_BUDGET, auto_minimum), PlanFix(FixKind.SMALLER_BATCH)]
        why_not = (
            f"device_budget={budget} ({format_bytes(budget)}) cannot hold model data ({format_bytes(model_need)}) and "
            f"the saved activations of the largest auto block call; it needs at least {auto_minimum} "
            f"({format_bytes(auto_minimum)}). {describe_all(tuple(fixes))}"
        )
    manager = chunked.manager
    return Plan(
        fits=not why_not,
        why_not=why_not,
        world_size=world_size,
        device_budget=budget,
        device_capacity=capacity,
        min_device_budget=minimum,
        peak_device_bytes=peak,
        non_model_bytes=non_model,
        host_bytes_per_rank=manager.ledger.host_bytes,
        peak_host_bytes=max(c.peak_host_bytes for c in counters),
        min_host_budget=policy.host_need(),
        disk_bytes_per_rank=manager.ledger.disk_bytes,
        disk_read_bytes_per_step=last.disk_read_bytes,
        disk_write_bytes_per_step=last.disk_write_bytes,
        h2d_bytes_per_step=last.h2d_bytes,
        d2h_bytes_per_step=last.d2h_bytes,
        allgather_bytes_per_step=last.allgather_bytes,
        reduce_scatter_bytes_per_step=last.reduce_scatter_bytes,
        gathers_per_step=last.gathers,
        prefetches_per_step=last.prefetches,
        chunks=len(manager.chunks),
        chunk_size=max(c.layout.capacity for c in manager.chunks),
        parameters=sum(info.numel for info in manager.infos),
        grad_accum=grad_accum,
        bandwidth=bandwidth,
        disk_bandwidth=disk_bandwidth,
        steps=tuple(counters),
        activation_calls=calls,
        repeated_block=repeated.describe() if repeated is not None else None,
        activation_min_device_budget=auto_minimum,
        model_need_bytes=model_need,
        activation_max_prefetch=plugin.activations.max_prefetch if plugin.activations is not None else 0,
        activation_host_budget=_activation_host_budget(plugin),
        fixes=tuple(fixes) if why_not else (),
    )
