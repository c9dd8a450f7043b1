"""The device layer is the only code that knows the accelerator: no ``torch.cuda`` and no
``"cuda"`` literal anywhere else in the library, so every stream, event, pinned buffer and
capacity probe goes through ``chunkmem.device``; the host buffers it pins are pinned once."""

from __future__ import annotations

import ast
import re
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from support.models import adamw_two_groups, batches, boost, gpt2, lm_loss
from support.paths import ROOT

from chunkmem.device import AcceleratorLayer, DeviceLayer, device_layer
from chunkmem.device.simulated import simulated_device
from chunkmem.placement import StaticPlacementConfig
from chunkmem.usage.accounting import Location

LIBRARY = ("chunkmem",)
LAYER = ROOT / "chunkmem" / "device"
FORBIDDEN = re.compile(
    r"""torch\.cuda\b|["']cuda["']|pin_memory=|torch\.(Stream|Event|accelerator)\b|(?<!layer)\.(is_pinned|record_stream)\("""
)

# Lines that match the pattern without touching the accelerator, each with why.
NOT_THE_ACCELERATOR = {
    # a field of DCP's saved description of a tensor, rebuilt from a checkpoint; nothing is pinned
    ("chunkmem/checkpoint/dcp_reader.py", 'pin_memory=self._typed(pin_memory, bool, "pin_memory"),'),
}


def _library_files() -> list[Path]:
    return [path for package in LIBRARY for path in sorted((ROOT / package).rglob("*.py")) if LAYER not in path.parents]


# Moves, pinning and asynchronous copies outside the layer: on the CPU a move to the CPU is the
# tensor itself and ``non_blocking`` changes nothing, so the simulated device cannot see what they
# would do on a GPU. Tensors move through ``chunkmem.device.moves`` (blocking) or ``HostTransfers``.
_MOVES = ("cuda", "cpu", "pin_memory")
_DEVICE_WORDS = re.compile(r"device|\bcpu\b|cuda|meta|_META")
NOT_A_TENSOR_MOVE = {
    # the module's own .cpu() / .cuda(), which refuse anything but the device it computes on
    ("chunkmem/boosted/model.py", "self.to('cpu')"),
    ("chunkmem/boosted/model.py", "self.to(gpu_device(device))"),
    # the user's module before boosting, moved where Lightning asks (a boosted one stays put)
    ("chunkmem/integrations/lightning.py", "self.model.to(self.root_device)"),
    # a field of DCP's saved description of a tensor, rebuilt from a checkpoint; nothing is pinned
    ("chunkmem/checkpoint/dcp_reader.py", "pin_memory=self._typed(pin_memory, bool, 'pin_memory')"),
}


def _names_a_device(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    text = ast.unparse(node)
    return bool(_DEVICE_WORDS.search(text)) and "dtype" not in text


def moves_and_pins(source: str) -> list[tuple[int, str]]:
    """Every ``non_blocking``, pinning and device move in ``source``: (line, what)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.keyword) and node.arg in ("non_blocking", "pin_memory"):
            found.append((node.value.lineno, f"{node.arg}={ast.unparse(node.value)}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            moved = name == "to" and (
                any(k.arg == "device" for k in node.keywords) or any(_names_a_device(a) for a in node.args)
            )
            if moved or name in _MOVES:
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_tensors_move_only_through_the_layer_and_never_asynchronously() -> None:
    offending = []
    for path in _library_files():
        relative = str(path.relative_to(ROOT))
        for line, what in moves_and_pins(path.read_text()):
            if not any(relative == file and what.startswith(allowed) for file, allowed in NOT_A_TENSOR_MOVE):
                offending.append(f"{relative}:{line}: {what}")
    assert offending == [], (
        "device moves, pinning or non_blocking outside chunkmem/device (use chunkmem.device.moves, or "
        "HostTransfers for chunk memory):\n" + "\n".join(offending)
    )


def test_the_move_check_sees_what_it_forbids() -> None:
    forbidden = [
        "t.to('cpu', non_blocking=True)",
        "t.pin_memory()",
        "torch.empty(3, pin_memory=True)",
        "t.cuda()",
        "t.cpu()",
        "t.to(self._device)",
        "t.to(device=d, dtype=x)",
        "t.to(torch.device('cuda'))",
        "t.copy_(s, non_blocking=pinned)",
    ]
    for source in forbidden:
        assert moves_and_pins(source), source
    for source in ("t.to(torch.float32)", "t.to(other.dtype)", "t.to(dtype=self._dtype)", "def cpu(self): pass"):
        assert not moves_and_pins(source), source


def test_only_the_device_layer_names_the_accelerator() -> None:
    files = _library_files()
    assert len(files) > 50, "the library's files were not found"
    offending = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if FORBIDDEN.search(line) and (str(path.relative_to(ROOT)), line.strip()) not in NOT_THE_ACCELERATOR
    ]
    assert offending == [], "accelerator specifics outside chunkmem/device:\n" + "\n".join(offending)


def test_the_check_sees_what_it_forbids() -> None:
    for line in ("torch.cuda.Stream(device)", 'device.type == "cuda"', "x.record_stream(s)", "t.is_pinned()"):
        assert FORBIDDEN.search(line), line
    assert not FORBIDDEN.search("def cuda(self, device=None):") and not FORBIDDEN.search("layer.is_pinned(host)")


def test_the_cpu_is_a_synchronous_device_with_nothing_to_wait_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHUNKMEM_DEVICE", raising=False)
    layer = device_layer(torch.device("cpu"))
    assert type(layer) is DeviceLayer and not layer.asynchronous and not layer.pins
    assert layer.new_stream() is None and layer.record_event() is None
    assert not layer.host_empty(4, torch.float32, torch.device("cpu")).is_pinned()


@pytest.mark.cuda
def test_a_gpu_gets_the_asynchronous_layer() -> None:
    layer = device_layer(torch.device("cuda", 0))
    assert isinstance(layer, AcceleratorLayer) and layer.asynchronous and layer.pins
    buffer = layer.host_empty(4, torch.float32, torch.device("cpu"))
    assert layer.is_pinned(buffer)


@pytest.mark.parametrize("device", ["simulated", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_host_buffers_are_pinned_and_allocated_once(device: str) -> None:
    """Where copies are asynchronous (a GPU; the simulated device on a CPU), the host buffers that
    cross the bus are pinned, and pinned once (pinning is slow): the first step allocates them, the
    later steps allocate no host buffer at all. The gradient shard, freed by zero_grad as plain
    PyTorch frees ``.grad``, comes back in its pinned buffer, and so does a master that went to
    the device and back."""
    offload = StaticPlacementConfig(offload_optim_frac=1.0, offload_param_frac=1.0, max_prefetch=2)
    with simulated_device() if device == "simulated" else nullcontext():
        chunked, optimizer, booster = boost(
            gpt2(n_layer=1), adamw_two_groups, placement=offload, precision="bf16", chunk_size=12_000
        )
        layer = chunked.manager.comm.layer
        assert layer.asynchronous and layer.pins
        chunk = chunked.manager.chunks[0]
        assert chunk.store.master_location is Location.HOST and layer.is_pinned(chunk.store.master)
        allocated: list[bool] = []
        real = layer.host_empty

        def counted(numel: int, dtype: torch.dtype, host: torch.device, pinned: bool = True) -> torch.Tensor:
            allocated.append(pinned)
            return real(numel, dtype, host, pinned)

        layer.host_empty = counted  # type: ignore[method-assign]
        grads = []
        for step, ids in enumerate(batches(3)):
            before = len(allocated)
            booster.backward(lm_loss(chunked, ids), optimizer)
            optimizer.step()  # the host steps that may run during the backward are settled
            assert layer.is_pinned(chunk.store.grad), f"step {step}: the gradient shard is not pinned"
            grads.append(chunk.store.grad.data_ptr())
            optimizer.zero_grad()
            assert not chunk.store.grad_allocated, "zero_grad frees the gradient shard"
            if step > 0:
                assert len(allocated) == before, f"step {step} allocated {len(allocated) - before} host buffers"
        assert allocated and all(allocated), "the buffers the first step allocates are pinned"
        assert grads == [grads[0]] * len(grads)
        assert layer.is_pinned(chunk.store.master)
