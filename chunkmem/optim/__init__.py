"""The optimizer side of a boosted model: ``ChunkOptimizer`` and what it owns.

* :mod:`.optimizer`: ``ChunkOptimizer``, the user's torch optimizer re-pointed at this rank's
  fp32 master pieces;
* :mod:`.runs`: the flat runs the user's optimizer steps, and the optimizer state kept per run;
* :mod:`.early_steps`: host steps taken during the backward, kept or undone exactly;
* :mod:`.disk_sides`: the optimizer sides on disk and the step pipeline that streams them;
* :mod:`.host_kernels`: which kernel steps the runs in host memory;
* :mod:`.state_dict`: the state in plain PyTorch's format, and the checks a loaded state passes;
* :mod:`.probe`: what chunkmem learns about an optimizer class by probing it;
* :mod:`.loss_scale` and :mod:`.step_config`: the configs of fp16 loss scaling and of when the
  host step runs.
"""

from .loss_scale import LossScaleConfig
from .optimizer import ChunkOptimizer, Piece
from .probe import StateSize, check_elementwise, optimizer_state_size
from .step_config import HostStepConfig, StepAfterBackward, StepDuringBackward

__all__ = [
    "ChunkOptimizer",
    "HostStepConfig",
    "LossScaleConfig",
    "Piece",
    "StateSize",
    "StepAfterBackward",
    "StepDuringBackward",
    "check_elementwise",
    "optimizer_state_size",
]
