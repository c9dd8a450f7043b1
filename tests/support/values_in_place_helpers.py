"""Pieces of ``integration/tiers/test_values_in_place.py`` that other tests use too."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

WIDTH = 64


CHUNK = WIDTH * WIDTH  # every base weight fills a chunk, the four adapter matrices another: no padding


BASE = ("embed.weight", "layers.0.weight", "layers.1.weight", "head.weight")


class Tiny(torch.nn.Module):
    """A LoRA-style model: a frozen base (embedding, two layers, head) and a low-rank adapter per
    layer, called as transformers models are (``input_ids``, ``labels``, ``.loss``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(WIDTH, WIDTH)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(2))
        self.down = torch.nn.ModuleList(torch.nn.Linear(WIDTH, 16, bias=False) for _ in range(2))
        self.up = torch.nn.ModuleList(torch.nn.Linear(16, WIDTH, bias=False) for _ in range(2))
        self.head = torch.nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        h = self.embed(input_ids % WIDTH)
        for layer, down, up in zip(self.layers, self.down, self.up, strict=True):
            h = torch.tanh(layer(h) + up(down(h)))
        logits = self.head(h).float()
        return SimpleNamespace(loss=F.cross_entropy(logits.flatten(0, 1), (labels % WIDTH).flatten()))


def tiny(base_dtype: torch.dtype = torch.bfloat16) -> Tiny:
    """Seeded values; the base frozen in ``base_dtype`` (its values rounded to bf16 either way)."""
    torch.manual_seed(0)
    model = Tiny()
    for name, p in model.named_parameters():
        if name in BASE:
            p.requires_grad_(False)
            p.data = p.data.to(torch.bfloat16).to(base_dtype)
    return model


def write_weights(out: Path, dtype: torch.dtype) -> Path:
    """The model's safetensors file, its base stored in ``dtype``."""
    path = out / f"{str(dtype).split('.')[-1]}.safetensors"
    save_file({n: p.detach().contiguous() for n, p in tiny(dtype).named_parameters()}, str(path))
    return path
