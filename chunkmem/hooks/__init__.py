"""Generic parameter-op hooks over torch: a parameter subclass whose ops call hooks, autograd
bridges so the same hooks fire around backward, and the ways to install hooks (bound to parameters,
or for a region). Knows nothing about chunks."""

from .bridges import OpBackward, PreForwardPostBackward
from .hook import ParamOpHook, bind, bound_hooks, hooks_for, param_op_hooks, unbind
from .param import HookedParameter, ValueCopy, to_hooked, to_plain, unhooked

__all__ = [
    "HookedParameter",
    "OpBackward",
    "ParamOpHook",
    "PreForwardPostBackward",
    "ValueCopy",
    "bind",
    "bound_hooks",
    "hooks_for",
    "param_op_hooks",
    "to_hooked",
    "to_plain",
    "unbind",
    "unhooked",
]
