"""``chunkmem.plan`` predicts what the blocks an ``ActivationPlacement`` names save, from a meta run:
an offloaded block's copies per step, a recomputed block's recomputations, an ``auto`` block's
saved bytes per call and the minimum budget a run refuses below; each equals what a real run on
the CPU counts (its ``Stats``, its measured ``activation_plan``, its ``BudgetTooSmallError``)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
from support.activation_budget_helpers import BATCH, WIDTH, Stack, _auto, _train
from support.plan_activations_helpers import _adamw, _lm_plan, _lm_run, _plugin

from chunkmem import Booster, BudgetTooSmallError, Plan, plan
from chunkmem.placement import ActivationChoice, ActivationPlacement, BlockPlacement, CopyRates

BLOCKS = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer"}


@pytest.mark.parametrize(
    ("arch", "precision"), [("gpt2", "fp32"), pytest.param("llama", "bf16", marks=pytest.mark.slow)]
)
def test_offloaded_blocks_copy_what_the_plan_predicts(arch: str, precision: str) -> None:
    # Eager attention: scaled_dot_product_attention picks its kernel, and so what it saves, by device.
    activations = ActivationPlacement(offload=[BLOCKS[arch]])
    predicted = _lm_plan(arch, activations, "eager", precision)
    measured = _lm_run(arch, activations, "eager", precision)
    assert [c.how for c in predicted.activation_calls] == [BlockPlacement.OFFLOAD] * 2
    assert predicted.activation_d2h_bytes_per_step > 0
    for step in measured:
        assert step["activation_d2h_bytes"] == predicted.activation_d2h_bytes_per_step
        assert step["activation_h2d_bytes"] == predicted.activation_h2d_bytes_per_step
    assert "activations d2h + h2d per step" in predicted.table()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_recomputed_blocks_are_counted_as_the_plan_predicts(arch: str) -> None:
    activations = ActivationPlacement(recompute=[BLOCKS[arch]])
    predicted = _lm_plan(arch, activations, "sdpa")
    measured = _lm_run(arch, activations, "sdpa")
    assert predicted.recomputed_blocks_per_step == 2  # two layers, one forward a step
    assert [step["recomputed_blocks"] for step in measured] == [2, 2]
    assert predicted.activation_d2h_bytes_per_step == 0


def _stack_plan(budget: int) -> Plan:
    with torch.device("meta"):
        model = Stack()
    x = torch.zeros(BATCH, WIDTH)
    plugin = _plugin(_auto(), budget, chunk_size=8_000)
    return plan(model, plugin, {"x": x}, optimizer=_adamw, device="cpu", steps=2)


@pytest.mark.slow
def test_auto_saved_bytes_per_call_and_the_minimum_budget_equal_a_runs() -> None:
    roomy = 10_000_000
    predicted = _stack_plan(roomy)
    run = _train(roomy, _auto())
    assert [c.how for c in predicted.activation_calls] == [BlockPlacement.AUTO] * 4
    assert tuple(c.saved_bytes for c in predicted.activation_calls) == run["plan"].saved_bytes
    # The first step offloads every auto call while measuring it: its copies are the planned ones.
    assert run["after_first"].activation_d2h_bytes == sum(c.offload_bytes for c in predicted.activation_calls) > 0
    minimum = predicted.activation_min_device_budget
    assert minimum is not None and predicted.fits
    # A real run below the predicted minimum is refused naming it; the plan says it does not fit.
    with pytest.raises(BudgetTooSmallError) as refused:
        _train(minimum - 1, _auto())
    assert refused.value.minimum == minimum
    tight = _stack_plan(minimum - 1)
    assert not tight.fits and f"at least {minimum}" in tight.why_not
    # The choice, from the planned bytes and timings a meta run cannot know: with room for every
    # call, every call is kept.
    choice = predicted.auto_choice([1e-3] * 4, CopyRates(to_host=1e9, to_device=1e9, overlap=True))
    assert choice.choices == (ActivationChoice.KEEP,) * 4


@pytest.mark.slow
def test_the_cli_plans_named_blocks_and_refuses_what_it_cannot_mean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan_cli = importlib.import_module("chunkmem.plan_command")
    small = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 3, "n_head": 2, "n_positions": 64}
    (tmp_path / "small.json").write_text(json.dumps(small))
    base = ["--hf-config", str(tmp_path / "small.json"), "--batch", "1x8", "--device", "cpu", "--precision", "fp32"]
    offloaded = plan_cli.main([*base, "--activations", "offload=GPT2Block"])
    table = capsys.readouterr().out
    assert [c.how for c in offloaded.activation_calls] == [BlockPlacement.OFFLOAD] * 3
    assert "blocks transformer.h.0 .. transformer.h.2 (3 calls), offload" in table
    auto = plan_cli.main([*base, "--device-budget", "64MiB", "--activations", "auto=GPT2Block", "--json"])
    shown = json.loads(capsys.readouterr().out)
    assert shown["activation_min_device_budget"] == auto.activation_min_device_budget > 0
    assert [c["how"] for c in shown["activation_calls"]] == ["auto"] * 3
    refusals = {
        "keep": (["--activations", "keep=GPT2Block"], "HOW one of recompute, offload, auto"),
        "no class": (["--activations", "offload="], "argument --activations"),
        "absent": (["--activations", "offload=LlamaDecoderLayer"], "no module of the model is one"),
        "auto without a budget": (["--activations", "auto=GPT2Block"], "device_budget"),
    }
    for name, (argv, message) in refusals.items():
        with pytest.raises(SystemExit) as exit_:
            plan_cli.main([*base, *argv])
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_.value.code == 2 and last.startswith("python -m chunkmem.plan_command: error:"), (name, last)
        assert message in last, (name, last)


class Tricky(torch.nn.Module):
    """What a saved-tensor count can get wrong: views of an activation and of a parameter, one
    tensor saved twice, parameters saved by ops, and temporaries freed once saved (an offload
    keeps a copy), whose storages the next ones may take the place of."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(WIDTH, WIDTH)  # saves its input and (model memory) its weight
        self.scale = torch.nn.Parameter(torch.ones(WIDTH))
        self.proj = torch.nn.Parameter(torch.eye(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        a = h.t() @ h  # a view of h and h: one storage
        s = h * self.scale  # h again, and a parameter
        y = s @ self.proj.t()  # s, and a view of a parameter
        out = x + y * y + a.mean()  # y twice
        for i in range(3):
            out = out + torch.sin(s * (i + 2))  # a temporary, freed once saved
        return out


class TrickyStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Tricky() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@pytest.mark.parametrize("how", ["auto", "offload"])
def test_the_planned_saved_bytes_are_a_runs_with_views_double_saves_and_saved_parameters(how: str) -> None:
    rows = 64
    per_call = 7 * rows * WIDTH * 4  # x, h, s, y and the three temporaries
    activations = ActivationPlacement(**{how: ["Tricky"]})
    with torch.device("meta"):
        meta = TrickyStack()
    x = torch.randn(rows, WIDTH)
    predicted = plan(meta, _plugin(activations, 10_000_000), {"x": x}, optimizer=_adamw, device="cpu", steps=2)
    assert [(c.saved_bytes, c.offload_bytes) for c in predicted.activation_calls] == [(per_call, per_call)] * 2
    model = TrickyStack()
    booster = Booster(_plugin(activations, 10_000_000))
    chunked, optimizer, *_ = booster.boost(model, _adamw(model.parameters()))
    for _ in range(2):
        booster.backward(chunked(x), optimizer)
    stats = chunked.stats()
    if how == "auto":
        assert chunked.activation_plan.saved_bytes == (per_call,) * 2  # measured in the first step
        assert stats.activation_d2h_bytes == 2 * per_call  # the first step's copies (then all kept)
    else:
        assert stats.activation_d2h_bytes == 2 * 2 * per_call
