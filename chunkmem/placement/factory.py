"""``make_policy``: the policy object for a placement config.

Apart from ``policy.py`` because it names every policy, and every policy imports ``policy.py`` for
its base class.
"""

from __future__ import annotations

from .auto import AutoPolicy
from .config import AutoPlacementConfig, StaticPlacementConfig
from .policy import PlacementPolicy
from .static import StaticPolicy

__all__ = ["make_policy"]


def make_policy(config: StaticPlacementConfig | AutoPlacementConfig, device_capacity: int | None) -> PlacementPolicy:
    """The policy for a config (chosen by the config's type). ``device_capacity`` is the compute
    device's total memory, agreed across ranks; the auto policy needs it."""
    if isinstance(config, StaticPlacementConfig):
        return StaticPolicy(config)
    if isinstance(config, AutoPlacementConfig):
        return AutoPolicy(config, device_capacity)
    raise TypeError(f"make_policy: no policy for config type {type(config).__name__}")
