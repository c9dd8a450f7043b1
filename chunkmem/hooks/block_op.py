"""``BlockOp``: a module's whole call run as one op of its hooked parameters, the module seeing
plain tensors in their place (what a compiled region needs: no tensor subclass and no hook inside).

One call:

* ``pre_op`` of every hook of the module's hooked parameters, once, with all of them (the hooks make
  every parameter hold its data: for the chunk runtime, every chunk the module reads is gathered and
  waited on);
* each hooked parameter is stood in for, in the module and its submodules, by a plain tensor that
  aliases the storage it points at then (``.data``): a frozen one (or under ``no_grad``) as it is, a
  trainable one as the output of ``PlainAliases``, whose backward hands the alias's gradient to the
  hooked parameter, so its own gradient path (``.grad`` accumulation and its hooks) runs as for an op
  on it;
* the callable runs; the hooked parameters go back in its place (also when it raised), then
  ``post_op``.

Backward is bracketed as one op's (``bridges``): ``pre_backward`` from a pre-hook on the output nodes
(before the call's whole backward: the hooks gather again what it reads), ``post_backward`` from
``PlainAliases`` once that backward produced every gradient it feeds; inputs that need gradients go
through it too, so a module of frozen parameters is bracketed as well.

The aliases alias the storage the parameters point at during the call. Whatever the call saves for
backward (a compiled graph's saved tensors included) therefore reads that storage in backward: a hook
that frees a parameter's storage between uses must bring the values back into the same storage
(resize it, as the chunk runtime does), not point the parameter elsewhere.

An in-place write into a parameter inside the call cannot be seen before it happens (the callable
sees plain tensors): it is found after the call by the aliases' version counters and each hook is
asked (``ParamOpHook.mutating_op``), as for an in-place op on the parameter. Outputs that alias a
parameter's storage come back as ``ValueCopy`` copies, as an op's do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..compat.torch import disable_torch_function_subclass, set_parameter_entry, tree_flatten, tree_unflatten, version
from .bridges import OpBackward
from .hook import hooks_for
from .param import HookedParameter, _unalias

__all__ = ["BlockOp", "PlainAliases"]


class PlainAliases(torch.autograd.Function):
    """Plain aliases of ``count`` hooked parameters (their storage as it is now), then the other
    tensors as they are. Backward hands each alias's gradient to its parameter and the others' to
    theirs, and ends ``op``'s backward bracket (``None``: no bracket, gradients only)."""

    @staticmethod
    def forward(ctx: Any, op: OpBackward | None, count: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.op = op
        return (*(t.data for t in tensors[:count]), *tensors[count:])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        if ctx.op is not None:
            ctx.op.end()
        return (None, None, *grads)


class BlockOp:
    """Calls of one module as single ops of its hooked parameters; see the module docstring. The
    parameters are the module's (and its submodules') when it is built: parameters replaced later
    are not seen."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._name = type(module).__name__
        # Every place a hooked parameter sits in (a tied parameter sits in several), and each once.
        self._slots: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
        params: dict[int, torch.Tensor] = {}
        for sub in module.modules():
            for name, p in sub.named_parameters(recurse=False, remove_duplicate=False):
                if isinstance(p, HookedParameter):
                    self._slots.append((sub, name, p))
                    params.setdefault(id(p), p)
        self._params = list(params.values())

    @property
    def params(self) -> list[torch.Tensor]:
        """The module's hooked parameters, each once."""
        return list(self._params)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)`` as one op of the module's hooked parameters, with plain aliases
        in their place in the module."""
        params = self._params
        calls = hooks_for(params)
        observing = tuple(call for call in calls if call[0].observes_ops)
        leaves, spec = tree_flatten((args, kwargs))
        grad = torch.is_grad_enabled()
        with disable_torch_function_subclass():
            trainable = [p for p in params if p.requires_grad] if grad else []
            needs = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
            inputs = needs if grad else []
        # Backward reads the parameters in the reverse order of the forward (the last layer's first): the
        # hooks see them so, as they see the ops of an eager backward.
        op = OpBackward([(h, seen[::-1]) for h, seen in observing]) if observing and (trainable or inputs) else None
        bridged = inputs if op is not None else []
        for hook, seen in observing:
            hook.pre_op(seen)
        try:
            with disable_torch_function_subclass():
                aliases = {id(p): p.data for p in params}
                if trainable or bridged:
                    out = PlainAliases.apply(op, len(trainable), *trainable, *(leaves[i] for i in bridged))
                    aliases.update((id(p), alias) for p, alias in zip(trainable, out[: len(trainable)], strict=True))
                    for i, alias in zip(bridged, out[len(trainable) :], strict=True):
                        leaves[i] = alias
                    if bridged:
                        args, kwargs = tree_unflatten(leaves, spec)
                versions = [(p, aliases[id(p)], version(aliases[id(p)])) for p in params]
            for sub, name, p in self._slots:
                set_parameter_entry(sub, name, aliases[id(p)])  # torch.func.functional_call swaps the same entries
            try:
                result = fn(*args, **kwargs)
            finally:
                for sub, name, p in self._slots:
                    set_parameter_entry(sub, name, p)
            self._refuse_writes(calls, [p for p, alias, before in versions if version(alias) != before])
            out_leaves, out_spec = tree_flatten(result)
            with disable_torch_function_subclass():
                if _unalias(out_leaves, params):
                    result = tree_unflatten(out_leaves, out_spec)
        finally:
            for hook, seen in observing:
                hook.post_op(seen)
        if op is not None:
            op.hook_outputs(out_leaves, end_on_node=not (trainable or bridged))
        return result

    def _refuse_writes(self, calls: Any, written: list[torch.Tensor]) -> None:
        """Ask each hook about the parameters the call wrote into in place."""
        if not written:
            return
        what = f"an in-place write inside a call of {self._name} (run as one op of its parameters)"
        with disable_torch_function_subclass():
            for hook, seen in calls:
                mutated = [p for p in written if any(p is s for s in seen)]
                if mutated:
                    hook.mutating_op(mutated, what)
