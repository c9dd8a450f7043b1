"""Two gloo ranks: parity with plain PyTorch on the whole batch, gradient accumulation, clipping,
mixed precision traffic, a delayed process group, and ranks that disagree."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.distributed import RankFailure, run_ranks
from support.models import (
    Tolerance,
    adamw_two_groups,
    as_reference,
    assert_close_on_cpu,
    assert_state_close,
    batches,
    boost,
    copies,
    gpt2,
    llama,
    lm_loss,
    mean_over_ranks,
    reference_device,
    reordered,
    tolerance,
    train_chunked,
    train_reference,
)

from chunkmem.placement import AutoPlacementConfig, StaticPlacementConfig
from chunkmem.ranks.comm import Communicator

PLACEMENTS: dict[str, Any] = {
    "static": StaticPlacementConfig(),
    "static-prefetch3": StaticPlacementConfig(max_prefetch=3),
    "static-offload-prefetch1": StaticPlacementConfig(offload_optim_frac=1.0, offload_param_frac=1.0, max_prefetch=1),
    "zero2": StaticPlacementConfig(shard_param_frac=0.0),
    "auto": AutoPlacementConfig(device_budget=400_000),
    "auto-prefetch1": AutoPlacementConfig(device_budget=400_000, max_prefetch=1),
    "auto-prefetch3": AutoPlacementConfig(device_budget=400_000, max_prefetch=3),
}


# Each rank's own plain-PyTorch reference trains on the whole batch, where that rank computes.
STATE_TOLERANCE = {"fp32": Tolerance(1e-4, 1e-5), "bf16": Tolerance(5e-2, 2e-2), "fp16": Tolerance(2e-2, 5e-3)}
# bf16 compute against an fp32 reference: losses within 1% relative.
LOSS_TOLERANCE = {"fp32": Tolerance(1e-5, 1e-6), "bf16": Tolerance(1e-2, 0.0)}


def _parity(rank: int, world_size: int, arch: str, precision: str, placement: str) -> dict[str, Any]:
    build = gpt2 if arch == "gpt2" else llama
    model, ref = copies(build())
    data = batches(5, batch=4)
    expected = train_reference(ref, adamw_two_groups, data)
    chunked, optimizer, booster = boost(
        model, adamw_two_groups, placement=PLACEMENTS[placement], precision=precision, chunk_size=10_000
    )
    # The gloo ranks set no LOCAL_RANK: the reference helper must still find chunkmem's device.
    assert chunked.compute_device == reference_device()
    losses = train_chunked(chunked, optimizer, booster, data, rank, world_size)
    within = STATE_TOLERANCE[precision].widened_for(chunked)
    noise = reordered(chunked, steps=len(data))
    assert_state_close(chunked.state_dict(), ref.state_dict(), *within, zero_gradient=noise)
    stats = chunked.stats()
    budget = PLACEMENTS[placement].device_budget
    if budget is not None:
        assert stats.peak_device_bytes <= budget
    loss_tolerance = LOSS_TOLERANCE[precision].widened_for(chunked)
    return {"losses": losses, "expected": expected, "loss_tolerance": loss_tolerance, "stats": stats}


@pytest.mark.multirank
@pytest.mark.parametrize(
    "placement",
    [pytest.param(p, marks=pytest.mark.fast_tier) if p == "static" else p for p in PLACEMENTS],
)
def test_gpt2_fp32_two_ranks_match_pytorch(placement: str) -> None:
    results = run_ranks(_parity, args=("gpt2", "fp32", placement))
    for result in results:
        assert result["losses"] == result["loss_tolerance"].approx(result["expected"])
    assert results[0]["stats"].allgather_bytes > 0 or placement == "zero2"


@pytest.mark.multirank
def test_llama_fp32_two_ranks_offloaded_match_pytorch() -> None:
    for result in run_ranks(_parity, args=("llama", "fp32", "static-offload-prefetch1")):
        assert result["losses"] == result["loss_tolerance"].approx(result["expected"])


@pytest.mark.multirank
def test_llama_bf16_two_ranks_within_tolerance() -> None:
    for result in run_ranks(_parity, args=("llama", "bf16", "static")):
        assert result["losses"] == result["loss_tolerance"].approx(result["expected"])


def _traffic(rank: int, world_size: int) -> dict[str, int]:
    out = {}
    for precision in ("fp32", "bf16"):
        chunked, optimizer, booster = boost(gpt2(), adamw_two_groups, precision=precision, chunk_size=10_000)
        train_chunked(chunked, optimizer, booster, batches(2), rank, world_size)
        out[precision] = chunked.stats().allgather_bytes
    return out


@pytest.mark.multirank
def test_bf16_allgathers_half_the_bytes_of_fp32() -> None:
    for result in run_ranks(_traffic):
        assert result["bf16"] * 2 == result["fp32"]


def _accumulate(rank: int, world_size: int) -> None:
    model, ref = copies(gpt2())
    data = batches(3, batch=8)
    reference_optimizer = adamw_two_groups(ref)
    chunked, optimizer, booster = boost(model, adamw_two_groups, precision="fp32", chunk_size=10_000)
    for ids in data:
        loss = lm_loss(ref, ids)
        loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        micro = ids.chunk(world_size)[rank].chunk(2)
        before = chunked.stats().reduce_scatter_bytes
        with booster.no_sync(chunked, optimizer):
            booster.backward(lm_loss(chunked, micro[0]) / 2, optimizer)
        assert chunked.stats().reduce_scatter_bytes == before, "no_sync must not reduce gradients"
        booster.backward(lm_loss(chunked, micro[1]) / 2, optimizer)
        assert chunked.stats().reduce_scatter_bytes > before
        optimizer.step()
        optimizer.zero_grad()
    assert_state_close(chunked.state_dict(), ref.state_dict(), *tolerance(chunked, rtol=1e-4, atol=1e-5))


@pytest.mark.multirank
def test_no_sync_accumulation_equals_large_batch() -> None:
    run_ranks(_accumulate)


def _clip(rank: int, world_size: int) -> list[float]:
    model, ref = copies(gpt2())
    data = batches(4)
    reference_optimizer = adamw_two_groups(ref)
    chunked, optimizer, booster = boost(model, adamw_two_groups, precision="fp32", chunk_size=10_000)
    norms = []
    for ids in data:
        lm_loss(ref, ids).backward()
        expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        booster.backward(lm_loss(chunked, ids.chunk(world_size)[rank]), optimizer)
        norm = optimizer.clip_grad_norm(0.05)
        assert_close_on_cpu(norm, expected, tolerance(chunked, rtol=1e-4, atol=1e-6))
        optimizer.step()
        optimizer.zero_grad()
        norms.append(float(norm))
    assert_state_close(chunked.state_dict(), ref.state_dict(), *tolerance(chunked, rtol=1e-4, atol=1e-5))
    return norms


@pytest.mark.multirank
def test_clip_grad_norm_matches_torch_and_ranks_agree() -> None:
    norms = run_ranks(_clip)
    assert norms[0] == norms[1]


class _TwoBranch(torch.nn.Module):
    """``skip`` leaves ``b`` without a gradient; ``order`` swaps two independent layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, skip: bool = False, swap: bool = False) -> torch.Tensor:
        h = self.a(x).tanh()
        first, second = (self.c, self.b) if swap else (self.b, self.c)
        if not skip:
            h = h + first(h).tanh()
        h = h + second(h).tanh()
        return self.head(h).pow(2).mean()


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _branches(rank: int, world_size: int, schedule: list[dict[str, bool]]) -> int:
    """Same control flow on every rank (given by ``schedule``): parity, including a parameter
    with no gradient anywhere (skipped by the optimizer) and a changed op order."""
    model, ref = copies(_TwoBranch())
    reference_optimizer = _sgd(ref)
    chunked, optimizer, booster = boost(
        model, _sgd, precision="fp32", chunk_size=300, placement=StaticPlacementConfig(max_prefetch=2)
    )
    g = torch.Generator().manual_seed(3)  # CPU: the same inputs on every machine
    for flags in schedule:
        x = torch.randn(8, 16, generator=g)
        ref(x.to(reference_device()), **flags).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        loss = chunked(x.chunk(world_size)[rank], **flags)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    assert_state_close(chunked.state_dict(), ref.state_dict(), *tolerance(chunked, rtol=1e-5, atol=1e-6))
    return chunked.stats().divergences


@pytest.mark.multirank
def test_unused_parameter_and_changed_order_on_all_ranks() -> None:
    plain, skip, swap = {}, {"skip": True}, {"swap": True}
    divergences = run_ranks(_branches, args=([plain, plain, skip, plain, swap, swap, plain],))
    assert divergences[0] == divergences[1] >= 3


def _rank_dependent(rank: int, world_size: int) -> None:
    model = _TwoBranch()
    chunked, optimizer, booster = boost(model, _sgd, precision="fp32", chunk_size=300)
    for step in range(3):
        x = torch.randn(4, 16)
        loss = chunked(x, skip=(step == 2 and rank == 1))
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.multirank
def test_rank_dependent_branch_is_reported_with_its_rank() -> None:
    with pytest.raises(RankFailure) as failure:
        run_ranks(_rank_dependent, timeout=120, pg_timeout=15)
    report = str(failure.value)
    # Every rank's error names rank 1 as the one that departed from the trace.
    for rank in (0, 1):
        section = (
            report.split(f"rank {rank} raised:")[1].split("rank 1 raised:")[0]
            if rank == 0
            else report.split("rank 1 raised:")[1]
        )
        assert "CollectiveMismatchError" in section or "TraceDivergenceError" in section, section[-2000:]
        assert "ranks [1]" in section, section[-2000:]


class _DelayedWork:
    """Completes a real gather into a staging buffer, and only writes the result into the
    chunk when waited on, after a delay; until then the chunk holds NaN."""

    def __init__(self, work: Any, output: torch.Tensor, staging: torch.Tensor, delay: float) -> None:
        self._work, self._output, self._staging, self._delay = work, output, staging, delay
        self._done = False

    def is_completed(self) -> bool:
        return self._done

    def wait(self, timeout: Any = None) -> bool:
        time.sleep(self._delay)
        self._work.wait()
        self._output.copy_(self._staging)
        self._done = True
        return True


def _reduce_slots(rank: int, world_size: int) -> list[bool]:
    comm = Communicator(None, torch.device("cpu"))
    n = 6 * world_size
    every = [torch.arange(n, dtype=torch.float32) * (r + 1) + r for r in range(world_size)]
    expected = sum(every)[rank * 6 : (rank + 1) * 6]
    separate = torch.full((6,), float("nan"))
    full = every[rank].clone()
    comm.wait(comm.reduce_scatter_sum(separate, full, async_op=True, what="separate output"), "separate output")
    in_place = every[rank].clone()
    slot = in_place[rank * 6 : (rank + 1) * 6]
    comm.reduce_scatter_sum(slot, in_place, async_op=False, what="slot of the input")
    return [torch.equal(separate, expected), torch.equal(slot, expected)]


@pytest.mark.multirank
@pytest.mark.fast_tier
def test_gradient_reduction_leaves_each_rank_its_slot_of_the_sum() -> None:
    # On gloo the reduction is an all-reduce of the whole buffer; the contract is a reduce-scatter.
    # (W=4 training parity, in test_budget_ranks, runs the slot form at four ranks.)
    assert run_ranks(_reduce_slots, 2) == [[True, True]] * 2


class DelayedCommunicator(Communicator):
    """Computes on the CPU on every machine (it is the communicator that picks the device)."""

    def __init__(self, delay: float) -> None:
        super().__init__(None, torch.device("cpu"))
        self.delay = delay
        self.delayed = 0

    def all_gather(self, output: torch.Tensor, local: torch.Tensor, async_op: bool, what: str = "gather") -> Any:
        if not async_op:
            return super().all_gather(output, local, async_op=False, what=what)
        staging = torch.empty_like(output)
        work = super().all_gather(staging, local.clone(), async_op=True, what=what)
        output.fill_(float("nan"))
        self.delayed += 1
        return _DelayedWork(work, output, staging, self.delay)


def _delayed(rank: int, world_size: int) -> dict[str, Any]:
    model = gpt2()
    comm = DelayedCommunicator(delay=0.02)
    ref = as_reference(copy.deepcopy(model), comm.device)  # where this communicator computes: the CPU
    data = batches(3)
    expected = train_reference(ref, adamw_two_groups, data)
    chunked, optimizer, booster = boost(
        model,
        adamw_two_groups,
        precision="fp32",
        chunk_size=10_000,
        placement=StaticPlacementConfig(max_prefetch=2),
        process_group=comm,
    )
    losses = train_chunked(chunked, optimizer, booster, data, rank, world_size)
    assert chunked.compute_device == comm.device
    assert_state_close(chunked.state_dict(), ref.state_dict(), *tolerance(chunked, rtol=1e-4, atol=1e-5))
    return {
        "losses": losses,
        "expected": expected,
        "loss_tolerance": tolerance(chunked, rtol=1e-5, atol=1e-6),
        "delayed": comm.delayed,
        "stats": chunked.stats(),
    }


@pytest.mark.multirank
def test_compute_waits_for_delayed_gathers() -> None:
    for result in run_ranks(_delayed):
        assert result["delayed"] > 0
        stats = result["stats"]
        assert stats.prefetches > 0 and stats.prefetch_waits > 0
        assert result["losses"] == result["loss_tolerance"].approx(result["expected"])


def _fp16_overflow_on_one_rank(rank: int, world_size: int) -> dict[str, Any]:
    chunked, optimizer, booster = boost(gpt2(), adamw_two_groups, precision="fp16", chunk_size=10_000)
    ids = batches(1)[0].chunk(world_size)[rank]
    before = chunked.state_dict()
    scale = optimizer.loss_scale
    loss = lm_loss(chunked, ids)
    booster.backward(loss * (float("inf") if rank == 1 else 1.0), optimizer)
    optimizer.step()
    optimizer.zero_grad()
    after = chunked.state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return {"unchanged": unchanged, "scale": (scale, optimizer.loss_scale), "skipped": chunked.stats().skipped_steps}


@pytest.mark.multirank
def test_fp16_inf_on_one_rank_skips_the_step_everywhere() -> None:
    for result in run_ranks(_fp16_overflow_on_one_rank):
        assert result["unchanged"]
        assert result["skipped"] == 1
        assert result["scale"][1] == result["scale"][0] / 2


def _mean_loss_agrees(rank: int, world_size: int) -> float:
    x = torch.tensor(float(rank + 1))
    return mean_over_ranks(x, world_size)


@pytest.mark.multirank
def test_helper_reports_every_rank() -> None:
    assert run_ranks(_mean_loss_agrees) == [1.5, 1.5]


def _fails_on_rank_one(rank: int, world_size: int) -> None:
    dist.barrier()
    if rank == 1:
        raise ValueError("boom on rank 1")


@pytest.mark.multirank
def test_helper_names_the_failing_rank() -> None:
    with pytest.raises(RankFailure, match="rank 1 raised"):
        run_ranks(_fails_on_rank_one)
