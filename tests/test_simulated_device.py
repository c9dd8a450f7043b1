"""The simulated asynchronous device (``chunkmem.device.simulated``): training on it equals the
synchronous CPU run bit for bit, and removing any one wait of the copy protocol (a call site at a
time) makes a run on it fail, which the synchronous CPU never shows."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_ranks
from simulated import SCENARIOS, assert_identical, caught_without, run_scenario, synchronous, wait_sites

from chunkmem import Booster, ChunkPlugin
from chunkmem.device import bf16_supported, compute_device, device_layer
from chunkmem.device.simulated import SimulatedLayer, UnorderedAccessError, simulated_device
from chunkmem.ranks.comm import Communicator

pytestmark = pytest.mark.simulated

FAST = {"offload-p3-bf16", "load-after-eval"}


def _both(rank: int, world_size: int, name: str) -> None:
    # The synchronous run is shared with the tests below that remove a wait (one run a process).
    assert_identical(run_scenario(rank, world_size, name, True), synchronous(rank, world_size, name), name)


def _marks(name: str) -> list[Any]:
    marks: list[Any] = [] if name in FAST else [pytest.mark.slow]
    if SCENARIOS[name][0] > 1:
        marks += [pytest.mark.multirank] + ([pytest.mark.fast_tier] if name in FAST else [])
    return marks


@pytest.mark.parametrize("name", [pytest.param(name, marks=_marks(name)) for name in SCENARIOS])
def test_training_on_the_simulated_device_equals_the_synchronous_run_bit_for_bit(name: str) -> None:
    world_size = SCENARIOS[name][0]
    if world_size == 1:
        _both(0, 1, name)
    else:
        run_ranks(_both, world_size, args=(name,))


def test_the_simulated_device_is_asynchronous_and_pins() -> None:
    with simulated_device():
        layer = device_layer(torch.device("cpu"))
        assert isinstance(layer, SimulatedLayer) and layer.asynchronous and layer.pins
        assert layer.is_pinned(layer.host_empty(4, torch.float32, torch.device("cpu")))
        assert not layer.is_pinned(torch.empty(4))


def test_a_gpu_is_neither_picked_nor_taken_on_the_simulated_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a GPU is present the plugin picks it by itself, and nothing would be simulated there:
    asked for the simulated device, chunkmem computes on the CPU (in fp32, as on any CPU) and
    refuses a GPU handed to it. The GPU is made to look present, so this holds on any machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with simulated_device(check=False):
        assert compute_device() == torch.device("cpu")
        assert not bf16_supported(None)
        with pytest.raises(ValueError, match=r"CHUNKMEM_DEVICE=cpu-async .* handed cuda:0"):
            device_layer(torch.device("cuda", 0))


@pytest.mark.parametrize("simulated", [True, False])
def test_the_scenarios_compute_on_the_cpu_where_a_gpu_is_present(
    monkeypatch: pytest.MonkeyPatch, simulated: bool
) -> None:
    """Both runs a scenario compares (simulated and synchronous) compute on the CPU on a GPU
    machine too: the GPU is made to look present, so a run handed to it fails here."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    result = run_scenario(0, 1, "offload-p0", simulated)
    assert len(result["losses"]) == 2 and all(value.device.type == "cpu" for value in result["state"].values())


def test_a_block_in_which_nothing_computed_on_the_simulated_device_fails() -> None:
    """A model boosted before the block keeps its synchronous layer (as one on a GPU keeps the
    GPU's): training it inside the block checks nothing, so the block fails rather than pass."""
    booster = Booster(plugin=ChunkPlugin(precision="fp32", process_group=Communicator(None, torch.device("cpu"))))
    model, *_ = booster.boost(torch.nn.Linear(8, 8))
    with pytest.raises(RuntimeError, match="nothing computed on the simulated device"), simulated_device():
        model(torch.ones(2, 8)).sum().backward()


def test_a_host_write_before_the_copy_reading_the_buffer_is_waited_for_raises() -> None:
    with simulated_device(check=False) as simulator:
        layer = device_layer(torch.device("cpu"))
        host = layer.host_empty(8, torch.float32, torch.device("cpu"))
        host.fill_(1.0)
        device = torch.empty(8)
        side = layer.new_stream()
        with layer.on_stream(side):
            device.copy_(host, non_blocking=True)
            read = layer.record_event()
        layer.synchronize(read)
        host.fill_(2.0)  # waited for: fine
        with layer.on_stream(side):
            device.copy_(host, non_blocking=True)
        with pytest.raises(UnorderedAccessError, match="fill_"):
            host.fill_(3.0)  # the copy on the side stream may not have read it yet
        assert len(simulator.errors) == 1


# Which scenario fails without each wait (file: function: call). Every wait is caught by one: a
# wait no scenario could catch was removed (issue 29; the reasons are at the call sites that lost
# them, and in ``transfers.py``'s rule for copies into host buffers).
CATCHES = {
    "activations/offload.py: recycle: self._transfers.before_host_write(host)": "activation-offload",
    "activations/disk.py: write: self._transfers.before_host_read(stage)": "activation-disk",
    "activations/disk.py: read: self._transfers.before_host_write(stage)": "activation-disk",
    "activations/disk.py: _free: self._transfers.before_host_write(stage)": "activation-disk",
    "activations/offload.py: _unpack: self._layer.wait_event(call.ready)": "activation-offload",
    "activations/offload.py: _unpack: self._layer.record_stream(device, self._layer.current_stream())": (
        "activation-offload"
    ),
    "activations/offload.py: _fetch_now: self._transfers.before_host_read(copy.host)": "activation-offload",
    "chunks/chunk_grads.py: _load_host: self._transfers.before_host_read(host)": "w2-no-sync-spill",
    "chunks/chunk_grads.py: _drop_host: self._transfers.before_host_write(self._host)": "w2-no-sync-spill",
    "ranks/comm.py: wait: self._comm.layer.wait_event(self._event)": "offload-p3-bf16",
    "ranks/comm.py: side_stream: self._layer.wait_stream(self._side_stream, self._layer.current_stream())": (
        "offload-p3-bf16"
    ),
    "chunks/grad_on_disk.py: receive: self._transfers.before_host_read(host)": "disk-bf16",
    "chunks/param_on_disk.py: read_for_gather: transfers.before_host_write(staged)": "param-disk-bf16",
    "chunks/param_on_disk.py: write: transfers.before_host_write(self._kept)": "param-disk-full",
    "chunks/shard.py: prepare_host_write: self._transfers.before_host_write(self._master)": "load-after-eval",
    "chunks/grad_shard.py: _settle: self._transfers.before_host_read(self._grad)": "offload-p0",
    "chunks/grad_shard.py: _settle: self._transfers.before_host_read(staged)": "auto-p3",
    "chunks/shard.py: _host_compute: self._transfers.before_host_write(self._host_cast)": "load-after-eval-bf16",
    "tiers/transfers.py: copy: layer.wait_stream(stream, layer.current_stream())": "offload-p0",
    "tiers/transfers.py: copy: layer.record_stream(source, stream)": "offload-p0",
    "tiers/transfers.py: before_host_read: self._layer.synchronize(event)": "offload-p0",
    "tiers/transfers.py: before_host_write: self._layer.synchronize(event)": "load-after-eval",
    "tiers/transfers.py: before_host_write: self.before_host_read(host)": "host-write-after-copy",
}
# Waits that order no data, so no run's numbers can show them missing; why each is there.
NOT_DATA = {
    "activations/offload.py: settle: self._transfers.before_host_read(copy.host)": "the ledger's truth: an "
    "auto block's saved tensors leave the accounted device bytes once their copies to the host are done (until "
    "then the allocator holds them, record_stream-ed to the copy stream); without it the accounted peak could "
    "be under the allocator's",
    "activations/auto.py: _measure: layer.synchronize(layer.record_event())": "timing only: the host waits for "
    "the compute stream around a measured block call so that the wall clock measures its forward",
    "tiers/transfers.py: settle: self._layer.synchronize(end)": "timing only: the auto policy's copy rates are "
    "read once every measured copy's end event has completed (settle(wait=True)); no data is read after it",
}


def _label(site: tuple[str, int, str]) -> str:
    from simulated import LIBRARY

    lines = (LIBRARY / site[0]).read_text().splitlines()
    function = next(line for line in reversed(lines[: site[1]]) if line.lstrip().startswith("def "))
    name = function.split("def ", 1)[1].split("(", 1)[0]
    return f"{site[0]}: {name}: {lines[site[1] - 1].split('#')[0].strip()}"


SITES = {_label(site): site for site in wait_sites()}


def test_every_wait_of_the_protocol_is_listed() -> None:
    assert not CATCHES.keys() & NOT_DATA.keys()
    assert sorted(SITES) == sorted({**CATCHES, **NOT_DATA}), "a wait was added or moved: say which scenario catches it"


@pytest.mark.parametrize(
    "label",
    [pytest.param(label, marks=[pytest.mark.slow, *_marks(name)[1:]]) for label, name in CATCHES.items()],
)
def test_removing_one_wait_fails_a_run_on_the_simulated_device(label: str) -> None:
    site, name = SITES[label], CATCHES[label]
    world_size = SCENARIOS[name][0]
    if world_size == 1:
        found = [caught_without(0, 1, site, name)]
    else:
        found = run_ranks(caught_without, world_size, args=(site, name))
    assert any(found), f"{label}: {name} still passes without it"
