"""Checkpoints: PyTorch formats, portable across chunk sizes, placements and world sizes,
interchangeable with plain PyTorch, written atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.distributed import run_ranks
from support.models import (
    adamw_two_groups,
    as_reference,
    assert_state_close,
    batches,
    boost,
    copies,
    gpt2,
    lm_loss,
    reordered,
    tolerance,
    train_chunked,
)

from chunkmem import Booster, ChunkPlugin, checkpoint
from chunkmem.placement import AutoPlacementConfig, StaticPlacementConfig


def _plain_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list[torch.Tensor]) -> None:
    for ids in data:
        lm_loss(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.slow  # the fast tier's case: the README loop's resume
def test_resume_with_another_chunk_size_and_placement(tmp_path: Path) -> None:
    model, ref = copies(gpt2())
    data = batches(5)
    reference_optimizer = adamw_two_groups(ref)
    _plain_steps(ref, reference_optimizer, data)

    chunked, optimizer, booster = boost(model, adamw_two_groups, precision="fp32", chunk_size=12_000)
    train_chunked(chunked, optimizer, booster, data[:3])
    booster.save_model(chunked, tmp_path / "model.pt")
    booster.save_optimizer(optimizer, tmp_path / "optim.pt")

    placement = AutoPlacementConfig(device_budget=400_000, max_prefetch=1)
    resumed, resumed_optimizer, resumed_booster = boost(
        gpt2(seed=7), adamw_two_groups, precision="fp32", chunk_size=5_000, placement=placement
    )
    resumed_booster.load_model(resumed, tmp_path / "model.pt")
    resumed_booster.load_optimizer(resumed_optimizer, tmp_path / "optim.pt")
    train_chunked(resumed, resumed_optimizer, resumed_booster, data[3:])
    assert_state_close(resumed.state_dict(), ref.state_dict(), *tolerance(chunked, resumed, rtol=1e-4, atol=1e-5))


def test_checkpoint_files_are_plain_pytorch_both_ways(tmp_path: Path) -> None:
    data = batches(5)
    model, ref = copies(gpt2())
    reference_optimizer = adamw_two_groups(ref)
    _plain_steps(ref, reference_optimizer, data)

    # chunkmem -> plain PyTorch
    chunked, optimizer, booster = boost(model, adamw_two_groups, precision="fp32", chunk_size=12_000)
    train_chunked(chunked, optimizer, booster, data[:3])
    booster.save_model(chunked, tmp_path / "model.pt")
    booster.save_optimizer(optimizer, tmp_path / "optim.pt")
    plain = as_reference(gpt2(seed=3))  # resumes in plain PyTorch where the reference trains
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    plain_optimizer = adamw_two_groups(plain)
    plain_optimizer.load_state_dict(torch.load(tmp_path / "optim.pt", weights_only=True))
    _plain_steps(plain, plain_optimizer, data[3:])
    assert_state_close(plain.state_dict(), ref.state_dict(), *tolerance(chunked, rtol=1e-4, atol=1e-5))

    # plain PyTorch -> chunkmem
    halfway, halfway_ref = copies(gpt2())
    halfway_optimizer = adamw_two_groups(halfway_ref)
    _plain_steps(halfway_ref, halfway_optimizer, data[:2])
    torch.save(halfway_ref.state_dict(), tmp_path / "plain_model.pt")
    torch.save(halfway_optimizer.state_dict(), tmp_path / "plain_optim.pt")
    chunked2, optimizer2, booster2 = boost(
        halfway,
        adamw_two_groups,
        precision="fp32",
        chunk_size=8_000,
        placement=StaticPlacementConfig(offload_optim_frac=1),
    )
    booster2.load_model(chunked2, tmp_path / "plain_model.pt", verify=False)
    booster2.load_optimizer(optimizer2, tmp_path / "plain_optim.pt", verify=False)
    train_chunked(chunked2, optimizer2, booster2, data[2:])
    assert_state_close(chunked2.state_dict(), ref.state_dict(), *tolerance(chunked2, rtol=1e-4, atol=1e-5))


def _save_on_two_ranks(rank: int, world_size: int, directory: str) -> None:
    model = gpt2()
    chunked, optimizer, booster = boost(model, adamw_two_groups, precision="fp32", chunk_size=6_000)
    train_chunked(chunked, optimizer, booster, batches(3), rank, world_size)
    booster.save_model(chunked, Path(directory) / "model.pt")
    booster.save_optimizer(optimizer, Path(directory) / "optim.pt")


@pytest.mark.multirank
@pytest.mark.fast_tier
def test_saved_on_two_ranks_resumes_on_one(tmp_path: Path) -> None:
    run_ranks(_save_on_two_ranks, args=(str(tmp_path),))
    data = batches(5)
    model, ref = copies(gpt2())
    reference_optimizer = adamw_two_groups(ref)
    _plain_steps(ref, reference_optimizer, data)
    chunked, optimizer, booster = boost(model, adamw_two_groups, precision="fp32", chunk_size=12_000)
    booster.load_model(chunked, tmp_path / "model.pt")
    booster.load_optimizer(optimizer, tmp_path / "optim.pt")
    train_chunked(chunked, optimizer, booster, data[3:])
    # The first three steps ran at W=2 in the spawned ranks: with their default placement, as here.
    # Their gradients were summed over the ranks, the reference's over the whole batch (``reordered``).
    within = tolerance(chunked, rtol=1e-4, atol=1e-5)
    noise = reordered(chunked, steps=len(data))
    assert_state_close(chunked.state_dict(), ref.state_dict(), *within, zero_gradient=noise)


def test_fp16_loss_scale_is_saved(tmp_path: Path) -> None:
    chunked, optimizer, booster = boost(gpt2(), adamw_two_groups, precision="fp16", chunk_size=12_000)
    booster.backward(lm_loss(chunked, batches(1)[0]) * float("inf"), optimizer)
    optimizer.step()
    optimizer.zero_grad()
    booster.save_optimizer(optimizer, tmp_path / "optim.pt")
    _, fresh_optimizer, fresh_booster = boost(gpt2(), adamw_two_groups, precision="fp16", chunk_size=12_000)
    fresh_booster.load_optimizer(fresh_optimizer, tmp_path / "optim.pt")
    assert fresh_optimizer.loss_scale == optimizer.loss_scale == 2.0**15


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "model.pt"
    checkpoint.atomic_save({"version": 1}, target)

    def broken_save(obj: Any, f: Any) -> None:
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.atomic_save({"version": 2}, target)
    monkeypatch.undo()
    assert torch.load(target, weights_only=True) == {"version": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_lr_scheduler_round_trip(tmp_path: Path) -> None:
    model = gpt2()
    booster = Booster(plugin=ChunkPlugin(precision="fp32", chunk_size=12_000))
    optimizer = adamw_two_groups(model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    _, boosted, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)
    boosted.step()  # no gradients: nothing changes, but the scheduler sees a step first
    scheduler.step()
    booster.save_lr_scheduler(scheduler, tmp_path / "sched.pt", boosted)
    other = torch.optim.lr_scheduler.StepLR(adamw_two_groups(gpt2()), step_size=1, gamma=0.5)
    booster.load_lr_scheduler(other, tmp_path / "sched.pt")
    assert other.last_epoch == scheduler.last_epoch == 1


def _recipe_step(model: Any, optimizer: Any, booster: Any, ids: torch.Tensor, accumulation: int = 2) -> None:
    """One step of the README's training loop."""
    micro = ids.chunk(accumulation)
    if booster is None:
        for part in micro:
            (lm_loss(model, part) / accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    else:
        with booster.no_sync(model, optimizer):
            for part in micro[:-1]:
                booster.backward(lm_loss(model, part) / accumulation, optimizer)
        booster.backward(lm_loss(model, micro[-1]) / accumulation, optimizer)
        optimizer.clip_grad_norm(0.5)
    optimizer.step()
    optimizer.zero_grad()


def test_the_readme_training_loop_resumes_like_uninterrupted_pytorch(tmp_path: Path) -> None:
    """Accumulation, clipping, a scheduler built after boosting, a checkpoint of all three and a
    resume into a freshly boosted model with another chunk size: the same as plain PyTorch
    training without interruption."""
    data = batches(5, batch=8)

    def scheduler_for(optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-3, total_steps=5)

    model, ref = copies(gpt2())
    reference_optimizer = adamw_two_groups(ref)
    reference_scheduler = scheduler_for(reference_optimizer)
    for ids in data:
        _recipe_step(ref, reference_optimizer, None, ids)
        reference_scheduler.step()

    chunked, optimizer, booster = boost(model, adamw_two_groups, precision="fp32", chunk_size=12_000)
    scheduler = scheduler_for(optimizer)
    for ids in data[:3]:
        _recipe_step(chunked, optimizer, booster, ids)
        scheduler.step()
    booster.save_model(chunked, tmp_path / "model.pt")
    booster.save_optimizer(optimizer, tmp_path / "optim.pt")
    booster.save_lr_scheduler(scheduler, tmp_path / "sched.pt", optimizer)

    resumed, resumed_optimizer, resumed_booster = boost(
        gpt2(seed=4), adamw_two_groups, precision="fp32", chunk_size=7_000
    )
    resumed_scheduler = scheduler_for(resumed_optimizer)
    resumed_booster.load_model(resumed, tmp_path / "model.pt")
    resumed_booster.load_optimizer(resumed_optimizer, tmp_path / "optim.pt")
    resumed_booster.load_lr_scheduler(resumed_scheduler, tmp_path / "sched.pt")
    assert resumed_scheduler.last_epoch == 3
    for ids in data[3:]:
        _recipe_step(resumed, resumed_optimizer, resumed_booster, ids)
        resumed_scheduler.step()
    assert [g["lr"] for g in resumed_optimizer.param_groups] == pytest.approx(
        [g["lr"] for g in reference_optimizer.param_groups]
    )
    assert_state_close(resumed.state_dict(), ref.state_dict(), *tolerance(chunked, resumed, rtol=1e-4, atol=1e-5))
