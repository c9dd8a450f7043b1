"""chunkmem: train PyTorch models larger than accelerator memory.

Parameters are packed into fixed-size chunks, sharded over the data-parallel ranks, and moved
between the accelerator and host memory by a placement policy (``chunkmem.placement``), driven by
parameter-op hooks (``chunkmem.hooks``).
"""

from . import checkpoint
from .boosted.model import ChunkedModel
from .booster import Booster
from .chunks.chunk import Chunk
from .chunks.manager import ChunkManager
from .chunks.search import ChunkSizeSearch, search_chunk_size
from .chunks.tensor_state import TensorInfo, TensorState
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
from .execution.runtime import ChunkRuntime
from .optim import ChunkOptimizer, LossScaleConfig, StepAfterBackward, StepDuringBackward
from .placement import (
    ActivationPlacement,
    AutoPlacementConfig,
    BlockPlacement,
    PlacementConfig,
    StaticPlacementConfig,
    load_placement_config,
)
from .planning.planner import Plan, PlanningCommunicator, StepCounters, plan
from .plugin import ChunkPlugin
from .ranks.comm import Communicator, PendingGather
from .usage.accounting import Location, MemoryKind, MemoryLedger
from .usage.memory import describe_devices, device_capacity, device_free, host_memory, process_capacity
from .usage.stats import Stats

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
    "Chunk",
    "ChunkManager",
    "ChunkOptimizer",
    "ChunkPlugin",
    "ChunkRuntime",
    "ChunkSizeSearch",
    "ChunkedModel",
    "ChunkmemError",
    "CollectiveMismatchError",
    "Communicator",
    "DiskTierError",
    "HostBudgetTooSmallError",
    "IllegalTransition",
    "Location",
    "LossScaleConfig",
    "MaterializeError",
    "MemoryKind",
    "MemoryLedger",
    "NotSupportedError",
    "OptimizerAfterBoostError",
    "PendingGather",
    "PlacementConfig",
    "Plan",
    "PlanningCommunicator",
    "ShardedGradientError",
    "StateDictMismatchError",
    "StaticPlacementConfig",
    "Stats",
    "StepAfterBackward",
    "StepCounters",
    "StepDuringBackward",
    "TensorInfo",
    "TensorState",
    "TraceDivergenceError",
    "UnmanageableParameter",
    "UnscaledBackwardError",
    "checkpoint",
    "describe_devices",
    "device_capacity",
    "device_free",
    "host_memory",
    "load_placement_config",
    "plan",
    "process_capacity",
    "search_chunk_size",
]
