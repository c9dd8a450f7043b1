"""The disk tier when its disk fails: a write that fails in ``optimizer.step()`` raises
``DiskTierError`` after a step that is finished (the model the next forward uses, the counters),
like plain PyTorch's step; a file that cannot be read while saving raises the same error on every
rank within seconds."""

from __future__ import annotations

import errno
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.disk_tier_helpers import ON_DISK, WIDTH, _boost, _mlp
from support.distributed import run_ranks
from support.models import as_reference, assert_close_on_cpu, tolerance

from chunkmem import DiskTierError


def _full(fd: int, buffers: Any, offset: int) -> int:
    raise OSError(errno.ENOSPC, "No space left on device")


def _step_with_failing_writes(optimizer: Any, fail: bool) -> str:
    """``optimizer.step()``; with ``fail``, every disk write in it fails as on a full disk."""
    real = os.pwritev
    if fail:
        os.pwritev = _full
    try:
        optimizer.step()
    except DiskTierError as error:
        return str(error)
    finally:
        os.pwritev = real
    return "ok"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_write_failing_in_step_leaves_the_step_taken_like_plain_pytorch(tmp_path: Path, precision: str) -> None:
    chunked, optimizer, booster = _boost(ON_DISK, precision, tmp_path)
    reference = as_reference(_mlp(), chunked.compute_device)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    # Masters on disk step on the host: widened where the reference's AdamW runs on a GPU.
    bound = 1e-5 if precision == "fp32" else 2e-2
    within = tolerance(chunked, rtol=bound, atol=bound)
    g = torch.Generator().manual_seed(1)
    probe = torch.randn(4, WIDTH, generator=g)
    for step in range(4):
        x = torch.randn(8, WIDTH, generator=g)
        booster.backward(chunked(x).float().square().mean(), optimizer)
        outcome = _step_with_failing_writes(optimizer, fail=step in (1, 2))
        optimizer.zero_grad()
        reference(x.to(dtype).float().to(chunked.compute_device)).square().mean().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        if step in (1, 2):
            assert "No space left" in outcome, outcome
        else:
            assert outcome == "ok", outcome
        with torch.no_grad():
            got, expected = chunked(probe).float(), reference(probe.to(chunked.compute_device))
        assert_close_on_cpu(got, expected, within, f"step {step}: the next forward differs from plain PyTorch")
        assert chunked.stats().optimizer_steps == step + 1
        assert optimizer.progress.step == step + 1
    state = optimizer.state_dict()["state"]
    assert all(int(entry["step"]) == 4 for entry in state.values())


def _unreadable(fd: int, buffers: Any, offset: int) -> int:
    raise OSError(errno.EIO, "Input/output error")


def _save_with_a_failing_disk(rank: int, world_size: int, tmp: str, how: str, call: str) -> Any:
    """Rank 1's disk tier fails (``how``: its reads fail, or its scratch directory is removed)
    before ``call`` (a full or sharded save, or ``state_dict``); returns what each rank saw, and how fast."""
    disk_dir = Path(tmp) / f"r{rank}"
    disk_dir.mkdir()
    chunked, optimizer, booster = _boost(ON_DISK, "fp32", disk_dir)
    booster.backward(chunked(torch.ones(2, WIDTH)).square().mean(), optimizer)
    optimizer.step()
    real = os.preadv
    if rank == 1 and how == "unreadable":
        os.preadv = _unreadable
    if rank == 1 and how == "removed":
        for scratch in disk_dir.glob(".chunkmem-scratch-*"):
            shutil.rmtree(scratch)
    start = time.monotonic()
    try:
        if call == "save":
            booster.save_optimizer(optimizer, Path(tmp) / "optimizer.pt")
        elif call == "sharded save":
            booster.save_optimizer(optimizer, Path(tmp) / "optimizer.pt", shard=True)
        else:
            optimizer.state_dict()
    except DiskTierError as error:
        return str(error), time.monotonic() - start
    except Exception as error:  # what must not happen: not the disk tier's error
        return f"{type(error).__name__}: {error}", time.monotonic() - start
    finally:
        os.preadv = real
    return "ok", time.monotonic() - start


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("how", "call"),
    [
        pytest.param("unreadable", "save", marks=pytest.mark.fast_tier),
        ("unreadable", "state_dict"),
        ("removed", "save"),
        ("removed", "state_dict"),
        ("removed", "sharded save"),
    ],
)
def test_a_disk_tier_file_that_cannot_be_read_while_saving_raises_on_every_rank(
    tmp_path: Path, how: str, call: str
) -> None:
    results = run_ranks(_save_with_a_failing_disk, 2, args=(str(tmp_path), how, call), timeout=120)
    for rank, (message, seconds) in enumerate(results):
        assert "rank 1" in message and "disk tier" in message, f"rank {rank}: {message}"
        assert seconds < 20, f"rank {rank} waited {seconds:.0f} s"
    assert not (tmp_path / "optimizer.pt").exists()
