"""The calls an ``ActivationPlacement(auto=...)`` plan offloads are fetched ``max_prefetch`` calls
ahead of their backward, within the one device budget: the plan reserves room for the fetches
ahead and the ledger's peak stays within the budget; the fetches happen in the order the depth
implies (the bytes fetched when each block's backward begins, observed through a gradient hook on
the block's output); training equals plain PyTorch bit for bit (one rank) and keeping (two ranks);
the planner's choice for the same timings is the run's plan. Beyond ``host_budget`` those calls go
to the disk tier as the ``offload`` blocks' do: the bytes written equal the README's rule over a
saved-tensor hooks count of the plain model, the copies' host bytes stay within the budget, and
the planner predicts the bytes a run writes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from support.activation_budget_helpers import (
    BATCH,
    BLOCKS,
    PER_BLOCK,
    STEPS,
    WIDTH,
    Stack,
    _data,
    _loss,
    _model_minimum,
    _plain,
    _recomputed,
)
from support.activation_disk_helpers import _to_disk
from support.activations_helpers import _assert_identical, saved_storages
from support.distributed import run_ranks
from support.models import adamw_two_groups, as_reference, boost, device_of

from chunkmem import BudgetTooSmallError, ChunkPlugin, Plan, plan
from chunkmem.placement import ActivationChoice, ActivationPlacement, CopyRates, StaticPlacementConfig
from chunkmem.usage.accounting import Location, MemoryKind

OFF, KEEP = ActivationChoice.OFFLOAD, ActivationChoice.KEEP
FORWARD = 1.0  # seconds a call's forward takes, as the timings below say
# Each way a call's copy takes half a forward: the copy out hides behind the call's forward, the
# copy back only behind the backward of a call fetched ahead of it.
RATES = CopyRates(to_host=2 * PER_BLOCK / FORWARD, to_device=2 * PER_BLOCK / FORWARD, overlap=True)


@contextmanager
def _timed() -> Iterator[None]:
    """The plan chosen from the timings above, not from what this CPU measured (restored after:
    ranks run in pooled processes)."""
    import chunkmem.activations.auto as auto

    choose = auto.choose_activations

    def timed(measures: Any, rates: CopyRates, *args: Any) -> Any:
        return choose([replace(m, forward_seconds=FORWARD, offload_seconds=0.0) for m in measures], RATES, *args)

    auto.choose_activations = timed
    try:
        yield
    finally:
        auto.choose_activations = choose


def _fetched_when_backward_begins(j: int, offloaded: list[int], depth: int) -> int:
    """How many offloaded calls are fetched when call ``j``'s backward begins: every offloaded call
    whose backward began (those after ``j``), and the ``depth`` offloaded calls next in backward
    order after the last of them (fetched when its backward began)."""
    began = [i for i in offloaded if i > j]
    if not began:
        return 0
    last = min(began)
    return sum(1 for i in offloaded if i >= last) + min(depth, sum(1 for i in offloaded if i < last))


def _watched(stack: Stack, box: list[Any]) -> list[tuple[int, int]]:
    """(block, ``activation_h2d_bytes`` of the boosted model in ``box``) when each block's backward
    begins: a gradient hook on the block's output runs just before the block's own backward."""
    seen: list[tuple[int, int]] = []

    def watch(index: int) -> Any:
        def forward_hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
            if out.requires_grad:
                out.register_hook(lambda grad: seen.append((index, box[0].stats().activation_h2d_bytes)))

        return forward_hook

    for index, block in enumerate(stack.blocks):
        block.register_forward_hook(watch(index))
    return seen


def test_offload_blocks_fetch_each_call_max_prefetch_calls_ahead_of_its_backward() -> None:
    """The window slides by one call per backward (it used to fetch in batches: the calls fetched
    ahead by one block's backward were not followed by more until a call was met unfetched)."""
    stack = Stack()
    box: list[Any] = []
    seen = _watched(stack, box)
    box.append(boost(stack, adamw_two_groups, activations=ActivationPlacement(offload=["Block"], max_prefetch=2))[0])
    _loss(box[0], _data()[0]).backward()
    expected = {j: PER_BLOCK * _fetched_when_backward_begins(j, list(range(BLOCKS)), 2) for j in range(BLOCKS)}
    assert dict(seen) == expected == {3: 0, 2: 3 * PER_BLOCK, 1: 4 * PER_BLOCK, 0: 4 * PER_BLOCK}


def _prefetching(rank: int = 0, world_size: int = 1, host_budget: int | None = None, disk: str = "") -> dict[str, Any]:
    """Train the stack under ``model data + 3 blocks`` with the timings above: each step, the bytes
    fetched (``activation_h2d_bytes`` since its forward ended) when each block's backward begins,
    and the host bytes of the activations' copies when its forward ended (with ``host_budget``,
    beyond which copies go to ``disk``)."""
    budget = _model_minimum() + 3 * PER_BLOCK
    stack = Stack()
    box: list[Any] = []
    seen = _watched(stack, box)
    activations = ActivationPlacement(auto=["Block"], max_prefetch=1, host_budget=host_budget)
    with _timed():
        chunked, optimizer, booster = boost(
            stack,
            adamw_two_groups,
            chunk_size=8_000,
            placement=StaticPlacementConfig(device_budget=budget),
            activations=activations,
            disk_dir=disk or None,
        )
        box.append(chunked)
        losses, fetched, host = [], [], []
        for x in _data(rank, world_size):
            loss = _loss(chunked, x.clone())  # a rank's rows alone: each call saves what it does at one rank
            base, seen[:] = chunked.stats().activation_h2d_bytes, []
            host.append(chunked.manager.ledger.bytes(Location.HOST, MemoryKind.ACTIVATION))
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
            fetched.append({index: h2d - base for index, h2d in seen})
    return {
        "losses": losses,
        "state": chunked.state_dict(),
        "stats": chunked.stats(),
        "plan": chunked.activation_plan,
        "fetched": fetched,
        "host": host,
        "budget": budget,
    }


def _assert_prefetched(run: dict[str, Any], depth: int) -> None:
    chosen = run["plan"]
    offloaded = [i for i, choice in enumerate(chosen.choices) if choice is OFF]
    # The first step measures, fetching each call when its backward needs it; then the plan's depth.
    for step, fetched in enumerate(run["fetched"]):
        expected = {
            j: PER_BLOCK
            * _fetched_when_backward_begins(j, offloaded if step else list(range(BLOCKS)), depth if step else 0)
            for j in range(BLOCKS)
        }
        assert fetched == expected, step
    stats = run["stats"]
    assert stats.peak_device_bytes <= run["budget"]
    steps = len(run["fetched"])
    assert (
        stats.activation_h2d_bytes == stats.activation_d2h_bytes == PER_BLOCK * (BLOCKS + (steps - 1) * len(offloaded))
    )


@pytest.mark.slow  # the fast tier's case: the choice's depth and room (test_activation_budget)
def test_auto_offloaded_calls_are_fetched_ahead_within_the_budget_bit_for_bit() -> None:
    run = _prefetching()
    chosen = run["plan"]
    # Fetched one call ahead, the copies back hide: three calls offloaded, the last (whose copy
    # back nothing hides) kept, and room for two calls' fetches beside it.
    assert (chosen.choices, chosen.prefetch, chosen.reserve) == ((OFF, OFF, OFF, KEEP), 1, 2 * PER_BLOCK)
    _assert_prefetched(run, depth=1)
    _assert_identical(run, _plain(set()))
    # The planner, from the same timings, makes the run's plan.
    assert _planned(run["budget"]).auto_choice([FORWARD] * BLOCKS, RATES) == chosen


def _planned(budget: int, host_budget: int | None = None, min_offload_bytes: int = 1024) -> Plan:
    with torch.device("meta"):
        meta = Stack()
    activations = ActivationPlacement(auto=["Block"], host_budget=host_budget, min_offload_bytes=min_offload_bytes)
    placement = StaticPlacementConfig(device_budget=budget)
    plugin = ChunkPlugin(precision="fp32", chunk_size=8_000, placement=placement, activations=activations)
    return plan(meta, plugin, {"x": torch.zeros(BATCH, WIDTH)}, optimizer=torch.optim.AdamW, device="cpu")


@pytest.mark.slow
def test_the_small_storages_of_offloaded_calls_are_in_the_choice_and_its_plan_trains_within_the_budget() -> None:
    """Each call's input stays on the device when the call is offloaded (under ``min_offload_bytes``),
    held from its forward to its backward: the choice counts it, so that four offloaded calls that
    leave it there are not planned into room for one block and two of them; the plan trains
    within the budget, bit for bit as plain PyTorch (with the calls it recomputes checkpointed), and
    the planner makes the same plan."""
    from support.activation_budget_helpers import _recomputed, _train

    small = BATCH * WIDTH * 4  # a call's input, fp32 (a saved-tensor hooks count: PER_BLOCK's x)
    budget = _model_minimum() + PER_BLOCK + 2 * small
    with _timed():
        run = _train(budget, ActivationPlacement(auto=["Block"], min_offload_bytes=small + 1))
    chosen = run["plan"]
    assert chosen.choices.count(OFF) == 2 and chosen.small_bytes == 2 * small
    _assert_identical(run, _plain(_recomputed(chosen)))
    assert run["stats"].peak_device_bytes <= budget
    assert _planned(budget, min_offload_bytes=small + 1).auto_choice([FORWARD] * BLOCKS, RATES) == chosen


@pytest.mark.slow
def test_the_measuring_steps_fetches_find_room_at_model_data_and_one_call() -> None:
    """The optimizer side on the host: gradient buffers wait on the device for their copy to it, and
    in the first (measuring) step the fetch of a call's copies for its backward found the budget
    filled by them. Model data's least budget and one call's saved bytes (a saved-tensor hooks
    count) train from the first step, within the budget, bit for bit as plain PyTorch (with the
    calls the plan recomputes checkpointed)."""
    from support.activation_budget_helpers import _recomputed, _train

    budget = _model_minimum(optim_on_host=True) + PER_BLOCK
    run = _train(budget, ActivationPlacement(auto=["Block"]), optim_on_host=True)
    _assert_identical(run, _plain(_recomputed(run["plan"])))
    assert run["stats"].peak_device_bytes <= budget


@pytest.mark.slow  # the fast tier's case: refused at the first forward (test_activation_budget)
def test_a_measured_fetch_without_room_for_the_small_tensors_beside_it_is_refused_naming_the_budget() -> None:
    """Each call's input stays on the device (under ``min_offload_bytes``): the first (measuring)
    step's backward fetches the last call back beside the inputs the three calls before it keep. A
    budget that holds model data and one call (the plan's least, not refused by the forward) but not
    those is refused when that fetch finds no room, naming model data, one call and the three
    inputs; that budget trains, one byte less is refused with it."""
    from support.activation_budget_helpers import _boosted, _train

    small = BATCH * WIDTH * 4  # a call's input, fp32 (a saved-tensor hooks count: PER_BLOCK's x)
    placement = ActivationPlacement(auto=["Block"], min_offload_bytes=small + 1)
    model = _model_minimum(optim_on_host=True)
    minimum = model + PER_BLOCK + (BLOCKS - 1) * small
    for budget in (model + PER_BLOCK, minimum - 1):
        chunked, optimizer, booster = _boosted(budget, placement, optim_on_host=True)
        loss = _loss(chunked, _data()[0])  # the forward fits: the plan's least is in the budget
        with pytest.raises(BudgetTooSmallError, match=rf"fetching blocks\.3 back.* at least {minimum} ") as refused:
            booster.backward(loss, optimizer)
        assert refused.value.minimum == minimum
    run = _train(minimum, placement, optim_on_host=True)
    _assert_identical(run, _plain(_recomputed(run["plan"])))
    assert run["stats"].peak_device_bytes <= minimum


# --- beyond a host budget, to disk ----------------------------------------------------------------
HOST = 1 << 20  # the copies of a little more than two calls (the staging window takes a quarter)


def _to_disk_of(blocks: list[int]) -> int:
    """What the README's rule sends to disk when these blocks' calls are offloaded, counted with
    saved-tensor hooks over the plain model."""
    model = as_reference(Stack())
    x = _data()[0].to(device_of(model))
    return _to_disk(saved_storages([model.blocks[i] for i in blocks], lambda: _loss(model, x)), HOST)


def _assert_on_disk(run: dict[str, Any]) -> None:
    """The first step offloads every call, the next ones the plan's: beyond the host budget, to disk."""
    offloaded = [i for i, choice in enumerate(run["plan"].choices) if choice is OFF]
    first, later = _to_disk_of(list(range(BLOCKS))), _to_disk_of(offloaded)
    assert 0 < later < first
    stats = run["stats"]
    steps = len(run["fetched"])
    assert stats.activation_disk_write_bytes == stats.activation_disk_read_bytes == first + (steps - 1) * later
    assert 0 < max(run["host"]) <= HOST  # the host copies and the staging window, at each forward's end


@pytest.mark.slow
def test_auto_offloaded_calls_beyond_the_host_budget_go_to_disk_bit_for_bit(tmp_path: Path) -> None:
    run = _prefetching(host_budget=HOST, disk=str(tmp_path))
    assert (run["plan"].choices, run["plan"].prefetch) == ((OFF, OFF, OFF, KEEP), 1)
    _assert_prefetched(run, depth=1)  # fetched ahead from disk too
    _assert_identical(run, _plain(set()))
    _assert_on_disk(run)
    predicted = _planned(run["budget"], HOST)
    stats = run["stats"]
    later = predicted.activation_disk_bytes_per_forward(predicted.auto_choice([FORWARD] * BLOCKS, RATES))
    assert predicted.activation_disk_write_bytes_per_step + (STEPS - 1) * later == stats.activation_disk_write_bytes


def _two_ranks(rank: int, world_size: int, disk: str) -> None:
    """Each rank's half of the batch saves what the whole batch does at one rank."""
    from support.activation_budget_helpers import _train

    run = _prefetching(rank, world_size, HOST, disk)
    assert (run["plan"].choices, run["plan"].prefetch) == ((OFF, OFF, OFF, KEEP), 1)
    _assert_prefetched(run, depth=1)
    _assert_on_disk(run)
    _assert_identical(run, _train(None, None, rank, world_size))


@pytest.mark.slow
@pytest.mark.multirank
def test_two_ranks_fetch_ahead_and_beyond_the_host_budget_alike_and_train_as_keep(tmp_path: Path) -> None:
    run_ranks(_two_ranks, 2, args=(str(tmp_path),))
