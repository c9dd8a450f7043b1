"""chunkmem: train PyTorch models larger than accelerator memory.

Parameters are packed into fixed-size chunks, sharded over the data-parallel ranks, and moved
between the accelerator and host memory by a placement policy (``placement``), driven by
parameter-op hooks (``hooks``).
"""

from . import checkpoint
from .accounting import Location, MemoryKind, MemoryLedger
from .booster import Booster
from .chunk import Chunk, ChunkState, GradState
from .comm import Communicator, PendingGather
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
from .manager import ChunkManager
from .memory import describe_devices, device_capacity, device_free, host_memory, process_capacity
from .model import ChunkedModel
from .optim import ChunkOptimizer, LossScaleConfig, StepAfterBackward, StepDuringBackward
from .planner import Plan, PlanningCommunicator, StepCounters, plan
from .plugin import ChunkPlugin
from .runtime import ChunkRuntime
from .search import ChunkSizeSearch, search_chunk_size
from .stats import Stats
from .tensor_state import TensorInfo, TensorState

__all__ = [
    "AlreadyBoostedError",
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
    "ChunkState",
    "ChunkedModel",
    "ChunkmemError",
    "CollectiveMismatchError",
    "Communicator",
    "DiskTierError",
    "GradState",
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
    "Plan",
    "PlanningCommunicator",
    "ShardedGradientError",
    "StateDictMismatchError",
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
    "plan",
    "process_capacity",
    "search_chunk_size",
]
