"""``RunStepper``: the user's optimizer object, stepped by chunkmem over runs.

The object the user passed to ``boost`` does every step, on the runs (``chunkmem.optim.runs``) its
param groups hold. Used directly after boosting it would step runs without gradients and silently
do nothing, or save run-shaped state, so it refuses unless chunkmem is the caller. A step over some
runs sets each group's ``params`` to its runs of the step for the call and puts the full lists
back after it; runs whose master is on the device and on the host are stepped in two calls, the
host ones with the kernel ``HostKernels`` picks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from ..device import DeviceLayer
from ..errors import NotSupportedError
from ..usage.accounting import Location
from ..usage.stats import Stats
from .host_kernels import HostKernels
from .runs import Run, StepRuns

__all__ = ["RunStepper"]


class RunStepper:
    """See the module docstring. ``stats`` receives the host step's time."""

    def __init__(self, optimizer: torch.optim.Optimizer, runs: StepRuns, layer: DeviceLayer, stats: Stats) -> None:
        self._optim = optimizer
        self._runs = runs
        self._stats = stats
        self._kernels = HostKernels(type(optimizer), layer)
        self._name = type(optimizer).__name__
        self._inside = 0
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._refuse("step()"))
        optimizer.register_state_dict_pre_hook(lambda opt: self._refuse("state_dict()"))
        optimizer.register_load_state_dict_pre_hook(lambda opt, state: self._refuse("load_state_dict()"))

    @contextmanager
    def inside(self) -> Iterator[None]:
        """chunkmem itself is calling the optimizer."""
        self._inside += 1
        try:
            yield
        finally:
            self._inside -= 1

    def _refuse(self, verb: str) -> None:
        if self._inside:
            return
        raise NotSupportedError(
            f"{verb} on the {self._name} object that was passed to booster.boost: after boosting, that object "
            "steps this rank's shards of the parameters for chunkmem and must not be used directly. Call "
            f"{verb.split('(')[0]}() on the optimizer booster.boost returned (a torch.optim.Optimizer too)."
        )

    def probe_host_kernels(self) -> None:
        """Decide the host kernel of every group with host runs now, not in the first step."""
        for position, group in enumerate(self._optim.param_groups):
            if any(run.location is Location.HOST for run in self._runs.groups[position]):
                self._kernels.fuse(group)

    def step(self, runs: Sequence[Run]) -> None:
        """Run the user's optimizer over ``runs`` (their gradients set): the runs whose master is
        on the device in one call, those on the host in another, each param group holding only
        its runs of that call. A group whose kernel the user left to PyTorch steps its host runs
        with the fastest CPU kernel (``HostKernels``); a single host tensor in a call would turn
        PyTorch's default for the device runs into its per-tensor loop, hence the two calls."""
        groups = self._optim.param_groups
        kept = [(group["params"], group.get("fused")) for group in groups]
        try:
            for location in (Location.DEVICE, Location.HOST):
                subsets: list[list[torch.Tensor]] = [[] for _ in groups]
                for run in runs:
                    if run.location is location:
                        subsets[run.group].append(run.tensor)
                # With nothing to step the optimizer is still called once, as plain PyTorch's
                # would be (LR schedulers and step hooks see the call).
                if not any(subsets) and (runs or location is Location.HOST):
                    continue
                for group, subset, (_, fused) in zip(groups, subsets, kept, strict=True):
                    group["params"] = subset
                    if "fused" in group:
                        group["fused"] = fused
                    if location is Location.HOST and subset and self._kernels.fuse(group):
                        group["fused"] = True
                begin = time.perf_counter()
                with self.inside():
                    self._optim.step()
                if location is Location.HOST and threading.current_thread() is threading.main_thread():
                    self._stats.host_step_seconds += time.perf_counter() - begin
        finally:
            for position, (group, (_, fused)) in enumerate(zip(groups, kept, strict=True)):
                group["params"] = self._runs.tensors(position)
                if "fused" in group:
                    group["fused"] = fused

    def step_with_grads(self, runs: Sequence[Run], grad_shard: Callable[[int], torch.Tensor]) -> None:
        """Step ``runs`` on their slices of the reduced gradient shards (``grad_shard`` of a chunk
        id; each read once)."""
        shards: dict[int, torch.Tensor] = {}
        try:
            for run in runs:
                chunk_id = run.chunk.chunk_id
                if chunk_id not in shards:
                    shards[chunk_id] = grad_shard(chunk_id)
                run.tensor.grad = shards[chunk_id][run.start : run.stop]
            self.step(runs)
        finally:
            for run in runs:
                run.tensor.grad = None
