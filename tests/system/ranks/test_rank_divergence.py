"""Ranks that depart from each other raise on every rank, within seconds, with a message naming
each rank's iteration and op and what to do - never a gloo abort or a hang until the timeout.

Each case runs a few normal steps, then one rank departs: an extra no-grad forward (evaluation)
on one rank, a module called outside the model's forward on one rank, a module skipped by a
rank-dependent branch (in the first, recording iteration and in a later, trace-following one, with
prefetch, at W=2 and W=4). The same departure taken by every rank is not an error.

A state call (save, load, state dict, plain copy) on some ranks raises on every rank within seconds
while the others wait in a collective of the script's own (``dist.barrier()``), or end their
script; ranks that are only slow (sleeping, or waiting in a collective for a slow rank) are
waited for.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from support.distributed import run_ranks
from support.models import boost

from chunkmem.placement import AutoPlacementConfig, StaticPlacementConfig

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

DEADLINE = 30.0  # seconds from the departure to an error on every rank


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, skip: int | None = None) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            if index != skip:
                x = x + block(x).tanh()
        return self.head(x).pow(2).mean()


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


PLACEMENTS = {
    "static": StaticPlacementConfig(),
    "static-prefetch2": StaticPlacementConfig(max_prefetch=2),
    "auto-budget-prefetch1": AutoPlacementConfig(device_budget=60_000, max_prefetch=1),
}


def _run(rank: int, world_size: int, placement: str, depart: str, at_step: int, who: int) -> dict[str, Any]:
    chunked, optimizer, booster = boost(
        _Blocks(), _adamw, precision="fp32", chunk_size=1_100, placement=PLACEMENTS[placement]
    )
    g = torch.Generator().manual_seed(rank)
    departed_at = None
    try:
        for step in range(at_step + 2):
            x = torch.randn(4, 32, generator=g)
            skip = None
            if step == at_step and rank in (who, -1):
                departed_at = time.monotonic()
                if depart == "eval":
                    with torch.no_grad():
                        chunked(x)
                elif depart == "submodule":
                    # Called directly, the block gets no input moving from the wrapper.
                    chunked.module.blocks[1](x.to(chunked.compute_device))
                elif depart == "skip":
                    skip = 2
            if step == at_step and depart == "skip" and who == -1:
                skip = 2
            loss = chunked(x, skip=skip)
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
    except Exception as error:  # every rank must get here
        return {"error": type(error).__name__, "message": str(error), "raised": time.monotonic()}
    return {"error": None, "departed": departed_at, "divergences": chunked.stats().divergences}


def _check_all_raised(results: list[dict[str, Any]], names: tuple[str, ...]) -> None:
    for rank, result in enumerate(results):
        assert result["error"] == "TraceDivergenceError", (rank, result)
        message = result["message"]
        assert f"rank {rank}:" in message
        for name in names:
            assert name in message, (rank, name, message)
        assert "every rank" in message or "Every rank" in message  # says what to do


@pytest.mark.parametrize("depart", ["eval", "submodule"])
def test_extra_work_on_one_rank_raises_everywhere(depart: str) -> None:
    start = time.monotonic()
    results = run_ranks(_run, 2, args=("static", depart, 2, 0), timeout=120, pg_timeout=60)
    assert time.monotonic() - start < DEADLINE + 20  # spawning ranks and three steps included
    _check_all_raised(results, ("rank 0", "rank 1", "training iteration 2"))
    if depart == "eval":
        assert "grad disabled" in results[0]["message"]


@pytest.mark.parametrize(
    ("placement", "at_step", "world_size"),
    [
        ("static", 0, 2),  # recording: collectives are agreed one by one
        ("static-prefetch2", 2, 2),  # following the trace: the departing rank alarms the others
        ("auto-budget-prefetch1", 2, 2),
        ("static-prefetch2", 2, 4),
    ],
)
def test_rank_dependent_skip_raises_everywhere(placement: str, at_step: int, world_size: int) -> None:
    who = world_size - 1
    start = time.monotonic()
    results = run_ranks(_run, world_size, args=(placement, "skip", at_step, who), timeout=150, pg_timeout=60)
    assert time.monotonic() - start < DEADLINE + 30
    _check_all_raised(results, (f"rank {who}", f"training iteration {at_step}"))
    if at_step > 0:
        # The departing rank is named as such on every rank.
        for result in results:
            assert f"ranks [{who}] departed from the compute trace" in result["message"]


def test_the_same_departure_on_every_rank_trains_on() -> None:
    results = run_ranks(_run, 2, args=("static-prefetch2", "skip", 2, -1), timeout=120)
    for result in results:
        assert result["error"] is None, result
        assert result["divergences"] >= 1


def _compile_second_model(rank: int, world_size: int) -> tuple[str, list[str]]:
    """The message each rank gets, and the graphs Dynamo handed to the backend before it. The
    backend records them instead of compiling: the refusal comes while Dynamo traces, before any
    backend runs (test_training.py's refusal test), and Inductor's import alone took 10 s here."""
    graphs: list[str] = []

    def backend(graph: torch.fx.GraphModule, inputs: Any) -> Any:
        graphs.append(str(graph.graph))
        return graph.forward

    first, optimizer, booster = boost(_Blocks(), _adamw, precision="fp32", chunk_size=1_100)
    second, _, _ = boost(_Blocks(), _adamw, precision="fp32", chunk_size=1_100)
    x = torch.randn(4, 32)
    booster.backward(first(x), optimizer)
    optimizer.step()
    compiled = torch.compile(second, backend=backend)
    try:
        compiled(x)
    except Exception as error:  # dynamo wraps it; the message is chunkmem's
        return str(error), graphs
    finally:
        torch._dynamo.reset()  # a pooled rank: no compiled code or guards left for the next test
    return "compiled and ran", graphs


def test_torch_compile_of_a_boosted_model_is_refused_not_hung() -> None:
    start = time.monotonic()
    results = run_ranks(_compile_second_model, 2, timeout=120)
    assert time.monotonic() - start < DEADLINE + 30
    for message, graphs in results:
        assert "torch.compile" in message and "eagerly" in message, message
        assert graphs == [], f"compiled before refusing: {graphs}"


def _hugging_face_on_one_rank(rank: int, world_size: int, depart: str, out_dir: str) -> dict[str, Any]:
    from support.models import adamw_two_groups, batches, gpt2, lm_loss

    chunked, optimizer, booster = boost(gpt2(), adamw_two_groups, precision="fp32", chunk_size=10_000)
    try:
        for step, ids in enumerate(batches(3, batch=4)):
            if step == 1 and rank == 0:
                if depart == "generate":
                    chunked.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
                else:
                    chunked.save_pretrained(out_dir)
            booster.backward(lm_loss(chunked, ids.chunk(world_size)[rank]), optimizer)
            optimizer.step()
            optimizer.zero_grad()
    except Exception as error:
        return {"error": type(error).__name__, "message": str(error)}
    return {"error": None}


@pytest.mark.parametrize("depart", ["generate", "save_pretrained"])
def test_hugging_face_calls_on_one_rank_raise_everywhere(depart: str, tmp_path: Any) -> None:
    start = time.monotonic()
    results = run_ranks(_hugging_face_on_one_rank, 2, args=(depart, str(tmp_path)), timeout=120, pg_timeout=60)
    assert time.monotonic() - start < DEADLINE + 30
    for rank, result in enumerate(results):
        assert result["error"] == "TraceDivergenceError", (rank, result)
        assert "plain_copy()" in result["message"]
    # generate() agrees its entry before anything (its KV cache's forecast is agreed over ranks).
    assert "rank 0: generate" in results[0]["message"] or "plain copy" in results[0]["message"]


# --- a chunkmem call on some ranks while the others wait in a collective of their own -----------
# Issue 23 item 5: ``if rank == 0: booster.save_model(...)`` then ``dist.barrier()`` on every rank.
# The process-group timeout is far above the deadline, so a timeout cannot pass for the error.
PG_TIMEOUT = 90.0
SOON = 20.0  # seconds from the departure to an error on every rank
# A slow rank, not a departed one: longer than the grace after which a waiting rank asks the others
# what they do (1 s) and the pause before it asks again (1 s, to confirm what it was told), so the
# question is asked and answered "still coming" twice (at 1 s and 2 s; the next would be at 4 s).
SLOW = 2.5


class _ChunkmemErrors(logging.Handler):
    """The errors chunkmem logs in this process, with when."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((time.monotonic(), record.getMessage()))


def _trained_a_step() -> tuple[Any, Any, Any]:
    """A boosted model, its optimizer and booster, after one training step."""
    chunked, optimizer, booster = boost(_Blocks(), _adamw, precision="fp32", chunk_size=1_100)
    booster.backward(chunked(torch.randn(4, 32)), optimizer)
    optimizer.step()
    optimizer.zero_grad()
    return chunked, optimizer, booster


def _state_call(call: str, chunked: Any, optimizer: Any, booster: Any, path: str) -> None:
    if call == "save_model":
        booster.save_model(chunked, os.path.join(path, "model.pt"))
    elif call == "save_sharded":
        booster.save_model(chunked, os.path.join(path, "model-sharded"), shard=True)
    elif call == "save_optimizer":
        booster.save_optimizer(optimizer, os.path.join(path, "optim.pt"))
    elif call == "load_model":
        booster.load_model(chunked, os.path.join(path, "model.pt"))
    elif call == "load_sharded":
        booster.load_model(chunked, os.path.join(path, "model-sharded"))
    elif call == "state_dict":
        chunked.state_dict()
    else:
        raise AssertionError(call)


def _some_ranks_call(
    rank: int, world_size: int, call: str, callers: tuple[int, ...], others: str, path: str
) -> dict[str, Any]:
    """Train a step; then ranks ``callers`` make ``call`` while the others do ``others``: wait in a
    ``dist.barrier()`` of the script's own, end the script, sleep SLOW seconds and make the call too, or
    (``subgroup``) meet in a barrier of their own group, which the last of them reaches after SLOW seconds,
    and make the call too, or (``issued``) wait in an all-reduce that the callers started before
    their call (``async_op``) and the last of them reaches after SLOW seconds, and make the call too."""
    errors = _ChunkmemErrors()
    logging.getLogger("chunkmem").addHandler(errors)
    try:
        chunked, optimizer, booster = _trained_a_step()
        others_group = dist.new_group([r for r in range(world_size) if r not in callers])
        if call.startswith("load"):  # something to load, written by every rank
            _state_call("save_sharded" if call == "load_sharded" else "save_model", chunked, optimizer, booster, path)
        dist.barrier()
        departed = time.monotonic()
        result: dict[str, Any] = {"departed": departed, "error": None}
        try:
            if rank in callers:
                started = dist.all_reduce(torch.ones(1), async_op=True) if others == "issued" else None
                _state_call(call, chunked, optimizer, booster, path)
                if started is not None:
                    started.wait()
            elif others == "barrier":
                dist.barrier()
            elif others == "exit":
                return result
            elif others in ("subgroup", "issued"):
                if rank == world_size - 1:
                    time.sleep(SLOW)
                if others == "subgroup":
                    dist.barrier(group=others_group)  # completes once the slow rank comes
                else:
                    dist.all_reduce(torch.ones(1))  # the callers issued it already
                _state_call(call, chunked, optimizer, booster, path)
            else:
                time.sleep(SLOW)  # a slow rank, not a departed one
                _state_call(call, chunked, optimizer, booster, path)
        except Exception as error:
            result.update(error=type(error).__name__, message=str(error), raised=time.monotonic() - departed)
            if rank not in callers:  # a collective of the script's own failed: chunkmem's next call says why
                try:
                    chunked(torch.randn(4, 32))
                except Exception as next_error:
                    result.update(next_error=type(next_error).__name__, next_message=str(next_error))
        else:
            booster.backward(chunked(torch.randn(4, 32)), optimizer)  # training goes on
            optimizer.step()
        result["logged"] = [(at - departed, message) for at, message in errors.records]
        return result
    finally:
        logging.getLogger("chunkmem").removeHandler(errors)


def _check_named(message: str, rank: int, callers: tuple[int, ...], waiting: list[int]) -> None:
    # The fix first (issue 28 item 16), then where each rank is.
    assert message.startswith(f"rank {rank}: make the chunkmem call that ranks {list(callers)} are in ("), message
    assert message.index("on every rank:") < message.index("wait in a torch.distributed collective"), message
    assert f"ranks {waiting} wait in a torch.distributed collective of their own" in message, message
    assert f"ranks {list(callers)} will not join" in message, message
    assert "generate()" not in message, message  # not the list of every other fix
    for other in waiting:
        assert f"rank {other}: waits in torch.distributed.barrier() called at " in message, message
        assert "test_rank_divergence.py:" in message, message  # the script's line that called it
    assert "on every rank" in message, message  # what to do


@pytest.mark.parametrize(
    "call",
    # Every state call enters through the same agreement; these cover the model's and the
    # optimizer's gathers, and the single-file and sharded loads.
    ["save_model", "state_dict", "load_model", "load_sharded", "save_optimizer"],
)
def test_a_state_call_on_one_rank_while_the_other_waits_in_its_own_barrier_raises_on_both(
    call: str, tmp_path: Any
) -> None:
    results = run_ranks(
        _some_ranks_call, 2, args=(call, (0,), "barrier", str(tmp_path)), timeout=150, pg_timeout=PG_TIMEOUT
    )
    caller, waiter = results
    # The calling rank raises chunkmem's error within seconds.
    assert caller["error"] == "TraceDivergenceError", caller
    assert caller["raised"] < SOON, caller
    _check_named(caller["message"], 0, (0,), [1])
    # The waiting rank logs the same error within seconds, and its barrier raises it once the calling
    # rank's process ends (issue 28 item 16), as does its next chunkmem call.
    assert waiter["error"] == "TraceDivergenceError" and waiter["raised"] < SOON, waiter
    _check_named(waiter["message"], 1, (0,), [1])
    assert waiter["next_error"] == "TraceDivergenceError", waiter
    _check_named(waiter["next_message"], 1, (0,), [1])
    logged = [(at, message) for at, message in waiter["logged"] if "wait in a torch.distributed collective" in message]
    assert logged and logged[0][0] < SOON, waiter["logged"]
    _check_named(logged[0][1], 1, (0,), [1])


@pytest.mark.parametrize(("world_size", "callers"), [(3, (0,)), (4, (0, 1))])
def test_ranks_save_while_the_others_wait_in_their_own_barrier_every_rank_raises(
    world_size: int, callers: tuple[int, ...], tmp_path: Any
) -> None:
    results = run_ranks(
        _some_ranks_call,
        world_size,
        args=("save_model", callers, "barrier", str(tmp_path)),
        timeout=200,
        pg_timeout=PG_TIMEOUT,
    )
    waiting = [r for r in range(world_size) if r not in callers]
    for rank, result in enumerate(results):
        assert result["error"] == "TraceDivergenceError" and result["raised"] < SOON, (rank, result)
        _check_named(result["message"], rank, callers, waiting)
        assert rank in callers or result["next_error"] == "TraceDivergenceError", (rank, result)


def test_a_save_on_one_rank_while_the_other_ends_its_script_raises_at_once(tmp_path: Any) -> None:
    caller, ended = run_ranks(
        _some_ranks_call, 2, args=("save_model", (0,), "exit", str(tmp_path)), timeout=150, pg_timeout=PG_TIMEOUT
    )
    assert ended["error"] is None
    assert caller["error"] == "TraceDivergenceError" and caller["raised"] < SOON, caller
    assert caller["message"].startswith("rank 0: the other ranks did not reach a cross-rank check"), caller
    assert "process ended" in caller["message"] and "on every rank" in caller["message"], caller


@pytest.mark.parametrize(
    ("world_size", "others"),
    [
        (2, "sleep"),  # rank 1 sleeps, then saves
        (4, "subgroup"),  # ranks 1 and 2 wait in a barrier of their own group for rank 3, which sleeps
        (4, "issued"),  # ranks 1 and 2 wait for rank 3 in an all-reduce rank 0 issued before its save
    ],
)
def test_ranks_busy_for_seconds_before_their_save_are_waited_for(world_size: int, others: str, tmp_path: Any) -> None:
    results = run_ranks(_some_ranks_call, world_size, args=("save_model", (0,), others, str(tmp_path)), timeout=150)
    for result in results:
        assert result["error"] is None, result
        assert result["logged"] == [], result


def _save_on_one_rank_then_train(rank: int, world_size: int, path: str) -> dict[str, Any]:
    chunked, optimizer, booster = boost(_Blocks(), _adamw, precision="fp32", chunk_size=1_100)
    try:
        for step in range(3):
            if step == 1 and rank == 0:
                booster.save_model(chunked, os.path.join(path, "model.pt"))
            booster.backward(chunked(torch.randn(4, 32)), optimizer)
            optimizer.step()
            optimizer.zero_grad()
    except Exception as error:
        return {"error": type(error).__name__, "message": str(error)}
    return {"error": None}


def test_a_save_on_one_rank_raises_everywhere_when_the_other_trains_on(tmp_path: Any) -> None:
    start = time.monotonic()
    results = run_ranks(_save_on_one_rank_then_train, 2, args=(str(tmp_path),), timeout=120, pg_timeout=PG_TIMEOUT)
    assert time.monotonic() - start < DEADLINE + 30
    for rank, result in enumerate(results):
        assert result["error"] == "TraceDivergenceError", (rank, result)
        assert "rank 0: gathering a state dict" in result["message"], result  # the save gathers first
        assert "rank 1: forward" in result["message"], result


# --- point-to-point traffic, then a rank waiting in a collective for a slow rank ----------------
# Issue 28 item 7: operation numbers count a point-to-point call on its own side only. After
# ``dist.monitored_barrier()`` (or a send from rank 0), rank 0 waiting as the root of a gather for a
# slow last rank has a higher number than rank 1, which gave its part and went on into a save: rank
# 1 must not find rank 0 departed while the gather still waits for the last rank.
def _gather_after_messages(rank: int, world_size: int, messages: str, path: str) -> dict[str, Any]:
    errors = _ChunkmemErrors()
    logging.getLogger("chunkmem").addHandler(errors)
    try:
        chunked, optimizer, booster = _trained_a_step()
        last = world_size - 1
        if messages == "monitored_barrier":
            dist.monitored_barrier()
        elif rank == 0:
            dist.send(torch.ones(1), dst=last)
        elif rank == last:
            dist.recv(torch.ones(1), src=0)
        start = time.monotonic()
        if rank == last:
            time.sleep(SLOW)
        gathered = [torch.zeros(1) for _ in range(world_size)] if rank == 0 else None
        dist.gather(torch.full((1,), float(rank)), gathered, dst=0)
        gave = time.monotonic() - start
        try:
            booster.save_model(chunked, os.path.join(path, "model.pt"))
            booster.backward(chunked(torch.randn(4, 32)), optimizer)  # training goes on
            optimizer.step()
        except Exception as error:
            return {"error": type(error).__name__, "message": str(error)}
        return {"error": None, "gave": gave, "logged": [message for _, message in errors.records]}
    finally:
        logging.getLogger("chunkmem").removeHandler(errors)


@pytest.mark.parametrize(("world_size", "messages"), [(3, "monitored_barrier"), (3, "send"), (4, "monitored_barrier")])
def test_a_rank_waiting_for_a_slow_rank_after_point_to_point_traffic_is_waited_for(
    world_size: int, messages: str, tmp_path: Any
) -> None:
    results = run_ranks(_gather_after_messages, world_size, args=(messages, str(tmp_path)), timeout=150)
    for result in results:
        assert result["error"] is None, result
        assert result["logged"] == [], result
    assert results[1]["gave"] < SLOW / 2 < results[0]["gave"]  # rank 1 went into the save while rank 0 waited
