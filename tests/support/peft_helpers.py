"""Pieces of ``integration/peft/test_peft.py`` that other tests use too."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from chunkmem import Booster
from support.models import Step, as_reference, batches, device_of, gpt2, optimizer_step_side

RANK, TARGET = 4, "c_attn"  # GPT-2 2x64: c_attn is 64 -> 192


STEPS = 3


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def lora_model(seed: int = 0) -> Any:
    import peft

    config = peft.LoraConfig(r=RANK, lora_alpha=8, target_modules=[TARGET], lora_dropout=0.0, fan_in_fan_out=True)
    model = peft.get_peft_model(gpt2(seed=seed), config)
    # PEFT starts lora_B at zero (the adapter's output is 0): draw it, so that every adapter
    # weight matters from the first step (the same values on both sides: same seed).
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


def plain_peft(
    precision: str,
    data: Sequence[torch.Tensor],
    steps_on: torch.device,
    world_size: int = 1,
    build: Callable[[], torch.nn.Module] = lora_model,
) -> tuple[list[list[float]], Any]:
    """Plain PEFT: each step, every rank's share of the batch through a copy of the model in the
    compute dtype on the device chunkmem computes on, the fp32 gradients of the shares added and
    divided by the world size (as DDP does), AdamW on fp32 adapter masters on ``steps_on`` (where
    chunkmem steps them: a GPU's Adam rounds otherwise than the CPU's), the compute copy refreshed
    from them. Returns each step's per-rank losses and the fp32 model (on ``steps_on``). ``build``
    makes the model (a full fine-tune: one whose parameters all train)."""
    masters = build().to(steps_on)
    trainable = {n: p for n, p in masters.named_parameters() if p.requires_grad}
    compute = as_reference(copy.deepcopy(masters).to(DTYPES[precision]))
    weights = dict(compute.named_parameters())
    optimizer = adamw(masters)
    losses = []
    for ids in data:
        grads: dict[str, torch.Tensor] = {}
        step = []
        for share in ids.chunk(world_size):
            share = share.to(device_of(compute))
            loss = compute(input_ids=share, labels=share).loss
            loss.backward()
            step.append(loss.item())
            for name in trainable:
                g = weights[name].grad.float().to(steps_on)
                grads[name] = g if name not in grads else grads[name] + g
                weights[name].grad = None
        for name, p in trainable.items():
            p.grad = grads[name] / world_size
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for name, p in trainable.items():
                weights[name].copy_(p)
        losses.append(step)
    return losses, masters


def steps_on(chunked: Any) -> torch.device:
    """Where chunkmem's optimizer steps the adapter's fp32 masters."""
    return torch.device("cpu") if optimizer_step_side(chunked) is Step.HOST else chunked.compute_device


def train(chunked: Any, optimizer: Any, booster: Booster, data: Sequence[torch.Tensor], rank: int, world: int) -> list:
    losses = []
    for ids in data:
        share = ids.chunk(world)[rank]
        loss = chunked(input_ids=share, labels=share).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def adapter_files(directory: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    config = json.loads((directory / "adapter_config.json").read_text())
    return {"files": sorted(p.name for p in directory.iterdir()), "config": config}, load_file(
        directory / "adapter_model.safetensors"
    )


def assert_same_adapter(saved: Path, expected: Path) -> None:
    """The files plain PEFT writes, with the same tensors; both load with plain PEFT onto a fresh
    base and give the same outputs."""
    (meta, tensors), (expected_meta, expected_tensors) = adapter_files(saved), adapter_files(expected)
    assert meta == expected_meta
    assert tensors.keys() == expected_tensors.keys()
    for name, value in expected_tensors.items():
        assert torch.equal(tensors[name], value), name
    ids = batches(1, seed=7)[0]
    import peft

    loaded = [peft.PeftModel.from_pretrained(gpt2(), d).eval() for d in (saved, expected)]
    with torch.no_grad():
        assert torch.equal(loaded[0](input_ids=ids).logits, loaded[1](input_ids=ids).logits)


def assert_same_states(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name
