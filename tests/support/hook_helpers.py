"""Shared helpers for the ``hooks`` tests (``test_hooks.py`` and ``test_hooks_backward.py``):
``Recorder`` logs every hook call, ``Gather`` and ``FreeStorage`` emulate a chunk gathered before
and released after each op, ``TiedLM`` is a small model with a tied output projection, plus
helpers to hook a module's parameters, make an unhooked reference copy, compare gradients and
watch an op's autograd node. ``_seed_and_no_leftover_region`` is an autouse fixture: each test
module imports it so that it applies there."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from chunkmem.hooks import ParamOpHook, to_hooked, unhooked
from chunkmem.hooks import hook as hook_module

Event = tuple[Any, ...]


class Recorder(ParamOpHook):
    """Records every call as ``(kind, param names)``; ``log`` may be shared with other recorders
    or with autograd node hooks to check relative ordering."""

    def __init__(self, names: dict[int, str], log: list[Event] | None = None, tag: str = "") -> None:
        self.names = names
        self.events: list[Event] = [] if log is None else log
        self.tag = tag

    def _ev(self, kind: str, params: Sequence[torch.Tensor], *extra: Any) -> None:
        names = tuple(self.names.get(id(p), "?") for p in params)
        event: Event = (kind, names, *extra)
        if self.tag:
            event = (self.tag, *event)
        self.events.append(event)

    def pre_op(self, params: Sequence[torch.Tensor]) -> None:
        self._ev("pre_op", params)

    def post_op(self, params: Sequence[torch.Tensor]) -> None:
        self._ev("post_op", params)

    def pre_backward(self, params: Sequence[torch.Tensor]) -> None:
        self._ev("pre_backward", params)

    def post_backward(self, params: Sequence[torch.Tensor]) -> None:
        self._ev("post_backward", params)

    def mutating_op(self, params: Sequence[torch.Tensor], op_name: str) -> None:
        self._ev("mutating_op", params, op_name)

    def kinds(self, kind: str) -> list[tuple[str, ...]]:
        return [e[1] for e in self.events if e[0] == kind]


class Gather(ParamOpHook):
    """Emulates a chunk gather/release: the real values live in a side dict; between ops each
    parameter holds a NaN placeholder of the same shape, swapped back in by pre_op/pre_backward."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        self.real: dict[int, torch.Tensor] = {}
        self.params = list(params)
        with unhooked():
            for p in self.params:
                self.real[id(p)] = p.data
        self.release(self.params)

    def gather(self, params: Sequence[torch.Tensor]) -> None:
        with unhooked():
            for p in params:
                p.data = self.real[id(p)]

    def release(self, params: Sequence[torch.Tensor]) -> None:
        with unhooked():
            for p in params:
                real = self.real[id(p)]
                p.data = torch.full((1,), float("nan"), dtype=real.dtype).expand(real.shape)

    def pre_op(self, params: Sequence[torch.Tensor]) -> None:
        self.gather(params)

    def post_op(self, params: Sequence[torch.Tensor]) -> None:
        self.release(params)

    def pre_backward(self, params: Sequence[torch.Tensor]) -> None:
        self.gather(params)

    def post_backward(self, params: Sequence[torch.Tensor]) -> None:
        self.release(params)

    def all_released(self) -> bool:
        with unhooked():
            return all(bool(torch.isnan(p.data).all()) and p.data.stride() == (0,) * p.dim() for p in self.params)


class FreeStorage(ParamOpHook):
    """A stricter gather emulation, like a chunk whose storage is freed: between ops each
    parameter's storage is resized to zero bytes (so tensors the op's backward saved, which alias
    it, are unreadable too) and refilled by pre_op/pre_backward. Reference counted, since the ops
    sharing a parameter may interleave in backward."""

    def __init__(self, params: Iterable[nn.Parameter], gather_in_backward: bool = True) -> None:
        self.params = list(params)
        with unhooked():
            self.real = {id(p): p.data.clone() for p in self.params}
            self.nbytes = {id(p): p.data.untyped_storage().nbytes() for p in self.params}
            for p in self.params:
                p.data.untyped_storage().resize_(0)
        self.users = dict.fromkeys(self.real, 0)
        self.gather_in_backward = gather_in_backward

    def gather(self, params: Sequence[torch.Tensor]) -> None:
        with unhooked():
            for p in params:
                if self.users[id(p)] == 0:
                    p.data.untyped_storage().resize_(self.nbytes[id(p)])
                    p.data.copy_(self.real[id(p)])
                self.users[id(p)] += 1

    def release(self, params: Sequence[torch.Tensor]) -> None:
        with unhooked():
            for p in params:
                self.users[id(p)] -= 1
                if self.users[id(p)] == 0:
                    p.data.untyped_storage().resize_(0)

    def pre_op(self, params: Sequence[torch.Tensor]) -> None:
        self.gather(params)

    def post_op(self, params: Sequence[torch.Tensor]) -> None:
        self.release(params)

    def pre_backward(self, params: Sequence[torch.Tensor]) -> None:
        if self.gather_in_backward:
            self.gather(params)

    def post_backward(self, params: Sequence[torch.Tensor]) -> None:
        if self.gather_in_backward:
            self.release(params)

    def all_released(self) -> bool:
        with unhooked():
            return all(p.data.untyped_storage().nbytes() == 0 for p in self.params)


def hook_params(module: nn.Module) -> dict[int, str]:
    """Turn the module's parameters into HookedParameters; return ``id -> qualified name``."""
    names = {id(p): n for n, p in module.named_parameters()}
    to_hooked(module.parameters())
    return names


def clones(module: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(module to hook, an identical unhooked reference)."""
    return module, copy.deepcopy(module)


def assert_grads_equal(model: nn.Module, ref: nn.Module) -> None:
    got = dict(model.named_parameters())
    for name, p_ref in ref.named_parameters():
        p = got[name]
        assert (p.grad is None) == (p_ref.grad is None), name
        if p_ref.grad is not None:
            assert torch.equal(p.grad, p_ref.grad), name


def op_node(out: torch.Tensor) -> Any:
    """The autograd node of the hooked op that produced ``out`` (outputs are not wrapped: the
    bridge hooks the op's own node)."""
    assert out.grad_fn is not None
    return out.grad_fn


def watch_node(node: Any, log: list[Event], label: str) -> None:
    """Record when ``node``'s own backward starts and ends."""
    node.register_prehook(lambda grad_outputs: log.append(("op_backward_begin", label)))
    node.register_hook(lambda grad_inputs, grad_outputs: log.append(("op_backward_end", label)))


class TiedLM(nn.Module):
    """Embedding -> LayerNorm -> Linear -> GELU -> Linear -> tied output projection, by default
    ``h @ emb.weight.T`` (``tie="linear"``: ``F.linear(h, emb.weight)``)."""

    def __init__(self, vocab: int = 11, dim: int = 8, ckpt: bool | None = None, tie: str = "T") -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.ln = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.ckpt = ckpt  # None: no checkpointing; else use_reentrant
        self.tie = tie

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(self.ln(h))))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = self.block(h) if self.ckpt is None else checkpoint(self.block, h, use_reentrant=self.ckpt)
        return h @ self.emb.weight.T if self.tie == "T" else F.linear(h, self.emb.weight)


@pytest.fixture(autouse=True)
def _seed_and_no_leftover_region() -> Iterable[None]:
    torch.manual_seed(0)
    yield
    assert hook_module._region == [], "a region hook leaked out of its block"
