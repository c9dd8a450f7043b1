"""``Backing``: where a boost's parameter values come from, and where the disk tier keeps what
leaves host memory.

A training run reads values from the model itself, or, for a model built on the meta device,
replays its initialisation or reads a checkpoint slice by slice (``chunkmem.materialize``); it
keeps the disk tier's sides in a file it creates under ``ChunkPlugin(disk_dir=...)``. A plan
(``chunkmem.plan``) holds meta tensors only and gives a backing of its own (values that are never
computed, a disk file that only counts). The plugin asks its backing; it never asks which kind it is.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

import torch

from chunkmem.placement.policy import format_bytes

from ..activations.disk import check_disk_dir
from ..chunks.param_values import ParamValues
from ..errors import DiskTierError
from ..materialize import model_values
from ..ranks.agreement import agree
from ..ranks.comm import Communicator
from ..tiers.disk import DiskFile, ScratchDir, SidesFile
from ..usage.stats import Stats
from .compile_config import CompileBlocks
from .frozen_models import FrozenModels

__all__ = ["Backing", "TrainingBacking"]


class Backing(Protocol):
    """Values for a boost's parameters, and the disk tier's file."""

    def values(self, model: torch.nn.Module, weights: str | os.PathLike[str] | None) -> ParamValues:
        """Where closing a chunk reads its parameters' values from."""
        ...

    def disk_file(self, nbytes: int, chunks: int, comm: Communicator, stats: Stats, disk_dir: str | None) -> SidesFile:
        """A file of ``nbytes`` for the optimizer sides of ``chunks`` chunks the placement puts on disk."""
        ...

    def activation_disk_dir(self, disk_dir: str | None, comm: Communicator) -> str:
        """Where the offloaded activations beyond ``ActivationPlacement.host_budget`` go."""
        ...

    def compile_block(self, forward: Callable[..., Any], config: CompileBlocks) -> Callable[..., Any]:
        """What runs a compiled block class's ``forward`` (``ChunkPlugin(compile=...)``)."""
        ...

    def check_frozen(
        self, frozen: FrozenModels, trained: torch.nn.Module, weights: str | os.PathLike[str] | None
    ) -> None:
        """Refuse frozen models whose values this backing cannot give."""
        ...


class TrainingBacking:
    """A training run's: the model's (or its initialisation's, or a checkpoint's) values, and a
    preallocated file in a scratch directory under ``disk_dir``."""

    def values(self, model: torch.nn.Module, weights: str | os.PathLike[str] | None) -> ParamValues:
        return model_values(model, weights)

    def check_frozen(
        self, frozen: FrozenModels, trained: torch.nn.Module, weights: str | os.PathLike[str] | None
    ) -> None:
        """Frozen models' values come from the models themselves: they must be in memory."""
        frozen.refuse_values_not_in_memory(trained, weights)

    def disk_file(self, nbytes: int, chunks: int, comm: Communicator, stats: Stats, disk_dir: str | None) -> SidesFile:
        """Refused, on every rank, without a ``disk_dir``, or when it is missing, not writable, or
        has too little free space."""
        if disk_dir is None:
            raise DiskTierError(
                f"the placement puts the optimizer sides of {chunks} chunks ({format_bytes(nbytes)}) on disk, but "
                "ChunkPlugin has no disk_dir: pass ChunkPlugin(disk_dir=...) (a fast local disk), or raise "
                "host_budget / lower offload_disk_frac so that everything stays in memory"
            )

        def open_file() -> DiskFile:
            scratch = ScratchDir(disk_dir, comm.rank)
            try:
                return DiskFile(scratch, "sides.bin", nbytes, stats)
            except BaseException:
                scratch.close()
                raise

        return agree(comm, "opening the disk tier", open_file, DiskTierError, f"in {disk_dir}")

    def activation_disk_dir(self, disk_dir: str | None, comm: Communicator) -> str:
        """``disk_dir``, refused on every rank when it is not given, missing or not writable
        (nothing is created there until a storage goes to disk)."""
        return agree(
            comm, "checking the disk tier for activations", lambda: check_disk_dir(disk_dir, comm.rank), DiskTierError
        )

    def compile_block(self, forward: Callable[..., Any], config: CompileBlocks) -> Callable[..., Any]:
        """``forward`` compiled as ``config`` says."""
        return config.compile(forward)
