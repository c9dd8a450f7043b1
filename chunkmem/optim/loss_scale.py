"""Dynamic loss scaling for fp16 training (the rule of ``torch.amp.GradScaler``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DynamicLossScaler", "LossScaleConfig"]


class LossScaleConfig(BaseModel):
    """fp16 dynamic loss scaling; ignored for fp32 and bf16."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    initial_scale: float = Field(default=2.0**16, gt=0)
    """Scale of the first step."""
    growth_factor: float = Field(default=2.0, gt=1.0)
    """Multiplier after ``growth_interval`` steps in a row without inf/nan gradients."""
    backoff_factor: float = Field(default=0.5, gt=0.0, lt=1.0)
    """Multiplier when a step finds inf/nan gradients (the step is skipped)."""
    growth_interval: int = Field(default=2000, ge=1)
    """Clean steps in a row before the scale grows."""
    min_scale: float = Field(default=1.0, gt=0)
    """The scale never drops below this."""


class DynamicLossScaler:
    """The current fp16 loss scale and its update rule."""

    def __init__(self, config: LossScaleConfig) -> None:
        self._config = config
        self._scale = config.initial_scale
        self._clean_steps = 0

    @property
    def scale(self) -> float:
        return self._scale

    def update(self, found_inf: bool) -> None:
        """After a step: back off (the step was skipped) or count towards growth."""
        if found_inf:
            self._scale = max(self._config.min_scale, self._scale * self._config.backoff_factor)
            self._clean_steps = 0
            return
        self._clean_steps += 1
        if self._clean_steps == self._config.growth_interval:
            self._scale *= self._config.growth_factor
            self._clean_steps = 0

    def state_dict(self) -> dict[str, float]:
        """Scale and progress towards the next growth, for checkpoints."""
        return {"scale": self._scale, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore what ``state_dict`` returned."""
        self._scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
