"""Training scenarios run on the simulated asynchronous device (``chunkmem.device.simulated``) and
on the synchronous CPU: each returns what the run ends with (losses and the full state), so a
test can require the two runs equal bit for bit, and a missing wait (an unordered access the
simulated device raises for, or changed numbers) fails it."""

from __future__ import annotations

import dataclasses
import gc
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from chunkmem import (
    Booster,
    BudgetTooSmallError,
    ChunkedModel,
    ChunkOptimizer,
    ChunkPlugin,
    DiskTierError,
    StepAfterBackward,
    StepDuringBackward,
)
from chunkmem.device import CollectiveWaits
from chunkmem.device.simulated import SimulatedDeviceError, simulated_device
from chunkmem.optim.host_kernels import HostKernels
from chunkmem.placement import ActivationPlacement, AutoPlacementConfig, StaticPlacementConfig
from chunkmem.ranks.comm import Communicator
from chunkmem.tiers import disk
from chunkmem.tiers.disk import DiskFile
from support.disk_faults import parameter_writes_fail
from support.models import adamw_two_groups, batches, boost, gpt2, lm_loss, train_accumulating, train_chunked
from support.simulated_waits import Site, without

OFFLOAD = {"offload_optim_frac": 1.0, "offload_param_frac": 1.0}


def _boost(model: torch.nn.Module, **options: Any) -> tuple[ChunkedModel, ChunkOptimizer, Booster]:
    """Boosted onto the CPU whatever GPU the machine has: the simulated device is the CPU, and so
    must be the synchronous run it is compared with bit for bit (on a GPU machine the plugin's own
    choice would be the GPU, where the simulated device does nothing)."""
    cpu = Communicator(None, torch.device("cpu"), check_plans=True)
    return boost(model, adamw_two_groups, process_group=cpu, **options)


def _offload(prefetch: int, **extra: Any) -> StaticPlacementConfig:
    return StaticPlacementConfig(**{**OFFLOAD, **extra}, max_prefetch=prefetch)


def _train(rank: int, world_size: int, placement: Any, precision: str = "fp32", **options: Any) -> dict[str, Any]:
    """Two steps: the first records the trace, the second follows it (prefetch, eviction by next
    use); a third would run the second's path again (every wait is still caught with two)."""
    clip = options.pop("clip", None)
    chunked, optimizer, booster = _boost(gpt2(), precision=precision, chunk_size=6_000, placement=placement, **options)
    losses = train_chunked(chunked, optimizer, booster, batches(2), rank, world_size, clip=clip)
    return {"losses": losses, "state": chunked.state_dict()}


def _accumulate(rank: int, world_size: int, placement: Any, no_sync: bool) -> dict[str, Any]:
    """Two micro-batches a step, the first inside ``no_sync`` when asked (a spill to the host
    where the budget is small, folded back by the reduction); two steps, as in ``_train``."""
    chunked, optimizer, booster = _boost(gpt2(), precision="fp32", chunk_size=10_000, placement=placement)
    losses: list[Any] = train_accumulating(chunked, optimizer, booster, batches(2, batch=8), rank, world_size, no_sync)
    return {"losses": [*losses, chunked.stats().grad_spills], "state": chunked.state_dict()}


def _spilling(budget: int) -> StaticPlacementConfig:
    return StaticPlacementConfig(device_budget=budget, max_prefetch=1, offload_optim_frac=1)


def _smallest(placement: Callable[[int], Any]) -> Any:
    """``placement`` at the smallest budget boost accepts: inside ``no_sync`` gradient buffers
    then go to the host and are folded back by the reduction."""
    try:
        _boost(gpt2(), precision="fp32", chunk_size=10_000, placement=placement(1))
    except BudgetTooSmallError as refused:
        return placement(refused.minimum)
    raise AssertionError("a budget of one byte was accepted")


def _disk(rank: int, world_size: int) -> dict[str, Any]:
    placement = StaticPlacementConfig(offload_optim_frac=1.0, offload_disk_frac=1.0, max_prefetch=2)
    with tempfile.TemporaryDirectory() as scratch:
        return _train(rank, world_size, placement, "bf16", disk_dir=Path(scratch))


@contextmanager
def disk_io_seen() -> Iterator[None]:
    """The disk tier's I/O threads move bytes with ``pwritev`` / ``preadv`` (or a reader of the
    user's weights files) through ``ctypes``, which no ``TorchDispatchMode`` sees: within the block
    each transfer is also a torch op on the I/O thread, on its tensor (one element: the checks are
    per storage) and on a tensor standing for its region of the file, so the simulated device checks
    the I/O tasks' accesses against everyone else's: a write to disk of a piece before the copy into
    it landed, a read into a piece a copy still reads, a read of a region before the write to it is
    waited for, a file closed under a transfer."""
    transfer, read_with, close = DiskFile._transfer, DiskFile.read_with, disk._close_file
    regions: dict[tuple[Any, int], torch.Tensor] = {}
    lock = threading.Lock()

    def touch(tensor: torch.Tensor, write: bool) -> None:
        if tensor.numel():
            first = tensor.view(-1)[:1]
            _ = first.zero_() if write else first.clone()

    def region(file: Any, offset: int) -> torch.Tensor:
        with lock:
            key = (id(file) if isinstance(file, DiskFile) else file, offset)
            if key not in regions:
                with _disable_current_modes():  # bookkeeping: not an access of the task's
                    regions[key] = torch.zeros(1)
            return regions[key]

    def seen_transfer(file: DiskFile, tensor: torch.Tensor, offset: int, write: bool, then: Any, param: bool) -> None:
        touch(tensor, write=not write)
        touch(region(file, offset), write=write)
        touch(region(file._fd, -1), write=False)  # the file stays open under the transfer
        transfer(file, tensor, offset, write, then, param)

    def seen_close(fd: int, pool: Any) -> None:
        close(fd, pool)  # joins the I/O threads, then closes
        touch(region(fd, -1), write=True)

    def seen_read_with(file: DiskFile, tensor: torch.Tensor, fill: Callable[[memoryview], int]) -> Any:
        def filled(view: memoryview) -> int:
            touch(tensor, write=True)
            return fill(view)

        return read_with(file, tensor, filled)

    DiskFile._transfer = seen_transfer  # type: ignore[method-assign]
    DiskFile.read_with = seen_read_with  # type: ignore[method-assign]
    disk._close_file = seen_close
    try:
        yield
    finally:
        DiskFile._transfer = transfer  # type: ignore[method-assign]
        DiskFile.read_with = read_with  # type: ignore[method-assign]
        disk._close_file = close


def _early_disk(rank: int, world_size: int) -> dict[str, Any]:
    """Half the chunks' optimizer states and gradients on disk (the disk tier's I/O threads), the
    other half's host steps during the backward (the early-step worker: chunks with sides on disk
    step after it): at two ranks, the host threads beside the collectives."""
    placement = StaticPlacementConfig(offload_optim_frac=1.0, offload_disk_frac=0.5, max_prefetch=2)
    with tempfile.TemporaryDirectory() as scratch:
        return _train(rank, world_size, placement, host_step=StepDuringBackward(), disk_dir=Path(scratch))


def _activation_disk(rank: int, world_size: int) -> dict[str, Any]:
    """Offloaded activations beyond a host budget go to disk through the staging window (pieces of
    8 KiB: a storage takes several, read back into the two pieces in turn)."""
    activations = ActivationPlacement(offload=["GPT2Block"], host_budget=65_536)
    with tempfile.TemporaryDirectory() as scratch:
        return _train(rank, world_size, StaticPlacementConfig(), activations=activations, disk_dir=Path(scratch))


def _param_disk_placement() -> StaticPlacementConfig:
    return StaticPlacementConfig(
        offload_optim_frac=1.0,
        offload_param_frac=1.0,
        offload_disk_frac=1.0,
        offload_param_disk_frac=1.0,
        max_prefetch=2,
    )


def _param_disk(rank: int, world_size: int) -> dict[str, Any]:
    """Parameter shards on disk too: every gather reads its shard into a staging buffer."""
    with tempfile.TemporaryDirectory() as scratch:
        return _train(rank, world_size, _param_disk_placement(), "bf16", disk_dir=Path(scratch))


def _param_disk_full(rank: int, world_size: int) -> dict[str, Any]:
    """Parameter shards on disk, and the second step's writes of them fail (a full disk): the
    shards stay in host memory and a forward without gradients copies them from there; then a
    checkpoint saved after the first step is loaded, which writes the shards again and gives
    those buffers back with no step (and its waits for gradient copies) between."""
    losses: list[Any] = []
    data = batches(3)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch)
        chunked, optimizer, booster = _boost(
            gpt2(), precision="bf16", chunk_size=6_000, placement=_param_disk_placement(), disk_dir=path
        )
        for step, ids in enumerate(data[:2]):
            loss = lm_loss(chunked, ids)
            booster.backward(loss, optimizer)
            losses.append(loss.item())
            try:
                with parameter_writes_fail() if step == 1 else nullcontext():
                    optimizer.step()
            except DiskTierError as error:
                losses.append(type(error).__name__)
            optimizer.zero_grad()
            if step == 0:
                booster.save_model(chunked, path / "model.pt")
                booster.save_optimizer(optimizer, path / "optim.pt")
        with torch.no_grad():
            losses.append(lm_loss(chunked, data[0]).item())
        booster.load_model(chunked, path / "model.pt")
        booster.load_optimizer(optimizer, path / "optim.pt")
        losses += train_chunked(chunked, optimizer, booster, data[2:], rank, world_size)
        return {"losses": losses, "state": chunked.state_dict()}


def _checkpoint(rank: int, world_size: int, precision: str, evaluate: bool) -> dict[str, Any]:
    """Saved after two steps, loaded into a second boosted model mid-training (after a step of
    its own, or with ``evaluate`` right after a forward without gradients: no copy back to the
    host stands between the gathers that read host shards and the load that rewrites them),
    trained on."""
    chunked, optimizer, booster = _boost(gpt2(), precision=precision, chunk_size=6_000, placement=_offload(2))
    data = batches(4)
    train_chunked(chunked, optimizer, booster, data[:2], rank, world_size)
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch)
        booster.save_model(chunked, path / "model.pt")
        booster.save_optimizer(optimizer, path / "optim.pt")
        other, other_optimizer, other_booster = _boost(
            gpt2(seed=5), precision=precision, chunk_size=6_000, placement=_offload(2)
        )
        if evaluate:
            with torch.no_grad():
                lm_loss(other, data[0])
        else:
            train_chunked(other, other_optimizer, other_booster, data[:1], rank, world_size)
        other_booster.load_model(other, path / "model.pt")
        other_booster.load_optimizer(other_optimizer, path / "optim.pt")
    losses = train_chunked(other, other_optimizer, other_booster, data[2:], rank, world_size)
    return {"losses": losses, "state": other.state_dict()}


def _host_write_after_copy(rank: int, world_size: int) -> dict[str, Any]:
    """``before_host_write``'s own contract on its own: the host writes a buffer a copy wrote into
    (a master moved to the host, then stepped there), with no read between (in training some read
    always comes first and waits already: this is the guard callers such as ``prepare_host_write``
    rely on when none does)."""
    from chunkmem.device import device_layer
    from chunkmem.tiers.transfers import Direction, HostTransfers
    from chunkmem.usage.stats import Stats

    transfers = HostTransfers(Stats(), device_layer(torch.device("cpu")))
    host = transfers.staging(1_000, torch.float32, torch.device("cpu"))
    transfers.copy(host, torch.arange(1_000.0), Direction.TO_HOST)
    transfers.before_host_write(host)
    host.mul_(2.0)
    transfers.before_host_read(host)
    return {"losses": [], "state": {"buffer": host.clone()}}


def _early_checkpoint(rank: int, world_size: int) -> dict[str, Any]:
    """Host steps during the backward, and a checkpoint saved between a backward and its step:
    the save puts the pending early steps back first (and the step then takes them again)."""
    chunked, optimizer, booster = _boost(
        gpt2(), precision="fp32", chunk_size=6_000, placement=_offload(2), host_step=StepDuringBackward()
    )
    losses: list[Any] = []
    with tempfile.TemporaryDirectory() as scratch:
        for step, ids in enumerate(batches(3)):
            loss = lm_loss(chunked, ids.chunk(world_size)[rank])
            booster.backward(loss, optimizer)
            if step == 1:
                booster.save_model(chunked, Path(scratch) / "model.pt")
                booster.save_optimizer(optimizer, Path(scratch) / "optim.pt")
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
    return {"losses": losses, "state": chunked.state_dict()}


def _evaluate_between(rank: int, world_size: int) -> dict[str, Any]:
    """A forward without gradients between training steps, with prefetch: the chunks prefetched
    for a backward that never comes are released while their gathers may be in flight."""
    chunked, optimizer, booster = _boost(gpt2(), precision="bf16", chunk_size=6_000, placement=_offload(3))
    data = batches(3)
    losses = train_chunked(chunked, optimizer, booster, data[:2], rank, world_size)
    with torch.no_grad():
        losses.append(float(lm_loss(chunked, data[0].chunk(world_size)[rank])))
    losses += train_chunked(chunked, optimizer, booster, data[2:], rank, world_size)
    return {"losses": losses, "state": chunked.state_dict()}


def _disk_accumulate(rank: int, world_size: int) -> dict[str, Any]:
    """Two micro-batches a step, both reduced (no ``no_sync``), with the gradient shards on disk:
    the second reduction adds onto the gradient the first wrote there."""
    placement = StaticPlacementConfig(offload_optim_frac=1.0, offload_disk_frac=1.0, max_prefetch=2)
    with tempfile.TemporaryDirectory() as scratch:
        chunked, optimizer, booster = _boost(
            gpt2(), precision="fp32", chunk_size=10_000, placement=placement, disk_dir=Path(scratch)
        )
        losses: list[Any] = train_accumulating(
            chunked, optimizer, booster, batches(2, batch=8), rank, world_size, False
        )
        return {"losses": losses, "state": chunked.state_dict()}


class _Raised(RuntimeError):
    """What the block of ``_forward_raises`` raises, once."""


def _forward_raises(rank: int, world_size: int) -> dict[str, Any]:
    """Offloaded activations beyond a host budget go to disk, and the second step's forward raises
    in the middle of the second block's call (after the first block's saved tensors and part of
    its own went out): the loop catches it and trains on with the next batch. What the failed
    forward wrote is dropped with its graph, while its writes to disk may be in flight."""
    activations = ActivationPlacement(offload=["GPT2Block"], host_budget=65_536)
    losses: list[Any] = []
    with tempfile.TemporaryDirectory() as scratch:
        chunked, optimizer, booster = _boost(
            gpt2(),
            precision="fp32",
            chunk_size=6_000,
            placement=StaticPlacementConfig(),
            activations=activations,
            disk_dir=Path(scratch),
        )
        calls = [0]

        def raise_once(module: torch.nn.Module, args: Any) -> None:
            calls[0] += 1
            if calls[0] == 3:  # the second step, the second block
                raise _Raised("the forward raises here")

        chunked.module.transformer.h[1].mlp.register_forward_pre_hook(raise_once)
        for ids in batches(4):
            try:
                loss = lm_loss(chunked, ids.chunk(world_size)[rank])
            except _Raised as error:
                losses.append(str(error))
                continue
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        return {"losses": losses, "state": chunked.state_dict()}


def _dropped_with_writes_in_flight(rank: int, world_size: int) -> dict[str, Any]:
    """Parameter shards on disk: the last step writes them (nothing waits for those writes until
    the next gather), and the model is dropped then, which closes its disk file."""
    with tempfile.TemporaryDirectory() as scratch:
        chunked, optimizer, booster = _boost(
            gpt2(), precision="bf16", chunk_size=6_000, placement=_param_disk_placement(), disk_dir=Path(scratch)
        )
        losses = train_chunked(chunked, optimizer, booster, batches(2), rank, world_size)
        del chunked, optimizer, booster
        gc.collect()
        return {"losses": losses, "state": {}}


def _evaluate_before_step(rank: int, world_size: int) -> dict[str, Any]:
    """A forward without gradients between a backward and its step (an evaluation where a trainer
    evaluates): its gathers read host masters after the gradients went to the host, and the step
    then writes those masters."""
    chunked, optimizer, booster = _boost(gpt2(), precision="fp32", chunk_size=6_000, placement=_offload(2))
    data = batches(3)
    losses: list[Any] = []
    for ids in data[:2]:
        loss = lm_loss(chunked, ids.chunk(world_size)[rank])
        booster.backward(loss, optimizer)
        with torch.no_grad():
            losses.append(float(lm_loss(chunked, data[2].chunk(world_size)[rank])))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": chunked.state_dict()}


@contextmanager
def every_auto_call_offloaded() -> Iterator[None]:
    """The ``auto`` activation plan offloads every call, whatever the timings say (the simulated
    device takes no time, the CPU some: both runs must take one plan)."""
    import chunkmem.activations.auto as auto
    from chunkmem.placement import ActivationChoice

    choose = auto.choose_activations

    def offload_all(*args: Any) -> Any:
        plan = choose(*args)
        return dataclasses.replace(plan, choices=(ActivationChoice.OFFLOAD,) * len(plan.choices), kept_bytes=0)

    auto.choose_activations = offload_all
    try:
        yield
    finally:
        auto.choose_activations = choose


def _activation_auto(rank: int, world_size: int) -> dict[str, Any]:
    """``auto`` blocks under a device budget: the first step measures every call (its copies timed
    and waited for), the plan offloads them; the next steps copy out and fetch back by the plan."""
    activations = ActivationPlacement(auto=["GPT2Block"])
    with every_auto_call_offloaded():
        return _train(rank, world_size, StaticPlacementConfig(device_budget=2_735_616), activations=activations)


def _values_in_place(rank: int, world_size: int) -> dict[str, Any]:
    """A frozen bf16 base read in place from its safetensors file by the disk tier's threads for
    every gather, adapters trained; the full state read at the end reads the base in place too."""
    from chunkmem.placement import StaticPlacementConfig as Static
    from support.values_in_place_helpers import BASE, CHUNK, tiny, write_weights

    with tempfile.TemporaryDirectory() as scratch:
        weights = write_weights(Path(scratch), torch.bfloat16)
        with torch.device("meta"):
            model = tiny()
        placement = Static(
            offload_optim_frac=1.0,
            offload_param_frac=1.0,
            offload_disk_frac=1.0,
            offload_param_disk_frac=1.0,
            max_prefetch=2,
        )
        cpu = Communicator(None, torch.device("cpu"), check_plans=True)
        booster = Booster(
            ChunkPlugin(placement=placement, precision="bf16", chunk_size=CHUNK, disk_dir=scratch, process_group=cpu)
        )
        trained = [p for n, p in model.named_parameters() if n not in BASE]
        chunked, optimizer, *_ = booster.boost(model, torch.optim.AdamW(trained, lr=1e-2), weights=str(weights))
        assert optimizer is not None
        losses = train_chunked(chunked, optimizer, booster, batches(2), rank, world_size)
        booster.save_model(chunked, Path(scratch) / "model.pt")
        booster.load_model(chunked, Path(scratch) / "model.pt")  # checks the base in the file is the one loaded
        return {"losses": losses, "state": chunked.state_dict()}


@dataclass(frozen=True)
class Scenario:
    """A training run the simulated device checks: on how many ranks, and what a wait for the chunk
    group's collectives does there (a GPU's, NCCL's, by default)."""

    world_size: int
    run: Callable[[int, int], dict[str, Any]]
    collectives: CollectiveWaits = CollectiveWaits.STREAM
    asynchronous: bool = True
    """``False``: on the synchronous CPU (its paths), its host threads checked."""


SCENARIOS: dict[str, Scenario] = {
    "offload-p0": Scenario(1, lambda r, w: _train(r, w, _offload(0), host_step=StepAfterBackward())),
    "offload-p3-bf16": Scenario(1, lambda r, w: _train(r, w, _offload(3), "bf16", host_step=StepAfterBackward())),
    "offload-p3-early-undo": Scenario(
        1, lambda r, w: _train(r, w, _offload(3), host_step=StepDuringBackward(), clip=0.05)
    ),
    "fp16-early": Scenario(1, lambda r, w: _train(r, w, _offload(2), "fp16", host_step=StepDuringBackward())),
    "early-checkpoint": Scenario(1, _early_checkpoint),
    "optim-offload-p2-bf16": Scenario(
        1, lambda r, w: _train(r, w, StaticPlacementConfig(offload_optim_frac=1.0, max_prefetch=2), "bf16")
    ),
    "auto-p3": Scenario(1, lambda r, w: _train(r, w, AutoPlacementConfig(device_budget=600_000, max_prefetch=3))),
    "evaluate-between": Scenario(1, _evaluate_between),
    "evaluate-before-step": Scenario(1, _evaluate_before_step),
    "accumulate-offload": Scenario(1, lambda r, w: _accumulate(r, w, _offload(2), no_sync=False)),
    "disk-bf16": Scenario(1, _disk),
    "disk-accumulate": Scenario(1, _disk_accumulate),
    "param-disk-bf16": Scenario(1, _param_disk),
    "param-disk-cpu": Scenario(1, _param_disk, asynchronous=False),
    "values-in-place": Scenario(1, _values_in_place),
    "param-disk-full": Scenario(1, _param_disk_full),
    "dropped-with-writes": Scenario(1, _dropped_with_writes_in_flight),
    "checkpoint-mid-training": Scenario(1, lambda r, w: _checkpoint(r, w, "fp32", evaluate=False)),
    "load-after-eval-bf16": Scenario(1, lambda r, w: _checkpoint(r, w, "bf16", evaluate=True)),
    "load-after-eval": Scenario(1, lambda r, w: _checkpoint(r, w, "fp32", evaluate=True)),
    "activation-offload": Scenario(
        1, lambda r, w: _train(r, w, StaticPlacementConfig(), activations=ActivationPlacement(offload=["GPT2Block"]))
    ),
    "activation-disk": Scenario(1, _activation_disk),
    "activation-auto": Scenario(1, _activation_auto),
    "forward-raises": Scenario(1, _forward_raises),
    "host-write-after-copy": Scenario(1, _host_write_after_copy),
    "w2-offload-p3": Scenario(2, lambda r, w: _train(r, w, _offload(3))),
    "w2-offload-p3-gloo": Scenario(2, lambda r, w: _train(r, w, _offload(3)), CollectiveWaits.HOST),
    "w2-no-sync-spill": Scenario(2, lambda r, w: _accumulate(r, w, _smallest(_spilling), True)),
    "w2-activation-auto": Scenario(2, _activation_auto),
    "w2-early-disk": Scenario(2, _early_disk),
}


@contextmanager
def host_kernels_of_a_gpu() -> Iterator[None]:
    """Within the block the synchronous CPU steps host runs with the kernel a GPU's (and so the
    simulated device's) host runs take (``HostKernels``), so that the two runs of a scenario compare
    bit for bit."""
    decides = HostKernels.__dict__["decides"]
    HostKernels.decides = staticmethod(lambda layer: True)  # type: ignore[method-assign]
    try:
        yield
    finally:
        HostKernels.decides = decides  # type: ignore[method-assign]


def run_scenario(rank: int, world_size: int, name: str, simulated: bool) -> dict[str, Any]:
    """One scenario on this rank, on the simulated device (its disk I/O seen) or the synchronous CPU."""
    scenario = SCENARIOS[name]
    if not simulated:
        with host_kernels_of_a_gpu() if scenario.asynchronous else nullcontext():
            return scenario.run(rank, world_size)
    with simulated_device(collectives=scenario.collectives, asynchronous=scenario.asynchronous), disk_io_seen():
        return scenario.run(rank, world_size)


def assert_identical(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert a["losses"] == b["losses"], f"{what}: losses differ"
    assert a["state"].keys() == b["state"].keys()
    for key, value in a["state"].items():
        assert torch.equal(value, b["state"][key]), f"{what}: {key} differs"


# --- removing one wait ------------------------------------------------------------------------
_SYNCHRONOUS: dict[tuple[str, int, int], dict[str, Any]] = {}


def synchronous(rank: int, world_size: int, name: str) -> dict[str, Any]:
    """Scenario ``name`` on the synchronous CPU, run once a process (every scenario is seeded, so
    each run gives the same result): the reference of every simulated run of it there."""
    key = (name, rank, world_size)
    if key not in _SYNCHRONOUS:
        _SYNCHRONOUS[key] = run_scenario(rank, world_size, name, False)
    return _SYNCHRONOUS[key]


def caught_without(rank: int, world_size: int, site: Site, name: str) -> str | None:
    """How scenario ``name`` on the simulated device fails with the wait at ``site`` removed
    (``None``: it does not): ``checker: ...`` when the simulated device found it (whatever the run
    raised then: the library may wrap it, or fail on what it led to), else how the run failed (its
    numbers differ from the synchronous run's, or it raised)."""
    expected = synchronous(rank, world_size, name)
    try:
        with without(site):
            result = run_scenario(rank, world_size, name, True)
        assert_identical(result, expected, name)
    except SimulatedDeviceError as error:
        return f"checker: {error}"
    except AssertionError as error:
        return f"numbers differ: {str(error).splitlines()[0]}"
    except Exception as error:  # any failure is a failing test
        return f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    return None


def caught_on_every_rank(site: Site, name: str) -> list[str | None]:
    """``caught_without`` on each rank of scenario ``name`` (W=2 ones on the rank pool)."""
    world_size = SCENARIOS[name].world_size
    if world_size == 1:
        return [caught_without(0, 1, site, name)]
    from support.distributed import run_ranks

    return run_ranks(caught_without, world_size, args=(site, name))
