"""The benchmark scripts a user runs, on tiny configurations: their JSON is checked against what
must hold whatever the speed of the machine (losses equal to plain PyTorch's, peak device bytes
within the budget, host-device bytes equal to analytic counts, every row measured the same way),
never against timings."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from support.child_env import child_env
from support.forked import run_main
from support.paths import ROOT

from benchmarks.workers import START_METHOD_VARIABLE

pytestmark = [pytest.mark.benchmark, pytest.mark.slow]

TINY = ["--layers", "1", "--width", "64", "--vocab", "256", "--seq", "32", "--batch", "2"]
CHUNK = "16384"  # 256 x 64 embedding and 64 x 256 MLP weights: every chunk the same size


# What a test sets where the benchmark's own default depends on the machine, so that it checks the
# same thing on a CPU and on a GPU machine.
FP32 = ("--precision", "fp32")  # the default is bf16 on a GPU, fp32 on a CPU
# Two ranks on GPUs need two GPUs (NCCL takes one GPU a rank; the benchmarks refuse W=2 on fewer):
# a W=2 test runs its ranks on the CPU (gloo) with the GPUs hidden, on any machine.
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def _run(script: str, *args: str, tiny: bool = True, env: dict[str, str] | None = None) -> str:
    """``script`` run with ``args`` (after the tiny model's flags), in this environment plus ``env``."""
    # benchmarks/results/*.json is committed (the manual's benchmarks page): a test writes elsewhere.
    assert "--out-dir" in args, f"{script}: pass --out-dir (a temporary directory), not the checkout's results"
    # Forked from the tests' fork server, not a fresh interpreter: the script runs as its __main__
    # without importing torch and transformers again (a third of each of these tests).
    path = str(ROOT / "benchmarks" / script)
    done = run_main(path, *(TINY if tiny else []), *args, cwd=str(ROOT), env=child_env(**_fork_where_safe(env or {})))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "loss_type" not in done.stderr, "the transformers loss_type warning is back"
    return done.stdout


def _fork_where_safe(env: dict[str, str]) -> dict[str, str]:
    """``env``, plus: the script's own processes are forked from it (it imported everything and
    computed nothing yet), not from a fork server of its own that would import everything again (a
    fresh interpreter: about ten seconds a script on a 2-core machine). Not where they compute on a
    GPU (a forked process cannot initialise CUDA): there they keep the fork server. Without a GPU,
    hiding the GPUs changes nothing but lets a torch built with CUDA fork."""
    if not torch.cuda.is_available():
        env = {**NO_GPU, **env}
    if env.get("CUDA_VISIBLE_DEVICES") != "":
        return env
    return {START_METHOD_VARIABLE: "fork", **env}


def _table_lines(out: str, rows: int) -> list[str]:
    """The header, the dashes and ``rows`` body lines of the first table in ``out``."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("---")) - 1
    return lines[start : start + 2 + rows]


def _spans(lines: list[str]) -> list[tuple[int, int]]:
    """Each column's [start, end) as the dashes under its header mark it."""
    spans, start = [], None
    for i, ch in enumerate(lines[1] + " "):
        if ch == "-" and start is None:
            start = i
        elif ch != "-" and start is not None:
            spans.append((start, i))
            start = None
    return spans


def _assert_aligned(lines: list[str]) -> None:
    """No cell of any line crosses into the gap between two columns."""
    spans = _spans(lines)
    width = spans[-1][1]
    assert len(spans) >= 3, lines[:2]
    for line in lines:
        padded = line.ljust(width)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert padded[end:start].strip() == "", (end, start, line)


BUDGET_W1 = ("--steps", "4", "--rounds", "1", "--budgets", "1,0.5,0.2", "--prefetch", "0,1", "--chunk-size", CHUNK)


@pytest.fixture(scope="module")
def budget_w1(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("memory_budget")
    out = _run("memory_budget.py", *BUDGET_W1, "--out-dir", str(out_dir), *FP32)
    return out, json.loads((out_dir / "memory_budget.json").read_text())


def test_memory_budget_rows_train_the_plain_model_within_their_budgets(budget_w1: tuple[str, dict[str, Any]]) -> None:
    out, payload = budget_w1
    rows = {r["key"]: r for r in payload["rows"]}
    plain = rows["plain"]
    assert plain["state"] == "ok" and plain["final_loss"] is not None
    trained = [r for r in payload["rows"] if r["state"] == "ok"]
    assert len(trained) == len(payload["rows"]) == 2 + 3 * 2 * 2
    for row in trained:
        assert abs(row["final_loss"] - plain["final_loss"]) < 1e-4, row["key"]
        if row["budget"] is not None:
            assert row["peak_device_bytes"] <= row["budget"], row["key"]
    assert "within budget in every row" in out and "equal to plain PyTorch's" in out


def test_memory_budget_measures_plain_pytorch_like_every_other_row(budget_w1: tuple[str, dict[str, Any]]) -> None:
    _, payload = budget_w1
    counts = {r["key"]: (len(r["step_times_ms"]), len(r["losses"])) for r in payload["rows"]}
    # Step 0 is untimed for every row; 3 timed steps each, the plain reference included.
    assert set(counts.values()) == {(3, 4)}, counts
    plain = next(r for r in payload["rows"] if r["key"] == "plain")
    assert plain["step_ms"] == sorted(plain["step_times_ms"])[1]


def test_memory_budget_says_the_spread_the_load_and_what_the_data_is(budget_w1: tuple[str, dict[str, Any]]) -> None:
    import math
    import shlex

    out, payload = budget_w1
    meta = payload["meta"]
    # The command as run (the out dir is the fixture's temporary directory).
    assert meta["command"].startswith(shlex.join(["python", "benchmarks/memory_budget.py", *TINY, *BUDGET_W1]))
    assert meta["command"].endswith(" " + shlex.join(FP32)) and " --out-dir " in meta["command"]
    load = meta["load"]
    assert len(load["samples"]) == 1, "one sample after the one round"
    busy = "WARNING: the machine was busy" in out
    assert (
        busy == load["busy"] == (max(s[0] for s in [load["before"], *load["samples"], load["after"]]) > load["cores"])
    )
    assert "load average (1/5/15 min): before " in out
    # Each row's spread is its fastest and slowest timed step around the median.
    table = payload["summary_table"]
    assert table["headers"][table["headers"].index("step ms") + 1] == "min-max ms"
    assert len(table["rows"]) == len(payload["rows"])
    spread = table["headers"].index("min-max ms")
    for row, cells in zip(payload["rows"], table["rows"], strict=True):
        times = row["step_times_ms"]
        assert row["step_ms_min"] == min(times) <= row["step_ms"] <= max(times) == row["step_ms_max"]
        assert cells[spread] == f"{min(times):.1f}-{max(times):.1f}"
    # Random tokens: nothing to learn, so every row's loss stays near ln(vocabulary) (256 here).
    assert "data: random tokens" in out and "random tokens" in table["note"]
    assert all(abs(row["final_loss"] - math.log(256)) < 0.1 for row in payload["rows"])
    assert ("WARNING: the machine was busy" in table["note"]) == busy


def test_memory_budget_offload_bytes_match_the_analytic_counts(budget_w1: tuple[str, dict[str, Any]]) -> None:
    _, payload = budget_w1
    offloaded = [r for r in payload["rows"] if r["state"] == "ok" and r["setting"] == "optim 1.0 / param 1.0 offloaded"]
    # In fp32 (in bf16 the 16-bit weights are a smaller part of the model data, and 20% fits with
    # the parameters on the device and 90% of the optimizer sides offloaded).
    assert offloaded, "the 20% budget needs full offload with the static policy"
    for row in offloaded:
        capacities, itemsize = row["chunk_capacities"], row["compute_itemsize"]
        assert len(set(capacities)) == 1, "precondition: uniform chunks"
        chunk_bytes = capacities[0] * itemsize
        # Parameters live on the host: every fetch moves one whole chunk, and each parameter at least once.
        assert row["h2d_per_step"] == row["fetches_per_step"] * chunk_bytes
        assert row["h2d_per_step"] >= payload["param_bytes"]
        # The optimizer steps on the host: each chunk's fp32 gradient goes there once a step.
        assert row["d2h_per_step"] == len(capacities) * capacities[0] * 4
    unconstrained = next(r for r in payload["rows"] if r["key"] == "unconstrained")
    assert unconstrained["h2d_per_step"] == 0 and unconstrained["d2h_per_step"] == 0


def test_memory_budget_table_columns_line_up(budget_w1: tuple[str, dict[str, Any]]) -> None:
    out, _ = budget_w1
    lines = _table_lines(out, 14)
    assert lines[0].split()[0] == "budget"
    _assert_aligned(lines)
    # Numbers are right-aligned: every "step ms" cell ends at the column's end.
    _, end = next(span for span in _spans(lines) if lines[0][span[0] : span[1]].strip() == "step ms")
    for line in lines[2:]:
        assert line[end - 1] != " ", line


def test_memory_budget_at_world_size_2_reports_every_row(tmp_path: Path) -> None:
    out = _run(
        "memory_budget.py",
        *("--world-size", "2", "--steps", "3", "--budgets", "0.5", "--policies", "auto", "--prefetch", "0"),
        *("--chunk-size", CHUNK, "--out-dir", str(tmp_path), "--timeout", "120"),
        env=NO_GPU,
    )
    payload = json.loads((tmp_path / "memory_budget_w2.json").read_text())
    rows = {r["key"]: r for r in payload["rows"]}
    assert set(rows) == {"plain", "unconstrained", "auto-0.5-p0"}
    assert rows["plain"]["policy"] == "ddp" and rows["plain"]["state"] == "ok"
    # A row either trained the same model as DDP within its budget, or says why it did not.
    for row in rows.values():
        if row["state"] == "ok":
            assert abs(row["final_loss"] - rows["plain"]["final_loss"]) < 1e-4, row["key"]
            assert row["budget"] is None or row["peak_device_bytes"] <= row["budget"]
        else:
            assert row["state"] in ("failed", "timeout", "out of memory") and row["note"], row
    assert "W=2" in out


def test_peers_train_the_same_model_and_ratios_are_against_the_same_run(tmp_path: Path) -> None:
    out = _run(
        "peers.py",
        *("--systems", "fsdp2,chunkmem", "--rounds", "2", "--steps", "1", "--warmup", "1"),
        *("--world-size", "2", "--out-dir", str(tmp_path)),
        env=NO_GPU,
    )
    payload = json.loads((tmp_path / "peers_w2.json").read_text())
    results = {r["system"]: r for r in payload["results"]}
    assert set(results) == {"fsdp2", "chunkmem"}
    assert all(r["state"] == "ok" for r in results.values()), results
    # Same weights, same data, same optimizer: every step's loss agrees between the two systems.
    losses = [results[name]["losses"] for name in ("fsdp2", "chunkmem")]
    assert len(losses[0]) == len(losses[1]) == 3
    for a, b in zip(*losses, strict=True):
        assert abs(a - b) < 1e-5, losses
    assert payload["loss_mismatches"] == [] and "first-step loss equal" in out
    for r in results.values():
        assert len(r["round_medians"]) == 2
        assert r["median_s"] == pytest.approx(sorted(r["round_medians"])[0] / 2 + sorted(r["round_medians"])[1] / 2)
        assert r["vs"]["fsdp2"] == pytest.approx(r["median_s"] / results["fsdp2"]["median_s"])
        # Peak RSS of each rank process holds at least its model (fp32 weights and Adam states).
        assert r["peak_rss"] > payload["params"] * 4
    _assert_aligned(_table_lines(out, 2))


def test_overhead_benchmark_trains_the_same_model_on_every_side(tmp_path: Path) -> None:
    _run("overhead.py", "--steps", "2", "--variants", "static,auto-prefetch2", "--out-dir", str(tmp_path))
    payload = json.loads((tmp_path / "overhead.json").read_text())
    plain = payload["losses"]["plain"]
    for variant in ("static", "auto-prefetch2"):
        chunked = payload["losses"][variant]
        assert len(plain) == len(chunked) == 2 + 3
        assert max(abs(a - b) for a, b in zip(plain, chunked, strict=True)) < 1e-5
        ratio = payload["median_ms"][variant] / payload["median_ms"]["plain"]
        assert payload["ratio_to_plain"][variant] == pytest.approx(ratio)
        assert len(payload["step_ms"][variant]) == 2
    assert len(payload["step_ms"]["plain"]) == 2


@pytest.mark.long
def test_before_after_runs_each_version_from_its_own_checkout(tmp_path: Path) -> None:
    """``benchmarks/before_after.py`` with a copy of this checkout's package and benchmarks as
    "before": each version's runs import the chunkmem of its own tree (not the installed one), and
    the summary's medians are those of the runs it recorded."""
    before = tmp_path / "before"
    shutil.copytree(ROOT / "chunkmem", before / "chunkmem", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "benchmarks", before / "benchmarks", ignore=shutil.ignore_patterns("__pycache__", "results"))
    tiny = " ".join(TINY)
    out = _run(
        "before_after.py",
        *("--before", str(before), "--after", str(ROOT), "--rounds", "1", "--benchmarks", "overhead"),
        *("--overhead-args", f"--steps 2 {tiny}", "--out-dir", str(tmp_path / "out")),
        tiny=False,
    )
    payload = json.loads((tmp_path / "out" / "before_after.json").read_text())
    assert Path(payload["chunkmem"]["before"]).is_relative_to(before.resolve())
    assert Path(payload["chunkmem"]["after"]).is_relative_to(ROOT.resolve())
    runs = payload["runs"]["overhead"]
    assert len(runs["before"]) == len(runs["after"]) == 1
    for version in ("before", "after"):
        (run,) = runs[version]
        assert payload["summary"]["overhead"][version]["ratio_median"] == pytest.approx(run["ratio"])
    assert "after/before" in out and payload["summary_table"]["rows"]


def test_disk_tier_fits_every_system_and_the_disk_traffic_is_the_optimizer_sides(tmp_path: Path) -> None:
    out = _run(
        "disk_tier.py",
        *("--sizes", "64x1,64x3", "--vocab", "256", "--steps", "2", "--threads", "1", "--dd-mib", "4"),
        *("--verify", "64x2", "--chunk-size", CHUNK, "--disk-dir", str(tmp_path / "scratch")),
        *("--out-dir", str(tmp_path)),
        tiny=False,
    )
    payload = json.loads((tmp_path / "disk_tier.json").read_text())
    for system, runs in payload["trials"].items():
        assert [r["state"] for r in runs] == ["ok", "ok"], system
        assert runs[0]["parameters"] < runs[1]["parameters"]
        assert payload["summary"][system]["bytes_per_parameter"] is not None, system
    # the in-memory run never touches the disk; the disk tier reads and writes every step
    assert all(s["disk_read_bytes"] == 0 for r in payload["trials"]["chunkmem-ram"] for s in r["steps"])
    verify = payload["verify"]
    assert verify["state"] == "ok" and len(verify["steps"]) == 2
    steady = verify["steps"][-1]
    # fp32 AdamW(amsgrad): three fp32 states and the fp32 gradient shard a parameter go to disk and come
    # back each step (chunk padding aside), nothing more; the master stays in host memory for the gathers
    assert steady["disk_read_bytes"] == steady["disk_write_bytes"]
    assert 16 * verify["parameters"] <= steady["disk_read_bytes"] <= steady["disk_bytes"]
    assert "the largest model is" in out and "chunkmem disk tier, 64x2" in out
    assert not any((tmp_path / "scratch").iterdir()), "scratch files left behind"


@pytest.mark.long
@pytest.mark.slow  # three systems at two sizes and a verify run, each in its own process
def test_lora_trains_every_system_and_the_base_on_disk_is_read_every_step(tmp_path: Path) -> None:
    out = _run(
        "lora.py",
        *("--sizes", "64x1,64x2", "--vocab", "256", "--steps", "2", "--threads", "1", "--dd-mib", "4"),
        *("--verify", "64x3", "--chunk-size", CHUNK, "--disk-dir", str(tmp_path / "scratch")),
        *("--out-dir", str(tmp_path)),
        tiny=False,
    )
    payload = json.loads((tmp_path / "lora.json").read_text())
    for system, runs in payload["trials"].items():
        assert [r["state"] for r in runs] == ["ok", "ok"], system
        assert runs[0]["base_parameters"] < runs[1]["base_parameters"]
        assert all(s["tokens_per_second"] > 0 for r in runs for s in r["steps"]), system
    assert all(s["disk_read_bytes"] == 0 for r in payload["trials"]["chunkmem-ram"] for s in r["steps"])
    for run in [*payload["trials"]["chunkmem-disk"], payload["verify"]]:
        for step in run["steps"]:
            # Every frozen chunk is gathered in the forward (and most again in the backward), each
            # gather reading its 16-bit shard from disk: at least the base's bf16 bytes a step. Only
            # the adapter's shard is written.
            assert step["disk_param_read_bytes"] >= run["base_bf16_bytes"], step
            assert 0 < step["disk_param_write_bytes"] < run["base_bf16_bytes"] / 4, step
    assert payload["dd"]["read_bytes_per_second"] > 0
    assert "chunkmem, base on disk, 64x3: ok" in out
    assert (tmp_path / "lora.png").exists()
    assert not any((tmp_path / "scratch").iterdir()), "scratch files left behind"


@pytest.mark.long
@pytest.mark.slow  # two systems at two sizes and a plan, each in its own process
def test_qlora_trains_the_nf4_base_from_disk_and_plain_peft_qlora(tmp_path: Path) -> None:
    """The 4-bit systems (the 16-bit one is lora.py's, tested above): the NF4 base's stored bytes are
    at least what its layers' shapes say (half a byte a weight, a 4-byte scale per 64; the rest is
    chunk padding), all on disk, read from there every step, never written."""
    out = _run(
        "qlora.py",
        *("--systems", "chunkmem-nf4-disk,peft-qlora", "--sizes", "64x1,64x2", "--vocab", "256", "--steps", "2"),
        *("--threads", "1", "--dd-mib", "4", "--chunk-size", "2048"),
        *("--plan-hidden", "64", "--plan-parameters", "200000", "--host-budget", "1GiB"),
        *("--disk-dir", str(tmp_path / "scratch"), "--out-dir", str(tmp_path)),
        tiny=False,
    )
    payload = json.loads((tmp_path / "qlora.json").read_text())
    for system, runs in payload["trials"].items():
        assert [r["state"] for r in runs] == ["ok", "ok"], system
        assert all(s["tokens_per_second"] > 0 for r in runs for s in r["steps"]), system
    four, plain = payload["trials"]["chunkmem-nf4-disk"], payload["trials"]["peft-qlora"]
    assert [r["base_parameters"] for r in four] == [r["base_parameters"] for r in plain]  # counted before packing
    for run in four:
        analytic = run["quantized_parameters"] // 2 + 4 * run["quantized_parameters"] // 64
        for step in run["steps"]:
            assert step["disk_bytes"] >= step["quantized_bytes"] >= analytic > 0, step
            assert step["disk_param_read_bytes"] >= step["quantized_bytes"], step  # every quantized chunk, each step
            assert step["disk_param_write_bytes"] < step["quantized_bytes"], step  # the adapter's chunks only
    assert payload["summary"]["chunkmem-nf4-disk"]["disk_bytes_per_base_parameter"] > 0
    assert payload["summary"]["peft-qlora"]["host_bytes_per_base_parameter"] is not None
    # The planner's bound: a base of the asked size (whole layers), its quantized bytes on disk, under the budget.
    planned = payload["planned"]["chunkmem-nf4-disk"]
    assert planned["fits"] and planned["peak_host_bytes"] <= 2**30, planned
    assert 100_000 < planned["base_parameters"] <= 200_000, planned
    assert planned["disk_bytes"] >= planned["quantized_parameters"] // 2 + 4 * planned["quantized_parameters"] // 64
    assert set(payload["planned"]) == {"chunkmem-nf4-disk"}  # plain PEFT is not planned
    summary = payload["summary"]["chunkmem-nf4-disk"]
    assert summary["quantized_bytes_per_quantized_parameter"] >= 0.5 + 4 / 64  # padding only adds
    per = (planned["disk_bytes"] + planned["host_bytes"]) / planned["base_parameters"]
    assert summary["planned_host_and_disk_bytes_per_base_parameter"] == per
    table = payload["summary_table"]
    assert [row[0] for row in table["rows"]] == ["chunkmem-nf4-disk", "peft-qlora"]
    assert all(len(row) == len(table["headers"]) for row in table["rows"])
    assert "plan of chunkmem-nf4-disk at 64x" in out
    assert not any((tmp_path / "scratch").iterdir()), "scratch files left behind"


def test_offload_breakdown_trains_the_same_model_everywhere_and_steps_early_only_when_asked(tmp_path: Path) -> None:
    systems = "plain,chunkmem-after,chunkmem-during,fsdp2-offload"
    _run(
        "offload.py",
        *("--layers", "2", "--width", "64", "--batch", "4", "--steps", "4", "--rounds", "1"),
        *("--systems", systems, "--out-dir", str(tmp_path)),
        tiny=False,
    )
    summary = json.loads((tmp_path / "offload.json").read_text())["summary"]
    assert {s: e["state"] for s, e in summary.items()} == dict.fromkeys(systems.split(","), "ok")
    first = {s: e["first_loss"] for s, e in summary.items()}
    assert len(set(first.values())) == 1, first  # the same model, data and first loss
    assert summary["chunkmem-after"]["early_steps"] == 0
    assert summary["chunkmem-during"]["early_steps"] > 0
    assert summary["plain"]["fused_host_step"] > 0
    for system in ("chunkmem-after", "chunkmem-during"):
        # every parameter's gradient leaves for its host master once a step: 4 bytes (fp32) each
        assert summary[system]["d2h_bytes"] >= 4 * 2 * (64 * 64 + 64), system


# --- benchmarks/activations.py ----------------------------------------------------------------------
ACT_SEQS = (16, 32, 64)  # at 64 chunkmem-auto's budget cannot keep every block call
ACT_SYSTEMS = (
    "chunkmem-keep",
    "chunkmem-offload",
    "chunkmem-recompute",
    "chunkmem-auto",
    "plain",
    "plain-ckpt",
    "fsdp2-ckpt",
)
ACT_BUDGET = 600 * 1024


def _block_call_bytes(seq: int, keep_below: int) -> int:
    """What one GPT-2 block call of the benchmark's tiny model saves for the backward, counted here
    (not with the benchmark's meter): each storage once, parameters, views of them and the block's
    buffers left out, storages under ``keep_below`` bytes too (chunkmem keeps those on the device)."""
    import torch

    from benchmarks.activation_systems import parse_shape

    shape = parse_shape("gpt2:2x32", 128)
    model = shape.build(max(ACT_SEQS), torch.device("cpu"))
    block = shape.blocks(model)[0]
    own = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *block.buffers())}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in own and storage.nbytes() >= keep_below:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    hidden = torch.randn(1, seq, 32, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(hidden)
    del out
    return sum(saved.values())


@pytest.fixture(scope="module")
def activations_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    out_dir = tmp_path_factory.mktemp("activations")
    out = _run(
        "activations.py",
        *("--models", "gpt2:2x32", "--vocab", "128", "--seqs", ",".join(map(str, ACT_SEQS))),
        *("--systems", ",".join(ACT_SYSTEMS), "--budget", str(ACT_BUDGET), "--steps", "1"),
        *("--out-dir", str(out_dir)),
        tiny=False,
    )
    assert (out_dir / "activations.png").exists() or "plot:" not in out
    return out, json.loads((out_dir / "activations.json").read_text())


def test_activations_rows_grow_until_the_ledger_exceeds_the_budget(activations_run: tuple[str, dict[str, Any]]) -> None:
    from benchmarks.common import GPT2Shape

    out, payload = activations_run
    rows = payload["rows"]
    params = GPT2Shape(2, 32, 128, max(ACT_SEQS)).params()
    summary = payload["summary"]["GPT-2 2x32"]["systems"]
    assert set(summary) == set(ACT_SYSTEMS)
    for system in ACT_SYSTEMS:
        mine = [r for r in rows if r["system"] == system]
        # Lengths in order from the first; only the last may be over the budget, and then it stops.
        assert [r["seq"] for r in mine] == list(ACT_SEQS[: len(mine)]), system
        assert all(r["state"] == "ok" for r in mine[:-1]), system
        for row in mine:
            assert row["ledger_bytes"] == row["model_bytes"] + row["saved_bytes"]
            assert row["fits"] == (row["ledger_bytes"] <= ACT_BUDGET)
            assert row["state"] == ("ok" if row["fits"] else "over budget")
            assert len(row["step_times_ms"]) == 1 and len(row["losses"]) == 2  # a warmup step, a timed one
        assert len(mine) == len(ACT_SEQS) or not mine[-1]["fits"], system
        assert summary[system]["longest"] == max([r["seq"] for r in mine if r["fits"]], default=0)
        if system in ("plain", "plain-ckpt", "fsdp2-ckpt"):
            # fp32 weights and gradients and two AdamW moments, every parameter on the device
            assert all(r["model_bytes"] == 16 * params for r in mine), system
        elif system == "chunkmem-auto":  # its peak holds its blocks' activations, within its own budget
            assert all(r["model_bytes"] <= r["chunkmem_device_budget"] for r in mine if "model_bytes" in r)
        else:  # the optimizer side in host memory
            assert all(r["model_bytes"] < 16 * params for r in mine), system
    assert "longest seq" in out and "vs plain-ckpt" in out


def test_activations_systems_train_the_same_model_and_hold_what_they_say(
    activations_run: tuple[str, dict[str, Any]],
) -> None:
    _, payload = activations_run
    rows = {(r["system"], r["seq"]): r for r in payload["rows"]}
    for seq in ACT_SEQS:
        # The same weights and batches: chunkmem keep and FSDP2 train as plain PyTorch, chunkmem's
        # recompute as HF checkpointing (fp32 on the CPU).
        for system, reference in (
            ("chunkmem-keep", "plain"),
            ("chunkmem-offload", "plain"),
            ("chunkmem-recompute", "plain-ckpt"),
            ("fsdp2-ckpt", "plain-ckpt"),
            ("plain-ckpt", "plain"),
        ):
            if (system, seq) in rows and (reference, seq) in rows:
                ours, theirs = rows[system, seq]["losses"], rows[reference, seq]["losses"]
                assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-5, (system, seq)
        keep, offload, recompute = (rows.get((s, seq)) for s in ACT_SYSTEMS[:3])
        if keep is not None and recompute is not None:
            assert recompute["saved_bytes"] < keep["saved_bytes"]
        if recompute is not None:
            # one block's recomputation: what a block call saves when kept
            assert recompute["blocks_extra_bytes"] == _block_call_bytes(seq, 0)
            assert recompute["chunkmem"]["recomputed_blocks"] == 2
        if offload is not None:
            per_call = _block_call_bytes(seq, 1024)
            assert offload["chunkmem"]["activation_d2h_bytes"] == 2 * per_call  # two blocks a step
            assert offload["chunkmem"]["activation_h2d_bytes"] == 2 * per_call
            assert offload["blocks_extra_bytes"] == 2 * per_call  # the call and the one fetched ahead


def test_activations_out_of_memory_and_the_time_limit_end_a_system(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run in this process with stand-in systems: one that runs out of memory at its second
    length, one when it is built, one that fails otherwise; a past deadline skips."""
    import time

    import torch

    from benchmarks import activation_runs, activation_systems
    from benchmarks.activation_systems import Plain, Recipe, parse_shape

    class OutOfMemoryAt(Plain):
        def build(self, shape: Any, max_seq: int, recipe: Any) -> Any:
            trainer = super().build(shape, max_seq, recipe)
            step = trainer.step_fn

            def failing(ids: torch.Tensor) -> torch.Tensor:
                if ids.shape[1] >= 32:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
                return step(ids)

            trainer.step_fn = failing
            return trainer

    class OutOfMemoryBuilding(Plain):
        def build(self, shape: Any, max_seq: int, recipe: Any) -> Any:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.00 GiB")

    monkeypatch.setitem(activation_systems.SYSTEMS, "oom-at-32", OutOfMemoryAt("oom-at-32"))
    monkeypatch.setitem(activation_systems.SYSTEMS, "oom-building", OutOfMemoryBuilding("oom-building"))
    shape = parse_shape("gpt2:1x16", 64)
    settings = activation_runs.RunSettings(Recipe(torch.device("cpu"), "fp32"), 1, 1, 1, time.time() + 600, 1 << 30)
    rows: list[dict[str, Any]] = []
    for name in ("oom-at-32", "oom-building"):
        activation_runs.run_system(shape, "gpt2:1x16", name, [16, 32, 64], settings, rows.append)
    assert [(r["system"], r["seq"], r["state"]) for r in rows] == [
        ("oom-at-32", 16, "ok"),
        ("oom-at-32", 32, "out of memory"),
        ("oom-building", 16, "out of memory"),
    ]
    assert rows[0]["fits"] and not rows[1]["fits"] and rows[2]["note"].startswith("building: CUDA out of memory")
    # Any other error ends the system with a row that says so, after the lengths it trained.
    monkeypatch.setitem(activation_systems.SYSTEMS, "broken", Plain("broken", checkpointing=True))
    monkeypatch.setattr(activation_systems, "enable_hf_checkpointing", lambda model: 1 / 0)
    spec = {"shape": shape, "preset": "gpt2:1x16", "system": "broken", "seqs": [16, 32], "settings": settings}
    failed = activation_runs.system_process({**spec, "started": time.time()})
    assert [(r["seq"], r["state"], r["note"]) for r in failed] == [
        (16, "failed", "ZeroDivisionError: division by zero")
    ]
    late = activation_runs.RunSettings(Recipe(torch.device("cpu"), "fp32"), 1, 1, 1, time.time() - 1, 1 << 30)
    skipped: list[dict[str, Any]] = []
    activation_runs.run_system(shape, "gpt2:1x16", "plain", [16, 32], late, skipped.append)
    assert [(r["seq"], r["state"], r["note"]) for r in skipped] == [(16, "skipped", "time limit")]


def _plain_with_plan(seq: int, step_base: int, steps: int, plan: list[str]) -> list[float]:
    """The benchmark's plain PyTorch from the initial weights on the batches of a length: its first
    step as it is, the next ones with the blocks the plan recomputes under non-reentrant
    checkpointing (the first step of chunkmem-auto offloads every call and measures)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from benchmarks.activation_systems import SYSTEMS, Recipe, parse_shape
    from benchmarks.common import rank_batch

    shape = parse_shape("gpt2:2x32", 128)
    trainer = SYSTEMS["plain"].build(shape, max(ACT_SEQS), Recipe(torch.device("cpu"), "fp32"))
    losses = []
    for index in range(steps):
        if index == 1:
            for block, choice in zip(shape.blocks(trainer.model), plan, strict=True):
                if choice == "recompute":
                    own = block.forward
                    block.forward = lambda *a, _own=own, **k: checkpoint(_own, *a, use_reentrant=False, **k)
        losses.append(trainer.step(rank_batch(step_base + index, 0, 1, 1, seq, shape.vocab)))
    return losses


def test_activations_auto_trains_as_plain_pytorch_within_the_budget(
    activations_run: tuple[str, dict[str, Any]],
) -> None:
    """chunkmem-auto, built again at each length from the initial weights: its losses are plain
    PyTorch's with the plan's checkpointing; its own budget plus what the benchmark's ledger adds
    outside it is the benchmark's budget; where it fits, the total is within it."""
    _, payload = activations_run
    auto = [r for r in payload["rows"] if r["system"] == "chunkmem-auto"]
    assert [r["seq"] for r in auto] == list(ACT_SEQS[: len(auto)])
    # Bytes decide what is kept (time only whether the rest is offloaded or recomputed): at the
    # first length everything, at the last not everything (unless its budget refused it).
    assert set(auto[0]["activation_plan"]) == {"keep"}
    if len(auto) == len(ACT_SEQS) and "activation_plan" in auto[-1]:
        assert set(auto[-1]["activation_plan"]) != {"keep"}
    plain = {r["seq"]: r["losses"] for r in payload["rows"] if r["system"] == "plain"}
    assert auto[0]["losses"] == plain[ACT_SEQS[0]]  # the first length: the same start as every system
    for index, row in enumerate(auto):
        if "activation_plan" not in row:  # refused by its own budget
            assert row["state"] == "over budget" and not row["fits"], row
            continue
        assert len(row["activation_plan"]) == 2  # one choice a block call
        assert row["losses"] == _plain_with_plan(row["seq"], 2 * index, 2, row["activation_plan"]), row["seq"]
        recomputes = "recompute" in row["activation_plan"]
        assert row["blocks_extra_bytes"] == (_block_call_bytes(row["seq"], 0) if recomputes else 0)
        outside = ACT_BUDGET - row["chunkmem_device_budget"]  # less once more by the recomputation, where retried
        assert outside - row["saved_meter_bytes"] in (0, row["blocks_extra_bytes"]), row["seq"]
        assert row["model_bytes"] <= row["chunkmem_device_budget"]
        assert row["fits"] == (row["ledger_bytes"] <= ACT_BUDGET)


@pytest.mark.long
def test_compile_benchmark_trains_bit_for_bit_as_plain_per_block_compile_with_inductor(tmp_path: Path) -> None:
    """LLaMA's blocks compiled by Inductor (the generated C++ kernels, run on chunk views under an
    auto budget) train to the same losses, bit for bit, as plain PyTorch with the same blocks
    compiled, and one graph is compiled per process, none again. Two systems only: each compiles
    (the compile dominates this test's time)."""
    systems = ["plain-compiled", "chunkmem-budget-compiled"]
    out = _run(
        "compile.py",
        *("--layers", "2", "--arch", "llama", "--systems", ",".join(systems)),
        *("--rounds", "2", "--steps", "1", "--warmup", "2", "--out-dir", str(tmp_path)),
        env=NO_GPU,
    )
    payload = json.loads((tmp_path / "compile_w1.json").read_text())
    results = {r["system"]: r for r in payload["results"]}
    assert list(results) == systems
    assert all(r["state"] == "ok" and len(r["losses"]) == 4 for r in results.values()), results
    assert payload["loss_checks"]["llama"] == {"chunkmem-budget-compiled == plain-compiled": True}
    for name in systems:
        assert (results[name]["graphs"], results[name]["recompiles"]) == (1, 0), name
    for r in results.values():
        assert len(r["round_medians"]) == 2 and r["median_s"] == pytest.approx(sum(r["round_medians"]) / 2)
    assert payload["summary_table"]["rows"] and "llama: losses equal" in out
    _assert_aligned(_table_lines(out, len(systems)))


def test_dpo_trains_the_pair_as_plain_pytorch_under_each_budget_and_fits_a_larger_pair(tmp_path: Path) -> None:
    """The DPO benchmark (benchmarks/dpo.py) on a tiny LLaMA pair: every system's losses are plain
    PyTorch's, bit for bit (fp32, one rank); each budget holds both models' chunks (the ledger's peak
    within it); and under the fit budget chunkmem trains a pair plain PyTorch cannot hold resident,
    the pair sizes its counts from the parameters."""
    out = _run(
        "dpo.py",
        *("--size", "64x2", "--vocab", "256", "--seq", "16", "--batch", "1", "--steps", "2", "--rounds", "1"),
        *("--chunk-size", "4096", "--budget-chunks", "8", "--threads", "1"),
        *("--fit-budget", "1MiB", "--fit-sizes", "32x1,64x2", "--fit-chunk-size", "4096"),
        *("--out-dir", str(tmp_path)),
        tiny=False,
    )
    payload = json.loads((tmp_path / "dpo.json").read_text())
    rows = {(r["system"], r["budget"]): r for r in payload["rows"]}
    fit = payload["fit"]
    budget = 8 * 4 * 4096
    assert set(rows) == {("plain", None), ("chunkmem", None), ("chunkmem", budget), ("chunkmem-no-prefetch", budget)}
    plain = rows["plain", None]
    for key, row in rows.items():
        assert row["state"] == "ok", key
        assert row["losses"] == plain["losses"], key
        assert row["reference_s"] > 0, key
    # plain's figure is its resident model state, 16 B a policy parameter and 4 B a reference one. A
    # LLaMA 64x2 (one head of 64, one kv head, MLP 170 wide) over 256 tokens: embedding and head 256 x 64
    # each, a block's attention 4 x 64 x 64 and MLP 3 x 64 x 170 and two norms, the final norm.
    parameters = 2 * 256 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 170 + 2 * 64) + 64
    assert plain["peak_device_bytes"] == 20 * parameters
    assert fit["sizes"][1]["parameters_per_model"] == parameters
    for system in ("chunkmem", "chunkmem-no-prefetch"):
        assert 0 < rows[system, budget]["peak_device_bytes"] <= budget, system
        assert rows[system, budget]["peak_host_bytes"] > 0, system  # the offloaded chunks
    assert [s["plain_fits"] for s in fit["sizes"]] == [True, False]
    assert [s["chunkmem_fits"] for s in fit["sizes"]] == [True, True]
    assert fit["ratio"] >= 2.0, fit
    assert all(s["chunkmem_peak_device_bytes"] <= fit["budget"] for s in fit["sizes"])
    table = payload["summary_table"]
    assert len(table["rows"]) == 4 and all(len(row) == len(table["headers"]) for row in table["rows"])
    _assert_aligned(_table_lines(out, 4))
    assert (tmp_path / "dpo.png").exists()


def test_the_walks_of_an_op_a_gradient_and_a_load_stay_within_their_files(tmp_path: Path) -> None:
    """``benchmarks/walks.py`` at two ranks: the stacks it recorded start where a user's call enters
    chunkmem (the boosted model's forward, the booster's backward) and end at the collective (the
    communicator) and the user's optimizer (the stepper), and stay within issue 47's files; a
    sharded optimizer load, from the booster, enters the optimizer state's checks by three ways (its
    layout before reading, what it read, the install; it was five)."""
    _run("walks.py", "--out-dir", str(tmp_path), tiny=False)
    walks = {w["walk"]: w for w in json.loads((tmp_path / "walks.json").read_text())["walks"]}
    op, gradient = walks["op to its all-gather"], walks["gradient to the step"]
    assert op["files"][0] == "boosted/model.py" and op["files"][-1] == "ranks/comm.py", op["files"]
    assert gradient["files"][0] == "booster.py" and gradient["files"][-1] == "optim/stepper.py", gradient["files"]
    assert len(op["files"]) <= 8 and len(gradient["files"]) <= 11, (op["files"], gradient["files"])
    assert op["calls"] == len(op["stacks"][0]) and gradient["calls"] == sum(map(len, gradient["stacks"]))
    load = walks["a sharded optimizer load"]
    assert load["files"][0] == "booster.py" and "checkpoint/sharded_optimizer.py" in load["files"], load["files"]
    assert load["entries"]["optim/state_dict.py"] == ["check_saved_layout", "stage_read_state", "install"], load
    assert load["calls"] >= len(load["files"]) and all(" -> " in climb for climb in load["climbs"]), load
