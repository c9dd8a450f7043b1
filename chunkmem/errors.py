"""chunkmem's exceptions: one hierarchy under :class:`ChunkmemError`, so ``except ChunkmemError``
catches every refusal and failure chunkmem raises on purpose. Each class also derives from the
builtin a caller would expect (``ValueError`` for bad input, ``RuntimeError`` for a state that
cannot go on), so existing ``except ValueError`` / ``except RuntimeError`` code keeps working."""

from __future__ import annotations

from chunkmem import placement

__all__ = [
    "AlreadyBoostedError",
    "BudgetExceededError",
    "BudgetTooSmallError",
    "CheckpointCorruptedError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointUnverifiedError",
    "CheckpointWriteError",
    "ChunkmemError",
    "CollectiveMismatchError",
    "DiskTierError",
    "HostBudgetTooSmallError",
    "IllegalTransition",
    "MaterializeError",
    "NotSupportedError",
    "OptimizerAfterBoostError",
    "ShardedGradientError",
    "StateDictMismatchError",
    "TraceDivergenceError",
    "UnmanageableParameter",
    "UnscaledBackwardError",
]


class ChunkmemError(Exception):
    """Base of every exception chunkmem raises on purpose."""


class BudgetTooSmallError(ChunkmemError, placement.BudgetTooSmallError):
    """The device budget cannot hold one op's working set under the decided placement (raised when
    boosting; ``budget`` and ``minimum`` are in bytes). Also a ``placement.BudgetTooSmallError``."""

    @classmethod
    def from_placement(cls, error: placement.BudgetTooSmallError) -> BudgetTooSmallError:
        return cls(str(error), error.budget, error.minimum)


class HostBudgetTooSmallError(ChunkmemError, placement.HostBudgetTooSmallError):
    """The host budget cannot hold what the placement keeps in host memory (raised when boosting;
    ``budget`` and ``minimum`` in bytes). Also a ``placement.HostBudgetTooSmallError``."""

    @classmethod
    def from_placement(cls, error: placement.HostBudgetTooSmallError) -> HostBudgetTooSmallError:
        return cls(str(error), error.budget, error.minimum)


class DiskTierError(ChunkmemError, OSError):
    """The disk tier cannot be used or failed: its directory is missing, not writable or too small
    (when boosting), or a read or write of its files failed (every rank raises it)."""


class BudgetExceededError(ChunkmemError, RuntimeError):
    """An op cannot run within the device budget even after evicting everything evictable.
    ``minimum`` (bytes), when known, is a budget that would run it."""

    def __init__(self, message: str, minimum: int | None = None) -> None:
        super().__init__(message)
        self.minimum = minimum


class TraceDivergenceError(ChunkmemError, RuntimeError):
    """Ranks ran different ops on managed parameters in the same iteration."""


class CollectiveMismatchError(ChunkmemError, RuntimeError):
    """A chunk collective failed or timed out, and the ranks have compared what they ran."""


class UnmanageableParameter(ChunkmemError, ValueError):
    """A parameter chunkmem cannot put in a chunk."""


class MaterializeError(ChunkmemError, ValueError):
    """A model with parameters on the meta device cannot be given exact values: its own
    initialisation cannot be replayed as the CPU would have run it, or the weights given for it do
    not match it. Raised before any parameter is moved into chunks; the message names the module or
    parameter and what to do."""


class IllegalTransition(ChunkmemError, RuntimeError):
    """A parameter was asked to move between states the table does not connect."""


class NotSupportedError(ChunkmemError, RuntimeError):
    """Something plain PyTorch allows that a boosted model or optimizer cannot do; the message
    names the supported way (``model.to()`` after boosting, stepping the optimizer object that was
    passed to ``boost``...)."""


class OptimizerAfterBoostError(NotSupportedError):
    """A torch optimizer built from a boosted model's parameters (``AdamW(model.parameters())``
    after boosting) was stepped: those parameters hold placeholders, so its update would be lost.
    Raised before the step changes anything; the message gives the one-line fix (build the
    optimizer before boosting and pass it to ``booster.boost``)."""


class AlreadyBoostedError(ChunkmemError, ValueError):
    """``booster.boost`` was given a model that is already boosted (or whose parameters are in a
    boosted model's chunks); the message says how to boost a model with its optimizer."""


class ShardedGradientError(NotSupportedError):
    """Per-parameter gradient values were read (``torch.nn.utils.clip_grad_norm_``, ``p.grad``):
    chunkmem keeps gradients sharded in chunks, so ``p.grad`` holds no values. Use
    ``optimizer.clip_grad_norm(max_norm)``."""


class UnscaledBackwardError(NotSupportedError):
    """fp16 gradients were computed by a plain ``loss.backward()``, without the loss scaling of
    ``booster.backward(loss, optimizer)``; the optimizer refuses to step on them."""


class StateDictMismatchError(ChunkmemError, RuntimeError):
    """A state dict does not fit the model, optimizer or scheduler it is loaded into (keys, shapes,
    dtypes, parameter groups, optimizer state). Raised before anything is written: the target is
    unchanged. A ``RuntimeError``, like ``torch.nn.Module.load_state_dict``'s."""


class CheckpointError(ChunkmemError, RuntimeError):
    """A checkpoint file could not be written or loaded; every rank raises it with the same message.
    Nothing was changed by the refused load."""


class CheckpointCorruptedError(CheckpointError):
    """A checkpoint file differs from what was saved (checksum, size), is truncated or unreadable."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint file was saved for another model, by another kind of save (a model file given
    to ``load_optimizer``), or at another step than the files loaded with it."""


class CheckpointUnverifiedError(CheckpointError):
    """A checkpoint without chunkmem's manifest (a plain PyTorch file, a plain DCP directory, or
    chunkmem files copied without theirs) was loaded without ``verify=False``."""


class CheckpointWriteError(CheckpointError, OSError):
    """A save failed on some rank (disk full, unwritable path); the previous file is unchanged."""
