"""One budget for model data and saved activations (``ActivationPlacement(auto=...)``): a model whose
plain-PyTorch activations alone exceed ``device_budget`` trains within it, bit for bit as plain
PyTorch (with the same checkpointing for the calls the plan recomputes, read from the public
``activation_plan``); the ledger's activation bytes equal a saved-tensor hooks count over the plain
model; a budget that cannot hold model data and one block is refused with the minimum; with room
everything is kept. The choice itself is tested on synthetic measurements."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError
from support.activation_budget_helpers import (
    AUTO,
    BATCH,
    BLOCKS,
    FP32,
    HIDDEN,
    PER_BLOCK,
    STEPS,
    WIDTH,
    Stack,
    _auto,
    _boosted,
    _data,
    _loss,
    _model_minimum,
    _plain,
    _recomputed,
    _train,
)
from support.activations_helpers import _assert_identical, _saved_bytes
from support.distributed import run_ranks
from support.models import adamw_two_groups, as_reference, boost, device_of

from chunkmem import BudgetExceededError, BudgetTooSmallError, ChunkedModel
from chunkmem.placement import (
    ActivationChoice,
    ActivationPlacement,
    BlockMeasure,
    CopyRates,
    StaticPlacementConfig,
    choose_activations,
)


def _plain_saved_bytes() -> int:
    """What autograd saves in the blocks of the plain model in one forward, every storage counted."""
    model = as_reference(Stack())
    x = _data()[0].to(device_of(model))
    return _saved_bytes(model.blocks, lambda: _loss(model, x), keep_below=0)


# --- end to end -------------------------------------------------------------------------------
@pytest.mark.slow  # the fast tier's case: with room, everything kept
def test_activations_beyond_the_budget_train_bit_for_bit_within_it() -> None:
    per_block = _plain_saved_bytes() // BLOCKS
    assert per_block == PER_BLOCK
    budget = _model_minimum() + 2 * PER_BLOCK + PER_BLOCK // 2  # one block kept, and one's working set
    assert _plain_saved_bytes() > budget  # plain PyTorch's activations alone do not fit
    run = _train(budget, _auto())
    plan = run["plan"]
    assert plan is not None and plan.choices.count(ActivationChoice.KEEP) == 1
    _assert_identical(run, _plain(_recomputed(plan)))
    stats = run["stats"]
    assert stats.peak_device_bytes <= budget
    assert stats.peak_device_bytes >= _model_minimum() + PER_BLOCK  # activations are in the figure
    offloaded = plan.choices.count(ActivationChoice.OFFLOAD)
    recomputed = len(_recomputed(plan))
    # The first step offloads every call; then the plan's calls copy, keep and recompute.
    assert stats.activation_d2h_bytes == PER_BLOCK * (BLOCKS + (STEPS - 1) * offloaded)
    assert stats.activation_h2d_bytes == stats.activation_d2h_bytes
    assert stats.activation_kept_bytes == (STEPS - 1) * PER_BLOCK
    assert stats.recomputed_blocks == (STEPS - 1) * recomputed
    assert stats.activation_recomputed_bytes == (STEPS - 1) * recomputed * PER_BLOCK
    assert stats.activation_bytes == 0


def test_with_room_everything_is_kept_and_the_ledger_counts_what_autograd_saves() -> None:
    saved = _plain_saved_bytes()
    budget = _model_minimum() + saved + PER_BLOCK
    run = _train(budget, _auto())
    assert set(run["plan"].choices) == {ActivationChoice.KEEP}
    _assert_identical(run, _plain(set()))
    first, last = run["after_first"], run["stats"]
    assert last.activation_d2h_bytes == first.activation_d2h_bytes  # no copies after the first step
    assert last.activation_h2d_bytes == first.activation_h2d_bytes
    assert last.recomputed_blocks == 0
    for forward in run["after_forward"][1:]:
        assert forward.activation_bytes == saved  # in the ledger from the save to the backward
    assert last.activation_bytes == 0
    assert saved <= last.peak_device_bytes <= budget


@pytest.mark.slow  # the fast tier's case: with room, everything kept
def test_a_budget_below_model_data_and_one_block_is_refused_with_the_minimum() -> None:
    minimum = _model_minimum() + PER_BLOCK
    with pytest.raises(BudgetTooSmallError, match=rf"at least {minimum} .*every block recomputed or offloaded"):
        _train(minimum - 1, _auto())
    run = _train(minimum, _auto())  # the minimum named trains, keeping nothing
    assert ActivationChoice.KEEP not in run["plan"].choices
    assert run["stats"].peak_device_bytes <= minimum


def test_a_budget_under_the_minimum_is_refused_at_the_first_forward_and_the_minimum_trains() -> None:
    """With the optimizer on the host model data needs little of the budget: one between its need
    and its need plus one call's saved bytes is refused by the first training forward, naming the
    minimum (the measured step's backward would fetch a call back into room it does not have), and
    that minimum trains as plain PyTorch with the plan's checkpointing."""
    minimum = _model_minimum(optim_on_host=True) + PER_BLOCK
    chunked, _, _ = _boosted(minimum - 1, optim_on_host=True)
    with pytest.raises(BudgetTooSmallError, match=rf"at least {minimum} ") as refused:
        _loss(chunked, _data()[0])
    assert (refused.value.budget, refused.value.minimum) == (minimum - 1, minimum)
    run = _train(minimum, AUTO, optim_on_host=True)
    assert ActivationChoice.KEEP not in run["plan"].choices
    _assert_identical(run, _plain(_recomputed(run["plan"])))
    assert run["stats"].peak_device_bytes <= minimum


def test_after_a_refusal_at_the_first_forward_the_same_model_trains_a_shorter_batch_as_plain_pytorch() -> None:
    """The refusal's fix (a shorter micro-batch) followed on the same boosted model: it measures
    again (nothing of the refused batch's figures stays, nor the reserve kept for its fetches), and
    trains as plain PyTorch does with the plan's checkpointing, bit for bit."""
    minimum = _model_minimum(optim_on_host=True) + PER_BLOCK
    chunked, optimizer, booster = _boosted(minimum - 1, optim_on_host=True)
    with pytest.raises(BudgetTooSmallError, match=rf"at least {minimum} "):
        _loss(chunked, _data()[0])
    # Each block call saves half of PER_BLOCK: it fits (cloned: a view's whole storage counts).
    half = [x[: BATCH // 2].clone() for x in _data()]
    run = _steps(chunked, optimizer, booster, half)
    plan = chunked.activation_plan
    assert plan is not None and plan.saved_bytes == (PER_BLOCK // 2,) * BLOCKS  # measured on the half batch
    _assert_identical(run, _plain(_recomputed(plan), half))
    assert chunked.stats().peak_device_bytes <= minimum - 1


def _steps(chunked: Any, optimizer: Any, booster: Any, data: list[torch.Tensor]) -> dict[str, Any]:
    losses = []
    for x in data:
        loss = _loss(chunked, x)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": chunked.state_dict()}


def _refused_then_half(rank: int, world_size: int) -> list[float]:
    minimum = _model_minimum(optim_on_host=True) + PER_BLOCK
    chunked, optimizer, booster = _boosted(minimum - 1, optim_on_host=True)
    with pytest.raises(BudgetTooSmallError):  # the same figures on both ranks
        _loss(chunked, _data(rank, world_size)[0])
    half = [x[: BATCH // 2] for x in _data(rank, world_size)]
    run = _steps(chunked, optimizer, booster, half)
    _assert_identical(run, _steps(*_boosted(None, None, optim_on_host=True), half))  # all activations kept
    return run["losses"]


@pytest.mark.slow
@pytest.mark.multirank
def test_after_a_refusal_at_the_first_forward_two_ranks_train_a_shorter_batch_as_keeping_everything() -> None:
    first, second = run_ranks(_refused_then_half, 2)
    assert first != second  # each rank's own half of the batch


@pytest.mark.slow  # the fast tier's case: with room, everything kept
def test_a_later_step_that_saves_more_than_the_first_is_refused_not_run_over_the_budget_and_re_planned() -> None:
    budget = _model_minimum() + BLOCKS * PER_BLOCK + PER_BLOCK  # every call kept
    chunked, optimizer, booster = _boosted(budget)
    for x in _data()[:2]:
        booster.backward(_loss(chunked, x), optimizer)
        optimizer.step()
        optimizer.zero_grad()
    assert set(chunked.activation_plan.choices) == {ActivationChoice.KEEP}
    longer = torch.cat(_data()[:2])  # twice the rows: every kept call saves twice the bytes
    with pytest.raises(BudgetExceededError, match=r"a step saved more than the plan's figures .* This step is refused"):
        _loss(chunked, longer)
    assert chunked.stats().peak_device_bytes <= budget
    assert chunked.activation_plan.saved_bytes == (2 * PER_BLOCK,) * BLOCKS  # planned again for the new figures
    booster.backward(_loss(chunked, longer), optimizer)  # the step of this shape runs under the new plan
    assert chunked.stats().peak_device_bytes <= budget


@pytest.mark.slow
@pytest.mark.simulated
def test_on_the_simulated_asynchronous_device_the_budget_holds_and_results_are_exact() -> None:
    """Copies overlap compute there (the plan's model hides them), fetched copies are read after the
    fetch stream, and the ledger frees a saved tensor only once its copy out is done."""
    from chunkmem.device.simulated import simulated_device

    budget = _model_minimum() + 2 * PER_BLOCK + PER_BLOCK // 2
    with simulated_device():
        run = _train(budget, _auto())
    _assert_identical(run, _plain(_recomputed(run["plan"])))
    assert run["stats"].peak_device_bytes <= budget
    assert run["plan"].choices.count(ActivationChoice.KEEP) == 1


def test_auto_needs_a_device_budget_and_one_field_per_class() -> None:
    with pytest.raises(ValueError, match="has no device_budget"):
        _train(None, _auto())
    with pytest.raises(ValidationError, match=r"auto and offload both name \['Block'\]"):
        ActivationPlacement(auto=["Block"], offload=["Block"])


def _two_ranks(rank: int, world_size: int) -> dict[str, Any]:
    """Each rank's half of the batch saves what the whole batch does at one rank (``_data``)."""
    budget = _model_minimum() + 2 * PER_BLOCK + PER_BLOCK // 2  # sharded model data, one block kept, one's room
    assert budget < BLOCKS * PER_BLOCK
    keep = _train(None, None, rank, world_size)
    auto = _train(budget, _auto(), rank, world_size)
    _assert_identical(auto, keep)
    assert auto["stats"].peak_device_bytes <= budget
    return {"choices": auto["plan"].choices, "peak": auto["stats"].peak_device_bytes}


@pytest.mark.slow
@pytest.mark.multirank
def test_two_ranks_train_under_one_budget_as_keep_with_one_plan() -> None:
    first, second = run_ranks(_two_ranks, 2)
    assert first["choices"] == second["choices"]
    assert ActivationChoice.KEEP in first["choices"] and set(first["choices"]) != {ActivationChoice.KEEP}


@pytest.mark.slow
def test_gpt2_under_one_budget_equals_plain_pytorch_bit_for_bit() -> None:
    """Hugging Face blocks (tuple outputs, attention masks, SDPA): the plan's choices are exact and
    the budget holds, with plain activations alone above it."""
    from support.models import batches, gpt2, lm_loss, train_reference

    data = batches(3, batch=8, seq=32)
    model = as_reference(gpt2(n_layer=3, n_embd=32))
    saved = _saved_bytes(model.transformer.h, lambda: lm_loss(model, data[0]), keep_below=0)
    per_block = saved // 3
    with pytest.raises(BudgetTooSmallError) as refused:
        boost(gpt2(n_layer=3, n_embd=32), adamw_two_groups, placement=StaticPlacementConfig(device_budget=1))
    budget = refused.value.minimum + 2 * per_block + per_block // 2
    assert saved > budget - refused.value.minimum
    reference = as_reference(gpt2(n_layer=3, n_embd=32))
    plain = {"losses": train_reference(reference, adamw_two_groups, data), "state": reference.state_dict()}
    chunked, optimizer, booster = boost(
        gpt2(n_layer=3, n_embd=32),
        adamw_two_groups,
        placement=StaticPlacementConfig(device_budget=budget),
        activations=ActivationPlacement(auto=["GPT2Block"]),
    )
    losses = []
    for ids in data:
        loss = lm_loss(chunked, ids)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    # No dropout: recomputing a block gives the same values, so every choice equals plain PyTorch.
    _assert_identical({"losses": losses, "state": chunked.state_dict()}, plain)
    assert chunked.activation_plan.choices.count(ActivationChoice.KEEP) == 1
    assert chunked.stats().peak_device_bytes <= budget


# --- the choice -------------------------------------------------------------------------------
MB = 1 << 20


def _measures(*seconds: float) -> list[BlockMeasure]:
    return [BlockMeasure(f"b{i}", MB, s) for i, s in enumerate(seconds)]


def test_everything_is_kept_when_it_fits_with_one_blocks_working_set() -> None:
    rates = CopyRates(to_host=MB, to_device=MB, overlap=False)
    plan = choose_activations(_measures(1.0, 1.0, 1.0), rates, budget=10 * MB + 4 * MB, model_bytes=10 * MB)
    assert plan.choices == (ActivationChoice.KEEP,) * 3 and plan.seconds == 0 and plan.reserve == MB
    plan = choose_activations(_measures(1.0, 1.0, 1.0), rates, budget=10 * MB + 4 * MB - 1, model_bytes=10 * MB)
    assert plan.choices.count(ActivationChoice.KEEP) == 2


def test_recompute_where_compute_is_cheaper_than_the_copies_and_offload_where_they_hide() -> None:
    # 1 MiB at 1 MiB/s each way: 2 s of copies; forwards of 0.5 s and 3 s.
    serial = CopyRates(to_host=MB, to_device=MB, overlap=False)
    plan = choose_activations(_measures(0.5, 3.0), serial, budget=2 * MB, model_bytes=MB)
    assert plan.choices == (ActivationChoice.RECOMPUTE, ActivationChoice.OFFLOAD)
    assert plan.seconds == 0.5 + 2.0
    # Asynchronous copies hide behind the call's forward (out: 1 s against 1.0 and 0.7 s) and, fetched
    # one call ahead, the next call's backward (back: 1 s against twice its forward, 1.4 s; the last
    # call has none); the budget has room for that fetch.
    overlapped = CopyRates(to_host=MB, to_device=MB, overlap=True)
    plan = choose_activations(_measures(1.0, 0.7, 0.7), overlapped, budget=3 * MB, model_bytes=MB, max_prefetch=1)
    assert plan.choices == (ActivationChoice.OFFLOAD, ActivationChoice.OFFLOAD, ActivationChoice.RECOMPUTE)
    assert plan.seconds == pytest.approx(0.0 + 0.3 + 0.7) and (plan.prefetch, plan.reserve) == (1, 2 * MB)
    # Without room for it (or fetched when the backward needs it), the copy back hides behind nothing.
    plan = choose_activations(_measures(1.0, 0.7, 0.7), overlapped, budget=2 * MB, model_bytes=MB, max_prefetch=1)
    assert plan.choices == (ActivationChoice.RECOMPUTE, ActivationChoice.RECOMPUTE, ActivationChoice.RECOMPUTE)
    assert (plan.prefetch, plan.reserve) == (0, MB)


def test_the_offloads_own_host_time_counts_against_it() -> None:
    """Copies of 1 MiB at 1 GiB/s cost next to nothing; the hooks' host time decides."""
    fast = CopyRates(to_host=1024 * MB, to_device=1024 * MB, overlap=False)
    costly = [BlockMeasure("b", MB, forward_seconds=1.0, offload_seconds=3.0)]
    cheap = [BlockMeasure("b", MB, forward_seconds=1.0, offload_seconds=0.25)]
    assert choose_activations(costly, fast, budget=2 * MB, model_bytes=MB).choices == (ActivationChoice.RECOMPUTE,)
    plan = choose_activations(cheap, fast, budget=2 * MB, model_bytes=MB)
    assert plan.choices == (ActivationChoice.OFFLOAD,) and plan.seconds == 0.25


def test_the_calls_kept_are_those_whose_other_way_costs_most_per_byte() -> None:
    rates = CopyRates(to_host=0.0, to_device=0.0, overlap=False)  # no copy measured: never offload
    measures = [BlockMeasure("cheap", MB, 0.1), BlockMeasure("dear", MB, 5.0), BlockMeasure("big", 2 * MB, 6.0)]
    plan = choose_activations(measures, rates, budget=MB + 2 * MB + MB, model_bytes=MB)
    assert plan.by_block() == {
        "cheap": ActivationChoice.RECOMPUTE,
        "dear": ActivationChoice.KEEP,
        "big": ActivationChoice.RECOMPUTE,
    }
    with pytest.raises(ValueError, match=rf"block big saves 2.00 MiB .*at least {MB + 2 * MB} "):
        choose_activations(measures, rates, budget=3 * MB - 1, model_bytes=MB)


def test_a_chunked_model_without_auto_blocks_has_no_plan() -> None:
    chunked, _, _ = boost(Stack(), adamw_two_groups, activations=ActivationPlacement(offload=["Block"]))
    assert isinstance(chunked, ChunkedModel) and chunked.activation_plan is None


def test_small_saved_tensors_an_offloaded_call_keeps_come_back_for_its_backward() -> None:
    """Storages under ``min_offload_bytes`` stay on the device in the ledger's handle, also in the
    first step, whose calls are offloaded (here every storage is that small)."""
    budget = _model_minimum() + BLOCKS * PER_BLOCK + PER_BLOCK
    run = _train(budget, ActivationPlacement(auto=["Block"], min_offload_bytes=BATCH * HIDDEN * FP32 + 1))
    _assert_identical(run, _plain(_recomputed(run["plan"])))
    assert run["stats"].activation_d2h_bytes == 0  # nothing was large enough to copy
    assert run["after_forward"][0].activation_bytes == BLOCKS * PER_BLOCK  # kept, in the ledger
    assert run["stats"].peak_device_bytes <= budget


# --- what the choice is made from, and a failed wait ------------------------------------------
def _every_call_offloaded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Make the plan offload every call (whatever the timings say); returns the choice's inputs."""
    import dataclasses

    import chunkmem.activations.auto as auto

    choose, inputs = auto.choose_activations, []

    def offload_all(measures: Any, rates: CopyRates, *args: Any) -> Any:
        inputs.append((measures, rates))
        plan = choose(measures, rates, *args)
        return dataclasses.replace(plan, choices=(ActivationChoice.OFFLOAD,) * len(plan.choices), kept_bytes=0)

    monkeypatch.setattr(auto, "choose_activations", offload_all)
    return inputs


def test_a_failed_wait_for_an_offloaded_calls_copies_leaves_nothing_in_the_ledger(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wait at a call's end for its copies to the host fails (a device error): the call is over,
    and what it held for them leaves the ledger at once (the failed call itself lives on in the
    error's traceback)."""
    import sys

    from chunkmem.tiers.transfers import HostTransfers

    _every_call_offloaded(monkeypatch)
    budget = _model_minimum() + BLOCKS * PER_BLOCK + PER_BLOCK
    chunked, optimizer, booster = _boosted(budget)
    x = _data()[0]
    booster.backward(_loss(chunked, x), optimizer)  # measured
    wait = HostTransfers.before_host_read

    def failing(self: HostTransfers, host: torch.Tensor) -> None:
        if sys._getframe(1).f_code.co_name == "settle":
            raise RuntimeError("injected: the device failed while the host waited for a copy")
        wait(self, host)

    monkeypatch.setattr(HostTransfers, "before_host_read", failing)
    with pytest.raises(RuntimeError, match="injected") as failed:
        _loss(chunked, x)  # the plan's first call: offloaded, its wait fails
    assert chunked.activation_plan.choices[0] is ActivationChoice.OFFLOAD
    assert chunked.stats().activation_bytes == 0
    assert failed.value is not None  # the traceback (and the failed call) lived until here
    monkeypatch.setattr(HostTransfers, "before_host_read", wait)
    booster.backward(_loss(chunked, x), optimizer)  # trains on
    assert chunked.stats().activation_bytes == 0


@pytest.mark.simulated
def test_the_copy_rates_the_choice_reads_hold_every_measured_copys_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an asynchronous device a copy's time is known once it completed. Copies here complete
    only when the host waits for them, and take 1 ms out, 3 ms back: the rates the choice is made
    from are the measured bytes over all the measured copies' time, each way."""
    import sys

    from chunkmem.device.simulated import SimulatedLayer, simulated_device
    from chunkmem.tiers.transfers import Direction, HostTransfers

    seconds = {Direction.TO_HOST: 1e-3, Direction.TO_DEVICE: 3e-3}
    copying: list[Direction] = []
    direction_of: dict[int, Direction] = {}
    waited: set[int] = set()
    made = {d: [0, 0] for d in Direction}  # copies, bytes
    copy, record, synchronize = HostTransfers.copy, SimulatedLayer.record_event, SimulatedLayer.synchronize

    def counted_copy(self: HostTransfers, target: torch.Tensor, source: torch.Tensor, direction: Direction, **kw: Any):
        copying.append(direction)
        try:
            copy(self, target, source, direction, **kw)
        finally:
            copying.pop()
        activations = sys._getframe(1).f_globals["__name__"].startswith("chunkmem.activations")
        if activations and not inputs:  # the activations' copies, before the choice
            made[direction][0] += 1
            made[direction][1] += source.numel() * source.element_size()

    def recorded(self: SimulatedLayer, *args: Any, **kwargs: Any) -> Any:
        event = record(self, *args, **kwargs)
        if copying:
            direction_of[id(event)] = copying[-1]
        return event

    def synchronized(self: SimulatedLayer, event: Any) -> None:
        waited.add(id(event))
        synchronize(self, event)

    monkeypatch.setattr(HostTransfers, "copy", counted_copy)
    monkeypatch.setattr(SimulatedLayer, "record_event", recorded)
    monkeypatch.setattr(SimulatedLayer, "synchronize", synchronized)
    monkeypatch.setattr(SimulatedLayer, "query", lambda self, event: event is None or id(event) in waited)
    monkeypatch.setattr(SimulatedLayer, "elapsed_seconds", lambda self, begin, end: seconds[direction_of[id(end)]])
    inputs = _every_call_offloaded(monkeypatch)
    budget = _model_minimum() + BLOCKS * PER_BLOCK + PER_BLOCK
    with simulated_device():
        chunked, optimizer, booster = _boosted(budget)
        for x in _data()[:2]:
            booster.backward(_loss(chunked, x), optimizer)
    ((_, rates),) = inputs
    assert made[Direction.TO_HOST] == made[Direction.TO_DEVICE] == [4 * BLOCKS, BLOCKS * PER_BLOCK]
    assert rates.to_host == pytest.approx(BLOCKS * PER_BLOCK / (4 * BLOCKS * seconds[Direction.TO_HOST]))
    assert rates.to_device == pytest.approx(BLOCKS * PER_BLOCK / (4 * BLOCKS * seconds[Direction.TO_DEVICE]))


def test_a_shorter_step_whose_storages_fall_under_the_copy_threshold_copies_them_within_the_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dynamic padding: the first (measured) step is the longest, a later one is four times shorter.
    Its storages fall under ``min_offload_bytes`` where the first step's were copied: the call
    copies them still, within the bytes its plan accounts, rather than refusing a call that saves
    less than the first. Results equal plain PyTorch on the same batches."""
    _every_call_offloaded(monkeypatch)
    batches = [x if step == 0 else x[: BATCH // 4] for step, x in enumerate(_data())]
    budget = _model_minimum() + BLOCKS * PER_BLOCK + PER_BLOCK
    activations = ActivationPlacement(auto=["Block"], min_offload_bytes=BATCH * WIDTH * FP32)
    chunked, optimizer, booster = _boosted(budget, activations)
    losses = []
    for x in batches:
        loss = _loss(chunked, x)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    assert set(chunked.activation_plan.choices) == {ActivationChoice.OFFLOAD}
    model = as_reference(Stack())
    reference = adamw_two_groups(model)
    expected = []
    for x in batches:
        loss = _loss(model, x.to(device_of(model)))
        loss.backward()
        reference.step()
        reference.zero_grad()
        expected.append(float(loss.detach()))
    assert losses == expected
    for name, value in model.state_dict().items():
        assert torch.equal(chunked.state_dict()[name].cpu(), value.cpu()), name
    assert chunked.stats().peak_device_bytes <= budget
