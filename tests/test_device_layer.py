"""The device layer is the only code that knows the accelerator: no ``torch.cuda`` and no
``"cuda"`` literal anywhere else in the library, so every stream, event, pinned buffer and
capacity probe goes through ``chunkmem.device``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from chunkmem.device import AcceleratorLayer, DeviceLayer, device_layer

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("chunkmem", "hooks", "placement")
LAYER = ROOT / "chunkmem" / "device"
FORBIDDEN = re.compile(
    r"""torch\.cuda\b|["']cuda["']|pin_memory=|torch\.(Stream|Event|accelerator)\b|(?<!layer)\.(is_pinned|record_stream)\("""
)

# Lines that match the pattern without touching the accelerator, each with why.
NOT_THE_ACCELERATOR = {
    # a field of DCP's saved description of a tensor, rebuilt from a checkpoint; nothing is pinned
    ("chunkmem/checkpoint/dcp_metadata.py", 'pin_memory=self._typed(pin_memory, bool, "pin_memory"),'),
}


def _library_files() -> list[Path]:
    return [path for package in LIBRARY for path in sorted((ROOT / package).rglob("*.py")) if LAYER not in path.parents]


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
