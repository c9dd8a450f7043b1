"""Memory probes against independent measurements: the kernel's own figures (sysconf,
/proc/meminfo) and, on a GPU, an allocation of a known size. (On the CPU the allocation check is on
RSS, in test_benchmark_helpers: in sandboxed kernels MemAvailable moves by only part of an
allocation, so free host memory is checked against the kernel's figure instead.)"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import pytest
import torch

from chunkmem.device import probes
from chunkmem.device.probes import DeviceMemory
from chunkmem.usage.memory import (
    describe_devices,
    device_capacity,
    device_free,
    device_memory,
    host_memory,
    nvml_memory,
)

CPU = torch.device("cpu")
GiB = 2**30


def _physical_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _meminfo_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


linux_only = pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="reads /proc/meminfo")


@linux_only
def test_cpu_capacity_is_the_physical_memory_the_kernel_reports() -> None:
    assert device_capacity(CPU) == _physical_bytes()
    assert host_memory().total == _physical_bytes()
    assert "no GPU" in device_memory(CPU).source


@linux_only
def test_free_memory_agrees_with_the_kernel_available_figure() -> None:
    # Read back to back; other processes on the machine may move it a little in between.
    for probe in (lambda: device_free(CPU), lambda: host_memory().free):
        gaps = [abs(probe() - _meminfo_available()) for _ in range(5)]
        assert statistics.median(gaps) < 64 * 2**20, gaps


@linux_only
def test_describe_devices_reports_the_host_in_gib() -> None:
    lines = describe_devices().splitlines()
    words = lines[0].split()
    assert words[0] == "host:" and words[2:4] == ["GiB", "total,"]
    assert abs(float(words[1]) - _physical_bytes() / GiB) <= 0.05
    if torch.cuda.is_available():
        assert _named(lines[1:]) == [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    else:
        assert lines[1:] == ["no CUDA device (torch.cuda.is_available() is False): the CPU is the compute device"]


def _named(lines: list[str]) -> list[str]:
    """The device each line of ``describe_devices`` is about ("cuda:1: 79.2 GiB total, ..." -> "cuda:1")."""
    return [line.partition(": ")[0] for line in lines]


def test_describe_devices_names_each_gpu_by_its_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU lines of a two-GPU machine, on any machine: the probes answer known figures."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    figures = {0: (80 * GiB, 60 * GiB), 1: (80 * GiB, 20 * GiB)}
    monkeypatch.setattr(
        probes, "_cuda_memory", lambda device: DeviceMemory(*figures[device.index], source="torch.cuda")
    )
    monkeypatch.setattr(probes, "nvml_memory", lambda index: None)
    lines = describe_devices().splitlines()[1:]
    assert _named(lines) == ["cuda:0", "cuda:1"]
    assert lines[0].startswith("cuda:0: 80.0 GiB total, 60.0 GiB free") and "NVML unavailable" in lines[0]
    assert lines[1].startswith("cuda:1: 80.0 GiB total, 20.0 GiB free")


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="an NVIDIA driver is present")
def test_nvml_answers_none_without_a_driver() -> None:
    assert nvml_memory(0) is None
    assert nvml_memory(10_000) is None


@pytest.mark.cuda
def test_cuda_probes_see_a_known_allocation() -> None:
    """``device_free`` is the whole GPU's free memory, so another process on the GPU (a parallel
    run's other workers) moves it too between two readings. Each trial reads it around allocating
    1 GiB and around freeing it; the median trial is one that no other process disturbed."""
    device = torch.device("cuda", 0)
    assert device_capacity(device) == torch.cuda.get_device_properties(device).total_memory
    drops, rises = [], []
    for _ in range(5):
        torch.cuda.empty_cache()
        before = device_free(device)
        buffer = torch.empty(GiB, dtype=torch.uint8, device=device)
        during = device_free(device)
        del buffer
        torch.cuda.empty_cache()
        drops.append(before - during)
        rises.append(device_free(device) - during)
    # The caching allocator rounds up and the driver may add a little for its own bookkeeping; on a
    # shared GPU another process allocating or freeing in the same instant moves a trial either way
    # (on the H200 with 14 workers one median drop was 2 MiB short of 1 GiB), so 64 MiB each way.
    slack = 64 * 2**20
    assert abs(statistics.median(drops) - GiB) <= slack, drops
    assert abs(statistics.median(rises) - GiB) <= slack, rises
    mem = nvml_memory(0)
    if mem is not None:
        assert abs(mem.total - device_capacity(device)) <= 0.05 * mem.total
