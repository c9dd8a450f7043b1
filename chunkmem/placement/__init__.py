"""Placement decisions for chunkmem: configs, the compute trace and the policies.

Pure decisions: nothing here moves a tensor or imports ``chunkmem``.
"""

from .actions import Action, Verb
from .activation_host import HostRoom, disk_bytes_per_call
from .activation_plan import ActivationChoice, ActivationPlan, BlockMeasure, CopyRates, choose_activations
from .activations import ActivationPlacement, BlockClass, BlockPlacement, block_class_name, matches_block
from .auto import AutoPolicy
from .config import AutoPlacementConfig, PlacementConfig, StaticPlacementConfig, load_placement_config
from .factory import make_policy
from .gradients import GradBuffer
from .places import PLACES, Location
from .policy import DISK_WINDOW, BudgetNeed, BudgetTooSmallError, HostBudgetTooSmallError, PlacementPolicy
from .repeated_blocks import RepeatedBlocks
from .residency import DeviceResidency, Held, NoRoomError, PlanObserver
from .simulate import SimulationResult, simulate
from .snapshot import (
    BufferKind,
    ChunkPlacement,
    ChunkSpec,
    FetchPlan,
    Layout,
    OpSnapshot,
    ReleaseSnapshot,
    Residency,
    ResidentChunk,
    ResidentSet,
    WorkingSet,
)
from .static import StaticPolicy
from .trace import ComputeTrace, CursorMode, Divergence, Phase, TraceCursor, TraceStep, step_digest

__all__ = [
    "DISK_WINDOW",
    "PLACES",
    "Action",
    "ActivationChoice",
    "ActivationPlacement",
    "ActivationPlan",
    "AutoPlacementConfig",
    "AutoPolicy",
    "BlockClass",
    "BlockMeasure",
    "BlockPlacement",
    "BudgetNeed",
    "BudgetTooSmallError",
    "BufferKind",
    "ChunkPlacement",
    "ChunkSpec",
    "ComputeTrace",
    "CopyRates",
    "CursorMode",
    "DeviceResidency",
    "Divergence",
    "FetchPlan",
    "GradBuffer",
    "Held",
    "HostBudgetTooSmallError",
    "HostRoom",
    "Layout",
    "Location",
    "NoRoomError",
    "OpSnapshot",
    "Phase",
    "PlacementConfig",
    "PlacementPolicy",
    "PlanObserver",
    "ReleaseSnapshot",
    "RepeatedBlocks",
    "Residency",
    "ResidentChunk",
    "ResidentSet",
    "SimulationResult",
    "StaticPlacementConfig",
    "StaticPolicy",
    "TraceCursor",
    "TraceStep",
    "Verb",
    "WorkingSet",
    "block_class_name",
    "choose_activations",
    "disk_bytes_per_call",
    "load_placement_config",
    "make_policy",
    "matches_block",
    "simulate",
    "step_digest",
]
