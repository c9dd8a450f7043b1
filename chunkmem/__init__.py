"""chunkmem: train PyTorch models larger than accelerator memory.

Parameters are packed into fixed-size chunks, sharded over the data-parallel ranks, and moved
between the accelerator, host memory and disk by a placement policy (``chunkmem.placement``),
driven by parameter-op hooks (``chunkmem.hooks``).

This module is the front door: what a training script imports (the booster and its plugin, the
boosted model and optimizer, the placement, compile and step configs, the counters, the planner, the
checkpoint functions and the exceptions). The machinery (chunks, the runtime, collectives, the
byte ledger, the memory probes) is importable from its own subpackage, e.g.
``from chunkmem.chunks.manager import ChunkManager``.
"""

from importlib import metadata as _metadata

from . import checkpoint
from .boosted.compile_config import CompileBlocks
from .boosted.model import ChunkedModel
from .booster import Booster
from .errors import (
    AlreadyBoostedError,
    BudgetExceededError,
    BudgetTooSmallError,
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointUnverifiedError,
    CheckpointWriteError,
    ChunkmemError,
    CollectiveMismatchError,
    DiskTierError,
    HostBudgetTooSmallError,
    IllegalTransition,
    MaterializeError,
    NotSupportedError,
    OptimizerAfterBoostError,
    ShardedGradientError,
    StateDictMismatchError,
    TraceDivergenceError,
    UnmanageableParameter,
    UnscaledBackwardError,
)
from .optim import ChunkOptimizer, LossScaleConfig, StepAfterBackward, StepDuringBackward
from .placement import (
    ActivationPlacement,
    AutoPlacementConfig,
    BlockPlacement,
    PlacementConfig,
    StaticPlacementConfig,
    load_placement_config,
)
from .planning.planner import Plan, StepCounters, plan
from .plugin import ChunkPlugin
from .usage.stats import Stats

# The version in pyproject.toml, for a checkout imported without being installed (tests/unit/chunkmem/test_front_door.py
# keeps the two equal); an installed chunkmem reports its installed metadata.
_CHECKOUT_VERSION = "0.1.0"


def _version() -> str:
    try:
        return _metadata.version("chunkmem")
    except _metadata.PackageNotFoundError:
        return _CHECKOUT_VERSION


__version__ = _version()

__all__ = [
    "ActivationPlacement",
    "AlreadyBoostedError",
    "AutoPlacementConfig",
    "BlockPlacement",
    "Booster",
    "BudgetExceededError",
    "BudgetTooSmallError",
    "CheckpointCorruptedError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointUnverifiedError",
    "CheckpointWriteError",
    "ChunkOptimizer",
    "ChunkPlugin",
    "ChunkedModel",
    "ChunkmemError",
    "CollectiveMismatchError",
    "CompileBlocks",
    "DiskTierError",
    "HostBudgetTooSmallError",
    "IllegalTransition",
    "LossScaleConfig",
    "MaterializeError",
    "NotSupportedError",
    "OptimizerAfterBoostError",
    "PlacementConfig",
    "Plan",
    "ShardedGradientError",
    "StateDictMismatchError",
    "StaticPlacementConfig",
    "Stats",
    "StepAfterBackward",
    "StepCounters",
    "StepDuringBackward",
    "TraceDivergenceError",
    "UnmanageableParameter",
    "UnscaledBackwardError",
    "checkpoint",
    "load_placement_config",
    "plan",
]
