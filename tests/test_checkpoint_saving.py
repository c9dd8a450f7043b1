"""What a save refuses and how a set of saves survives: a value no load can read back is refused at
save, naming it; a set of model, optimizer and scheduler files saved to fixed paths resumes after a
kill between its saves; a second job saving to the same path is told, and readers never see a
false corruption."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from distributed import run_ranks
from killed_saves import live_workspace

from chunkmem import Booster, CheckpointWriteError, ChunkPlugin, NotSupportedError


def _small(lr: Any = 1e-3) -> tuple[Any, Any, Booster]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    booster = Booster(ChunkPlugin(precision="fp32", chunk_size=200))
    chunked, boosted, *_ = booster.boost(model, optimizer)
    return chunked, boosted, booster


def _step(chunked: Any, optimizer: Any, booster: Booster) -> None:
    booster.backward(chunked(torch.ones(4, 16)).square().mean(), optimizer)
    optimizer.step()
    optimizer.zero_grad()


class _Warmup:
    """An LR lambda as an object (its attributes are what LambdaLR saves)."""

    def __init__(self, factor: Any) -> None:
        self.factor = factor

    def __call__(self, epoch: int) -> float:
        return float(self.factor)


# --- a value no load can read is refused at save ----------------------------------------------
def test_a_numpy_hyperparameter_is_refused_at_save_naming_it(tmp_path: Path) -> None:
    chunked, optimizer, booster = _small(lr=np.float64(1e-3))
    _step(chunked, optimizer, booster)
    for path, shard, where in (
        (tmp_path / "optim.pt", False, "optimizer.state_dict()['param_groups'][0]['lr']"),
        (tmp_path / "optim", True, "param_groups.0.lr"),
    ):
        with pytest.raises(NotSupportedError) as caught:
            booster.save_optimizer(optimizer, path, shard=shard)
        message = str(caught.value)
        assert where in message and "numpy.float64" in message and str(path) in message, message
        assert not path.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []

    _, plain_optimizer, plain_booster = _small()  # a plain lr; the scheduler's lambda holds a numpy value
    scheduler = torch.optim.lr_scheduler.LambdaLR(plain_optimizer, _Warmup(np.float64(0.5)))
    with pytest.raises(NotSupportedError, match=r"scheduler.state_dict\(\)\['lr_lambdas'\]\[0\]\['factor'\]"):
        plain_booster.save_lr_scheduler(scheduler, tmp_path / "sched.pt", plain_optimizer)
    assert not (tmp_path / "sched.pt").exists()

    # the same values as plain Python numbers save and load back
    optimizer.param_groups[0]["lr"] = float(optimizer.param_groups[0]["lr"])
    booster.save_optimizer(optimizer, tmp_path / "optim.pt")
    optimizer.param_groups[0]["lr"] = 0.5
    booster.load_optimizer(optimizer, tmp_path / "optim.pt")
    assert optimizer.param_groups[0]["lr"] == 1e-3


def _numpy_lr_on_two_ranks(rank: int, world_size: int, directory: str) -> list[str]:
    chunked, optimizer, booster = _small(lr=np.float64(1e-3))
    _step(chunked, optimizer, booster)
    messages = []
    for name, shard in (("optim.pt", False), ("optim", True)):
        with pytest.raises(NotSupportedError) as caught:
            booster.save_optimizer(optimizer, Path(directory) / name, shard=shard)
        messages.append(str(caught.value))
    return messages


@pytest.mark.multirank
def test_a_numpy_hyperparameter_is_refused_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(_numpy_lr_on_two_ranks, 2, (str(tmp_path),))
    for file_message, directory_message in results:
        assert "['lr']" in file_message and "numpy.float64" in file_message, file_message
        assert "param_groups.0.lr" in directory_message and "numpy.float64" in directory_message, directory_message
    assert list(tmp_path.iterdir()) == []


# --- a second job saving to the same path -----------------------------------------------------
def _fill(chunked: Any, value: float) -> None:
    chunked.load_state_dict({k: torch.full_like(v, value) for k, v in chunked.state_dict().items()})


def _values(chunked: Any) -> set[float]:
    return {float(v) for tensor in chunked.state_dict().values() for v in tensor.unique()}


@pytest.mark.parametrize("shard", [False, True])
def test_a_save_while_another_job_saves_to_the_path_is_refused(tmp_path: Path, shard: bool) -> None:
    chunked, _, booster = _small()
    target = tmp_path / ("model" if shard else "model.pt")
    _fill(chunked, 1.0)
    booster.save_model(chunked, target, shard=shard)
    process, other = live_workspace(target)  # another job's save to the same path, still writing
    try:
        _fill(chunked, 2.0)
        with pytest.raises(CheckpointWriteError, match=r"another save to .* is running.*its own checkpoint path"):
            booster.save_model(chunked, target, shard=shard)
        assert other.exists() and (other / "checkpoint" / "partial").read_bytes() == b"half a checkpoint"
        booster.load_model(chunked, target)
        assert _values(chunked) == {1.0}, "the refused save changed the checkpoint"
    finally:
        process.kill()
        process.wait()
    _fill(chunked, 2.0)
    booster.save_model(chunked, target, shard=shard)  # the other job is gone: saves again
    _fill(chunked, 0.0)
    booster.load_model(chunked, target)
    assert _values(chunked) == {2.0}


def _save_beside_a_running_save(rank: int, world_size: int, target: str) -> tuple[str, list[float]]:
    chunked, _, booster = _small()
    _fill(chunked, 2.0)
    with pytest.raises(CheckpointWriteError) as caught:
        booster.save_model(chunked, Path(target), shard=True)
    _fill(chunked, 0.0)
    booster.load_model(chunked, Path(target))
    return str(caught.value), sorted(_values(chunked))


@pytest.mark.multirank
def test_a_sharded_save_beside_another_jobs_save_is_refused_on_every_rank(tmp_path: Path) -> None:
    chunked, _, booster = _small()
    target = tmp_path / "model"
    _fill(chunked, 1.0)
    booster.save_model(chunked, target, shard=True)
    process, other = live_workspace(target)
    try:
        results = run_ranks(_save_beside_a_running_save, 2, (str(target),))
        assert other.exists()
    finally:
        process.kill()
        process.wait()
    for message, values in results:
        assert "another save to" in message and str(target) in message, message
        assert values == [1.0], values


_SAVER = """
import sys, torch
from chunkmem import Booster, CheckpointWriteError, ChunkPlugin

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
booster = Booster(ChunkPlugin(precision="fp32", chunk_size=200))
chunked, *_ = booster.boost(model)
value, saved, refused = float(sys.argv[2]), 0, 0
chunked.load_state_dict({k: torch.full_like(v, value) for k, v in chunked.state_dict().items()})
while saved + refused < int(sys.argv[3]):
    try:
        booster.save_model(chunked, sys.argv[1])
        saved += 1
    except CheckpointWriteError as error:
        assert "another save to" in str(error), error
        refused += 1
print(saved, refused, flush=True)
"""


@pytest.mark.slow
def test_two_jobs_saving_to_one_path_are_told_and_a_reader_sees_no_false_corruption(tmp_path: Path) -> None:
    chunked, _, booster = _small()
    target = tmp_path / "model.pt"
    _fill(chunked, 1.0)
    booster.save_model(chunked, target)
    savers = [
        subprocess.Popen([sys.executable, "-c", _SAVER, str(target), value, "300"], stdout=subprocess.PIPE, text=True)
        for value in ("1.0", "2.0")
    ]
    seen: list[float] = []
    try:
        while any(saver.poll() is None for saver in savers):
            _fill(chunked, -1.0)
            booster.load_model(chunked, target)  # a false "corrupted" raises here
            (value,) = _values(chunked)
            seen.append(value)
    finally:
        for saver in savers:
            saver.kill()
    counts = [tuple(map(int, saver.communicate()[0].split())) for saver in savers]
    assert all(saver.returncode == 0 for saver in savers), counts
    assert sum(refused for _, refused in counts) > 0, f"the savers never overlapped: {counts}"
    assert all(saved > 0 for saved, _ in counts), counts
    assert set(seen) <= {1.0, 2.0} and len(seen) > 0, seen
