"""The simulated asynchronous device (``chunkmem.device.simulated``): training on it equals the
synchronous CPU run bit for bit, and removing any one wait of the copy protocol (a call site at a
time) makes a run on it fail, which the synchronous CPU never shows."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from distributed import run_ranks
from simulated import SCENARIOS, assert_identical, caught_without, run_scenario, wait_sites

from chunkmem import Booster, ChunkPlugin, Communicator
from chunkmem.device import bf16_supported, compute_device, device_layer
from chunkmem.device.simulated import SimulatedLayer, UnorderedAccessError, simulated_device

pytestmark = pytest.mark.simulated

FAST = {"offload-p3-bf16", "load-after-eval", "w2-offload-p3"}


def _both(rank: int, world_size: int, name: str) -> None:
    assert_identical(run_scenario(rank, world_size, name, True), run_scenario(rank, world_size, name, False), name)


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
    assert len(result["losses"]) == 3 and all(value.device.type == "cpu" for value in result["state"].values())


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


# Which scenario fails without each wait (file: function: call). The ones below it no scenario
# can catch, and why.
CATCHES = {
    "activations/offload.py: _recycle: self._transfers.before_host_write(host)": "activation-offload",
    "activations/offload.py: _unpack: self._layer.wait_event(call.ready)": "activation-offload",
    "activations/offload.py: _unpack: self._layer.record_stream(device, self._layer.current_stream())": None,
    "activations/offload.py: _fetch: self._transfers.before_host_read(copy.host)": "activation-offload",
    "chunk_grads.py: spill: transfers.before_host_write(host)": None,
    "chunk_grads.py: _load_host: self._transfers.before_host_read(host)": "w2-no-sync-spill",
    "chunk_grads.py: _drop_host: self._transfers.before_host_write(self._host)": "w2-no-sync-spill",
    "comm.py: wait: self._comm.layer.wait_event(self._event)": "offload-p3-bf16",
    "comm.py: side_stream: self._layer.wait_stream(self._side_stream, self._layer.current_stream())": "offload-p3-bf16",
    "grad_on_disk.py: receive: self._transfers.before_host_read(host)": "disk-bf16",
    "param_on_disk.py: read_for_gather: transfers.before_host_write(staged)": "param-disk-bf16",
    "param_on_disk.py: write: self._transfers.before_host_write(self._kept)": None,
    "shard.py: prepare_host_write: self._transfers.before_host_write(self._master)": "load-after-eval",
    "shard.py: _settle_grad: self._transfers.before_host_read(self._grad)": "offload-p0",
    "shard.py: _settle_grad: self._transfers.before_host_read(staged)": "auto-p3",
    "shard.py: _before_write: self._transfers.before_host_write(buffer)": None,
    "shard.py: _host_compute: self._transfers.before_host_write(self._host_cast)": "load-after-eval-bf16",
    "transfers.py: copy: layer.wait_stream(stream, layer.current_stream())": "offload-p0",
    "transfers.py: copy: layer.record_stream(source, stream)": "offload-p0",
    "transfers.py: before_host_read: self._layer.synchronize(event)": "offload-p0",
    "transfers.py: before_host_write: self._layer.synchronize(event)": "load-after-eval",
    "transfers.py: before_host_write: self.before_host_read(host)": None,
}
UNCATCHABLE = {
    "activations/offload.py: _unpack: self._layer.record_stream(device, self._layer.current_stream())": "the "
    "device copy is made on the fetch stream and read on the compute stream after it waited for the fetch; without "
    "record_stream a GPU's allocator could give its memory to the fetch stream's next copy while the compute stream "
    "still reads it, but the simulated device only models freed memory going to the compute stream, which the "
    "wait already orders",
    "chunk_grads.py: spill: transfers.before_host_write(host)": "the host buffer is written by the copy out of "
    "the device buffer, on the copy stream after the compute stream, where the copy that last read it (into the "
    "device buffer it loaded) was queued: stream order already puts the write after that read",
    "shard.py: _before_write: self._transfers.before_host_write(buffer)": "the copy that then writes the buffer "
    "is queued after the host's last use of it and on the copy stream after the compute stream; no copy on "
    "another stream reads a master or gradient shard it guards",
    "param_on_disk.py: write: self._transfers.before_host_write(self._kept)": "a parameter shard is kept in "
    "memory only after its write failed (a full disk), which no scenario on the simulated device makes; its last "
    "readers are the gathers' copies since then",
    "transfers.py: before_host_write: self.before_host_read(host)": "every host buffer a copy writes into is "
    "read (before_host_read) before the host writes it",
}


def _label(site: tuple[str, int, str]) -> str:
    from simulated import LIBRARY

    lines = (LIBRARY / site[0]).read_text().splitlines()
    function = next(line for line in reversed(lines[: site[1]]) if line.lstrip().startswith("def "))
    name = function.split("def ", 1)[1].split("(", 1)[0]
    return f"{site[0]}: {name}: {lines[site[1] - 1].split('#')[0].strip()}"


SITES = {_label(site): site for site in wait_sites()}


def test_every_wait_of_the_protocol_is_listed() -> None:
    assert sorted(SITES) == sorted(CATCHES), "a wait was added or moved: say which scenario catches it"
    assert {label for label, name in CATCHES.items() if name is None} == set(UNCATCHABLE)


@pytest.mark.parametrize(
    "label",
    [
        pytest.param(label, marks=[pytest.mark.slow, *_marks(name)[1:]])
        for label, name in CATCHES.items()
        if name is not None
    ],
)
def test_removing_one_wait_fails_a_run_on_the_simulated_device(label: str) -> None:
    site, name = SITES[label], CATCHES[label]
    assert name is not None
    world_size = SCENARIOS[name][0]
    if world_size == 1:
        found = [caught_without(0, 1, site, name)]
    else:
        found = run_ranks(caught_without, world_size, args=(site, name))
    assert any(found), f"{label}: {name} still passes without it"
