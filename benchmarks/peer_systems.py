"""The systems ``peers.py`` compares, one class per framework, and the commands its rank processes run.

Every system trains the same GPT-2 (same seed, so the same initial weights on every rank) on the same
tokens (global batch ``step`` split over the ranks) with ``torch.optim.AdamW`` and the same
hyperparameters; only the way parameters, gradients and optimizer states are distributed differs.
Mixed precision is each framework's own: autocast for plain PyTorch and DDP, a
``MixedPrecisionPolicy`` for FSDP2, ``precision=`` for chunkmem, the ``bf16`` section for DeepSpeed.

Frameworks are imported inside the rank processes that use them, so DeepSpeed (an optional extra)
is only needed by its own systems.
"""

from __future__ import annotations

import contextlib
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import (
    DTYPES,
    GPT2Shape,
    current_rss,
    device_peak,
    gpt2_model,
    peak_rss,
    rank_batch,
    synchronize,
)
from benchmarks.workers import GroupInit, RankContext, init_torch_group

__all__ = [
    "DDP",
    "FSDP2",
    "Chunkmem",
    "DeepSpeedZero3",
    "PeerSetup",
    "Plain",
    "System",
    "build_system",
    "chunkmem_step",
    "deepspeed_config",
    "memory_report",
    "plain_step",
    "train_steps",
]


@dataclass(frozen=True)
class PeerSetup:
    """What every system shares: the model, the data, the optimizer's hyperparameters."""

    shape: GPT2Shape
    batch: int
    """Sequences per rank per step."""
    precision: str
    """``fp32``, or ``bf16`` / ``fp16`` mixed precision (fp32 master weights and optimizer states)."""
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0
    data_seed: int = 1
    activation_checkpointing: bool = False
    ds_torch_adam: bool = True
    """DeepSpeed runs ``torch.optim.AdamW`` (``"torch_adam": true``) instead of its own Adam kernels,
    which need compiling and would make it a different optimizer from everyone else's."""

    def model(self) -> torch.nn.Module:
        model = gpt2_model(self.shape.layers, self.shape.width, self.shape.vocab, self.shape.seq, self.seed)
        if self.activation_checkpointing:
            enable_checkpointing(model)
        return model

    def optimizer(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)

    def autocast(self, device: torch.device) -> Any:
        dtype = DTYPES[self.precision]
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype)


def enable_checkpointing(model: torch.nn.Module) -> None:
    """``transformers``' activation checkpointing, non-reentrant (renamed in transformers 5)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()


Step = Callable[[torch.Tensor], torch.Tensor]


class System(ABC):
    """One way to train the model: builds it in a rank process and returns its training step
    (ids -> loss, after the optimizer step)."""

    name: str
    """Label in tables and files."""

    def group_init(self, world_size: int) -> GroupInit | None:
        """How the rank processes form their process group (None: no group at world size 1)."""
        return init_torch_group

    def env(self) -> dict[str, str]:
        return {}

    def check(self, world_size: int) -> str | None:
        """Why this system cannot run at ``world_size`` (None when it can)."""
        return None

    @abstractmethod
    def build(self, ctx: RankContext, setup: PeerSetup) -> Step: ...


def plain_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, setup: PeerSetup, device: torch.device
) -> Step:
    def step(ids: torch.Tensor) -> torch.Tensor:
        with setup.autocast(device):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def chunkmem_step(ctx: RankContext, booster: Any, model: torch.nn.Module, setup: PeerSetup) -> Step:
    """``model`` and ``setup``'s optimizer boosted by ``booster`` (the boosted model kept in
    ``ctx.state["chunked"]`` for the memory report), and one training step of it."""
    chunked, optimizer, *_ = booster.boost(model, setup.optimizer(model.parameters()))
    ctx.state["chunked"] = chunked

    def step(ids: torch.Tensor) -> torch.Tensor:
        loss = chunked(input_ids=ids, labels=ids).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


@dataclass(frozen=True)
class Plain(System):
    """Plain PyTorch in one process (the world-size-1 reference)."""

    name: str = "plain"

    def group_init(self, world_size: int) -> GroupInit | None:
        return None

    def check(self, world_size: int) -> str | None:
        return None if world_size == 1 else "plain PyTorch is one process; at world size > 1 compare with ddp"

    def build(self, ctx: RankContext, setup: PeerSetup) -> Step:
        model = setup.model().to(ctx.device)
        return plain_step(model, setup.optimizer(model.parameters()), setup, ctx.device)


@dataclass(frozen=True)
class DDP(System):
    """``DistributedDataParallel``: every rank holds everything, gradients are all-reduced."""

    name: str = "ddp"

    def build(self, ctx: RankContext, setup: PeerSetup) -> Step:
        from torch.nn.parallel import DistributedDataParallel

        model = setup.model().to(ctx.device)
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=ids)
        return plain_step(wrapped, setup.optimizer(wrapped.parameters()), setup, ctx.device)


@dataclass(frozen=True)
class FSDP2(System):
    """``fully_shard`` on every transformer block, then on the root (ZeRO-3: parameters, gradients
    and optimizer states sharded); ``offload`` adds ``CPUOffloadPolicy``."""

    name: str = "fsdp2"
    offload: bool = False

    def build(self, ctx: RankContext, setup: PeerSetup) -> Step:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        model = setup.model().to(ctx.device)
        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        dtype = DTYPES[setup.precision]
        mixed = (
            MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
            if dtype != torch.float32
            else MixedPrecisionPolicy()
        )
        # Pinned host memory needs an accelerator; on the CPU the offload is a host-to-host copy.
        offload = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda") if self.offload else OffloadPolicy()
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh, mp_policy=mixed, offload_policy=offload)
        fully_shard(model, mesh=mesh, mp_policy=mixed, offload_policy=offload)
        optimizer = setup.optimizer(model.parameters())

        def step(ids: torch.Tensor) -> torch.Tensor:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        return step


@dataclass(frozen=True)
class Chunkmem(System):
    """chunkmem through its public API (``Booster`` + ``ChunkPlugin``) with a placement config."""

    name: str
    placement: Any
    """A ``StaticPlacementConfig`` or ``AutoPlacementConfig``."""
    chunk_size: int | None = None
    """Elements per chunk (``None``: searched, the default)."""

    def group_init(self, world_size: int) -> GroupInit | None:
        return init_torch_group if world_size > 1 else None

    def build(self, ctx: RankContext, setup: PeerSetup) -> Step:
        from chunkmem import Booster, ChunkPlugin

        model = setup.model()
        booster = Booster(ChunkPlugin(placement=self.placement, precision=setup.precision, chunk_size=self.chunk_size))
        return chunkmem_step(ctx, booster, model, setup)


def init_deepspeed_group(ctx: RankContext, backend: str) -> None:
    """DeepSpeed's own initialiser (it reads the same MASTER_ADDR / RANK environment)."""
    import datetime

    import deepspeed

    timeout = datetime.timedelta(seconds=float(os.environ.get("BENCH_PG_TIMEOUT", "120")))
    deepspeed.init_distributed(dist_backend=backend, timeout=timeout)


def deepspeed_config(setup: PeerSetup, offload: bool, on_cuda: bool) -> dict[str, Any]:
    """A ZeRO-3 config that trains what the other systems train: AdamW with the same
    hyperparameters, no gradient clipping, no loss scaling in fp32."""
    zero: dict[str, Any] = {"stage": 3}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_cuda}
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_cuda}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": setup.batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": setup.lr, "weight_decay": setup.weight_decay, "torch_adam": setup.ds_torch_adam},
        },
        "zero_optimization": zero,
        # Our optimizer is torch's AdamW on purpose (the same kernel as every other system).
        "zero_force_ds_cpu_optimizer": False,
        "wall_clock_breakdown": False,
    }
    if setup.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif setup.precision == "fp16":
        config["fp16"] = {"enabled": True}
    return config


@dataclass(frozen=True)
class DeepSpeedZero3(System):
    """DeepSpeed ZeRO stage 3; ``offload`` puts optimizer states and parameters on the CPU."""

    name: str = "deepspeed-z3"
    offload: bool = False

    def group_init(self, world_size: int) -> GroupInit | None:
        return init_deepspeed_group

    def env(self) -> dict[str, str]:
        return {} if torch.cuda.is_available() else {"DS_ACCELERATOR": "cpu"}

    def build(self, ctx: RankContext, setup: PeerSetup) -> Step:
        import deepspeed

        model = setup.model()
        config = deepspeed_config(setup, self.offload, ctx.device.type == "cuda")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def step(ids: torch.Tensor) -> torch.Tensor:
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            return loss.detach()

        return step


# --- commands the rank processes run ---------------------------------------------------------------
def build_system(ctx: RankContext, system: System, setup: PeerSetup) -> dict[str, int]:
    """Build ``system`` in this rank; keep its step for ``train_steps``."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    ctx.state["step"] = system.build(ctx, setup)
    return {"rss_after_build": current_rss()}


def train_steps(ctx: RankContext, setup: PeerSetup, start: int, count: int) -> list[tuple[float, float]]:
    """Steps ``start .. start+count-1`` (each on its own global batch): (seconds, loss) per step."""
    step: Step = ctx.state["step"]
    out = []
    for index in range(start, start + count):
        ids = rank_batch(
            index, ctx.rank, ctx.world_size, setup.batch, setup.shape.seq, setup.shape.vocab, setup.data_seed
        )
        ids = ids.to(ctx.device)
        synchronize(ctx.device)
        began = time.perf_counter()
        loss = float(step(ids).float().item())
        synchronize(ctx.device)
        out.append((time.perf_counter() - began, loss))
    return out


def memory_report(ctx: RankContext) -> dict[str, int | None]:
    """This rank's peak RSS over its life and its peak device allocation."""
    return {"peak_rss": peak_rss(), "rss": current_rss(), "device_peak": device_peak(ctx.device)}
