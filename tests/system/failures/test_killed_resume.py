"""A two-rank job killed in the middle of a step, with 16-bit parameters on disk (issue 32), resumes
from its last checkpoint exactly: a LoRA fine-tune whose frozen base is on disk, one rank killed in
its backward; a full fine-tune whose trainable shards are on disk, one rank killed while the write
of such a shard is half done. A new job (other processes) loads the checkpoint saved before the
kill and trains on like the uninterrupted run, bit for bit (with its parameters on disk, and with
everything in memory): losses, every weight and optimizer state, the adapter ``save_pretrained``
writes. The killed rank's scratch directory is removed by the next boost into the same
``disk_dir``, and the checkpoint's files are the bytes the save wrote. The other rank raises at
once, saying to restart every rank from the last checkpoint."""

from __future__ import annotations

import ctypes
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from support.distributed import RankFailure, run_ranks
from support.killed_resume_helpers import _checkpoint_digest, _kill, _KillInBackward, _scratch
from support.models import batches, gpt2
from support.param_disk_helpers import IN_RAM, ON_DISK, assert_same_states, boosted
from support.peft_helpers import assert_same_adapter, lora_model, train

from chunkmem.tiers.disk import DiskFile

STEPS, KILLED_RANK, KILLED_STEP = 3, 1, 1  # the checkpoint is saved after step 0
KILLED_IN = {"lora": "backward", "full": "parameter shard write"}
SEED, OTHER_SEED = 0, 3  # the resumed job builds its model from another seed: every value comes from the files
BUILDS: dict[str, Callable[[int], torch.nn.Module]] = {
    "lora": lambda seed: lora_model(seed),
    "full": lambda seed: gpt2(seed=seed),
}


@contextmanager
def _killed_in_backward(model: torch.nn.Module, out: Path) -> Iterator[None]:
    """Within the block, a backward through the first layer's attention kills this process: the
    second layer's adapter gradients are in its chunk's buffer then, the first layer's not yet."""
    attention = model.base_model.model.transformer.h[0].attn.c_attn
    handle = attention.register_forward_hook(lambda module, args, output: _KillInBackward.apply(output, out))
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def _killed_writing_a_parameter_shard(out: Path) -> Iterator[None]:
    """Within the block, the first write of a parameter shard to the disk tier's file writes half
    of its bytes, then kills this process (on the I/O thread, the write in flight)."""
    real = DiskFile._transfer

    def transfer(file: DiskFile, tensor: torch.Tensor, offset: int, write: bool, then: Any, param: bool) -> None:
        if write and param:
            half = tensor.numel() * tensor.element_size() // 2
            os.pwritev(file._fd, [(ctypes.c_char * half).from_address(tensor.data_ptr())], offset)
            _kill("parameter shard write", out)
        real(file, tensor, offset, write, then, param)

    DiskFile._transfer = transfer  # type: ignore[method-assign]
    try:
        yield
    finally:
        DiskFile._transfer = real  # type: ignore[method-assign]


def _boost(kind: str, seed: int, out: str, placement: Any = ON_DISK) -> tuple[Any, Any, Any]:
    model = BUILDS[kind](seed)
    return boosted(model, placement, "bf16", Path(out) / "scratch" if placement is ON_DISK else None)


def _killed_job(rank: int, world_size: int, kind: str, out: str) -> None:
    """Step 0, a sharded checkpoint, then step 1, in which rank 1 is killed."""
    chunked, optimizer, booster = _boost(kind, SEED, out)
    data = batches(STEPS)
    train(chunked, optimizer, booster, data[:KILLED_STEP], rank, world_size)
    booster.save_model(chunked, Path(out) / "model", shard=True)
    booster.save_optimizer(optimizer, Path(out) / "optim", shard=True)
    if rank == 0:  # every rank's part is written once the save returns
        digest = {part: _checkpoint_digest(Path(out) / part) for part in ("model", "optim")}
        (Path(out) / "digest.json").write_text(json.dumps(digest))
    killing = rank == KILLED_RANK
    if kind == "lora":
        kill = _killed_in_backward(chunked.module, Path(out)) if killing else nullcontext()
        with kill:
            train(chunked, optimizer, booster, data[KILLED_STEP : KILLED_STEP + 1], rank, world_size)
    else:
        share = data[KILLED_STEP].chunk(world_size)[rank]
        booster.backward(chunked(input_ids=share, labels=share).loss, optimizer)
        with _killed_writing_a_parameter_shard(Path(out)) if killing else nullcontext():
            optimizer.step()
    raise AssertionError(f"rank {rank} finished step {KILLED_STEP}: rank {KILLED_RANK} was not killed in it")


def _resumed_and_uninterrupted(rank: int, world_size: int, kind: str, out: str, dead: list[str]) -> dict[str, Any]:
    """A new job loads the checkpoint and trains on, with the parameters on disk in the same
    ``disk_dir`` and with everything in memory; then the uninterrupted run."""
    data = batches(STEPS)
    runs, losses, left = [], [], []
    for placement in (ON_DISK, IN_RAM):
        resumed, resumed_optimizer, resumed_booster = _boost(kind, OTHER_SEED, out, placement)
        left += [path for path in dead if Path(path).exists()]
        resumed_booster.load_model(resumed, Path(out) / "model")
        resumed_booster.load_optimizer(resumed_optimizer, Path(out) / "optim")
        losses.append(train(resumed, resumed_optimizer, resumed_booster, data[KILLED_STEP:], rank, world_size))
        runs.append((resumed, resumed_optimizer))
    chunked, optimizer, booster = _boost(kind, SEED, out)
    expected = train(chunked, optimizer, booster, data, rank, world_size)
    # Each state dict is gathered once (a collective over every chunk): not once per parameter.
    expected_model, expected_optimizer = chunked.state_dict(), optimizer.state_dict()["state"]
    for model, opt in runs:
        assert_same_states(model.state_dict(), expected_model)
        resumed_optimizer = opt.state_dict()["state"]
        for index, state in expected_optimizer.items():
            assert_same_states(resumed_optimizer[index], state)
    resumed = runs[0][0]
    if kind == "lora":
        resumed.save_pretrained(Path(out) / "resumed")  # every rank calls; rank 0 writes
        chunked.save_pretrained(Path(out) / "uninterrupted")
    return {"losses": losses, "expected": [expected[KILLED_STEP:]] * 2, "dead_left": left}


@pytest.mark.long
@pytest.mark.slow  # the killed job runs in processes of its own
@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_a_rank_killed_mid_step_resumes_from_the_last_checkpoint_bit_for_bit(tmp_path: Path, kind: str) -> None:
    (tmp_path / "scratch").mkdir()
    with pytest.raises(RankFailure) as killed:
        run_ranks(_killed_job, 2, args=(kind, str(tmp_path)), fresh=True, pg_timeout=30, timeout=120)
    report = str(killed.value)
    assert (tmp_path / "killed").read_text() == KILLED_IN[kind]
    assert f"rank {KILLED_RANK}: no result (exit code -9" in report, report
    assert "was not killed" not in report, report
    # The other rank raised (it did not wait for the group's timeout), saying what to do.
    assert "rank 0 raised" in report and "restart every rank from the last checkpoint" in report, report
    # The killed rank's scratch is left (its process could not remove it); the other rank's went at its exit.
    dead = _scratch(tmp_path / "scratch")
    assert [p.name.endswith(f"-rank{KILLED_RANK}") for p in dead] == [True], dead
    assert any(f.stat().st_size > 0 for f in dead[0].iterdir()), "the killed rank's scratch held its shards"
    digest = json.loads((tmp_path / "digest.json").read_text())
    for part in ("model", "optim"):
        assert _checkpoint_digest(tmp_path / part) == digest[part], f"the {part} checkpoint changed after its save"
    results = run_ranks(_resumed_and_uninterrupted, 2, args=(kind, str(tmp_path), [str(p) for p in dead]))
    for rank, result in enumerate(results):
        assert result["dead_left"] == [], f"rank {rank}: the next boost left the killed rank's scratch"
        assert result["losses"] == result["expected"], rank
    if kind == "lora":
        assert_same_adapter(tmp_path / "resumed", tmp_path / "uninterrupted")
