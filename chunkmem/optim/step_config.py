"""When the host optimizer step runs, as a config: one pydantic class per choice, discriminated by
``when`` (``ChunkPlugin(host_step=...)``).

Only chunks whose fp32 master lives on the host are concerned: their optimizer step runs on the
CPU, which is otherwise idle while the device computes the backward.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field

__all__ = ["HostStepConfig", "StepAfterBackward", "StepDuringBackward"]


class _Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class StepAfterBackward(_Config):
    """Every host step runs in ``optimizer.step()``, after the whole backward (as plain PyTorch
    steps). The default on a CPU, where the "device" and the host are the same cores and nothing
    can overlap."""

    when: Literal["after_backward"] = "after_backward"


class StepDuringBackward(_Config):
    """A chunk's host step starts on a worker thread as soon as its last gradient of the iteration
    is reduced and on the host, while the device goes on with the backward. The default on CUDA.

    It is speculative and exact: it runs only in the last backward pass of an iteration that
    follows the recorded trace after an iteration that ended in ``optimizer.step()``, and before
    each such step the chunk's master and optimizer state are copied aside. ``optimizer.step()``
    keeps the early steps when nothing changed what they computed; anything that would have (a
    clipping that scales the gradients, fp16 inf/nan, changed hyperparameters, another forward or
    backward, ``zero_grad``, a load or a state dict before the step) restores the copies first, and
    the step then runs as it would have without them: the result is the same bit for bit."""

    when: Literal["during_backward"] = "during_backward"
    backup_budget: ByteSize = Field(default=ByteSize(2 * 2**30), gt=0)
    """Host bytes for the copies of masters and optimizer states taken before early steps, in bytes
    or a string such as ``"2GiB"``. Chunks whose copies would not fit step after the backward."""


HostStepConfig = Annotated[StepAfterBackward | StepDuringBackward, Field(discriminator="when")]
