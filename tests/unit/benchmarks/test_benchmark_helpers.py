"""The benchmarks' own helpers: sizing from a card, the parameter-count formula, the round order,
tables, memory probes and the rank pool that spawns, times out and reports ranks."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from support.paths import ROOT

sys.path.insert(0, str(ROOT))

from benchmarks.card import (
    ACTIVATION_SHARE,
    HOST_SHARE,
    LADDER,
    activation_bytes_per_sequence,
    chunk_model_bytes,
    size_for_card,
)
from benchmarks.common import GPT2Shape, current_rss, format_table, parse_bytes, peak_rss, rotated
from benchmarks.peer_systems import PeerSetup, deepspeed_config
from benchmarks.workers import START_METHOD_VARIABLE, CallFailure, RankContext, RankPool, fork_problem, forked_context

GiB = 2**30


# --- sizing from the card -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("layers", "width", "vocab", "seq"), [(2, 64, 256, 32), (3, 96, 300, 50), (4, 1600, 50257, 64)]
)
def test_parameter_formula_matches_the_transformers_model(layers: int, width: int, vocab: int, seq: int) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    shape = GPT2Shape(layers, width, vocab, seq)
    with torch.device("meta"):
        model = GPT2LMHeadModel(
            GPT2Config(n_layer=layers, n_embd=width, vocab_size=vocab, n_positions=seq, n_head=shape.heads)
        )
    assert shape.params() == sum(p.numel() for p in model.parameters())


def test_a_20_gib_card_gets_gpt2_xl_that_plain_pytorch_cannot_train() -> None:
    card = size_for_card(20 * GiB, 128 * GiB, compute_itemsize=2)
    assert card.name == "GPT-2 XL" and card.shape.seq == 1024
    params = card.shape.params()
    assert 1.5e9 < params < 1.6e9
    # fp32 weights + gradients + two Adam moments alone exceed the card.
    assert 16 * params > 20 * GiB and not card.plain_fits
    assert card.batch >= 1 and card.batch * activation_bytes_per_sequence(card.shape, 2) <= ACTIVATION_SHARE * 20 * GiB


@pytest.mark.parametrize("capacity_gib", [8, 12, 20, 24, 40])
def test_the_chosen_shape_does_not_fit_plain_pytorch_and_the_one_below_does(capacity_gib: int) -> None:
    capacity = capacity_gib * GiB
    card = size_for_card(capacity, 512 * GiB, compute_itemsize=2)
    assert card.plain_bytes > capacity and not card.plain_fits
    names = [name for name, _, _ in LADDER]
    index = names.index(card.name)
    if index > 0:
        _, layers, width = LADDER[index - 1]
        below = GPT2Shape(layers, width, card.shape.vocab, card.shape.seq)
        per_seq = activation_bytes_per_sequence(below, 2)
        batch = max(1, min(8, int(ACTIVATION_SHARE * capacity // per_seq)))
        assert 16 * below.params() + batch * per_seq <= capacity


def test_a_card_larger_than_the_host_can_feed_says_plain_fits_and_how_to_emulate() -> None:
    card = size_for_card(80 * GiB, 128 * GiB, compute_itemsize=2)
    assert card.plain_fits and "--device-memory" in card.reason
    assert chunk_model_bytes(card.shape.params(), 2) <= HOST_SHARE * 128 * GiB


def test_a_host_too_small_for_gpt2_medium_is_refused_with_the_flags_to_use() -> None:
    with pytest.raises(ValueError, match="--layers"):
        size_for_card(20 * GiB, 4 * GiB)


def test_parse_bytes_reads_the_units_budgets_use() -> None:
    assert parse_bytes("20GiB") == 20 * GiB
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1234") == 1234


# --- order, tables --------------------------------------------------------------------------------
def test_rotation_puts_every_system_in_every_position_once() -> None:
    names = ["a", "b", "c", "d"]
    orders = [rotated(names, r) for r in range(len(names))]
    for position in range(len(names)):
        assert sorted(order[position] for order in orders) == names
    assert all(sorted(order) == names for order in orders)


def test_table_columns_start_at_the_same_offset_on_every_line() -> None:
    text = format_table(
        ["name", "bytes", "note"],
        [
            ["plain", "1.5 MiB", "x"],
            ["a much longer name", "-", "refused: budget below minimum"],
            ["c", "12.0 GiB", ""],
        ],
    )
    width = max(len(line) for line in text.splitlines())
    lines = [line.ljust(width) for line in text.splitlines()]
    header = lines[0]
    for column in ("bytes", "note"):
        end = header.index(column) + len(column)
        if column == "bytes":  # numbers: right-aligned under the header's end
            assert all(line[end - 1] != " " for line in lines[2:])
        else:  # text: left-aligned at the header's start
            start = header.index(column)
            assert all(line[start - 1] == " " for line in lines[2:])
    with pytest.raises(ValueError, match="cells"):
        format_table(["a", "b"], [["1"]])


# --- memory probes (RSS) --------------------------------------------------------------------------
def test_rss_probes_see_a_known_allocation() -> None:
    size = 256 * 2**20
    before = current_rss()
    buffer = torch.ones(size // 4, dtype=torch.float32)  # touched: every page resident
    during = current_rss()
    assert 0.85 * size <= during - before <= 1.25 * size, (before, during)
    assert peak_rss() >= during - 16 * 2**20
    del buffer
    after = current_rss()
    assert during - after >= 0.85 * size, "freeing a large tensor returns its pages"
    assert peak_rss() >= during - 16 * 2**20, "the high-water mark keeps the peak"


def test_deepspeed_config_trains_what_the_others_train() -> None:
    setup = PeerSetup(GPT2Shape(1, 64, 256, 32), batch=4, precision="fp32", lr=1e-3, weight_decay=0.01)
    plain = deepspeed_config(setup, offload=False, on_cuda=False)
    assert plain["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}
    assert plain["zero_optimization"] == {"stage": 3}
    assert "gradient_clipping" not in plain and "bf16" not in plain and "fp16" not in plain
    assert plain["train_micro_batch_size_per_gpu"] == 4
    offload = deepspeed_config(setup, offload=True, on_cuda=True)
    assert offload["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert offload["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    bf16 = PeerSetup(GPT2Shape(1, 64, 256, 32), batch=4, precision="bf16")
    assert deepspeed_config(bf16, offload=False, on_cuda=True)["bf16"] == {"enabled": True}


# --- the rank pool ----------------------------------------------------------------------------------
def _sum_ranks(ctx: RankContext, value: int) -> tuple[int, int]:
    import torch.distributed as dist

    tensor = torch.tensor([value + ctx.rank])
    dist.all_reduce(tensor)
    ctx.state["seen"] = ctx.state.get("seen", 0) + 1
    return ctx.rank, int(tensor.item()) + 100 * ctx.state["seen"]


def _raise_on_rank_1(ctx: RankContext) -> None:
    if ctx.rank == 1:
        raise ValueError("rank one refuses")
    import torch.distributed as dist

    dist.barrier()  # rank 0 waits for a rank that will never come


def _hang(ctx: RankContext) -> None:
    time.sleep(120)


@pytest.mark.benchmark
def test_rank_pool_runs_commands_keeps_state_and_reports_the_failing_rank() -> None:
    pool = RankPool(2, env={"BENCH_PG_TIMEOUT": "30"}, error_grace=2.0)
    try:
        assert pool.call(60, _sum_ranks, 10) == [(0, 21 + 100), (1, 21 + 100)]
        assert pool.call(60, _sum_ranks, 0) == [(0, 1 + 200), (1, 1 + 200)]  # state kept between calls
        began = time.monotonic()
        with pytest.raises(CallFailure) as failure:
            pool.call(60, _raise_on_rank_1)
        assert time.monotonic() - began < 20, "one rank raised: the others are not waited for to the limit"
        assert failure.value.kind == "error"
        assert "rank 1 raised" in str(failure.value) and "rank one refuses" in str(failure.value)
        assert "rank one refuses" in failure.value.summary()
        assert not pool.alive
        with pytest.raises(CallFailure, match="closed"):
            pool.call(60, _sum_ranks, 0)
    finally:
        pool.close(force=True)


@pytest.mark.benchmark
def test_rank_pool_kills_a_hung_call_at_its_timeout() -> None:
    threads = threading.active_count()
    pool = RankPool(2, init=None)
    pids = [pid for pid in pool.pids if pid is not None]
    try:
        began = time.monotonic()
        with pytest.raises(CallFailure) as failure:
            pool.call(3, _hang)
        assert 3 <= time.monotonic() - began < 30
        assert failure.value.kind == "timeout" and "hung" in str(failure.value)
        assert len(pids) == 2 and not any(psutil.pid_exists(pid) for pid in pids)
        # The threads that fed its commands to the ranks ended with it: a next pool may fork this process.
        assert threading.active_count() == threads
    finally:
        pool.close(force=True)


def test_forking_a_process_that_runs_a_thread_is_refused_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(START_METHOD_VARIABLE, "fork")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    # Counted, not only refused: a worker of pytest-xdist runs threads of its own already.
    before = fork_problem()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        counted = int(before.split()[0]) if before and "threads" in before else 1
        assert fork_problem() == f"{counted + 1} threads run in it"
        with pytest.raises(RuntimeError, match=f"threads run in it.*unset {START_METHOD_VARIABLE}"):
            forked_context()
        with pytest.raises(RuntimeError, match="threads run in it"):
            RankPool(1, init=None)
    finally:
        stop.set()
        thread.join()
    monkeypatch.setenv(START_METHOD_VARIABLE, "spawn")
    with pytest.raises(ValueError, match="'forkserver' or 'fork', got 'spawn'"):
        forked_context()


# --- the memory-budget driver: out of memory is a row state -----------------------------------------
@pytest.mark.slow  # the fast tier's case: the RSS probes
def test_a_run_out_of_device_memory_becomes_a_row_state_and_the_others_go_on(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from benchmarks import budget_runs
    from benchmarks.memory_budget import Driver, Row
    from benchmarks.workers import LocalRanks
    from chunkmem.placement import StaticPlacementConfig

    real_step = budget_runs.TrainingRun.step

    def step(run: budget_runs.TrainingRun, ids: torch.Tensor) -> float:
        if run.spec.kind == "plain":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_step(run, ids)

    monkeypatch.setattr(budget_runs.TrainingRun, "step", step)
    setup = budget_runs.BudgetSetup(GPT2Shape(1, 32, 128, 16), batch=2, precision="fp32", chunk_size=None)
    args = argparse.Namespace(timeout=60.0, schedule="alternate")
    driver = Driver(args, setup, lambda: LocalRanks(torch.device("cpu")))
    driver.start()
    driver.add(Row("plain", "plain", None, None, None, "plain PyTorch"), budget_runs.RowSpec("plain", "plain", "plain"))
    spec = budget_runs.RowSpec("static", "chunkmem", "static", placement=StaticPlacementConfig())
    driver.add(Row("static", "static", 0, None, None, "no budget"), spec)
    driver.measure([1, 1])
    plain, static = driver.rows
    assert plain.state == "out of memory" and "step 0" in plain.note and plain.step_ms is None
    assert static.state == "ok" and len(static.step_times_ms) == 2 and static.final_loss is not None


def test_peers_flag_a_system_whose_first_loss_differs_and_take_ratios_from_the_same_run() -> None:
    from benchmarks.peers import Result, check_losses, compare

    results = [
        Result("ddp", losses=[7.5, 7.4], median_s=0.2),
        Result("fsdp2", losses=[7.5 + 1e-7, 7.4], median_s=0.4),
        Result("chunkmem", losses=[7.51, 7.4], median_s=0.5),
        Result("deepspeed-z3", state="skipped"),
    ]
    compare(results)
    assert results[2].vs == {"fsdp2": pytest.approx(1.25), "ddp": pytest.approx(2.5)}
    assert results[3].vs == {}
    flagged = check_losses(results, "fp32")
    assert len(flagged) == 1 and flagged[0].startswith("chunkmem first-step loss 7.510000")
    assert check_losses(results, "bf16") == []  # 1e-2 relative is within mixed-precision rounding


# --- what every benchmark JSON says of its run, and the memory-budget table's spread ---------------
def test_write_json_records_when_how_and_on_how_busy_a_machine(tmp_path: Path) -> None:
    import datetime
    import json
    import os

    from benchmarks import common

    began = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    run = common.begin_run(str(common.ROOT / "benchmarks" / "x.py"), ["--steps", "2", "--name", "a b"])
    run.sample()
    path = common.write_json("x", {"rows": [1, 2]}, tmp_path)
    ended = datetime.datetime.now(datetime.timezone.utc)
    written = json.loads(path.read_text())
    assert list(written) == ["meta", "rows"] and written["rows"] == [1, 2]
    meta = written["meta"]
    date = datetime.datetime.fromisoformat(meta["date"])
    assert date.utcoffset() == datetime.timedelta(0) and began <= date <= ended
    assert meta["command"] == "python benchmarks/x.py --steps 2 --name 'a b'"  # as a shell reads it
    assert meta["machine"]["cpu_count"] == os.cpu_count()
    load = meta["load"]
    assert all(len(load[key]) == 3 and min(load[key]) >= 0 for key in ("before", "after"))
    assert len(load["samples"]) == 1
    peak = max(sample[0] for sample in [load["before"], *load["samples"], load["after"]])
    assert load["peak_1min"] == peak and load["busy"] == (peak > os.cpu_count())


def test_the_tests_benchmarks_write_outside_the_checkout() -> None:
    """A benchmark run by a test without ``--out-dir`` writes to the temporary directory the tests'
    conftest names, never into benchmarks/results/ of the checkout."""
    from benchmarks import common, memory_budget

    assert not common.RESULTS.resolve().is_relative_to(common.ROOT)
    assert memory_budget.parse_args([]).out_dir == common.RESULTS


def test_a_rows_spread_is_its_fastest_and_slowest_step_around_the_median() -> None:
    from benchmarks.memory_budget import Row, table

    times = [9.0, 1.0, 4.0, 3.0, 5.0]
    plain = Row("plain", "plain", None, None, None, "plain PyTorch", state="ok", step_times_ms=list(times))
    plain.summarize_times()
    ordered = sorted(times)
    assert (plain.step_ms_min, plain.step_ms, plain.step_ms_max) == (ordered[0], ordered[2], ordered[-1])
    assert plain.step_ms_min <= plain.step_ms_q1 <= plain.step_ms <= plain.step_ms_q3 <= plain.step_ms_max
    assert (plain.step_ms_q1, plain.step_ms_q3) == (ordered[1], ordered[3])  # inclusive quartiles of five
    headers, body = table([plain])
    cells = dict(zip(headers, body[0], strict=True))
    assert cells["step ms"] == "4.0" and cells["min-max ms"] == "1.0-9.0"


def test_busy_is_a_one_minute_load_above_the_cores() -> None:
    import os

    from benchmarks.common import RunRecord
    from benchmarks.memory_budget import busy_warning

    cores = os.cpu_count() or 1
    quiet = RunRecord("2026-01-01T00:00:00+00:00", "python x.py", [cores * 0.5, 0.0, 0.0], [[cores * 1.0, 0, 0]])
    assert not quiet.busy([0.1, 0.0, 0.0]) and busy_warning(quiet, [0.1, 0.0, 0.0]) == ""
    loaded = RunRecord("2026-01-01T00:00:00+00:00", "python x.py", [0.1, 0.0, 0.0], [[cores + 0.5, 0, 0]])
    assert loaded.busy([0.1, 0.0, 0.0]) and loaded.peak_load([0.1, 0.0, 0.0]) == cores + 0.5
    assert busy_warning(loaded, [0.1, 0.0, 0.0]).startswith("WARNING: the machine was busy")


@pytest.mark.slow  # matplotlib's import and a figure: 2 s
def test_the_memory_budget_plot_shows_the_budget_over_the_series_and_each_steps_spread() -> None:
    from benchmarks.common import pyplot
    from benchmarks.memory_budget import Row, draw

    plt = pyplot()
    if plt is None:
        pytest.skip("matplotlib is not installed (the bench extra)")

    def row(key: str, policy: str, frac: float | None, times: list[float], peak: int | None) -> Row:
        budget = None if frac is None else int(frac * 2**20)
        made = Row(key, policy, 0, frac, budget, "-", state="ok", step_times_ms=times, peak_device_bytes=peak)
        made.summarize_times()
        return made

    plain = row("plain", "plain", None, [10.0, 12.0, 20.0], None)
    rows = [plain]
    for policy in ("static", "auto"):
        rows += [row(f"{policy}-{f}", policy, f, [20.0 * f + 5, 30.0, 40.0 / f], int(f * 2**20)) for f in (1.0, 0.5)]
    fig = draw(plt, rows, "test")
    try:
        peak_axes, _, time_axes = fig.axes
        budget = next(line for line in peak_axes.get_lines() if line.get_label() == "budget")
        # Drawn above every series, at the budgets (MiB), so a peak equal to its budget cannot hide it.
        assert all(budget.get_zorder() > line.get_zorder() for line in peak_axes.get_lines() if line is not budget)
        assert sorted(budget.get_ydata()) == [0.5, 1.0]
        # One error bar per point, from its fastest to its slowest step, over plain PyTorch's median.
        bars = time_axes.containers
        assert len(bars) == 2
        expected = sorted((r.step_ms_min / 12.0, r.step_ms_max / 12.0) for r in rows[1:])
        found = []
        for container in bars:
            (segments,) = container.lines[2]
            found += [tuple(sorted(seg[:, 1])) for seg in segments.get_segments()]
        assert [v for pair in sorted(found) for v in pair] == pytest.approx([v for pair in expected for v in pair])
    finally:
        plt.close(fig)
