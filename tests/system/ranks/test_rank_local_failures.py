"""A failure that happens on one rank only, in a forward or a backward (a disk read of that rank's
own files, its activations' bytes tampered with): every rank raises the same error within
seconds, while the failing rank's process stays alive (a user who catches the error keeps it; a
process that ends would fail the others' collectives at once on gloo and hide a hang)."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.distributed import run_ranks
from support.models import adamw_two_groups, batches, boost, gpt2, lm_loss

from chunkmem import DiskTierError
from chunkmem.placement import ActivationPlacement, StaticPlacementConfig

GPT2_BUDGET = 64 * 1024
KEPT_ALIVE = 25.0  # seconds the failing rank waits for the others to raise too
PG_TIMEOUT = 30.0  # the process group's: a rank left waiting raises (a gloo timeout) after this


def _wait_for_the_others(signals: Path, rank: int, world_size: int, began: float) -> None:
    """This rank raised: it says so and stays alive until every rank did (or ``KEPT_ALIVE`` passed)."""
    (signals / f"raised-{rank}").touch()
    while time.monotonic() - began < KEPT_ALIVE:
        if all((signals / f"raised-{r}").exists() for r in range(world_size)):
            return
        time.sleep(0.05)


def _raised(run: Callable[[], Any], signals: str, rank: int, world_size: int) -> dict[str, Any]:
    """What ``run()`` raised on this rank (``"no error"``: nothing) and after how many seconds; then
    this rank stays alive until every rank raised (``_wait_for_the_others``)."""
    began = time.monotonic()
    try:
        run()
        outcome = "no error"
    except DiskTierError as error:
        outcome = str(error)
    except Exception as error:  # what must not happen: a collective's timeout, not the disk tier's error
        outcome = f"{type(error).__name__}: {error}"
    seconds = time.monotonic() - began
    _wait_for_the_others(Path(signals), rank, world_size, began)
    return {"error": outcome, "seconds": seconds}


def _on_two_ranks(fn: Callable[..., Any], tmp_path: Path, *args: Any) -> list[dict[str, Any]]:
    """``fn(rank, world_size, scratch, signals, *args)`` on two fresh ranks whose process group
    times out after ``PG_TIMEOUT``: a rank left waiting shows as an error after that long."""
    (tmp_path / "signals").mkdir()
    run_args = (str(tmp_path), str(tmp_path / "signals"), *args)
    results = run_ranks(fn, 2, args=run_args, pg_timeout=PG_TIMEOUT, timeout=90)
    for rank, result in enumerate(results):
        assert "on rank 1" in result["error"] and "on rank 0" not in result["error"], (rank, result)
        assert result["seconds"] < 10, (rank, result)
    assert results[0]["error"] == results[1]["error"]
    return results


def _activation_file_truncated(rank: int, world_size: int, scratch: str, signals: str, how: str) -> dict[str, Any]:
    """Rank 1's activation file is truncated (``how``), or overwritten with other bytes of its size,
    between the forward and the backward."""
    activations = ActivationPlacement(offload=["GPT2Block"], host_budget=GPT2_BUDGET)
    chunked, optimizer, booster = boost(
        gpt2(n_embd=32), adamw_two_groups, chunk_size=4_000, activations=activations, disk_dir=scratch
    )
    loss = lm_loss(chunked, batches(1, batch=8)[0].chunk(world_size)[rank])
    if rank == 1:
        files = sorted(Path(scratch).glob("*-rank1/activations-*.bin"))
        assert files, "rank 1 wrote activations to disk"
        for file in files:
            if how == "truncated":
                os.truncate(file, 0)
            else:
                file.write_bytes(os.urandom(file.stat().st_size))
    result = _raised(lambda: booster.backward(loss, optimizer), signals, rank, world_size)
    if "Every rank raises this error" not in result["error"]:
        return result
    # The backward's gradients are lost on every rank: its step is refused until zero_grad, then training goes on.
    with pytest.raises(DiskTierError, match=r"step is refused: call zero_grad\(\)"):
        optimizer.step()
    optimizer.zero_grad()
    booster.backward(lm_loss(chunked, batches(2, batch=8)[1].chunk(world_size)[rank]), optimizer)
    optimizer.step()
    result["steps"] = chunked.stats().optimizer_steps
    return result


@pytest.mark.multirank
@pytest.mark.parametrize(("how", "said"), [("truncated", "stopped at 0"), ("overwritten", "differ from those written")])
def test_an_activation_file_changed_on_one_rank_raises_on_every_rank_within_seconds(
    tmp_path: Path, how: str, said: str
) -> None:
    for rank, result in enumerate(_on_two_ranks(_activation_file_truncated, tmp_path, how)):
        assert "saved activations" in result["error"] and said in result["error"], (rank, result)
        assert result["steps"] == 1, (rank, result)


# --- the disk tier's own file: a parameter shard read for a gather, a gradient read back to accumulate ---------
PARAMS_ON_DISK = StaticPlacementConfig(
    offload_optim_frac=1.0, offload_param_frac=1.0, offload_disk_frac=1.0, offload_param_disk_frac=1.0, max_prefetch=1
)
GRADS_ON_DISK = StaticPlacementConfig(offload_optim_frac=1.0, offload_param_frac=1.0, offload_disk_frac=1.0)


def _sides_file_truncated(rank: int, world_size: int, scratch: str, signals: str, what: str) -> dict[str, Any]:
    """Rank 1's disk tier file is truncated: before a forward that gathers parameter shards from it
    (``what="parameters"``), or between two backwards that reduce into gradients on disk (the
    second adds the first, read back from it: ``"gradients"``)."""
    placement = PARAMS_ON_DISK if what == "parameters" else GRADS_ON_DISK
    chunked, optimizer, booster = boost(
        gpt2(n_embd=32), adamw_two_groups, chunk_size=4_000, placement=placement, disk_dir=scratch
    )
    first, second = batches(1, batch=8)[0].chunk(world_size)[rank].chunk(2)
    if what == "gradients":
        booster.backward(lm_loss(chunked, first), optimizer)
    if rank == 1:
        (file,) = Path(scratch).glob("*-rank1/sides.bin")
        os.truncate(file, 0)
    return _raised(lambda: booster.backward(lm_loss(chunked, second), optimizer), signals, rank, world_size)


@pytest.mark.multirank
@pytest.mark.parametrize("what", ["parameters", "gradients"])
def test_a_disk_tier_file_truncated_on_one_rank_raises_on_every_rank_within_seconds(tmp_path: Path, what: str) -> None:
    expected = "reading a parameter shard" if what == "parameters" else "reading back a gradient"
    for rank, result in enumerate(_on_two_ranks(_sides_file_truncated, tmp_path, what)):
        assert expected in result["error"] and "sides.bin" in result["error"], (rank, result)


# --- the weights files a meta model is boosted from: each rank's own copy ---------------------------
def _boosted_from_a_bad_weights_file(
    rank: int, world_size: int, scratch: str, signals: str, how: str
) -> dict[str, Any]:
    """Rank 1's own copy of the weights is bad at boost: ``"truncated"`` (its header names bytes past
    its end), or ``"unreadable"`` (a read error where boost samples the pages of a piece it reads in
    place, a bad sector: injected)."""
    import torch
    from support.param_disk_helpers import ON_DISK
    from support.peft_helpers import adamw
    from support.values_in_place_helpers import CHUNK, tiny, write_weights

    from chunkmem import Booster, ChunkPlugin
    from chunkmem.chunks import values_in_place

    own = Path(scratch) / f"rank{rank}"
    own.mkdir()
    weights = write_weights(own, torch.bfloat16)
    if rank == 1 and how == "truncated":
        os.truncate(weights, weights.stat().st_size - 4096)
    with torch.device("meta"):
        model = tiny()
    booster = Booster(ChunkPlugin(placement=ON_DISK, precision="bf16", chunk_size=CHUNK, disk_dir=own))
    take = values_in_place.ContentSample.take

    def unreadable(*args: Any) -> Any:
        raise OSError(errno.EIO, "Input/output error")

    if rank == 1 and how == "unreadable":
        values_in_place.ContentSample.take = unreadable  # type: ignore[method-assign]
    try:
        result = _raised(lambda: booster.boost(model, adamw(model), weights=weights), signals, rank, world_size)
    finally:
        values_in_place.ContentSample.take = take  # type: ignore[method-assign]
    result["file"] = str(Path(scratch) / "rank1" / weights.name)
    return result


@pytest.mark.multirank
@pytest.mark.parametrize(("how", "said"), [("truncated", "cannot be read"), ("unreadable", "Input/output error")])
def test_a_weights_file_bad_on_one_rank_at_boost_raises_on_every_rank_within_seconds(
    tmp_path: Path, how: str, said: str
) -> None:
    (tmp_path / "signals").mkdir()
    args = (str(tmp_path), str(tmp_path / "signals"), how)
    results = run_ranks(_boosted_from_a_bad_weights_file, 2, args=args, timeout=60)
    assert (
        results[0]["error"]
        == f"{results[1]['error']} (rank 0 did its part; every rank raises this error, nothing was changed here)"
    )
    for rank, result in enumerate(results):
        error = result["error"]
        assert error.startswith("opening the weights files") and "on rank 1: " in error, (rank, result)
        assert "on rank 0" not in error and said in error and result["file"] in error, (rank, result)
        assert "Boost from a complete checkpoint" in error, (rank, result)
        assert result["seconds"] < 10, (rank, result)
