"""``HostKernels``: which kernel steps the optimizer's runs in host memory.

Plain PyTorch never steps a host tensor for a model on a GPU, so for runs chunkmem keeps on the
host of an accelerator there is no plain-PyTorch choice to follow; what a user's unset ``fused`` /
``foreach`` means there is chunkmem's to decide. On CPU tensors PyTorch's own default is its
per-tensor loop, several times slower than its fused CPU kernel (Adam, AdamW, SGD and Adagrad have
one: on a 2-core machine, one thread, AdamW over 12.6M fp32 parameters took 74 ms with the default
and 16.6 ms fused). So, when the model computes on an accelerator, a param group that leaves both
unset steps its host runs fused, when the optimizer class has a fused CPU kernel for the group's
settings (probed once on a tiny tensor). When the model computes on the CPU, plain PyTorch steps
these very tensors with its CPU default, so that is kept (the results stay plain PyTorch's bit for
bit). The simulated asynchronous device (``chunkmem.device.simulated``) stands for a GPU: its host
runs take the kernel they take there. An explicit ``fused`` or ``foreach`` is the user's choice and
is kept everywhere, as are the device runs' defaults.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from ..device import DeviceLayer

__all__ = ["HostKernels"]


class HostKernels:
    """The kernel decision for one optimizer class; see the module docstring."""

    def __init__(self, cls: type[torch.optim.Optimizer], layer: DeviceLayer) -> None:
        self._cls = cls
        self._decide = self.decides(layer)
        self._accepted = frozenset(inspect.signature(cls.__init__).parameters)
        self._probed: dict[str, bool] = {}

    @staticmethod
    def decides(layer: DeviceLayer) -> bool:
        """Whether the host runs' kernel is chunkmem's to pick: the model computes apart from the
        host (an accelerator, or the simulated device standing for one). On the CPU itself the host
        runs are what plain PyTorch steps with its own default."""
        return layer.device.type != "cpu" or layer.asynchronous

    def fuse(self, group: Mapping[str, Any]) -> bool:
        """Whether to step this group's host runs with the fused kernel."""
        if not self._decide or "fused" not in group:
            return False
        if group.get("fused") is not None or group.get("foreach") is not None or group.get("differentiable"):
            return False
        settings = {k: v for k, v in group.items() if k != "params" and k in self._accepted}
        key = repr(sorted((k, v) for k, v in settings.items() if k not in ("lr", "fused", "foreach")))
        known = self._probed.get(key)
        if known is None:
            known = self._probed[key] = self._fused_works(settings)
        return known

    def _fused_works(self, settings: Mapping[str, Any]) -> bool:
        """One fused step on a tiny CPU tensor: some classes or settings have no fused CPU kernel
        in some PyTorch versions, and they say so by raising."""
        probe = torch.zeros(4, requires_grad=True)
        try:
            trial = self._cls([probe], **{**settings, "fused": True, "foreach": None})
            probe.grad = torch.full_like(probe, 1e-3)
            trial.step()
        except (RuntimeError, ValueError, TypeError, NotImplementedError):
            return False
        return True
