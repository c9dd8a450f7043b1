"""``ChunkAccelerator``: Accelerate's ``Accelerator`` with the calls a training loop makes on a
boosted model and optimizer routed to chunkmem.

Trainer (and the trainers built on it) reach the model and optimizer through a handful of public
``Accelerator`` methods: ``prepare`` (which would wrap the model in DDP at W>1 and copy the
optimizer's full state through ``load_state_dict``), ``backward``, ``no_sync`` and
``clip_grad_norm_``; and ``unwrap_model``, whose result Trainer's ``compute_loss`` reads the model's
class from (the user's module there, as DDP's; the boosted model elsewhere, where callers act on
it). Routing exactly those keeps every other part of Trainer's loop (data sharding,
gathers for metrics, logging, callbacks) as Trainer ships it, so a Trainer upgrade that keeps using
these calls needs nothing here.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from ..boosted.model import ChunkedModel
from ..compat.accelerate import prepared_models, prepared_optimizers
from ..errors import NotSupportedError
from ..optim import ChunkOptimizer

__all__ = ["ChunkAccelerator", "chunk_optimizer_of", "routed_to_chunkmem"]

# Whether unwrap_model shows the user's module (ChunkAccelerator.showing_users_model): a context
# variable, as the accelerator's class is swapped in on Trainer's own object and adds no state.
_SHOWING_USERS_MODEL: ContextVar[bool] = ContextVar("chunkmem_showing_users_model", default=False)


def chunk_optimizer_of(optimizer: Any) -> ChunkOptimizer | None:
    """The ``ChunkOptimizer`` inside Accelerate's optimizer wrappers, or None."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer if isinstance(optimizer, ChunkOptimizer) else None


class ChunkAccelerator(Accelerator):
    """An ``Accelerator`` that passes a boosted model and optimizer through ``prepare`` unwrapped
    (chunkmem shards and reduces gradients itself: DDP over its placeholder parameters would
    broadcast and all-reduce nothing real), and runs backward, ``no_sync`` and gradient clipping
    through chunkmem. What chunkmem cannot do (a model or optimizer that was not boosted, in
    training) is refused."""

    def _chunk_optimizer(self, what: str) -> ChunkOptimizer:
        found = {id(o): o for o in (chunk_optimizer_of(opt) for opt in prepared_optimizers(self)) if o is not None}
        if len(found) != 1:
            raise NotSupportedError(
                f"{what} under chunkmem needs exactly one boosted optimizer prepared by this accelerator, found "
                f"{len(found)}: prepare the model and optimizer that Booster.boost returned"
            )
        return next(iter(found.values()))

    @contextmanager
    def showing_users_model(self) -> Iterator[None]:
        """While open, ``unwrap_model`` gives the user's module inside a boosted model, as
        Accelerate gives the module inside DDP: for code that decides from the model's class what
        plain Trainer decides from the user's model (``ChunkTrainerMixin.compute_loss``)."""
        token = _SHOWING_USERS_MODEL.set(True)
        try:
            yield
        finally:
            _SHOWING_USERS_MODEL.reset(token)

    def unwrap_model(
        self, model: torch.nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> torch.nn.Module:
        """The boosted model itself, whose ``save_pretrained``, ``state_dict`` and ``generate``
        gather the chunks (the user's module holds placeholders, and its ``generate`` would not
        keep the ranks in step); the user's module inside ``showing_users_model``."""
        unwrapped = super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)
        if isinstance(unwrapped, ChunkedModel) and _SHOWING_USERS_MODEL.get():
            return unwrapped.module
        return unwrapped

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> torch.nn.Module:
        if isinstance(model, ChunkedModel):
            # The plugin chose the device and dtype; no DDP, no autocast wrapper around forward.
            if model not in prepared_models(self):
                prepared_models(self).append(model)
            return model
        if evaluation_mode:  # a frozen model beside the trained one (e.g. a reference model): Accelerate's way
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        raise NotSupportedError(
            f"{type(model).__name__} was not boosted: under chunkmem the trained model is the ChunkedModel that "
            "Booster.boost returns (ChunkTrainer boosts it when it is built)"
        )

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        if chunk_optimizer_of(optimizer) is None:
            raise NotSupportedError(
                f"{type(optimizer).__name__} was not boosted: under chunkmem the optimizer is the ChunkOptimizer "
                "that Booster.boost returns"
            )
        # No device placement: Accelerate would round-trip the full state through load_state_dict,
        # a collective gather of every optimizer state, to move tensors chunkmem already placed.
        return super().prepare_optimizer(optimizer, device_placement=False)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if kwargs:
            raise NotSupportedError(f"backward arguments {sorted(kwargs)} are not supported under chunkmem")
        # As Accelerate does: the loss divided by its own accumulation steps (1 under Trainer, which scales itself).
        self._chunk_optimizer("backward").backward(loss / self.gradient_accumulation_steps)

    @contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        if not isinstance(model, ChunkedModel):
            with super().no_sync(model):
                yield
            return
        # At every world size: under a tight budget no_sync is what lets a chunk's gradient buffer
        # move to the host instead of being reduced early (README, gradient accumulation).
        with model.runtime.no_sync():
            yield

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2) -> Any:
        optimizer = self._chunk_optimizer("clip_grad_norm_")
        # chunkmem clips over every gradient its optimizer holds: only "all of a boosted model's
        # parameters" (what Trainer passes) means that.
        params = {id(p) for p in parameters}
        if not any(params == {id(p) for p in model.parameters()} for model in prepared_models(self)):
            raise NotSupportedError(
                "clip_grad_norm_ under chunkmem clips the norm over all of the boosted model's gradients: pass "
                "model.parameters() of the boosted model, not a subset"
            )
        return optimizer.clip_grad_norm(max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        raise NotSupportedError(
            "clip_grad_value_ is not supported under chunkmem (gradients live sharded in chunks); clip by norm"
        )


@functools.cache
def routed_to_chunkmem(accelerator_class: type[Accelerator]) -> type[ChunkAccelerator]:
    """``ChunkAccelerator`` over ``accelerator_class``: itself for Accelerate's own class, else a
    subclass of both, so that a trainer's own Accelerator subclass keeps what it adds."""
    if issubclass(accelerator_class, ChunkAccelerator):
        return accelerator_class
    if accelerator_class is Accelerator:
        return ChunkAccelerator
    return type(f"Chunk{accelerator_class.__name__}", (ChunkAccelerator, accelerator_class), {})
