"""``GradScaling``: fp16 loss scaling and gradient clipping, one object over the reduced gradients.

Both read and change every chunk's reduced gradient shard before the step (in memory, or through
its ``GradOnDisk`` when it lives on disk). With fp16 the backward runs on a scaled loss
(``backward``); before the step or a clipping reads the gradients they are unscaled once and the
ranks agree on whether any is inf/nan (``prepare``), in which case the step is skipped and the scale
backs off (``after_step``). A gradient computed by a plain ``loss.backward()`` under fp16 is refused.
Clipping scales the gradients in place, which early host steps did not see: it undoes them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..chunks.grad_norm import flat_norm
from ..chunks.grad_on_disk import GradOnDisk
from ..errors import UnscaledBackwardError
from .loss_scale import DynamicLossScaler

if TYPE_CHECKING:
    from ..chunks.manager import ChunkManager
    from ..execution.runtime import ChunkRuntime
    from .early_steps import EarlySteps

__all__ = ["GradScaling"]


class GradScaling:
    """See the module docstring. ``scaler`` is ``None`` for fp32 and bf16 (no loss scaling)."""

    def __init__(
        self,
        runtime: ChunkRuntime,
        manager: ChunkManager,
        scaler: DynamicLossScaler | None,
        early: EarlySteps | None,
    ) -> None:
        self._runtime = runtime
        self._manager = manager
        self._scaler = scaler
        self._early = early
        self._unscaled = False  # this iteration's gradients were unscaled (once, before a step or a clip)
        self._found_inf = False  # and some rank found inf/nan in them
        self._in_scaled_backward = False
        self._unscaled_backward = False  # a gradient arrived outside ``backward``: refused at the step
        self._hooks = []
        if scaler is not None:
            self._hooks = [
                info.param.register_post_accumulate_grad_hook(self._note_gradient)
                for info in manager.infos
                if info.trainable
            ]

    @property
    def scaler(self) -> DynamicLossScaler | None:
        return self._scaler

    @property
    def scale(self) -> float:
        return self._scaler.scale if self._scaler is not None else 1.0

    def inverse(self) -> float | None:
        """What the gradients are multiplied by to unscale them (``None`` without loss scaling)."""
        return None if self._scaler is None else 1.0 / self._scaler.scale

    @property
    def found_inf(self) -> bool:
        """The gradients of this iteration hold inf/nan on some rank (after ``prepare``)."""
        return self._found_inf

    def backward(self, loss: torch.Tensor) -> None:
        """Backward on the scaled loss (fp16), then finish the gradient reduction."""
        if self._scaler is not None:
            loss = loss * self._scaler.scale
        self._in_scaled_backward = True
        try:
            loss.backward()
        finally:
            self._in_scaled_backward = False
        self._runtime.finish_backward()

    def _note_gradient(self, param: torch.Tensor) -> None:
        if not self._in_scaled_backward:
            self._unscaled_backward = True

    def zero_grad(self) -> None:
        """The gradients were dropped: what was learnt about them goes too."""
        self._unscaled = self._found_inf = self._unscaled_backward = False

    def after_step(self) -> None:
        """The step is done (taken or skipped): the scale follows what it found."""
        if self._scaler is not None:
            self._scaler.update(self._found_inf)
        self._unscaled = self._found_inf = False

    def reduced_grads(self) -> list[torch.Tensor | GradOnDisk]:
        """Each reduced gradient shard, in chunk order: in memory, or the ``GradOnDisk`` of one on
        disk (which keeps what the checks need of it)."""
        out: list[torch.Tensor | GradOnDisk] = []
        for chunk in self._manager.chunks:
            if chunk.layout.trainable and self._runtime.grads_reduced(chunk.chunk_id):
                grad = chunk.store.grad_on_disk
                out.append(grad if grad is not None else chunk.grads.shard)
        return out

    def prepare(self) -> None:
        """Reduce whatever is pending, then unscale fp16 gradients once and agree on inf/nan."""
        if self._unscaled_backward:
            raise UnscaledBackwardError(
                "fp16 gradients were computed by a plain loss.backward(): without loss scaling, small fp16 gradients "
                "underflow to zero and overflows go unnoticed, so the optimizer refuses to step on them. Use "
                "booster.backward(loss, optimizer) (it scales the loss and the step unscales and checks the "
                "gradients). Call optimizer.zero_grad() to drop the gradients computed so far."
            )
        self._runtime.prepare_step()
        if self._early is not None and self._early.pending:
            # The worker reads (and its kernel may write) gradient shards that the checks below
            # read or change (fp16 unscaling, clipping): the early steps are done first.
            self._early.settle()
        if self._scaler is None or self._unscaled:
            return
        inv = 1.0 / self._scaler.scale
        found = 0.0
        for g in self.reduced_grads():
            if isinstance(g, GradOnDisk):
                g.scale(inv)
                found = max(found, float(not g.finite))
            else:
                g.mul_(inv)
                found = max(found, float(not bool(torch.isfinite(g).all())))
        flag = torch.tensor([found], device=self._manager.comm.tensor_device)
        self._manager.comm.all_reduce(flag, dist.ReduceOp.MAX)
        self._found_inf = bool(flag[0] > 0)
        self._unscaled = True
        if self._found_inf and self._early is not None:
            self._early.cancel("fp16 inf/nan gradients: the step is skipped")

    def clip(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip the global gradient norm over all ranks to ``max_norm`` (like
        ``torch.nn.utils.clip_grad_norm_``) and return the norm before clipping. A collective."""
        norm_type = float(norm_type)
        self._runtime.agree_entry("clip_grad_norm", f"max_norm {float(max_norm)!r}, norm_type {norm_type!r}")
        self.prepare()
        grads = self.reduced_grads()  # in chunk order: the sum below adds in the same order anywhere
        comm = self._manager.comm

        def norm_of(grad: torch.Tensor | GradOnDisk) -> float:
            return grad.norm(norm_type) if isinstance(grad, GradOnDisk) else flat_norm(grad, norm_type)

        if norm_type == float("inf"):
            local = max((norm_of(g) for g in grads), default=0.0)
            total = torch.tensor([local], dtype=torch.float64, device=comm.tensor_device)
            comm.all_reduce(total, dist.ReduceOp.MAX)
            norm = total[0]
        else:
            local = sum(norm_of(g) ** norm_type for g in grads)
            total = torch.tensor([local], dtype=torch.float64, device=comm.tensor_device)
            comm.all_reduce(total)
            norm = total[0] ** (1.0 / norm_type)
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            if self._early is not None:
                self._early.cancel("the gradients they stepped on are clipped")
            for g in grads:
                if isinstance(g, GradOnDisk):
                    g.scale(coef)
                else:
                    g.mul_(coef)
        return norm.to(torch.float32)
