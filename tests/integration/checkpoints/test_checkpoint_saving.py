"""What a save refuses and how a set of saves survives: a value no load can read back is refused at
save, naming it; a set of model, optimizer and scheduler files saved to fixed paths resumes after a
kill between its saves; a second job saving to the same path is told, and readers never see a
false corruption."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.distributed import run_ranks
from support.forked import run_script, start_script
from support.killed_saves import live_workspace
from support.paths import TESTS

from chunkmem import Booster, CheckpointMismatchError, CheckpointWriteError, ChunkPlugin, NotSupportedError


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


# --- a set of saves interrupted between its saves ---------------------------------------------
class _Run:
    """A boosted model, optimizer and scheduler saving their set to fixed paths under ``root``."""

    def __init__(self, root: Path, shard: bool) -> None:
        self.chunked, self.optimizer, self.booster = _small()
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)
        self.shard = shard
        suffix = "" if shard else ".pt"
        self.paths = {
            "model": root / f"model{suffix}",
            "optimizer": root / f"optim{suffix}",
            "sched": root / "sched.pt",
        }

    def train(self) -> None:
        _step(self.chunked, self.optimizer, self.booster)
        self.scheduler.step()

    def save(self, upto: int = 3) -> None:
        """The set's saves in order; with ``upto`` < 3 the job dies after that many."""
        saves = [
            lambda: self.booster.save_model(self.chunked, self.paths["model"], shard=self.shard),
            lambda: self.booster.save_optimizer(self.optimizer, self.paths["optimizer"], shard=self.shard),
            lambda: self.booster.save_lr_scheduler(self.scheduler, self.paths["sched"], self.optimizer),
        ]
        for save in saves[:upto]:
            save()

    def state(self) -> tuple[dict[str, torch.Tensor], Any, Any]:
        model = {k: v.clone() for k, v in self.chunked.state_dict().items()}
        return model, copy.deepcopy(self.optimizer.state_dict()), copy.deepcopy(self.scheduler.state_dict())


def _same_state(actual: tuple[Any, Any, Any], expected: tuple[Any, Any, Any]) -> None:
    assert actual[0].keys() == expected[0].keys()
    assert all(torch.equal(actual[0][k], expected[0][k]) for k in expected[0])
    for key, value in expected[1]["state"].items():
        assert all(torch.equal(actual[1]["state"][key][name], v) for name, v in value.items())
    assert actual[1]["param_groups"] == expected[1]["param_groups"]
    assert actual[2] == expected[2]


def _kept(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.endswith(".chunkmem-kept"))


@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("killed_after", [1, 2])
def test_a_set_killed_between_its_saves_resumes_from_the_checkpoints_it_replaced(
    tmp_path: Path, shard: bool, killed_after: int
) -> None:
    job = _Run(tmp_path, shard)
    for _ in range(2):
        job.train()
        job.save()
    assert _kept(tmp_path) == [], "a whole set keeps nothing"
    at_step_2 = job.state()
    job.train()
    job.save(upto=killed_after)  # killed after the model (and the optimizer) save of step 3

    resumed = _Run(tmp_path, shard)  # a new job resumes from the fixed paths
    paths = resumed.paths
    resumed.booster.load_model(resumed.chunked, paths["model"])
    if killed_after == 1:
        with pytest.raises(CheckpointMismatchError) as caught:
            resumed.booster.load_optimizer(resumed.optimizer, paths["optimizer"])
    else:
        resumed.booster.load_optimizer(resumed.optimizer, paths["optimizer"])
        with pytest.raises(CheckpointMismatchError) as caught:
            resumed.booster.load_lr_scheduler(resumed.scheduler, paths["sched"])
    message = str(caught.value)
    named = [p for p in tmp_path.glob(".*.chunkmem-kept/*") if str(p) in message]  # the fix it names exists
    assert len(named) == killed_after and "step 2" in message, message
    for kept in named:  # the fix: load the checkpoints of step 2 the killed set replaced
        if kept.name.startswith("model"):
            resumed.booster.load_model(resumed.chunked, kept)
        else:
            resumed.booster.load_optimizer(resumed.optimizer, kept)
    if killed_after == 1:
        resumed.booster.load_optimizer(resumed.optimizer, paths["optimizer"])
    resumed.booster.load_lr_scheduler(resumed.scheduler, paths["sched"])
    _same_state(resumed.state(), at_step_2)

    resumed.train()  # step 3 again: the resumed set saves whole, and what was kept goes
    resumed.save()
    assert _kept(tmp_path) == []


_KILLED_JOB = """
import os, sys
from pathlib import Path
sys.path[:0] = [{here!r}, {tests!r}]
from test_checkpoint_saving import _Run

job = _Run(Path({root!r}), {shard!r})
for _ in range(2):
    job.train()
    job.save()
job.train()
job.save(upto=1)
os._exit(9)  # killed before the optimizer and scheduler saves of step 3
"""


def _close_state(actual: tuple[Any, Any, Any], expected: tuple[Any, Any, Any]) -> None:
    assert all(torch.allclose(actual[0][k], v, rtol=1e-6, atol=0) for k, v in expected[0].items())
    for key, value in expected[1]["state"].items():
        assert all(torch.allclose(actual[1]["state"][key][n], v, rtol=1e-6) for n, v in value.items())
    assert actual[1]["param_groups"] == expected[1]["param_groups"] and actual[2] == expected[2]


@pytest.mark.slow
@pytest.mark.parametrize("shard", [False, True])
def test_a_job_killed_between_the_saves_of_a_set_resumes(tmp_path: Path, shard: bool) -> None:
    script = _KILLED_JOB.format(here=str(Path(__file__).parent), tests=str(TESTS), root=str(tmp_path), shard=shard)
    done = run_script(script)
    assert done.returncode == 9, done.stderr[-2000:]
    reference = _Run(tmp_path / "unused", shard)  # the same job, uninterrupted, to step 2
    for _ in range(2):
        reference.train()
    resumed = _Run(tmp_path, shard)
    resumed.booster.load_model(resumed.chunked, resumed.paths["model"])
    with pytest.raises(CheckpointMismatchError, match=r"chunkmem-kept") as caught:
        resumed.booster.load_optimizer(resumed.optimizer, resumed.paths["optimizer"])
    (kept,) = [p for p in tmp_path.glob(".*.chunkmem-kept/*") if str(p) in str(caught.value)]
    resumed.booster.load_model(resumed.chunked, kept)
    resumed.booster.load_optimizer(resumed.optimizer, resumed.paths["optimizer"])
    resumed.booster.load_lr_scheduler(resumed.scheduler, resumed.paths["sched"])
    _close_state(resumed.state(), reference.state())


@pytest.mark.parametrize("shard", [False, True])
def test_a_directory_with_the_kept_name_that_chunkmem_did_not_make_is_never_touched(
    tmp_path: Path, shard: bool
) -> None:
    job = _Run(tmp_path, shard)
    job.train()
    job.save(upto=1)
    target = job.paths["model"]
    mine = tmp_path / f".{target.name}.chunkmem-kept"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    job.train()
    with pytest.raises(CheckpointWriteError, match=r"chunkmem did not make it"):
        job.save(upto=1)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "mine"
    job.booster.load_model(job.chunked, target)  # still the checkpoint of step 1
    assert job.chunked.progress.step == 1


def _killed_set_on_two_ranks(rank: int, world_size: int, directory: str) -> str:
    root = Path(directory)
    job = _Run(root, shard=True)
    for _ in range(2):
        job.train()
        job.save()
    at_step_2 = job.state()
    job.train()
    job.save(upto=1)
    resumed = _Run(root, shard=True)
    resumed.booster.load_model(resumed.chunked, resumed.paths["model"])
    with pytest.raises(CheckpointMismatchError) as caught:
        resumed.booster.load_optimizer(resumed.optimizer, resumed.paths["optimizer"])
    kept = root / ".model.chunkmem-kept" / "model"
    assert str(kept) in str(caught.value), str(caught.value)
    resumed.booster.load_model(resumed.chunked, kept)
    resumed.booster.load_optimizer(resumed.optimizer, resumed.paths["optimizer"])
    resumed.booster.load_lr_scheduler(resumed.scheduler, resumed.paths["sched"])
    _same_state(resumed.state(), at_step_2)
    resumed.train()
    resumed.save()
    return str(caught.value)


@pytest.mark.multirank
def test_a_sharded_set_killed_between_its_saves_resumes_at_two_ranks(tmp_path: Path) -> None:
    messages = run_ranks(_killed_set_on_two_ranks, 2, (str(tmp_path),))
    assert messages[0] == messages[1]
    assert _kept(tmp_path) == [], "the resumed set was saved whole: nothing stays kept"


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
import os, sys, time, torch
from chunkmem import Booster, CheckpointWriteError, ChunkPlugin

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
booster = Booster(ChunkPlugin(precision="fp32", chunk_size=200))
chunked, *_ = booster.boost(model)
value, saved, refused = float(sys.argv[2]), 0, 0
chunked.load_state_dict({k: torch.full_like(v, value) for k, v in chunked.state_dict().items()})
print("ready", flush=True)
while not os.path.exists(sys.argv[4]):  # both start saving together, however long each took to start
    time.sleep(0.01)
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
    go = tmp_path / "go"
    savers = [start_script(_SAVER, str(target), value, "150", str(go)) for value in ("1.0", "2.0")]
    seen: list[float] = []
    try:
        assert all(saver.stdout.readline() == "ready\n" for saver in savers)
        go.touch()
        while any(saver.poll() is None for saver in savers):
            _fill(chunked, -1.0)
            booster.load_model(chunked, target)  # a false "corrupted" raises here
            (value,) = _values(chunked)
            seen.append(value)
    finally:
        for saver in savers:
            saver.kill()
    finished = [saver.communicate() for saver in savers]
    assert all(saver.returncode == 0 for saver in savers), finished
    counts = [tuple(map(int, out.split())) for out, _ in finished]
    assert sum(refused for _, refused in counts) > 0, f"the savers never overlapped: {counts}"
    assert all(saved > 0 for saved, _ in counts), counts
    assert set(seen) <= {1.0, 2.0} and len(seen) > 0, seen
