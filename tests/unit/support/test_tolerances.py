"""The premise of ``models.reordered``, checked in plain PyTorch where the tests compute: an element
whose exact gradient is zero (GPT-2's key biases) gets only rounding noise below
``ZERO_GRADIENT_NOISE``, and two orders of summing the same gradients move it apart by at most
``2*k*lr*n/eps`` over k AdamW steps, while every other element stays far closer."""

from __future__ import annotations

import copy

import torch
from support.models import (
    ZERO_GRADIENT_NOISE,
    adamw_two_groups,
    as_reference,
    batches,
    gpt2,
    lm_loss,
    zero_gradient_part,
)

LR, EPS = 1e-3, 1e-8  # adamw_two_groups's


def _train(model: torch.nn.Module, data: list[torch.Tensor], halves: bool) -> float:
    """AdamW steps on each batch whole, or on its two halves with their gradients summed and
    halved (what two ranks do); returns the largest key-bias gradient seen."""
    optimizer = adamw_two_groups(model, lr=LR)
    params = list(model.parameters())
    noise = 0.0
    for ids in data:
        if halves:
            summed = [torch.zeros_like(p) for p in params]
            for part in ids.chunk(2):
                lm_loss(model, part).backward()
                for total, p in zip(summed, params, strict=True):
                    total.add_(p.grad)
                    p.grad = None
            for total, p in zip(summed, params, strict=True):
                p.grad = total / 2
        else:
            lm_loss(model, ids).backward()
        for name, p in model.named_parameters():
            part = zero_gradient_part(name, p)
            if part is not None:
                noise = max(noise, p.grad[part].abs().max().item())
        optimizer.step()
        optimizer.zero_grad()
    return noise


def test_a_zero_gradient_moves_by_noise_that_adam_bounds() -> None:
    steps = 3
    data = batches(steps)
    whole = as_reference(gpt2(n_layer=1))
    split = copy.deepcopy(whole)
    noise = max(_train(whole, data, halves=False), _train(split, data, halves=True))
    assert 0 < noise <= ZERO_GRADIENT_NOISE
    bound = 2 * steps * LR * noise / EPS
    for (name, a), b in zip(whole.named_parameters(), split.parameters(), strict=True):
        apart = (a - b).abs().detach().cpu()
        part = zero_gradient_part(name, a)
        if part is not None:
            assert apart[part].max() <= bound, name
            apart = torch.cat([apart[: part.start], apart[part.stop :]])
        assert apart.max() <= 1e-6, name  # everything with a real gradient: far inside every test's tolerance
