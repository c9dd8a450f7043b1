"""What a save refuses and how a set of saves survives: a value no load can read back is refused at
save, naming it; a set of model, optimizer and scheduler files saved to fixed paths resumes after a
kill between its saves; a second job saving to the same path is told, and readers never see a
false corruption."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from distributed import run_ranks

from chunkmem import Booster, ChunkPlugin, NotSupportedError


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
