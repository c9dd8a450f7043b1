"""What a budget refusal says: the host budget's refusal names what a disk directory would put on
disk when that makes it fit (and the budget it then fits is one a real run keeps), describes what
an fp32 run keeps in host memory without "16-bit copies", and a host budget that would cap nothing
(a CPU compute device, no device budget) is refused instead of ignored."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from chunkmem import Booster, ChunkPlugin, HostBudgetTooSmallError
from chunkmem.placement import AutoPlacementConfig, StaticPlacementConfig

WIDTH, LAYERS, CHUNK = 64, 6, 4_200  # one layer a chunk


def _boost(placement: Any, precision: str, disk_dir: Path | None = None) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    booster = Booster(ChunkPlugin(placement=placement, precision=precision, chunk_size=CHUNK, disk_dir=disk_dir))
    chunked, boosted, *_ = booster.boost(model, optimizer)
    return chunked, boosted, booster


def _host_need(precision: str) -> int:
    """What the placement with every optimizer side in RAM needs of host memory (the minimum a
    refusal reports; the run below checks the budget derived from it independently)."""
    with pytest.raises(HostBudgetTooSmallError) as refused:
        _boost(StaticPlacementConfig(offload_optim_frac=1.0, device_budget="1GiB", host_budget=1), precision)
    return refused.value.minimum


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_host_budget_that_disk_would_fit_says_which_fraction_and_disk_dir(precision: str, tmp_path: Path) -> None:
    need = _host_need(precision)
    budget = need * 3 // 4
    placement = StaticPlacementConfig(offload_optim_frac=1.0, device_budget="1GiB", host_budget=budget)
    with pytest.raises(HostBudgetTooSmallError) as refused:
        _boost(placement, precision)
    message = str(refused.value)
    found = re.search(
        r"offload_disk_frac=([0-9.]+) and ChunkPlugin\(disk_dir=\.\.\.\) to put [0-9.]+ \w+ on disk", message
    )
    assert found, message
    fixed = placement.model_copy(update={"offload_disk_frac": float(found.group(1))})
    chunked, optimizer, booster = _boost(fixed, precision, tmp_path)
    for _ in range(2):
        booster.backward(chunked(torch.randn(4, WIDTH)).float().square().mean(), optimizer)
        optimizer.step()
        optimizer.zero_grad()
    stats = chunked.stats()
    assert stats.disk_bytes > 0 and stats.peak_host_bytes <= budget
    assert "16-bit" not in message if precision == "fp32" else "16-bit copies" in message


def test_a_host_budget_no_disk_fraction_fits_keeps_the_plain_advice() -> None:
    placement = StaticPlacementConfig(offload_optim_frac=1.0, device_budget="1GiB", host_budget=100)
    with pytest.raises(HostBudgetTooSmallError) as refused:
        _boost(placement, "fp32")
    assert "disk_dir" not in str(refused.value) and "Raise host_budget" in str(refused.value)


@pytest.mark.parametrize(
    "placement",
    [StaticPlacementConfig(host_budget="1GiB"), AutoPlacementConfig(host_budget="1GiB")],
)
def test_a_host_budget_that_caps_nothing_on_a_cpu_compute_device_is_refused(placement: Any) -> None:
    """Nothing is offloaded from the compute device (the CPU: host memory too), which no
    device_budget caps: the host_budget would cap nothing, silently."""
    if torch.cuda.is_available():
        pytest.skip("the compute device is a GPU here")
    with pytest.raises(ValueError, match=r"host_budget=1073741824 caps nothing here.*device_budget"):
        _boost(placement, "fp32")


def test_a_host_budget_over_what_is_offloaded_from_a_cpu_compute_device_caps_it() -> None:
    with pytest.raises(HostBudgetTooSmallError):
        _boost(StaticPlacementConfig(offload_optim_frac=1.0, host_budget=100), "fp32")
    chunked, *_ = _boost(StaticPlacementConfig(offload_optim_frac=1.0, host_budget="1GiB"), "fp32")
    assert chunked.manager.ledger.host_bytes > 0
