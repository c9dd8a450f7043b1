"""``RepeatedBlocks()``: the model's repeated blocks found without naming their class. It finds the
class a user would name (GPT-2's ``GPT2Block``, LLaMA's ``LlamaDecoderLayer``, a stack's own
``Block``), refuses a model without one (naming what it looked at and the fix), is reported
(``model.activation_placement``, the plan), trains bit for bit as the named class, is the same on
every rank (a rank whose model finds another class raises on every rank), and the planner's CLI
takes it (``--activations auto=@repeated``)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from support.activation_budget_helpers import Block, Stack, _data, _loss, _model_minimum
from support.distributed import run_ranks
from support.models import adamw_two_groups, boost, gpt2, llama
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from chunkmem import NotSupportedError
from chunkmem.activations import detect_repeated_block
from chunkmem.placement import ActivationPlacement, BlockPlacement, RepeatedBlocks, StaticPlacementConfig


@pytest.mark.parametrize(
    ("build", "expected", "count"),
    [
        (lambda: gpt2(n_layer=3), GPT2Block, 3),
        (lambda: llama(n_layer=2), LlamaDecoderLayer, 2),
        (Stack, Block, 4),
    ],
    ids=["gpt2", "llama", "stack"],
)
def test_the_repeated_block_found_is_the_class_a_user_would_name(build: Any, expected: type, count: int) -> None:
    with torch.device("meta"):
        model = build()
    found = detect_repeated_block(model, RepeatedBlocks())
    assert found.cls is expected and found.count == count
    per_block = sum(p.numel() for p in next(m for m in model.modules() if type(m) is expected).parameters())
    assert found.parameters == count * per_block
    assert found.share == found.parameters / sum(p.numel() for p in model.parameters())


class Nested(torch.nn.Module):
    """Blocks that are ``nn.Sequential`` of two linears, in a ``ModuleList``: the linears hold as many
    parameters as the blocks; the blocks (fewer, larger) are the repeated layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)) for _ in range(3)
        )


def test_of_equal_parameters_the_fewer_larger_instances_are_the_block() -> None:
    found = detect_repeated_block(Nested(), RepeatedBlocks())
    assert found.cls is torch.nn.Sequential and found.count == 3


class Single(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block()])
        self.head = torch.nn.Linear(4, 4)


def test_a_model_without_repeated_blocks_is_refused_naming_what_was_looked_at_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"found no repeated block in Single.*layers \(ModuleList of 1\).*Block x1"):
        detect_repeated_block(Single(), RepeatedBlocks())
    with pytest.raises(ValueError, match=r"Name the block class instead"):
        boost(Single(), adamw_two_groups, activations=ActivationPlacement(offload=[RepeatedBlocks()]))
    assert detect_repeated_block(Single(), RepeatedBlocks(min_count=1)).cls is Block
    with pytest.raises(ValueError, match=r"holds no nn\.ModuleList, nn\.Sequential or nn\.ModuleDict"):
        detect_repeated_block(torch.nn.Linear(4, 4), RepeatedBlocks())


def test_the_marker_is_one_choice_like_a_class() -> None:
    with pytest.raises(ValueError, match="both name"):
        ActivationPlacement(offload=[RepeatedBlocks()], recompute=[RepeatedBlocks()])
    config = ActivationPlacement(auto=[RepeatedBlocks()], max_prefetch=2)
    assert config.repeated == RepeatedBlocks()
    resolved = config.resolved(Block)
    assert resolved.auto == (Block,) and resolved.max_prefetch == 2 and resolved.repeated is None


def _trained(activations: ActivationPlacement, budget: int | None) -> dict[str, Any]:
    chunked, optimizer, booster = boost(
        Stack(),
        adamw_two_groups,
        chunk_size=8_000,
        placement=StaticPlacementConfig(device_budget=budget),
        activations=activations,
    )
    for x in _data()[:2]:
        booster.backward(_loss(chunked, x), optimizer)
        optimizer.step()
        optimizer.zero_grad()
    stats = chunked.stats()
    return {
        "state": chunked.state_dict(),
        "placement": chunked.activation_placement,
        "plan": chunked.activation_plan,
        "copied": (stats.activation_d2h_bytes, stats.activation_h2d_bytes),
    }


@pytest.mark.slow  # about 3 s: two boosts and two steps of each
@pytest.mark.parametrize("how", ["offload", "auto"])
def test_training_with_the_found_blocks_equals_training_with_the_named_class_bit_for_bit(how: str) -> None:
    # auto: room for every call (a tighter plan's choice rests on measured times, which vary between runs)
    budget = _model_minimum() + 5 * 512 * 4 * (32 + 3 * 64) if how == "auto" else None
    found = _trained(ActivationPlacement(**{how: [RepeatedBlocks()]}), budget)
    named = _trained(ActivationPlacement(**{how: ["Block"]}), budget)
    assert getattr(found["placement"], how) == (Block,)
    assert found["copied"] == named["copied"] and found["copied"][0] > 0
    assert found["plan"] == named["plan"]
    for key, value in named["state"].items():
        assert torch.equal(found["state"][key], value), key


class Other(Block):
    """Rank 1's blocks: another class (a model that differs between ranks)."""


def _different_models(rank: int, world_size: int) -> str:
    model = Stack()
    if rank == 1:
        model.blocks = torch.nn.ModuleList(Other() for _ in model.blocks)
        model.blocks.load_state_dict(Stack().blocks.state_dict())
    with pytest.raises(NotSupportedError) as refused:
        boost(model, adamw_two_groups, chunk_size=8_000, activations=ActivationPlacement(offload=[RepeatedBlocks()]))
    return str(refused.value)


@pytest.mark.slow
@pytest.mark.multirank
def test_ranks_whose_models_find_different_blocks_raise_on_every_rank() -> None:
    first, second = run_ranks(_different_models, 2)
    assert first == second
    assert "rank 0: support.activation_budget_helpers.Block x4; rank 1: test_repeated_blocks.Other x4" in first


@pytest.mark.slow
def test_the_cli_and_the_plan_take_the_repeated_blocks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_cli = importlib.import_module("chunkmem.plan_command")
    small = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 3, "n_head": 2, "n_positions": 64}
    (tmp_path / "small.json").write_text(json.dumps(small))
    base = ["--hf-config", str(tmp_path / "small.json"), "--batch", "1x8", "--device", "cpu", "--precision", "fp32"]
    named = plan_cli.main([*base, "--device-budget", "64MiB", "--activations", "auto=GPT2Block", "--json"])
    capsys.readouterr()
    found = plan_cli.main([*base, "--device-budget", "64MiB", "--activations", "auto=@repeated"])
    table = capsys.readouterr().out
    assert found.activation_calls == named.activation_calls
    assert [c.how for c in found.activation_calls] == [BlockPlacement.AUTO] * 3
    assert found.activation_min_device_budget == named.activation_min_device_budget
    assert named.repeated_block is None
    assert found.repeated_block is not None and "GPT2Block (3 instances" in found.repeated_block
    assert "repeated block (RepeatedBlocks)" in table and "GPT2Block (3 instances" in table
