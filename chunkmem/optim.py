"""``ChunkOptimizer``: the user's own torch optimizer, re-pointed at this rank's fp32 master pieces.

Each parameter is represented by the piece of it that falls in this rank's shard of its chunk (a
view of the master shard, on the host or the device as the placement says), in the user's own
param group, so hyperparameters, LR schedulers and per-group settings keep working. Gradients are
views of the chunk's reduced gradient shard. A parameter that received no gradient on any rank has
no gradient, so the optimizer skips it, as plain PyTorch does.
"""

from __future__ import annotations

import inspect
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .accounting import Location, MemoryKind
from .chunk import Chunk, GradState
from .comm import Communicator
from .loss_scale import DynamicLossScaler
from .runtime import ChunkRuntime
from .tensor_state import TensorInfo

__all__ = ["ChunkOptimizer", "StateSize", "check_elementwise", "optimizer_state_size"]

log = logging.getLogger("chunkmem")
_FUSED_CAPABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
# torch optimizers whose update of each element depends only on that element's history.
_ELEMENTWISE = (
    *_FUSED_CAPABLE,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.ASGD,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
)


def _hyperparameters(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> dict[str, Any]:
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return {k: v for k, v in group.items() if k != "params" and k in accepted}


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """chunkmem runs the optimizer on flat pieces of each parameter, which is exact only for an
    update that treats every element on its own. Known torch optimizers are; any other class is
    probed: a few steps on a 2-D tensor must equal the same steps on its flattened halves."""
    if type(optimizer) in _ELEMENTWISE:
        return
    name = type(optimizer).__name__
    g = torch.Generator().manual_seed(0)
    start = torch.randn(4, 6, generator=g)
    grads = [torch.randn(4, 6, generator=g) for _ in range(3)]
    for group in optimizer.param_groups:
        hyper = _hyperparameters(optimizer, group)
        whole = start.clone().requires_grad_()
        halves = [start.reshape(-1)[:7].clone().requires_grad_(), start.reshape(-1)[7:].clone().requires_grad_()]
        try:
            on_whole, on_halves = type(optimizer)([whole], **hyper), type(optimizer)(halves, **hyper)
            for grad in grads:
                whole.grad = grad.clone()
                halves[0].grad, halves[1].grad = grad.reshape(-1)[:7].clone(), grad.reshape(-1)[7:].clone()
                on_whole.step()
                on_halves.step()
        except Exception as error:
            raise ValueError(
                f"could not check that {name} updates parameters elementwise ({type(error).__name__}: {error}); "
                "chunkmem runs the optimizer on flat pieces of each parameter"
            ) from error
        if not torch.allclose(whole.detach().reshape(-1), torch.cat([h.detach() for h in halves]), atol=1e-6):
            raise ValueError(
                f"{name} does not update parameters elementwise (its update depends on a parameter's shape, e.g. "
                "factored second moments); chunkmem shards parameters into flat pieces and cannot run it exactly. "
                "Use an elementwise optimizer such as AdamW, Adam, SGD, Adagrad or RMSprop."
            )


@dataclass(frozen=True)
class _Piece:
    """The part of one parameter in this rank's shard of its chunk."""

    tensor: torch.Tensor
    """View of the master shard."""
    chunk: Chunk
    info: TensorInfo
    first: int
    last: int
    """``[first, last)``: the elements of the flattened parameter it holds."""

    @property
    def shard_slice(self) -> slice:
        at = self.chunk.shard_offset(self.info)
        return slice(at + self.first, at + self.last)


@dataclass(frozen=True)
class StateSize:
    """Optimizer state an fp32 parameter piece of ``n`` elements costs: ``per_element * n +
    per_tensor`` bytes (scalars such as Adam's step count)."""

    per_element: int
    per_tensor: int


def optimizer_state_size(optimizer: torch.optim.Optimizer) -> StateSize:
    """Measured by one step of the same optimizer class with each group's hyperparameters on a
    small probe tensor; the largest over groups (momentum in one group only still needs room)."""
    n = 64
    per_element = per_tensor = 0
    for group in optimizer.param_groups:
        probe = torch.zeros(n, requires_grad=True)
        try:
            trial = type(optimizer)([probe], **_hyperparameters(optimizer, group))
            probe.grad = torch.full_like(probe, 1e-3)
            trial.step()
        except Exception as error:  # an optimizer we cannot probe: assume Adam-like state
            log.warning(
                "chunkmem: could not probe %s state size (%s); assuming Adam-like state",
                type(optimizer).__name__,
                error,
            )
            return StateSize(max(per_element, 8), max(per_tensor, 8))
        tensors = [v for v in trial.state[probe].values() if isinstance(v, torch.Tensor)]
        per_element = max(per_element, sum(v.numel() * v.element_size() for v in tensors if v.numel() == n) // n)
        per_tensor = max(per_tensor, sum(v.numel() * v.element_size() for v in tensors if v.numel() != n))
    return StateSize(per_element, per_tensor)


def _slice_state(state: dict[str, Any], piece: _Piece) -> dict[str, Any]:
    """A parameter's optimizer state cut down to a piece: tensors shaped like the parameter are
    sliced (elementwise state), anything else is kept. Devices and dtypes are left to
    ``Optimizer.load_state_dict``."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == piece.info.shape:
            out[key] = value.detach().reshape(-1)[piece.first : piece.last].clone()
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
        else:
            out[key] = value
    return out


class ChunkOptimizer:
    """What ``Booster.boost`` returns for the optimizer: ``step``, ``zero_grad``,
    ``clip_grad_norm``, ``param_groups`` (the user's groups, for LR schedulers) and checkpoints.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        runtime: ChunkRuntime,
        scaler: DynamicLossScaler | None,
    ) -> None:
        self._optim = optimizer
        self._runtime = runtime
        self._scaler = scaler
        self._unscaled = False
        self._found_inf = False
        self._accounted: Counter[Location] = Counter()
        manager = runtime.manager
        self._pieces: list[_Piece] = []
        # Each group's original parameters, in order: what a full (PyTorch-format) state dict indexes.
        self._group_infos: list[list[TensorInfo]] = []
        existing = dict(optimizer.state)
        resharded: dict[torch.Tensor, dict[str, Any]] = {}
        for group in optimizer.param_groups:
            pieces: list[torch.Tensor] = []
            infos: list[TensorInfo] = []
            self._group_infos.append(infos)
            for p in group["params"]:
                info = manager.info(p)
                infos.append(info)
                if not info.trainable:
                    continue
                chunk = manager.chunk(info.chunk_id)
                part = chunk.local_slice(info)
                if part is None:
                    continue
                at = chunk.shard_offset(info)
                piece = _Piece(chunk.store.master[at + part[0] : at + part[1]], chunk, info, *part)
                pieces.append(piece.tensor)
                self._pieces.append(piece)
                if p in existing:
                    resharded[piece.tensor] = _slice_state(existing[p], piece)
            group["params"] = pieces
            self._prefer_fused(group)
        self._load_local(resharded)

    def _prefer_fused(self, group: dict[str, Any]) -> None:
        """Use torch's fused kernels (CPU and CUDA) for the fp32 master pieces when the user left the
        choice to torch."""
        if (
            isinstance(self._optim, _FUSED_CAPABLE)
            and "fused" in group
            and group["fused"] is None
            and not group.get("foreach")
            and not group.get("differentiable")
        ):
            group["fused"] = True

    # --- what users call --------------------------------------------------------------------
    @property
    def optim(self) -> torch.optim.Optimizer:
        """The user's optimizer, now over master pieces."""
        return self._optim

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optim.param_groups

    @property
    def state(self) -> Any:
        return self._optim.state

    @property
    def communicator(self) -> Communicator:
        """The group the model's chunks are sharded over."""
        return self._runtime.manager.comm

    @property
    def loss_scale(self) -> float:
        return self._scaler.scale if self._scaler is not None else 1.0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward with loss scaling (fp16), then finish the gradient reduction."""
        if self._scaler is not None:
            loss = loss * self._scaler.scale
        loss.backward()
        self._runtime.finish_backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop all gradients (buffers, shards and the record of which parameters had one)."""
        self._runtime.zero_grad()
        self._unscaled = False
        self._found_inf = False

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm over all ranks to ``max_norm`` (like
        ``torch.nn.utils.clip_grad_norm_``) and return the norm before clipping."""
        self._prepare_grads()
        shards = self._grad_shards()
        norm_type = float(norm_type)
        device = self._runtime.manager.comm.device
        if norm_type == float("inf"):
            local = max((float(g.abs().max()) for g in shards if g.numel()), default=0.0)
            total = torch.tensor([local], dtype=torch.float64, device=device)
            self._runtime.manager.comm.all_reduce(total, dist.ReduceOp.MAX)
            norm = total[0]
        else:
            local = sum(float(torch.linalg.vector_norm(g, norm_type)) ** norm_type for g in shards)
            total = torch.tensor([local], dtype=torch.float64, device=device)
            self._runtime.manager.comm.all_reduce(total)
            norm = total[0] ** (1.0 / norm_type)
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            for g in shards:
                g.mul_(coef)
        return norm.to(torch.float32)

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """Reduce what is pending, unscale and check fp16 gradients (skipping the step on inf/nan
        on any rank), run the user's optimizer on this rank's master pieces, then refresh or
        release the gathered chunks.
        """
        if closure is not None:
            raise NotImplementedError("ChunkOptimizer.step does not take a closure; run forward/backward first")
        self._prepare_grads()
        stats = self._runtime.stats_counters
        if self._found_inf:
            stats.skipped_steps += 1
            log.info("chunkmem: inf/nan gradients at loss scale %s; step skipped", self.loss_scale)
        else:
            for piece in self._pieces:
                chunk = piece.chunk
                if chunk.grad_state is GradState.REDUCED and chunk.params_with_grad[piece.info.index]:
                    piece.tensor.grad = chunk.grad_shard[piece.shard_slice]
            try:
                self._optim.step()
            finally:
                for piece in self._pieces:
                    piece.tensor.grad = None
            self._account_state()
            self._runtime.check_budget(f"{type(self._optim).__name__}.step creating its state")
            stats.optimizer_steps += 1
        if self._scaler is not None:
            self._scaler.update(self._found_inf)
        self._unscaled = False
        self._found_inf = False
        self._runtime.after_step()

    # --- internals --------------------------------------------------------------------------
    def _grad_shards(self) -> list[torch.Tensor]:
        return [c.grad_shard for c in self._runtime.manager.chunks if c.trainable and c.grad_state is GradState.REDUCED]

    def _prepare_grads(self) -> None:
        """Reduce whatever is pending, then unscale fp16 gradients once and agree on inf/nan."""
        self._runtime.prepare_step()
        if self._scaler is None or self._unscaled:
            return
        inv = 1.0 / self._scaler.scale
        found = 0.0
        for g in self._grad_shards():
            g.mul_(inv)
            found = max(found, float(not bool(torch.isfinite(g).all())))
        flag = torch.tensor([found], device=self._runtime.manager.comm.device)
        self._runtime.manager.comm.all_reduce(flag, dist.ReduceOp.MAX)
        self._found_inf = bool(flag[0] > 0)
        self._unscaled = True

    def _account_state(self) -> None:
        """Account optimizer state per location: the largest figure over ranks, so that every
        rank's ledger, and every placement decision made from it, is the same (a rank's pieces
        of a chunk, and their per-tensor state such as Adam's step, differ from rank to rank)."""
        per_location: Counter[Location] = Counter()
        for piece in self._pieces:
            for value in self._optim.state.get(piece.tensor, {}).values():
                if isinstance(value, torch.Tensor):
                    per_location[piece.chunk.store.master_location] += value.numel() * value.element_size()
        comm = self._runtime.manager.comm
        if comm.world_size > 1:
            largest = torch.tensor(
                [per_location[location] for location in Location], dtype=torch.int64, device=comm.device
            )
            comm.all_reduce(largest, dist.ReduceOp.MAX)
            per_location = Counter(dict(zip(Location, largest.tolist(), strict=True)))
        ledger = self._runtime.manager.ledger
        for location in Location:
            delta = per_location[location] - self._accounted[location]
            if delta > 0:
                ledger.alloc(location, MemoryKind.OPTIM_STATE, delta)
            elif delta < 0:
                ledger.free(location, MemoryKind.OPTIM_STATE, -delta)
        self._accounted = per_location

    # --- checkpoints ------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, Any]:
        """The optimizer state in plain PyTorch's format (``torch.optim.Optimizer.state_dict``):
        full parameter shapes, indexed by position in the original param groups, on rank 0's CPU
        (an empty dict elsewhere). It loads into the same optimizer class in plain PyTorch or into
        chunkmem with any world size or chunk size. A collective: call it on every rank."""
        comm = self._runtime.manager.comm
        first = comm.rank == 0
        local: dict[str, tuple[bool, str]] = {}
        for piece in self._pieces:
            for key, value in self._optim.state.get(piece.tensor, {}).items():
                if isinstance(value, torch.Tensor):
                    local[key] = (value.shape == piece.tensor.shape and value.dim() > 0, str(value.dtype))
        keys: dict[str, tuple[bool, str]] = {}
        for other in comm.all_gather_object(local):
            keys.update(other)
        pieces_of: dict[int, list[_Piece]] = {}
        for piece in self._pieces:
            pieces_of.setdefault(id(piece.info), []).append(piece)
        state: dict[int, dict[str, Any]] = {}
        index = 0
        for infos in self._group_infos:
            for info in infos:
                entry = self._gather_param_state(info, pieces_of.get(id(info), []), keys) if info.trainable else None
                if first and entry:
                    state[index] = entry
                index += 1
        groups, start = [], 0
        for group, infos in zip(self._optim.param_groups, self._group_infos, strict=True):
            groups.append(
                {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + len(infos)))}
            )
            start += len(infos)
        out = {"state": state, "param_groups": groups} if first else {}
        if first and self._scaler is not None:
            out["loss_scaler"] = self._scaler.state_dict()
        return out

    def _gather_param_state(
        self, info: TensorInfo, pieces: list[_Piece], keys: dict[str, tuple[bool, str]]
    ) -> dict[str, Any] | None:
        """One parameter's full state, assembled on rank 0 from the pieces every rank holds."""
        comm = self._runtime.manager.comm
        present = torch.tensor([float(any(self._optim.state.get(p.tensor) for p in pieces))], device=comm.device)
        comm.all_reduce(present, dist.ReduceOp.MAX)
        if not present.item():
            return None  # no rank has state for it: it never had a gradient, as in plain PyTorch
        entry: dict[str, Any] = {}
        for key, (elementwise, dtype_name) in sorted(keys.items()):
            dtype = getattr(torch, dtype_name.removeprefix("torch."))
            if elementwise:
                with self._runtime.transient(info.numel * 4, f"gathering optimizer state '{key}' of '{info.name}'"):
                    full = torch.zeros(info.numel, dtype=torch.float32, device=comm.device)
                    for piece in pieces:
                        value = self._optim.state.get(piece.tensor, {}).get(key)
                        if value is not None:
                            full[piece.first : piece.last] = value.to(full.device)
                    comm.reduce_to_first(full)
                    entry[key] = full.view(info.shape).to("cpu", dtype)
                    del full
            else:
                values = [self._optim.state.get(p.tensor, {}).get(key) for p in pieces]
                known = [float(v) for v in values if isinstance(v, torch.Tensor)]
                scalar = torch.tensor([max(known, default=float("-inf"))], dtype=torch.float64, device=comm.device)
                comm.all_reduce(scalar, dist.ReduceOp.MAX)
                entry[key] = torch.tensor(scalar.item(), dtype=dtype)
        return entry

    def load_full_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict in plain PyTorch's format (from ``full_state_dict`` or from a plain
        PyTorch optimizer of the same class over the same model): hyperparameters per group and
        each parameter's state, cut down to the pieces this rank holds."""
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(infos) for infos in self._group_infos]:
            raise ValueError(
                f"optimizer state dict has param groups of sizes {[len(g['params']) for g in groups]}, this "
                f"optimizer has {[len(infos) for infos in self._group_infos]}; load a state saved for the same "
                "model and param groups"
            )
        saved = state_dict["state"]
        loaded: dict[torch.Tensor, dict[str, Any]] = {}
        for group, saved_group, infos in zip(self._optim.param_groups, groups, self._group_infos, strict=True):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
            for index, info in zip(saved_group["params"], infos, strict=True):
                entry = saved.get(index, saved.get(str(index)))
                if entry is None or not info.trainable:
                    continue
                for piece in self._pieces:
                    if piece.info is info:
                        loaded[piece.tensor] = _slice_state(entry, piece)
        self._load_local(loaded)
        if self._scaler is not None and "loss_scaler" in state_dict:
            self._scaler.load_state_dict(state_dict["loss_scaler"])

    def _load_local(self, states: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Install per-piece state through the optimizer's own ``load_state_dict`` (it puts each
        value on the device and dtype its class expects), replacing all existing state."""
        index: dict[int, int] = {}
        groups = []
        for group in self._optim.param_groups:
            ids = []
            for tensor in group["params"]:
                index[id(tensor)] = len(index)
                ids.append(index[id(tensor)])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        self._optim.state.clear()
        self._optim.load_state_dict({"state": {index[id(t)]: st for t, st in states.items()}, "param_groups": groups})
        self._account_state()
