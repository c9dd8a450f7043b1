"""``ActivationBlocks``: the blocks an ``ActivationPlacement`` names, run so that what autograd
saves in them is recomputed or offloaded, or, for ``auto`` blocks, placed under the device budget
(``AutoBlocks``).

Each matched block's ``forward`` is replaced, on the instance, by one that runs the class's own
under ``torch.utils.checkpoint`` (recompute), under the offload's saved-tensor hooks (offload), or
as the auto plan says (auto);
``detached()`` takes the replacements away (a deep copy of the module must not carry them).

Double checkpointing is refused: a recomputed or offloaded block that runs inside a checkpointed
region (Hugging Face's ``gradient_checkpointing_enable()``, or the user's own
``torch.utils.checkpoint`` around it) raises, naming the block and the two ways out. A checkpoint
the user put inside a block's forward is left alone: in a recomputed block it nests (PyTorch
supports nested non-reentrant checkpoints), in an offloaded block what it saves (its inputs) goes
through its own hooks and stays on the device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from chunkmem.placement import (
    ActivationPlacement,
    ActivationPlan,
    BlockPlacement,
    HostRoom,
    PlacementPolicy,
    block_class_name,
    matches_block,
)

from ..compat.torch import is_checkpoint_hook
from ..errors import NotSupportedError
from ..ranks.comm import Communicator
from ..ranks.local_failures import LocalFailures
from ..tiers.transfers import HostTransfers
from ..usage.accounting import MemoryLedger
from ..usage.saved import SEES_HOOKS, top_hooks
from ..usage.stats import Stats
from .auto import AutoBlocks
from .caching import holds_cache, refuse_cache, without_cache
from .disk import ActivationDisk
from .ledger import DeviceActivations
from .meter import SavedMeter
from .offload import ActivationOffload
from .outside import OutsideStretches

__all__ = ["ActivationBlocks", "DeviceBudget"]


class DeviceBudget(NamedTuple):
    """What ``auto`` blocks are placed under: the ledger their saved activations are accounted in,
    the room the runtime makes (``room(nbytes)``: the budget's free bytes then), and the policy
    whose ``device_budget`` it is."""

    ledger: MemoryLedger
    room: Callable[[int], int | None]
    policy: PlacementPolicy


SEES_CHECKPOINTS = SEES_HOOKS
"""Whether this PyTorch lets a block see that it runs inside a ``torch.utils.checkpoint`` (2.8 and
later); before, only a Hugging Face model's own ``gradient_checkpointing`` flag is seen, and a
checkpoint of the user's own around a placed block is not refused (it recomputes the block again,
which costs time and gives the same values)."""


def _in_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are those of a non-reentrant checkpoint."""
    top = top_hooks()
    return top is not None and is_checkpoint_hook(top[0])


def _refuse_double_checkpointing(name: str, how: str) -> None:
    raise NotSupportedError(
        f"block {name} is {how} by ActivationPlacement, but it runs inside an activation checkpoint already "
        f"(model.gradient_checkpointing_enable() or your own torch.utils.checkpoint around it): that would "
        "checkpoint it twice. Either drop the block's class from ActivationPlacement, or turn your checkpointing "
        "off (model.gradient_checkpointing_disable()) and name the class in ActivationPlacement(recompute=[...])."
    )


class ActivationBlocks:
    """The named blocks of one model and how each runs; see the module docstring. ``budget`` is what
    ``auto`` blocks are placed under."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: ActivationPlacement,
        comm: Communicator,
        stats: Stats,
        budget: DeviceBudget | None = None,
        ledger: MemoryLedger | None = None,
        disk_dir: str | None = None,
        failures: LocalFailures | None = None,
        *,
        meter: SavedMeter | None = None,
    ) -> None:
        """``ledger``: the model's, where a ``host_budget``'s bytes are accounted; ``disk_dir``:
        where what exceeds it goes (checked by the plugin's backing); ``failures``: the model's,
        where a read back from there that failed waits for the ranks' agreement; ``meter``: the
        model's, which counts what the ``offload`` blocks leave on the device and fetch back."""
        self._stats = stats
        self._config = config
        layer = comm.layer
        # The copies count apart from chunk traffic (``counts``).
        self._copies = Stats()
        self._transfers = HostTransfers(self._copies, layer)
        self._disk: ActivationDisk | None = None
        if config.host_budget is not None:
            assert ledger is not None and disk_dir is not None and failures is not None, "a host budget's parts"
            room = HostRoom(int(config.host_budget))
            self._disk = ActivationDisk(room, disk_dir, comm, ledger, self._transfers, failures)
        self._offload = ActivationOffload(
            self._transfers, layer.device, config.max_prefetch, config.min_offload_bytes, disk=self._disk, meter=meter
        )
        self._offloads = [self._offload]  # the auto blocks' too (one host budget)
        self._auto: AutoBlocks | None = None
        self._account: DeviceActivations | None = None
        outside_offload = self._offload
        if config.auto:
            assert budget is not None and budget.policy.budget is not None, "a device budget (checked when boosting)"
            ledger, room, policy = budget
            self._account = DeviceActivations(ledger, room, comm.rank)
            offload = ActivationOffload(
                self._transfers, layer.device, 0, config.min_offload_bytes, self._account, disk=self._disk
            )
            self._offloads.append(offload)
            outside_offload = offload  # the stretches outside the blocks are calls of the auto plan
            self._auto = AutoBlocks(
                offload,
                self._account,
                comm,
                policy,
                self._copies,
                self._measured_copies,
                self._recompute,
                config.max_prefetch,
            )
        self._outside = OutsideStretches(model, outside_offload, self._auto) if config.offload_outside else None
        self._cache_warned = [False]
        # A plan's forward (on the meta device) keeps its cache, and its blocks are placed with it: without
        # one, transformers' causal mask reads a value (``.all()`` of the positions) a meta tensor has not.
        self._planned = layer.device.type == "meta"
        self._blocks: list[tuple[str, torch.nn.Module, Callable[..., Any]]] = []
        for name, module in model.named_modules():
            how = config.placement_of(module)
            if how is None:
                continue
            inside = next((outer for outer, m, _ in self._blocks if name.startswith(outer + ".")), None)
            if inside is not None:
                raise ValueError(
                    f"ActivationPlacement names the class of {name} ({type(module).__name__}) and of {inside}, "
                    "which holds it: a block's saved tensors are placed once; name one of the two classes"
                )
            run = {
                BlockPlacement.RECOMPUTE: self._recomputed,
                BlockPlacement.OFFLOAD: self._offloaded,
                BlockPlacement.AUTO: self._automatic,
            }[how]
            self._blocks.append((name, module, functools.partial(run, name or "(the model)", module, module.forward)))
        for block in (*config.recompute, *config.offload, *config.auto):
            if not any(matches_block(block, m) for _, m, _ in self._blocks):
                present = sorted({type(m).__name__ for m in model.modules()})
                raise ValueError(
                    f"ActivationPlacement names the block class {block_class_name(block)!r}, but no module of the "
                    f"model is one; its module classes are {present}"
                )
        self._attach()

    def _measured_copies(self) -> None:
        """Every copy's time is in the counters (the host waits for copies still running)."""
        self._transfers.settle(wait=True)

    @property
    def config(self) -> ActivationPlacement:
        """The placement the blocks run under (a ``RepeatedBlocks()`` replaced by the class found)."""
        return self._config

    @property
    def plan(self) -> ActivationPlan | None:
        """The auto blocks' plan (``None`` without auto blocks, or before the first step ended)."""
        return self._auto.plan if self._auto is not None else None

    def training_kwargs(self, model: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments of the model's forward: where blocks may be recomputed (``recompute``,
        ``auto``), a training forward that would cache runs with ``use_cache=False`` (``caching``)."""
        if self._planned or not (self._config.recompute or self._config.auto):
            return kwargs
        return without_cache(model, kwargs, self._cache_warned)

    def begin_forward(self) -> None:
        """The model's forward starts: the host copies the last backward read go back (and out of a
        host budget, which both offloads share: its room is the same for every forward); the auto
        blocks number their calls, and may decide."""
        for offload in self._offloads:
            offload.recycle()
        if self._auto is not None:
            self._auto.begin_forward()

    @contextmanager
    def outside_blocks(self) -> Iterator[None]:
        """Around the model's own forward: with ``offload_outside``, a training forward's stretches
        outside the blocks are offloaded (refused inside an activation checkpoint of the user's around
        the whole model: what it saves is recomputed already)."""
        if self._outside is None or not torch.is_grad_enabled():
            yield
            return
        if _in_checkpoint():
            raise NotSupportedError(
                "ActivationPlacement(offload_outside=True) offloads what autograd saves outside the named blocks, "
                "but the model's forward runs inside an activation checkpoint (torch.utils.checkpoint around the "
                "whole model): what it saves there is recomputed already. Drop the checkpoint around the model (name "
                "its blocks in ActivationPlacement(recompute=[...]) instead), or set offload_outside=False."
            )
        self._outside.enter()
        try:
            yield
        except BaseException:
            self._outside.leave(finished=False)
            raise
        self._outside.leave(finished=True)

    def _block_call(self) -> AbstractContextManager[None]:
        """Around a placed block's call: it ends the stretch outside the blocks before it."""
        return self._outside.block() if self._outside is not None else nullcontext()

    def end_forward(self) -> None:
        """The model's forward returned (the auto blocks agree its calls over ranks, and may re-plan)."""
        if self._auto is not None:
            self._auto.end_forward()

    def counts(self, into: Stats) -> None:
        """Add the activation copies' counters to a snapshot of the model's ``Stats``."""
        self._transfers.settle()
        if self._account is not None:
            into.activation_bytes = self._account.device_bytes
            into.activation_kept_bytes = self._account.kept_total
        if self._disk is not None:
            into.activation_disk_write_bytes = self._disk.stats.disk_write_bytes
            into.activation_disk_read_bytes = self._disk.stats.disk_read_bytes
        into.activation_d2h_bytes = self._copies.d2h_bytes
        into.activation_h2d_bytes = self._copies.h2d_bytes
        into.activation_d2h_seconds = self._copies.d2h_seconds
        into.activation_h2d_seconds = self._copies.h2d_seconds

    def _attach(self) -> None:
        for _, module, run in self._blocks:
            module.forward = run

    def _detach(self) -> None:
        for _, module, _ in self._blocks:
            del module.forward

    @contextmanager
    def detached(self) -> Iterator[None]:
        """Within the block, the blocks run their class's own ``forward`` (for a deep copy)."""
        self._detach()
        try:
            yield
        finally:
            self._attach()

    @staticmethod
    def _placed(name: str, module: torch.nn.Module, how: str) -> bool:
        """Whether this call of a block places what it saves (autograd records it), refusing it
        inside a checkpoint."""
        if not torch.is_grad_enabled():
            return False
        if (getattr(module, "gradient_checkpointing", False) is True and module.training) or _in_checkpoint():
            _refuse_double_checkpointing(name, how)
        return True

    def _as_is_with_cache(self, name: str, module: torch.nn.Module, how: str, args: Any, kwargs: Any) -> bool:
        """Whether a block that may be recomputed runs as it is, being handed a KV cache (in eval
        mode; refused in training mode: see ``caching``)."""
        if self._planned or not holds_cache(args, kwargs):
            return False
        if module.training:
            refuse_cache(name, how)
        return True

    def _recomputed(
        self, name: str, module: torch.nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        how = "recomputed"
        if not self._placed(name, module, how) or self._as_is_with_cache(name, module, how, args, kwargs):
            return forward(*args, **kwargs)
        with self._block_call():
            return self._recompute(name, module, forward, 0, *args, **kwargs)

    def _automatic(
        self, name: str, module: torch.nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        how = "placed under the budget (its calls may be recomputed)"
        if not self._placed(name, module, how) or self._as_is_with_cache(name, module, how, args, kwargs):
            return forward(*args, **kwargs)
        assert self._auto is not None, "an auto block without auto placement"
        with self._block_call():
            return self._auto.run(name, module, forward, *args, **kwargs)

    def _recompute(
        self, name: str, module: torch.nn.Module, forward: Callable[..., Any], saved: int, *args: Any, **kwargs: Any
    ) -> Any:
        """Run a call checkpointed; each recomputation counts, and the ``saved`` bytes it makes
        again (known for auto blocks, measured in the first step)."""
        calls = 0

        def run(*inner: Any, **inner_kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:
                self._stats.recomputed_blocks += 1
                self._stats.activation_recomputed_bytes += saved
            return forward(*inner, **inner_kwargs)

        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    def _offloaded(
        self, name: str, module: torch.nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Any:
        if not self._placed(name, module, "offloaded"):
            return forward(*args, **kwargs)
        with self._block_call():
            call = self._offload.call(name, module)
            with self._offload.hooks(call):
                out = forward(*args, **kwargs)
            self._offload.finish(call)
        return out
