"""``chunkmem.plan`` predicts a run without running it: the counters it predicts for each step
(gathers, prefetches, evictions, bytes moved host-to-device and back, bytes all-gathered and
reduce-scattered, peak accounted device bytes) equal a real run's, for both policies, with and
without budgets and prefetch, at world size 1 and 2; and the minimum budget it reports is one a
real run accepts."""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from support.child_env import child_env
from support.distributed import run_ranks
from support.forked import run_main
from support.models import batches, gpt2, llama, reference_device
from support.paths import ROOT

from chunkmem import Booster, BudgetTooSmallError, ChunkPlugin, Plan, StepCounters, plan
from chunkmem.device.simulated import simulated_device
from chunkmem.placement import AutoPlacementConfig, StaticPlacementConfig
from chunkmem.usage.memory import process_capacity

CHUNK = 6_000
CAPACITY = process_capacity(torch.device("cpu"))


def adamw_groups(params: Iterable[torch.nn.Parameter]) -> torch.optim.AdamW:
    params = [p for p in params if p.requires_grad]
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2]},
        ],
        lr=1e-3,
    )


PLACEMENTS: dict[str, Any] = {
    "static": StaticPlacementConfig(),
    "static-prefetch2": StaticPlacementConfig(max_prefetch=2),
    "static-offload-budget": StaticPlacementConfig(
        offload_optim_frac=1.0, offload_param_frac=1.0, device_budget=200_000, max_prefetch=1
    ),
    "auto-budget": AutoPlacementConfig(device_budget=400_000),
    "auto-budget-prefetch3": AutoPlacementConfig(device_budget=250_000, max_prefetch=3),
}


def _on(planned_for: str) -> Any:
    """Where a run that a plan for a ``planned_for`` device predicts happens: a plan is by default
    for a GPU (asynchronous copies; host masters step during the backward by default), and on a
    machine without one the simulated asynchronous device stands in for it."""
    if planned_for == "cuda" and reference_device().type == "cpu":
        return simulated_device()
    assert reference_device().type == planned_for, f"a run for a {planned_for} plan computes on {reference_device()}"
    return nullcontext()


def _count_steps(
    rank: int,
    world_size: int,
    model: Any,
    plugin: ChunkPlugin,
    accumulation: int = 1,
    planned_for: str = "cuda",
    count: int = 3,
) -> tuple[list[dict[str, int]], Any]:
    """``count`` training steps of ``model`` boosted with ``plugin``, each of ``accumulation``
    micro-batches (all but the last in ``booster.no_sync``), where a plan for a ``planned_for``
    device says they run (``_on``): each step's counters, and the ledger."""
    with _on(planned_for):
        return _count_steps_here(rank, world_size, model, plugin, accumulation, count)


def _count_steps_here(
    rank: int, world_size: int, model: Any, plugin: ChunkPlugin, accumulation: int, count: int
) -> tuple[list[dict[str, int]], Any]:
    booster = Booster(plugin)
    chunked, optimizer, *_ = booster.boost(model, adamw_groups(model.parameters()))
    ledger = chunked.manager.ledger
    steps = []
    for ids in batches(count * accumulation, batch=4)[::accumulation]:
        local = ids.chunk(world_size)[rank]
        before = chunked.stats()
        ledger.reset_peak()
        with booster.no_sync(chunked, optimizer):
            for _ in range(accumulation - 1):
                booster.backward(chunked(input_ids=local, labels=local).loss / accumulation, optimizer)
        booster.backward(chunked(input_ids=local, labels=local).loss / accumulation, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        counters = StepCounters.between(before, chunked.stats(), ledger.peak_device_bytes, ledger.peak_host_bytes)
        steps.append(vars(counters))
    return steps, ledger


def _measured(rank: int, world_size: int, placement: Any, precision: str, arch: str) -> list[dict[str, int]]:
    model = (gpt2 if arch == "gpt2" else llama)(n_layer=3)
    plugin = ChunkPlugin(placement=placement, precision=precision, chunk_size=CHUNK)
    return _count_steps(rank, world_size, model, plugin)[0]


def _predicted(world_size: int, placement: Any, precision: str, arch: str) -> Plan:
    with torch.device("meta"):
        model = (gpt2 if arch == "gpt2" else llama)(n_layer=3)
    ids = torch.zeros(4 // world_size, 16, dtype=torch.long)
    plugin = ChunkPlugin(placement=placement, precision=precision, chunk_size=CHUNK)
    return plan(
        model,
        plugin,
        {"input_ids": ids, "labels": ids},
        world_size=world_size,
        optimizer=adamw_groups,
        device_capacity=CAPACITY,
        steps=3,
    )


# At one rank the placements that the two-rank test below does not run (the others are predicted
# there, for each rank).
@pytest.mark.multirank
@pytest.mark.parametrize("placement", [pytest.param("static", marks=pytest.mark.fast_tier), "auto-budget"])
def test_prediction_equals_a_run_at_world_size_1(placement: str) -> None:
    predicted = _predicted(1, PLACEMENTS[placement], "fp32", "gpt2")
    measured = run_ranks(_measured, 1, args=(PLACEMENTS[placement], "fp32", "gpt2"))[0]
    assert [vars(s) for s in predicted.steps] == measured
    budget = PLACEMENTS[placement].device_budget
    if budget is not None:
        assert predicted.fits and predicted.peak_device_bytes <= budget


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("placement", "precision", "arch"),
    [
        ("static-prefetch2", "bf16", "gpt2"),
        ("auto-budget-prefetch3", "fp32", "llama"),
        ("static-offload-budget", "fp32", "gpt2"),
    ],
)
def test_prediction_equals_a_run_at_world_size_2(placement: str, precision: str, arch: str) -> None:
    predicted = _predicted(2, PLACEMENTS[placement], precision, arch)
    measured = run_ranks(_measured, 2, args=(PLACEMENTS[placement], precision, arch))
    for steps in measured:
        assert [vars(s) for s in predicted.steps] == steps


def _trains_at(rank: int, world_size: int, budget: int) -> int:
    with _on("cuda"):
        return _trains_at_here(rank, world_size, budget)


def _trains_at_here(rank: int, world_size: int, budget: int) -> int:
    model = gpt2(n_layer=3)
    placement = AutoPlacementConfig(device_budget=budget, max_prefetch=1)
    booster = Booster(ChunkPlugin(placement=placement, precision="fp32", chunk_size=CHUNK))
    chunked, optimizer, *_ = booster.boost(model, adamw_groups(model.parameters()))
    for ids in batches(2, batch=4):
        local = ids.chunk(world_size)[rank]
        booster.backward(chunked(input_ids=local, labels=local).loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    return chunked.stats().peak_device_bytes


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [1, 2])
def test_the_minimum_budget_is_accepted_by_a_real_run(world_size: int) -> None:
    predicted = _predicted(world_size, AutoPlacementConfig(device_budget=10**9, max_prefetch=1), "fp32", "gpt2")
    minimum = predicted.min_device_budget
    peaks = run_ranks(_trains_at, world_size, args=(minimum,))
    assert all(peak <= minimum for peak in peaks)


@pytest.mark.slow  # the fast tier's case: a prediction equal to a run
def test_the_minimum_budget_is_the_minimum() -> None:
    predicted = _predicted(1, AutoPlacementConfig(device_budget=10**9, max_prefetch=1), "fp32", "gpt2")
    with pytest.raises(BudgetTooSmallError):
        _trains_at(0, 1, predicted.min_device_budget - 1)


@pytest.mark.slow
def test_the_cli_plans_llama_shapes_as_json(tmp_path: Path) -> None:
    cli = importlib.import_module("chunkmem.plan_command")
    # The shipped shape is LLaMA 7B. Planning all its 32 layers takes about 25 s here (PyTorch's
    # meta kernels run in Python), so the command line plans its widths at two layers, given as a
    # user gives a config: a config.json.
    assert 6.7e9 < sum(p.numel() for p in cli.build_meta_model("llama-7b", 512).parameters()) < 6.8e9
    (tmp_path / "config.json").write_text(json.dumps({**cli.SHAPES["llama-7b"], "num_hidden_layers": 2}))
    argv = ["--hf-config", str(tmp_path), "--device-budget", "24GiB", "--batch", "1x512", "--world-size", "8", "--json"]
    # ``python -m chunkmem.plan_command``, forked from the tests' fork server (its imports done).
    done = run_main("chunkmem.plan_command", *argv, cwd=str(ROOT), env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    hidden, mlp, vocab = 4096, 11008, 32000  # embeddings and head untied; four attention and three MLP matrices
    assert result["parameters"] == 2 * vocab * hidden + 2 * (4 * hidden**2 + 3 * hidden * mlp + 2 * hidden) + hidden
    # Gradients are reduce-scattered once per step: the fp32 model's bytes, all chunks padded.
    assert result["reduce_scatter_bytes_per_step"] >= 4 * result["parameters"]
    assert result["fits"] and result["peak_device_bytes"] <= 24 * 2**30


DISK_PLACEMENTS: dict[str, Any] = {
    "static-disk": StaticPlacementConfig(offload_optim_frac=1.0, offload_disk_frac=0.6, max_prefetch=1),
    "auto-host-budget": AutoPlacementConfig(device_budget=250_000, host_budget=2_200_000),
}


def _measured_on_disk(
    rank: int, world_size: int, placement: Any, disk_dir: str, planned_for: str = "cuda"
) -> list[dict[str, int]]:
    plugin = ChunkPlugin(placement=placement, precision="bf16", chunk_size=CHUNK, disk_dir=disk_dir)
    steps, ledger = _count_steps(rank, world_size, gpt2(n_layer=3), plugin, planned_for=planned_for)
    return [*steps, {"disk": ledger.disk_bytes, "host": ledger.host_bytes}]


def _planned_on_disk(placement: Any, device: str = "cuda") -> Plan:
    with torch.device("meta"):
        model = gpt2(n_layer=3)
    ids = torch.zeros(4, 16, dtype=torch.long)
    plugin = ChunkPlugin(placement=placement, precision="bf16", chunk_size=CHUNK)
    inputs = {"input_ids": ids, "labels": ids}
    return plan(model, plugin, inputs, optimizer=adamw_groups, device_capacity=CAPACITY, steps=3, device=device)


@pytest.mark.multirank
@pytest.mark.parametrize("placement", list(DISK_PLACEMENTS))
def test_disk_and_host_figures_equal_a_run_with_the_disk_tier(placement: str, tmp_path: Path) -> None:
    predicted = _planned_on_disk(DISK_PLACEMENTS[placement])
    measured = run_ranks(_measured_on_disk, 1, args=(DISK_PLACEMENTS[placement], str(tmp_path)))[0]
    totals = measured.pop()
    assert [vars(s) for s in predicted.steps] == measured
    assert predicted.disk_bytes_per_rank == totals["disk"] > 0
    assert predicted.host_bytes_per_rank == totals["host"]
    assert predicted.disk_read_bytes_per_step == predicted.disk_write_bytes_per_step > 0
    assert predicted.disk_seconds_per_step == pytest.approx(2 * predicted.disk_read_bytes_per_step / 2e9)
    if DISK_PLACEMENTS[placement].host_budget is not None:
        assert predicted.peak_host_bytes <= DISK_PLACEMENTS[placement].host_budget


@pytest.mark.multirank
@pytest.mark.cpu_compute(reason="a plan for the CPU against a run on the synchronous CPU")
def test_a_plan_for_the_cpu_equals_a_run_on_it_and_a_gpu_frees_disk_chunks_gradients_sooner(tmp_path: Path) -> None:
    # The CPU steps host masters after the backward by default: every gradient buffer lives until the
    # backward ends. A GPU steps them during it, and frees the buffer of a chunk whose optimizer side
    # is on disk as soon as its reduced slot is in the shard its early step reads: a lower peak.
    placement = DISK_PLACEMENTS["static-disk"]
    on_cpu = _planned_on_disk(placement, device="cpu")
    measured = run_ranks(_measured_on_disk, 1, args=(placement, str(tmp_path), "cpu"))[0]
    measured.pop()
    assert [vars(s) for s in on_cpu.steps] == measured
    on_gpu = _planned_on_disk(placement)
    assert on_gpu.steps[-1].peak_device_bytes < on_cpu.steps[-1].peak_device_bytes
    # The first step records the trace: no early steps yet, the same counters but the host peak,
    # where a GPU's pinned host buffers hold their allocator's power-of-two blocks.
    first_gpu, first_cpu = vars(on_gpu.steps[0]), vars(on_cpu.steps[0])
    assert first_gpu.pop("peak_host_bytes") > first_cpu.pop("peak_host_bytes")
    assert first_gpu == first_cpu
    with pytest.raises(ValueError, match="device must be 'cuda' or 'cpu'"):
        _planned_on_disk(placement, device="tpu")


def test_the_cli_plans_the_config_file_it_is_given_and_refuses_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan_cli = importlib.import_module("chunkmem.plan_command")

    small = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64}
    (tmp_path / "config.json").write_text(json.dumps({**small, "n_layer": 6}))  # the directory's, not asked for
    (tmp_path / "small.json").write_text(json.dumps(small))
    from transformers import GPT2Config, GPT2LMHeadModel

    result = plan_cli.main(["--hf-config", str(tmp_path / "small.json"), "--batch", "1x16", "--json"])
    capsys.readouterr()
    with torch.device("meta"):
        expected = sum(p.numel() for p in GPT2LMHeadModel(GPT2Config(**small)).parameters())
    assert result.parameters == expected  # the file given, not the directory's config.json
    (tmp_path / "odd.json").write_text(json.dumps({"model_type": "no-such-model"}))
    small_file = ["--hf-config", str(tmp_path / "small.json")]
    refusals = {
        "unknown model_type": (["--hf-config", str(tmp_path / "odd.json")], "model_type 'no-such-model'"),
        "batch 0": (["--hf-config", "gpt2", "--batch", "0x16"], "at least 1"),
        "world size 0": (["--hf-config", "gpt2", "--world-size", "0"], "must be at least 1"),
        "budget": (["--hf-config", "gpt2", "--device-budget", "lots"], "24GiB"),
        "separator": (["--hf-config", "gpt2", "--device-budget", "2,048MiB"], "argument --device-budget"),
        "nan": (["--hf-config", "gpt2", "--host-budget", "nan"], "argument --host-budget"),
        "disk fraction": (["--hf-config", "gpt2", "--policy", "static", "--disk-frac", "2"], "argument --disk-frac"),
        "disk with auto": (["--hf-config", "gpt2", "--disk-frac", "0.5"], "with --policy auto, --host-budget decides"),
        "no bandwidth": (["--hf-config", "gpt2", "--bandwidth", "0"], "argument --bandwidth"),
        "no disk bandwidth": (["--hf-config", "gpt2", "--disk-bandwidth", "0"], "argument --disk-bandwidth"),
        "accumulation": (["--hf-config", "gpt2", "--grad-accum", "0"], "argument --grad-accum"),
        "chunk": (["--hf-config", str(tmp_path / "small.json"), "--chunk-size", str(2**40)], "chunk_size="),
        # A refused config's error names the flag that set it, where the check is of one field or of several.
        "activation host budget": (
            [*small_file, "--activations", "offload=GPT2Block", "--activation-host-budget", "1KiB"],
            "error: argument --activation-host-budget: host_budget=1024 bytes is below the minimum",
        ),
        "activation host budget alone": (
            [*small_file, "--activation-host-budget", "1MiB"],
            "error: argument --activation-host-budget: host_budget caps",
        ),
        "one placement per class": (
            [*small_file, "--activations", "offload=GPT2Block", "--activations", "recompute=GPT2Block"],
            "error: argument --activations: offload and recompute both name",
        ),
        "parameters on disk beyond optimizer sides": (
            [*small_file, "--policy", "offload", "--disk-frac", "0.2", "--param-disk-frac", "0.5"],
            "error: argument --policy, --disk-frac and --param-disk-frac: offload_param_disk_frac=0.5",
        ),
    }
    for name, (argv, message) in refusals.items():
        with pytest.raises(SystemExit) as exit_:
            plan_cli.main(argv)
        err = capsys.readouterr().err  # argparse prints the usage, then one line
        assert exit_.value.code == 2, (name, exit_.value.code)
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
            "python -m chunkmem.plan_command: error:"
        )
        assert message in err.strip().splitlines()[-1], (name, err)


@pytest.mark.slow  # the fast tier's case: the CLI plans a config file
def test_the_cli_shows_its_defaults_and_plans_a_host_budget_too_small_as_not_fitting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan_cli = importlib.import_module("chunkmem.plan_command")
    with pytest.raises(SystemExit):
        plan_cli.main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 1x2048)", "(default: auto)", "(default: 25GB/s)", "(default: cuda)", "bf16 on cuda"):
        assert default in shown, default
    small = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64}
    (tmp_path / "small.json").write_text(json.dumps(small))
    common = ["--hf-config", str(tmp_path / "small.json"), "--batch", "1x16"]
    # The precision a training run on that device picks (ChunkPlugin's default there).
    assert plan_cli.main([*common, "--device", "cpu"]).table()  # fp32 on a CPU
    assert "fp32 (the default on cpu)" in capsys.readouterr().out
    plan_cli.main(common)
    assert "bf16 (the default on cuda)" in capsys.readouterr().out
    tight = plan_cli.main([*common, "--device-budget", "200000", "--host-budget", "1000"])
    assert not tight.fits and "host_budget=1000" in tight.why_not
    assert tight.peak_host_bytes <= tight.min_host_budget  # planned at the host budget it needs
    with torch.device("meta"):
        from transformers import GPT2Config, GPT2LMHeadModel

        count = sum(p.numel() for p in GPT2LMHeadModel(GPT2Config(**small)).parameters())
    assert f"parameters                     {count / 1e3:.3g}K ({count:,})" in capsys.readouterr().out


@pytest.mark.slow  # plans a small model four times
def test_a_plan_that_does_not_fit_names_the_flags_that_make_it_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Following what "to fit" says makes the plan fit: the fix is checked against the planner itself
    planning what it names, not against its own text."""
    plan_cli = importlib.import_module("chunkmem.plan_command")
    small = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 3, "n_head": 2, "n_positions": 64}
    (tmp_path / "small.json").write_text(json.dumps(small))
    common = ["--hf-config", str(tmp_path / "small.json"), "--batch", "4x64", "--device", "cpu", "--precision", "fp32"]
    # The activations of three GPT-2 blocks overflow a 1 MiB device; recomputing them (all but one call's
    # saved tensors leave the device) fits.
    over = plan_cli.main([*common, "--device-memory", "1MiB"])
    shown = capsys.readouterr().out
    assert not over.fits and "more than the 1.00 MiB device capacity" in over.why_not
    assert "ActivationPlacement(recompute=['GPT2Block'])" in over.why_not
    (to_fit,) = [line for line in shown.splitlines() if line.startswith("to fit: ")]
    assert to_fit.startswith("to fit: --activations recompute=GPT2Block (") and "a smaller --batch" in to_fit
    fixed = plan_cli.main([*common, "--device-memory", "1MiB", "--activations", "recompute=GPT2Block"])
    assert fixed.fits, fixed.why_not
    assert "to fit" not in capsys.readouterr().out
    # A device budget below the placement's minimum: the flag with the minimum, rounded up to a MiB, fits.
    low = plan_cli.main([*common, "--device-budget", "64KiB", "--json"])
    flags = [fix["flag"] for fix in json.loads(capsys.readouterr().out)["fixes"]]
    assert not low.fits and flags[0] == f"--device-budget {-(-low.min_device_budget // 2**20)}MiB", flags
    assert plan_cli.main([*common, *flags[0].split()]).fits


@pytest.mark.parametrize(
    ("count", "shown"), [(950, "950"), (120_576, "121K"), (5_800_000, "5.8M"), (124_439_808, "124M"), (1.2e9, "1.2B")]
)
def test_parameter_counts_read_as_people_write_them(count: int, shown: str) -> None:
    from chunkmem.planning.plan_report import format_count

    assert format_count(int(count)) == shown


# The step that records the trace and one step that follows the plans: every counter a later step
# has (compared over three steps with one micro-batch a step above; the accumulated runs' third
# step repeated their second).
ACCUMULATED_STEPS = 2
ACCUMULATION = {
    "static-offload-budget": (PLACEMENTS["static-offload-budget"], False),
    "auto-budget-hint": (AutoPlacementConfig(device_budget=400_000), True),
    "auto-tight": (AutoPlacementConfig(device_budget=250_000, max_prefetch=1), False),
}


def _measured_accumulating(rank: int, world_size: int, name: str) -> list[dict[str, int]]:
    placement, hint = ACCUMULATION[name]
    plugin = ChunkPlugin(placement=placement, precision="fp32", chunk_size=CHUNK, gradient_accumulation=hint)
    here = reference_device().type
    steps = ACCUMULATED_STEPS
    return _count_steps(rank, world_size, gpt2(n_layer=3), plugin, accumulation=3, planned_for=here, count=steps)[0]


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("name", "world_size"),
    # Every placement at two ranks (the collectives); at one rank, whose no_sync may run its
    # reductions, the placement that moves gradient buffers most (the others add suite time only).
    [*((name, 2) for name in ACCUMULATION), ("auto-tight", 1)],
)
def test_a_prediction_with_gradient_accumulation_equals_a_run(name: str, world_size: int) -> None:
    """Three micro-batches a step, two of them in no_sync: the plan's counters are the run's (they
    differ from a one-micro-batch plan: each micro-batch gathers again, and under a tight budget
    gradient buffers move to the host and back). Planned for the device the run computes on here
    (the CPU's synchronous run is several times faster than the simulated asynchronous device; what
    a GPU's asynchrony changes in a plan is compared in the disk-tier and world-size tests)."""
    placement, hint = ACCUMULATION[name]
    with torch.device("meta"):
        model = gpt2(n_layer=3)
    ids = torch.zeros(4 // world_size, 16, dtype=torch.long)
    plugin = ChunkPlugin(placement=placement, precision="fp32", chunk_size=CHUNK, gradient_accumulation=hint)
    inputs = {"input_ids": ids, "labels": ids}
    kwargs: dict[str, Any] = {"world_size": world_size, "optimizer": adamw_groups, "device_capacity": CAPACITY}
    kwargs.update(device=reference_device().type, steps=ACCUMULATED_STEPS)
    predicted = plan(model, plugin, inputs, grad_accum=3, **kwargs)
    measured = run_ranks(_measured_accumulating, world_size, args=(name,))
    for steps in measured:
        assert [vars(s) for s in predicted.steps] == steps
    single = plan(model, plugin, inputs, **kwargs)
    assert predicted.allgather_bytes_per_step + predicted.h2d_bytes_per_step > (
        single.allgather_bytes_per_step + single.h2d_bytes_per_step
    )


# --- a trained model and a frozen one beside it (a DPO policy and its reference) ------------------------------------
PAIR = StaticPlacementConfig(offload_optim_frac=1.0, offload_param_frac=1.0, device_budget=160_000, max_prefetch=2)


def _measured_pair(rank: int, world_size: int) -> list[dict[str, int]]:
    """Three steps of a LLaMA policy with its reference boosted beside it: each step the reference's
    forward under ``no_grad`` (no labels), then the policy's forward, backward and step."""
    with _on("cuda"):
        policy, reference = llama(n_layer=2), llama(n_layer=2, seed=1)
        booster = Booster(ChunkPlugin(placement=PAIR, precision="fp32", chunk_size=CHUNK))
        chunked, optimizer, *_ = booster.boost(policy, adamw_groups(policy.parameters()), frozen=reference)
        (beside,) = chunked.frozen_models
        ledger = chunked.manager.ledger
        steps = []
        for ids in batches(3, batch=4):
            local = ids.chunk(world_size)[rank]
            before = chunked.stats()
            ledger.reset_peak()
            with torch.no_grad():
                beside(input_ids=local)
            booster.backward(chunked(input_ids=local, labels=local).loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            counters = StepCounters.between(before, chunked.stats(), ledger.peak_device_bytes, ledger.peak_host_bytes)
            steps.append(vars(counters))
        return steps


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_prediction_for_a_trained_and_a_frozen_model_equals_a_run(world_size: int) -> None:
    """``plan(..., frozen=...)``: the counters of a DPO-shaped step (the reference's forward, then the
    policy's) under one budget equal a run's, step for step, with the reference's chunks counted."""
    with torch.device("meta"):
        policy, reference = llama(n_layer=2), llama(n_layer=2, seed=1)

    def planned(*frozen: Any) -> Plan:
        ids = torch.zeros(4 // world_size, 16, dtype=torch.long)
        plugin = ChunkPlugin(placement=PAIR, precision="fp32", chunk_size=CHUNK)
        return plan(
            policy,
            plugin,
            {"input_ids": ids, "labels": ids},
            world_size=world_size,
            optimizer=adamw_groups,
            device_capacity=CAPACITY,
            steps=3,
            frozen=frozen,
        )

    predicted = planned(reference)
    for measured in run_ranks(_measured_pair, world_size):
        assert [vars(s) for s in predicted.steps] == measured
    alone = planned()
    per_model = sum(p.numel() for p in policy.parameters())
    assert predicted.parameters == alone.parameters + per_model == 2 * per_model
    # Every step brings the reference's values (fp32 here: 4 bytes a parameter, this rank's share)
    # to the device for its forward, from the host where they stay between forwards.
    both, one = predicted.steps[-1], alone.steps[-1]
    assert both.gathers + both.prefetches > one.gathers + one.prefetches
    assert both.h2d_bytes - one.h2d_bytes >= 4 * per_model // world_size
    assert predicted.host_bytes_per_rank - alone.host_bytes_per_rank >= 4 * per_model // world_size
    assert predicted.fits and predicted.peak_device_bytes <= PAIR.device_budget


def test_a_plan_refuses_the_frozen_models_a_run_refuses() -> None:
    """A frozen model with real weights; the trained model itself; a copy sharing its parameters
    (the plan copies the models together, so the boost sees what a run's would)."""
    import copy

    with torch.device("meta"):
        policy = llama(n_layer=2)
    ids = torch.zeros(2, 16, dtype=torch.long)
    plugin = ChunkPlugin(placement=PAIR, chunk_size=CHUNK)
    with pytest.raises(ValueError, match=r"build frozen model 0 on the meta device"):
        plan(policy, plugin, {"input_ids": ids}, frozen=[llama(n_layer=1)])
    with pytest.raises(ValueError, match=r"frozen model 0 \(LlamaForCausalLM\) is the trained model itself"):
        plan(policy, plugin, {"input_ids": ids}, frozen=[policy])
    with pytest.raises(ValueError, match=r"of frozen model 0 \(LlamaForCausalLM\) is also a parameter of the trained"):
        plan(policy, plugin, {"input_ids": ids}, frozen=[copy.copy(policy)])
