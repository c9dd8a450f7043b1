"""Training scenarios run on the simulated asynchronous device (``chunkmem.device.simulated``) and
on the synchronous CPU: each returns what the run ends with (losses and the full state), so a
test can require the two runs equal bit for bit, and a missing wait (an unordered access the
simulated device raises for, or changed numbers) fails it."""

from __future__ import annotations

import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from disk_faults import parameter_writes_fail
from models import adamw_two_groups, batches, boost, gpt2, lm_loss, train_accumulating, train_chunked

from chunkmem import (
    Booster,
    BudgetTooSmallError,
    ChunkedModel,
    ChunkOptimizer,
    DiskTierError,
    StepAfterBackward,
    StepDuringBackward,
)
from chunkmem.device.simulated import UnorderedAccessError, simulated_device
from chunkmem.placement import ActivationPlacement, AutoPlacementConfig, StaticPlacementConfig
from chunkmem.ranks.comm import Communicator
from chunkmem.tiers.disk import DiskFile

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
    """The disk tier's I/O threads move bytes with ``pwritev`` / ``preadv`` through ``ctypes``,
    which no ``TorchDispatchMode`` sees: within the block each write first reads its tensor and
    each read first writes it with a torch op on the I/O thread, so the simulated device checks
    that the host waited for the copies using the tensor (a write to disk of a piece before the copy
    into it landed, a read into a piece a copy to the device still reads)."""
    real = DiskFile._transfer

    def transfer(file: DiskFile, tensor: torch.Tensor, offset: int, write: bool, then: Any, param: bool) -> None:
        _ = tensor.clone() if write else tensor.zero_()
        real(file, tensor, offset, write, then, param)

    DiskFile._transfer = transfer  # type: ignore[method-assign]
    try:
        yield
    finally:
        DiskFile._transfer = real  # type: ignore[method-assign]


def _activation_disk(rank: int, world_size: int) -> dict[str, Any]:
    """Offloaded activations beyond a host budget go to disk through the staging window (pieces of
    8 KiB: a storage takes several, read back into the two pieces in turn)."""
    activations = ActivationPlacement(offload=["GPT2Block"], host_budget=65_536)
    with tempfile.TemporaryDirectory() as scratch, disk_io_seen():
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


SCENARIOS: dict[str, tuple[int, Callable[[int, int], dict[str, Any]]]] = {
    # name: (world size, run)
    "offload-p0": (1, lambda r, w: _train(r, w, _offload(0), host_step=StepAfterBackward())),
    "offload-p3-bf16": (1, lambda r, w: _train(r, w, _offload(3), "bf16", host_step=StepAfterBackward())),
    "offload-p3-early-undo": (1, lambda r, w: _train(r, w, _offload(3), host_step=StepDuringBackward(), clip=0.05)),
    "optim-offload-p2-bf16": (
        1,
        lambda r, w: _train(r, w, StaticPlacementConfig(offload_optim_frac=1.0, max_prefetch=2), "bf16"),
    ),
    "auto-p3": (1, lambda r, w: _train(r, w, AutoPlacementConfig(device_budget=600_000, max_prefetch=3))),
    "accumulate-offload": (1, lambda r, w: _accumulate(r, w, _offload(2), no_sync=False)),
    "disk-bf16": (1, _disk),
    "param-disk-bf16": (1, _param_disk),
    "param-disk-full": (1, _param_disk_full),
    "checkpoint-mid-training": (1, lambda r, w: _checkpoint(r, w, "fp32", evaluate=False)),
    "load-after-eval-bf16": (1, lambda r, w: _checkpoint(r, w, "bf16", evaluate=True)),
    "load-after-eval": (1, lambda r, w: _checkpoint(r, w, "fp32", evaluate=True)),
    "w2-offload-p3": (2, lambda r, w: _train(r, w, _offload(3))),
    "activation-offload": (
        1,
        lambda r, w: _train(r, w, StaticPlacementConfig(), activations=ActivationPlacement(offload=["GPT2Block"])),
    ),
    "activation-disk": (1, _activation_disk),
    "w2-no-sync-spill": (2, lambda r, w: _accumulate(r, w, _smallest(_spilling), True)),
    "host-write-after-copy": (1, _host_write_after_copy),
}


def run_scenario(rank: int, world_size: int, name: str, simulated: bool) -> dict[str, Any]:
    """One scenario on this rank, on the simulated device or the synchronous CPU."""
    run = SCENARIOS[name][1]
    if not simulated:
        return run(rank, world_size)
    with simulated_device():
        return run(rank, world_size)


def assert_identical(a: dict[str, Any], b: dict[str, Any], what: str) -> None:
    assert a["losses"] == b["losses"], f"{what}: losses differ"
    assert a["state"].keys() == b["state"].keys()
    for key, value in a["state"].items():
        assert torch.equal(value, b["state"][key]), f"{what}: {key} differs"


# --- removing one wait ------------------------------------------------------------------------
LIBRARY = Path(__file__).resolve().parent.parent / "chunkmem"
_WAIT = re.compile(r"before_host_(read|write)\(|layer\.(wait_stream|wait_event|synchronize|record_stream)\(")


def wait_sites() -> list[tuple[str, int, str]]:
    """Every call of a wait of the protocol in the library outside the device layer: (path
    relative to the library, line, the call's name)."""
    sites = []
    for path in sorted(LIBRARY.rglob("*.py")):
        if "device" in path.relative_to(LIBRARY).parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found = _WAIT.search(line)
            if found and not line.lstrip().startswith("def "):
                name = found.group(0).removesuffix("(").split(".")[-1]
                sites.append((str(path.relative_to(LIBRARY)), number, name))
    return sites


@contextmanager
def without(site: tuple[str, int, str]) -> Iterator[None]:
    """The wait called at ``site`` does nothing there (everywhere else it waits)."""
    from chunkmem.device.simulated import SimulatedLayer
    from chunkmem.tiers.transfers import HostTransfers

    relative, line, name = site
    owner = HostTransfers if name.startswith("before_host") else SimulatedLayer
    original = getattr(owner, name)
    target = str(LIBRARY / relative)

    def skipped(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1)
        if caller.f_lineno == line and caller.f_code.co_filename == target:
            return None
        return original(*args, **kwargs)

    setattr(owner, name, skipped)
    try:
        yield
    finally:
        setattr(owner, name, original)


_SYNCHRONOUS: dict[tuple[str, int, int], dict[str, Any]] = {}


def synchronous(rank: int, world_size: int, name: str) -> dict[str, Any]:
    """Scenario ``name`` on the synchronous CPU, run once a process (every scenario is seeded, so
    each run gives the same result): the reference of every simulated run of it there."""
    key = (name, rank, world_size)
    if key not in _SYNCHRONOUS:
        _SYNCHRONOUS[key] = run_scenario(rank, world_size, name, False)
    return _SYNCHRONOUS[key]


def caught_without(rank: int, world_size: int, site: tuple[str, int, str], name: str) -> str | None:
    """How scenario ``name`` on the simulated device fails with the wait at ``site`` removed
    (``None``: it does not), against the synchronous run."""
    expected = synchronous(rank, world_size, name)
    try:
        with without(site):
            result = run_scenario(rank, world_size, name, True)
        assert_identical(result, expected, name)
    except UnorderedAccessError as error:
        return f"unordered access: {str(error)[:160]}"
    except AssertionError as error:
        return f"numbers differ: {str(error).splitlines()[0]}"
    except Exception as error:  # any failure is a failing test
        return f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return None
