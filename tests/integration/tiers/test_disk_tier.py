"""The disk tier: optimizer sides (states, and with 16-bit compute the fp32 master) on disk between
steps, under a host budget. Results equal the all-in-RAM run bit for bit; disk traffic per step is
what the optimizer step reads and writes, nothing more; the files are scratch chunkmem owns."""

from __future__ import annotations

import errno
import gc
import itertools
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.disk_tier_helpers import ON_DISK, WIDTH, _boost, _scratch, _train
from support.distributed import run_ranks
from support.forked import run_script
from support.paths import ROOT
from support.tier import slow_cases

from chunkmem import DiskTierError, HostBudgetTooSmallError
from chunkmem.placement import AutoPlacementConfig, StaticPlacementConfig
from chunkmem.usage.accounting import Location

IN_RAM = StaticPlacementConfig(offload_optim_frac=1.0, max_prefetch=0)


def _assert_equal_states(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_equal_states(a[key], b[key])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_equal_states(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("precision", slow_cases(["fp32", "bf16"], "bf16"))
def test_optimizer_sides_on_disk_train_like_the_all_in_ram_run_bit_for_bit(tmp_path: Path, precision: str) -> None:
    chunked, optimizer, booster = _boost(ON_DISK, precision, tmp_path)
    ram, ram_optimizer, ram_booster = _boost(IN_RAM, precision, None)
    stats = _train(chunked, optimizer, booster, 4)
    _train(ram, ram_optimizer, ram_booster, 4)
    _assert_equal_states(chunked.state_dict(), ram.state_dict())
    _assert_equal_states(optimizer.state_dict(), ram_optimizer.state_dict())
    # What stays in host memory between steps: what gathers read (the 16-bit copies, or the fp32
    # masters); states, gradient shards (and 16-bit models' masters) are on disk, in this
    # process's scratch directory.
    chunks = chunked.manager.chunks
    shard = sum(c.layout.shard_numel for c in chunks)
    assert len(_scratch(tmp_path)) == 1
    assert stats[-1].host_bytes == (2 * shard if precision == "bf16" else 4 * shard)
    assert stats[-1].peak_host_bytes < ram.stats().peak_host_bytes
    master = 4 * shard if precision == "bf16" else 0
    assert stats[-1].disk_bytes >= 8 * shard + 4 * shard + master
    del chunked, optimizer, booster, chunks
    gc.collect()
    assert _scratch(tmp_path) == [], "the scratch directory outlived the model"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_disk_traffic_per_step_is_twice_what_the_step_reads_and_nothing_more(tmp_path: Path, precision: str) -> None:
    chunked, optimizer, booster = _boost(ON_DISK, precision, tmp_path)
    stats = _train(chunked, optimizer, booster, 4)
    chunks = chunked.manager.chunks
    states = 8 * sum(c.layout.used for c in chunks)  # AdamW keeps two fp32 moments per parameter element
    grads = 4 * sum(c.layout.shard_numel for c in chunks)  # written when reduced, read by the step
    masters = grads if precision == "bf16" else 0  # an fp32 master stays where gathers read it
    # No state before the first step: it reads gradients and masters, and writes all three.
    assert stats[1].disk_read_bytes - stats[0].disk_read_bytes == grads + masters
    assert stats[1].disk_write_bytes - stats[0].disk_write_bytes == grads + states + masters
    for before, after in itertools.pairwise(stats[1:]):
        assert after.disk_read_bytes - before.disk_read_bytes == grads + states + masters
        assert after.disk_write_bytes - before.disk_write_bytes == grads + states + masters


def test_the_auto_policy_spills_to_disk_what_the_host_budget_cannot_hold(tmp_path: Path) -> None:
    def make(host_budget: int | None, disk_dir: Path | None) -> Any:
        placement = AutoPlacementConfig(device_budget=200_000, host_budget=host_budget)
        return _boost(placement, "bf16", disk_dir, layers=16)  # more chunks than the disk window

    ram, ram_optimizer, ram_booster = make(None, None)
    _train(ram, ram_optimizer, ram_booster, 3)
    needed = ram.stats().peak_host_bytes
    with pytest.raises(HostBudgetTooSmallError, match="host_budget") as refused:
        make(1, tmp_path)
    minimum = refused.value.minimum  # everything on disk
    assert 1 < minimum < needed
    for budget in (minimum, (minimum + needed) // 2):
        chunked, optimizer, booster = make(budget, tmp_path)
        stats = _train(chunked, optimizer, booster, 3)
        assert stats[-1].disk_bytes > 0
        assert stats[-1].peak_host_bytes <= budget
        _assert_equal_states(chunked.state_dict(), ram.state_dict())
        on_disk = chunked.manager.ledger.bytes(Location.DISK)
        if budget == minimum:
            all_on_disk = on_disk
        else:
            assert 0 < on_disk < all_on_disk  # only what the budget cannot hold goes


def test_the_static_policy_refuses_a_host_budget_its_fractions_do_not_fit() -> None:
    with pytest.raises(HostBudgetTooSmallError, match="offload_disk_frac"):
        _boost(StaticPlacementConfig(offload_optim_frac=1.0, host_budget=10_000), "bf16", None)


def test_a_placement_on_disk_needs_a_disk_dir_that_exists_and_is_writable(tmp_path: Path) -> None:
    with pytest.raises(DiskTierError, match="disk_dir"):
        _boost(ON_DISK, "fp32", None)
    with pytest.raises(DiskTierError, match="does not exist"):
        _boost(ON_DISK, "fp32", tmp_path / "missing")
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(DiskTierError, match="not a directory"):
        _boost(ON_DISK, "fp32", a_file)
    with pytest.raises(DiskTierError, match=r"scratch space|not writable"):
        _boost(ON_DISK, "fp32", Path("/proc/self"))  # read-only even for root


def test_a_disk_without_room_for_the_placement_is_refused_at_boost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(DiskTierError, match="disk is full") as refused:
        _boost(ON_DISK, "fp32", tmp_path)
    assert "bytes free" in str(refused.value)
    assert _scratch(tmp_path) == [], "a refused boost left its scratch directory"


_KILLED = """
import atexit, os, signal, sys, torch
sys.path.insert(0, sys.argv[2])
from chunkmem import Booster, ChunkPlugin
from chunkmem.placement import StaticPlacementConfig
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
placement = StaticPlacementConfig(offload_optim_frac=1.0, offload_disk_frac=1.0)
plugin = ChunkPlugin(placement=placement, precision="fp32", chunk_size=4200, disk_dir=sys.argv[1])
booster = Booster(plugin=plugin)
chunked, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters()))
booster.backward(chunked(torch.randn(2, 64)).sum(), optimizer)
optimizer.step()
if sys.argv[3] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
atexit._run_exitfuncs()  # forked, this process leaves through os._exit: run what a normal exit runs
"""


def test_the_scratch_directory_goes_at_exit_and_after_a_kill_with_the_next_boost(tmp_path: Path) -> None:
    # Both forked from the tests' server (imports done): one leaves normally, one is killed.
    done = run_script(_KILLED, str(tmp_path), str(ROOT), "exit")
    assert done.returncode == 0, done.stderr[-2000:]
    assert _scratch(tmp_path) == []
    done = run_script(_KILLED, str(tmp_path), str(ROOT), "kill")
    assert done.returncode == -9, done.stderr[-2000:]
    left = _scratch(tmp_path)
    assert len(left) == 1 and (left[0] / "sides.bin").stat().st_size > 0
    _next_run = _boost(ON_DISK, "fp32", tmp_path)
    assert not left[0].exists() and len(_scratch(tmp_path)) == 1


@pytest.mark.parametrize("shard", slow_cases([False, True], True), ids=["full", "sharded"])
def test_a_checkpoint_of_a_model_on_disk_resumes_like_the_all_in_ram_run(tmp_path: Path, shard: bool) -> None:
    disk_dir = tmp_path / "scratch"
    disk_dir.mkdir()
    chunked, optimizer, booster = _boost(ON_DISK, "bf16", disk_dir)
    _train(chunked, optimizer, booster, 2)
    model_path, optim_path = (
        (tmp_path / "model", tmp_path / "optim") if shard else (tmp_path / "model.pt", tmp_path / "optim.pt")
    )
    booster.save_model(chunked, model_path, shard=shard)
    booster.save_optimizer(optimizer, optim_path, shard=shard)
    ram, ram_optimizer, ram_booster = _boost(IN_RAM, "bf16", None)
    _train(ram, ram_optimizer, ram_booster, 2)
    # Into a fresh model on disk, and into one in memory: both continue like the uninterrupted run.
    resumed, resumed_optimizer, resumed_booster = _boost(ON_DISK, "bf16", disk_dir, seed=5)
    resumed_booster.load_model(resumed, model_path)
    resumed_booster.load_optimizer(resumed_optimizer, optim_path)
    in_ram, in_ram_optimizer, in_ram_booster = _boost(IN_RAM, "bf16", None, seed=5)
    in_ram_booster.load_model(in_ram, model_path)
    in_ram_booster.load_optimizer(in_ram_optimizer, optim_path)
    for model, opt, boost in (
        (resumed, resumed_optimizer, resumed_booster),
        (in_ram, in_ram_optimizer, in_ram_booster),
    ):
        _train(model, opt, boost, 2, seed=9)
    _train(ram, ram_optimizer, ram_booster, 2, seed=9)
    for model, opt in ((resumed, resumed_optimizer), (in_ram, in_ram_optimizer)):
        _assert_equal_states(model.state_dict(), ram.state_dict())
        _assert_equal_states(opt.state_dict(), ram_optimizer.state_dict())


def _two_ranks(rank: int, world_size: int, disk_dir: str, fail_at: int) -> list[Any]:
    """Trains with sides on disk; with ``fail_at`` >= 0, rank 1's writes fail (disk full) at that
    step. Returns each step's outcome, and whether the model (its state, its forward, its step
    count) still equals the in-RAM run's."""
    chunked, optimizer, booster = _boost(ON_DISK, "bf16", Path(disk_dir) / f"r{rank}")
    ram, ram_optimizer, ram_booster = _boost(IN_RAM, "bf16", None)
    real_pwritev = os.pwritev
    outcomes: list[Any] = []
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(8, WIDTH, generator=g)

        def full(fd: int, buffers: Any, offset: int) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        if step == fail_at and rank == 1:  # every write of this step fails: gradients and sides
            os.pwritev = full
        for model, opt, boost in ((chunked, optimizer, booster), (ram, ram_optimizer, ram_booster)):
            boost.backward(model(x).float().square().mean(), opt)
        start = time.monotonic()
        try:
            optimizer.step()
            outcomes.append("ok")
        except DiskTierError as error:
            outcomes.append((str(error), time.monotonic() - start))
        finally:
            os.pwritev = real_pwritev
        ram_optimizer.step()
        for opt in (optimizer, ram_optimizer):
            opt.zero_grad()
    state, reference = chunked.state_dict(), ram.state_dict()
    probe = torch.randn(4, WIDTH, generator=g)
    with torch.no_grad():  # the model the next forward uses too, and the steps counted
        same_forward = torch.equal(chunked(probe), ram(probe))
    same_steps = chunked.stats().optimizer_steps == ram.stats().optimizer_steps == 4
    outcomes.append(all(torch.equal(state[k], reference[k]) for k in reference) and same_forward and same_steps)
    return outcomes


@pytest.mark.multirank
@pytest.mark.parametrize("fail_at", [-1, 2])
def test_two_ranks_with_sides_on_disk_and_a_disk_that_fills_up(tmp_path: Path, fail_at: int) -> None:
    for rank in range(2):
        (tmp_path / f"r{rank}").mkdir()
    results = run_ranks(_two_ranks, 2, args=(str(tmp_path), fail_at))
    for rank, outcomes in enumerate(results):
        assert outcomes[-1] is True, f"rank {rank}: the model differs from the in-memory run"
        for step, outcome in enumerate(outcomes[:-1]):
            if step != fail_at:
                assert outcome == "ok", (rank, step, outcome)
            else:
                message, seconds = outcome
                assert "rank 1" in message and "No space left" in message, message
                assert seconds < 20


@pytest.mark.parametrize(("max_norm", "norm_type"), [(1e-3, 2.0), (1e6, 2.0), (1e-3, float("inf")), (1e-3, 1.0)])
def test_clipping_gradients_on_disk_equals_clipping_them_in_memory(
    tmp_path: Path, max_norm: float, norm_type: float
) -> None:
    def run(placement: Any, disk_dir: Path | None) -> tuple[Any, list[float]]:
        chunked, optimizer, booster = _boost(placement, "fp32", disk_dir)
        g = torch.Generator().manual_seed(1)
        norms = []
        for _ in range(3):
            booster.backward(chunked(torch.randn(8, WIDTH, generator=g)).square().mean(), optimizer)
            norms.append(float(optimizer.clip_grad_norm(max_norm, norm_type)))
            optimizer.step()
            optimizer.zero_grad()
        return chunked.state_dict(), norms

    on_disk, disk_norms = run(ON_DISK, tmp_path)
    in_ram, ram_norms = run(IN_RAM, None)
    assert disk_norms == pytest.approx(ram_norms, rel=1e-12)
    _assert_equal_states(on_disk, in_ram)


@pytest.mark.cpu_compute(reason="an infinite fp16 loss on the CPU")
def test_fp16_inf_with_gradients_on_disk_skips_the_step_like_in_memory(tmp_path: Path) -> None:
    def run(placement: Any, disk_dir: Path | None) -> tuple[Any, list[float]]:
        chunked, optimizer, booster = _boost(placement, "fp16", disk_dir)
        g = torch.Generator().manual_seed(1)
        scales = []
        for step in range(4):
            loss = chunked(torch.randn(8, WIDTH, generator=g)).float().square().mean()
            booster.backward(loss * float("inf") if step == 2 else loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            scales.append(optimizer.loss_scale)
        return chunked.state_dict(), scales

    on_disk, disk_scales = run(ON_DISK, tmp_path)
    in_ram, ram_scales = run(IN_RAM, None)
    assert disk_scales == ram_scales and disk_scales[2] < disk_scales[1]
    _assert_equal_states(on_disk, in_ram)


@pytest.mark.slow  # the fast tier's case: the sides on disk, bit exact
def test_gradients_accumulated_over_two_backward_passes_on_disk_equal_in_memory(tmp_path: Path) -> None:
    def run(placement: Any, disk_dir: Path | None) -> Any:
        chunked, optimizer, booster = _boost(placement, "fp32", disk_dir)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for _ in range(2):  # accumulation without no_sync: the second reduction adds to the first
                booster.backward(chunked(torch.randn(8, WIDTH, generator=g)).square().mean(), optimizer)
            optimizer.step()
            optimizer.zero_grad()
        return chunked.state_dict()

    _assert_equal_states(run(ON_DISK, tmp_path), run(IN_RAM, None))


def test_a_load_stages_what_goes_to_disk_in_files_of_the_scratch_directory(tmp_path: Path) -> None:
    half = StaticPlacementConfig(offload_optim_frac=1.0, offload_disk_frac=0.5, max_prefetch=0)
    chunked, optimizer, _ = _boost(half, "bf16", tmp_path)
    chunks = chunked.manager.chunks
    on_disk = [c for c in chunks if c.store.master_on_disk]
    in_memory = [c for c in chunks if not c.store.master_on_disk]
    assert on_disk and in_memory
    scratch = str(_scratch(tmp_path)[0])
    for chunk in on_disk:
        for staged in (optimizer.state_staging(chunk, 10, torch.float32), chunk.store.staging_for_master(10)):
            assert (staged.untyped_storage().filename or "").startswith(scratch)
    for chunk in in_memory:
        for staged in (optimizer.state_staging(chunk, 10, torch.float32), chunk.store.staging_for_master(10)):
            assert staged.untyped_storage().filename is None


def _boost_train_and_drop(rank: int, world_size: int, disk_dir: str) -> tuple[int, int]:
    """Boosts with sides on disk, takes a step, drops model and optimizer; returns the scratch
    directories of this rank while the model lives and after it was collected."""
    mine = Path(disk_dir) / f"r{rank}"
    mine.mkdir(exist_ok=True)
    chunked, optimizer, booster = _boost(ON_DISK, "fp32", mine)
    _train(chunked, optimizer, booster, 1)
    alive = len(_scratch(mine))
    del chunked, optimizer, booster
    gc.collect()
    return alive, len(_scratch(mine))


@pytest.mark.multirank
def test_the_scratch_directories_go_with_a_collected_model_at_two_ranks(tmp_path: Path) -> None:
    for rank, (alive, after) in enumerate(run_ranks(_boost_train_and_drop, 2, args=(str(tmp_path),))):
        assert alive == 1, f"rank {rank}: {alive} scratch directories while the model lives"
        assert after == 0, f"rank {rank}: the scratch directory outlived the collected model and optimizer"


def test_frozen_chunks_placed_on_disk_with_nothing_to_put_there_keep_their_shards_on_the_device(
    tmp_path: Path,
) -> None:
    """fp32, most of the model frozen, a fifth of chunk memory's sides placed on disk: those
    frozen chunks have no bytes for disk (their values are what gathers read, and they have no
    gradient or state), so no disk file is opened; they keep their optimizer side in host memory
    and their parameter shard on the device, as placed, and train as plain PyTorch does."""
    from support.models import as_reference, batches, boost, gpt2, train_chunked, train_reference

    def partly_frozen() -> torch.nn.Module:
        model = gpt2()
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith(("transformer.h.1.", "transformer.ln_f.")))
        return model

    def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)

    placement = StaticPlacementConfig(offload_optim_frac=1.0, offload_disk_frac=0.2)
    chunked, optimizer, booster = boost(
        partly_frozen(), sgd, precision="fp32", chunk_size=6_000, placement=placement, disk_dir=str(tmp_path)
    )
    assert _scratch(tmp_path) == []  # nothing to put on disk: no file
    losses = train_chunked(chunked, optimizer, booster, batches(2))
    assert losses == train_reference(as_reference(partly_frozen()), sgd, batches(2))
