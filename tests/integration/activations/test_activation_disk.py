"""Offloaded activations beyond ``ActivationPlacement.host_budget`` go to the disk tier: training
stays bit for bit as plain PyTorch (one rank) and as keeping them (two ranks, ``no_sync``); the
host memory the copies take (the ledger's peak) stays within the budget; the bytes written to disk
and read back equal a count made with saved-tensor hooks over the plain model and the documented
rule; the planner predicts them; a full disk is an error on every rank, naming the directory."""

from __future__ import annotations

import errno
import gc
import importlib
import json
import os
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from support.activation_disk_helpers import _to_disk
from support.activations_helpers import (
    STEPS,
    Block,
    Stack,
    _assert_identical,
    _data,
    _loss,
    _plain,
    _trained,
    saved_storages,
)
from support.distributed import run_ranks
from support.models import adamw_two_groups, as_reference, batches, boost, gpt2, lm_loss, train_accumulating

from chunkmem import ChunkPlugin, DiskTierError, plan
from chunkmem.device.simulated import simulated_device
from chunkmem.placement import ActivationPlacement


def _stack_sizes() -> list[int]:
    model = as_reference(Stack())
    return saved_storages(model.blocks, lambda: _loss(model, _data()[0]))


# --- config -----------------------------------------------------------------------------------
def test_the_host_budget_is_refused_where_it_cannot_apply_naming_the_field(tmp_path: Path) -> None:
    assert ActivationPlacement(offload=["Block"], host_budget="8KiB").host_budget == 8192
    with pytest.raises(ValidationError, match="host_budget caps the host memory of the offload blocks' copies"):
        ActivationPlacement(recompute=["Block"], host_budget=8192)
    assert ActivationPlacement(auto=["Block"], host_budget=8192).host_budget == 8192  # their offloaded calls
    with pytest.raises(ValidationError, match="host_budget=4095 bytes is below the minimum of 4096"):
        ActivationPlacement(offload=["Block"], host_budget=4095)
    with pytest.raises(DiskTierError, match=r"ChunkPlugin has no disk_dir: pass ChunkPlugin\(disk_dir=...\)"):
        boost(Stack(), adamw_two_groups, activations=ActivationPlacement(offload=[Block], host_budget=8192))
    with pytest.raises(DiskTierError, match="is not a writable directory"):
        activations = ActivationPlacement(offload=[Block], host_budget=8192)
        boost(Stack(), adamw_two_groups, activations=activations, disk_dir=tmp_path / "missing")


# --- one rank: exact, within the budget, counted ------------------------------------------------
def test_beyond_the_host_budget_activations_go_to_disk_bit_exact_and_counted(tmp_path: Path) -> None:
    budget = 6000
    sizes = _stack_sizes()
    disk = _to_disk(sizes, budget)
    assert 0 < disk < sum(sizes)  # some storages stay in host memory, some go to disk
    activations = ActivationPlacement(offload=[Block], host_budget=budget)
    chunked, optimizer, booster = boost(
        Stack(), adamw_two_groups, precision="fp32", chunk_size=4_000, activations=activations, disk_dir=tmp_path
    )
    _assert_identical(_trained(chunked, optimizer, booster), _plain(Stack()))
    stats = chunked.stats()
    assert stats.activation_disk_write_bytes == stats.activation_disk_read_bytes == STEPS * disk
    assert stats.activation_d2h_bytes == stats.activation_h2d_bytes == STEPS * sum(sizes)
    assert stats.disk_write_bytes == stats.disk_read_bytes == 0  # no chunk on disk
    # The default placement keeps every chunk on the device: the host peak is the copies' and the window's.
    assert 0 < stats.peak_host_bytes <= budget
    assert chunked.manager.ledger.disk_bytes == 0  # every region freed after its backward


def test_a_graph_dropped_without_its_backward_gives_its_host_bytes_and_disk_regions_back(tmp_path: Path) -> None:
    activations = ActivationPlacement(offload=[Block], host_budget=6000)
    chunked, *_ = boost(Stack(), adamw_two_groups, chunk_size=4_000, activations=activations, disk_dir=tmp_path)
    ledger = chunked.manager.ledger
    for _ in range(2):  # the second forward finds the first one's room free again
        loss = _loss(chunked, _data()[0])
        assert ledger.disk_bytes == _to_disk(_stack_sizes(), 6000) > 0 and ledger.host_bytes > 0
        del loss
        gc.collect()
        assert ledger.disk_bytes == ledger.host_bytes == 0


def test_activations_changed_on_disk_before_their_backward_are_refused_not_used(tmp_path: Path) -> None:
    """Each piece written carries its CRC-32: bytes read back that differ (the file overwritten
    between the forward and the backward) raise, naming the block and the file, instead of
    giving other gradients."""
    activations = ActivationPlacement(offload=[Block], host_budget=6000)
    chunked, optimizer, booster = boost(
        Stack(), adamw_two_groups, chunk_size=4_000, activations=activations, disk_dir=tmp_path
    )
    before = {key: value.clone() for key, value in chunked.state_dict().items()}
    loss = _loss(chunked, _data()[0])
    (file,) = tmp_path.glob(".chunkmem-scratch-*/activations-0.bin")
    file.write_bytes(os.urandom(file.stat().st_size))
    with pytest.raises(DiskTierError, match=r"saved activations of block blocks\.\d.*differ from those written"):
        booster.backward(loss, optimizer)
    # The backward stopped part-way: a user who catches the error and steps gets no partial update.
    with pytest.raises(DiskTierError, match=r"This optimizer step is refused: call zero_grad\(\)"):
        optimizer.step()
    assert all(torch.equal(value, before[key]) for key, value in chunked.state_dict().items())
    assert chunked.stats().optimizer_steps == 0
    optimizer.zero_grad()  # as the refusal says: the refusal goes with the lost gradients
    optimizer.step()  # no gradients: nothing changes, and nothing is refused
    assert all(torch.equal(value, before[key]) for key, value in chunked.state_dict().items())


# --- the planner --------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["plan-for-the-cpu", "plan-for-a-gpu"])
def test_the_plan_predicts_the_disk_bytes_a_run_counts(tmp_path: Path, device: str) -> None:
    """A plan for the CPU against a run on it; one for a GPU against a run on the simulated device
    (where the host budget counts each copy's pinned block, while the disk gets its bytes)."""
    budget = 6000
    activations = ActivationPlacement(offload=[Block], host_budget=budget)
    with torch.device("meta"):
        model = Stack()
    plugin = ChunkPlugin(precision="fp32", chunk_size=4_000, activations=activations, disk_dir=tmp_path)
    x = _data()[0]
    predicted = plan(model, plugin, {"x": torch.zeros_like(x)}, device=device, steps=2)
    with simulated_device() if device == "cuda" else nullcontext():
        chunked, optimizer, booster = boost(
            Stack(), adamw_two_groups, precision="fp32", chunk_size=4_000, activations=activations, disk_dir=tmp_path
        )
        booster.backward(_loss(chunked, x), optimizer)
    stats = chunked.stats()
    assert predicted.activation_disk_write_bytes_per_step == stats.activation_disk_write_bytes > 0
    assert predicted.activation_disk_read_bytes_per_step == stats.activation_disk_read_bytes
    assert predicted.activation_d2h_bytes_per_step == stats.activation_d2h_bytes
    assert "activations to disk and back per step" in predicted.table()


# --- two ranks ------------------------------------------------------------------------------------
GPT2_BUDGET = 64 * 1024


def _gpt2_disk(rank: int, world_size: int, scratch: str) -> None:
    """Two micro-batches a step, the first inside ``no_sync``: offloaded beyond the host budget
    equals keeping, bit for bit, and writes what the count says."""
    runs = {}
    for name, activations in (
        ("keep", None),
        ("disk", ActivationPlacement(offload=["GPT2Block"], host_budget=GPT2_BUDGET)),
    ):
        chunked, optimizer, booster = boost(
            gpt2(n_embd=32), adamw_two_groups, chunk_size=4_000, activations=activations, disk_dir=scratch
        )
        losses = train_accumulating(chunked, optimizer, booster, batches(2, batch=8), rank, world_size)
        runs[name] = {"losses": losses, "state": chunked.state_dict(), "stats": chunked.stats()}
    _assert_identical(runs["disk"], runs["keep"])
    model = as_reference(gpt2(n_embd=32))
    micro = batches(1, batch=8)[0].chunk(world_size)[rank].chunk(2)[0]
    sizes = saved_storages(model.transformer.h, lambda: lm_loss(model, micro))
    stats = runs["disk"]["stats"]
    assert 0 < _to_disk(sizes, GPT2_BUDGET) < sum(sizes)
    assert stats.activation_disk_write_bytes == stats.activation_disk_read_bytes == 4 * _to_disk(sizes, GPT2_BUDGET)
    assert stats.peak_host_bytes <= GPT2_BUDGET


@pytest.mark.multirank
def test_two_ranks_with_no_sync_equal_keep_bit_for_bit_and_write_the_counted_bytes(tmp_path: Path) -> None:
    run_ranks(_gpt2_disk, 2, args=(str(tmp_path),))


def _full_disk(rank: int, world_size: int, scratch: str) -> str:
    """Rank 1's disk cannot reserve the activations' file: every rank raises."""
    activations = ActivationPlacement(offload=["GPT2Block"], host_budget=GPT2_BUDGET)
    chunked, *_ = boost(gpt2(n_embd=32), adamw_two_groups, chunk_size=4_000, activations=activations, disk_dir=scratch)
    real = os.posix_fallocate

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    os.posix_fallocate = full if rank == 1 else real  # type: ignore[assignment]
    try:
        with pytest.raises(DiskTierError) as raised:
            lm_loss(chunked, batches(1, batch=8)[0].chunk(world_size)[rank])
    finally:
        os.posix_fallocate = real
    return str(raised.value)


@pytest.mark.multirank
def test_a_full_disk_while_writing_activations_raises_on_every_rank(tmp_path: Path) -> None:
    messages = run_ranks(_full_disk, 2, args=(str(tmp_path),))
    for message in messages:
        assert "on rank 1" in message and str(tmp_path) in message
        assert "the disk is full" in message and "raise host_budget" in message


@pytest.mark.slow
def test_the_cli_takes_the_host_budget_and_shows_the_disk_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan_cli = importlib.import_module("chunkmem.plan_command")
    small = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64}
    (tmp_path / "small.json").write_text(json.dumps(small))
    base = ["--hf-config", str(tmp_path / "small.json"), "--batch", "2x16", "--device", "cpu", "--precision", "fp32"]
    planned = plan_cli.main([*base, "--activations", "offload=GPT2Block", "--activation-host-budget", "64KiB"])
    assert "activations to disk and back per step" in capsys.readouterr().out
    assert 0 < planned.activation_disk_write_bytes_per_step < planned.activation_d2h_bytes_per_step
    with pytest.raises(SystemExit):
        plan_cli.main([*base, "--activation-host-budget", "64KiB"])
    assert "neither offload nor auto names a block class" in capsys.readouterr().err
