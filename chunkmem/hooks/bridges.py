"""Autograd bridges: ``pre_backward`` right before an op's backward starts and ``post_backward``
right after all of it ran, once each per backward pass.

* Start: a pre-hook on the autograd node(s) that produced the op's outputs. These run first in
  backward; hooking them (rather than wrapping the outputs in an identity function) leaves the
  outputs ordinary tensors that can still be modified in place (``relu_``, ``+=``).
* End: the op's inputs that need gradients go through an identity function,
  ``PreForwardPostBackward``, whose backward runs once the op's whole backward sub-graph has
  produced their gradients (a composite op such as ``linear`` is several nodes). An input the op
  writes in place cannot be replaced by an alias, so it is not bridged; an op left with no bridged
  input ends with a post-hook on its output node (an in-place op is a single node).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .hook import ParamOpHook

__all__ = ["OpBackward", "PreForwardPostBackward"]


class OpBackward:
    """One op's backward bracket: ``begin`` may be reached from several output nodes but calls
    ``pre_backward`` once; ``end`` calls ``post_backward`` and re-arms for a later backward pass.
    Each hook gets the parameters it saw in forward."""

    __slots__ = ("_calls", "_running")

    def __init__(self, calls: Sequence[tuple[ParamOpHook, tuple[torch.Tensor, ...]]]) -> None:
        self._calls = tuple(calls)
        self._running = False

    def begin(self) -> None:
        """Before the op's backward (from a pre-hook of an output node)."""
        if self._running:
            return
        self._running = True
        for hook, params in self._calls:
            hook.pre_backward(params)

    def end(self) -> None:
        """After the op's backward (from the input bridge, or the output node's post-hook)."""
        self.begin()  # an op whose output nodes did not run still pairs its calls
        self._running = False
        for hook, params in self._calls:
            hook.post_backward(params)

    def hook_outputs(self, outputs: Iterable[Any], end_on_node: bool) -> None:
        """Register ``begin`` on each distinct autograd node among ``outputs`` (and ``end`` after
        it when no input bridge will run it).
        """
        nodes: list[Any] = []
        for out in outputs:
            if isinstance(out, torch.Tensor) and out.grad_fn is not None and not any(out.grad_fn is n for n in nodes):
                nodes.append(out.grad_fn)
        for node in nodes:
            node.register_prehook(lambda grad_outputs: self.begin())
            if end_on_node:
                node.register_hook(lambda grad_inputs, grad_outputs: self.end())


class PreForwardPostBackward(torch.autograd.Function):
    """Identity on the op's inputs; its backward ends the op's backward bracket."""

    @staticmethod
    def forward(ctx: Any, op: OpBackward, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.op = op
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.op.end()
        return (None, *grads)
