"""A run takes the actions the replay of its trace predicts, also where a chunk's parameters do not
all get a gradient: a layer packed beside used ones but never called, frozen parameters, tied
weights, experts that only some inputs reach. When a chunk's gradients are complete is one rule
(``placement.DeviceResidency``: after the last backward op of the pass that uses it, read from the
trace), used by the run and by ``placement.simulate``; a rule read from the parameters (every one
has its gradient) never fires for a chunk holding a parameter no op used, so such a run reduced it
only at the end of the backward while the replay reduced it after its last op.

Each case trains a few steps with chunkmem and plain PyTorch side by side (equal to the bit), and
compares every step that followed a recorded trace with the replay of that trace through a fresh
policy of the same placement. A gradient that arrives after its chunk's reduction started (an op
the hooks do not see, here a custom autograd function using a weight before a layer that owns it)
gets a fresh buffer, reduced at the end and added: not lost, not counted twice."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.distributed import run_ranks
from support.models import adamw_two_groups, assert_state_close, boost, copies, tolerance

from chunkmem import ChunkedModel
from chunkmem.placement import Action, StaticPlacementConfig, Verb, make_policy, simulate

WIDTH = 16
CHUNK = 600  # elements: two 16x16 layers with their biases fill a chunk
STEPS = 3
# Every chunk's parameters live on the host and are gathered for each op (prefetched ahead): every
# op moves something, so the order of reductions among gathers and releases is visible.
PLACEMENT = StaticPlacementConfig(offload_param_frac=1.0, offload_optim_frac=1.0, max_prefetch=1)


def _linear(n_in: int = WIDTH, n_out: int = WIDTH) -> torch.nn.Linear:
    return torch.nn.Linear(n_in, n_out)


class Unused(torch.nn.Module):
    """``unused`` is packed with ``out`` (chunk 1, the first in backward) and never called."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.out, self.unused = _linear(), _linear(), _linear(WIDTH, 4), _linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


class Frozen(torch.nn.Module):
    """``inp`` and ``mid.weight`` are frozen (their chunk is used in backward, gets no gradient);
    ``mid.bias`` trains in the chunk of ``out``, and ``mid`` uses both chunks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.out = _linear(), _linear(), _linear(WIDTH, 4)
        for p in (*self.inp.parameters(), self.mid.weight):
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


VOCAB = 24


class Tied(torch.nn.Module):
    """The embedding is the output projection too, and ``mid`` runs twice: weights used by two ops."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.mid = _linear()
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.mid(self.emb(ids)))))
        return self.head(h)


class Routed(torch.nn.Module):
    """Each sample goes to the expert its first feature picks (below 0, 0 to 1, above 1); an expert
    no sample reaches is not called. Experts 1 and 2 share chunk 1."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = _linear()
        self.experts = torch.nn.ModuleList(_linear() for _ in range(3))
        self.out = _linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        route = (x[:, 0] > 0).long() + (x[:, 0] > 1).long()
        y = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (route == e).nonzero().squeeze(1)
            if rows.numel():
                y = y.index_add(0, rows, expert(h[rows]))
        return self.out(torch.tanh(y))


class _UseFirst(torch.autograd.Function):
    """``x @ w.T`` with its own backward: the hooks see its ops as forward ops, never as a backward
    op, so the trace does not know that its backward adds to ``w``'s gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        return grad @ w, grad.t() @ x


class LateGradient(torch.nn.Module):
    """``inp.weight`` is used by the custom function before ``inp`` runs: ``inp``'s backward is its
    chunk's last backward op, yet the weight's gradient comes after the function's backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = _linear(), _linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(_UseFirst.apply(x, self.inp.weight))
        return self.out(torch.tanh(self.inp(h)))


def _features(step: int, rank: int, buckets: tuple[int, ...] = (0, 1)) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, WIDTH, generator=g)
    # The first feature in each bucket's range (the routed model's branch), cycling over the rows.
    x[:, 0] = torch.tensor([(-0.5, 0.5, 1.5)[buckets[i % len(buckets)]] for i in range(8)])
    return x


def _routed_data(step: int, rank: int) -> torch.Tensor:
    # Steps 0-1 reach experts 0 and 1; step 2 all three (one more op on chunk 1: the iteration
    # departs from the trace and records a new one), which step 3 follows.
    return _features(step, rank, (0, 1) if step < 2 else (0, 1, 2))


def _ids(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(100 * step + rank))


def _regression(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _next_token(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


Data = Callable[[int, int], torch.Tensor]
Loss = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]
# name -> (model, loss, data of a step and rank, steps)
CASES: dict[str, tuple[Callable[[], torch.nn.Module], Loss, Data, int]] = {
    "unused": (Unused, _regression, _features, STEPS),
    "frozen": (Frozen, _regression, _features, STEPS),
    "tied": (Tied, _next_token, _ids, STEPS),
    "routed": (Routed, _regression, _routed_data, 4),
}


def _reference_step(ref: torch.nn.Module, optimizer: torch.optim.Optimizer, loss: Loss, parts: list[Any]) -> None:
    """Plain PyTorch: each rank's gradients, the ranks' sums added in rank order and divided by
    the world size (what DDP reduces; one rank: its own), then one step."""
    params = [p for p in ref.parameters() if p.requires_grad]
    total: list[torch.Tensor | None] = [None] * len(params)
    for part in parts:
        loss(ref, part).backward()
        for i, p in enumerate(params):
            if p.grad is not None:
                total[i] = p.grad.clone() if total[i] is None else total[i] + p.grad  # type: ignore[operator]
        optimizer.zero_grad()
    for p, g in zip(params, total, strict=True):
        p.grad = None if g is None else (g / len(parts) if len(parts) > 1 else g)
    optimizer.step()
    optimizer.zero_grad()


def _train(rank: int, world_size: int, name: str) -> dict[str, Any]:
    """Train the case with chunkmem and plain PyTorch (asserting equal states); return each step's
    actions and, for each step that followed a recorded trace, the replay's actions."""
    make, loss, data, steps = CASES[name]
    model, ref = copies(make())
    ref_optimizer = adamw_two_groups(ref)
    chunked, optimizer, booster = _boost(model)
    runtime = chunked.runtime
    real: list[list[tuple[str, int]]] = []
    replayed: list[list[tuple[str, int]] | None] = []
    for step in range(steps):
        parts = [data(step, r) for r in range(world_size)]
        _reference_step(ref, ref_optimizer, loss, parts)
        followed = runtime.trace
        divergences = runtime.stats_counters.divergences
        with runtime.record_actions() as actions:
            booster.backward(loss(chunked, parts[rank]), optimizer)
            optimizer.step()
            optimizer.zero_grad()
        real.append(_named(actions))
        if followed is None or runtime.stats_counters.divergences != divergences:
            replayed.append(None)  # the first step (nothing recorded yet), or one that departed
            continue
        replay = simulate(
            make_policy(PLACEMENT, None), runtime.specs, followed, 2, runtime.policy.working_sets, world_size=world_size
        )
        assert not replay.over_budget
        replayed.append(_named(replay.actions[1]))
    assert_state_close(chunked.state_dict(), ref.state_dict(), *tolerance(chunked, rtol=0.0, atol=0.0))
    return {"real": real, "replayed": replayed, "chunks": _chunk_params(chunked)}


def _boost(model: torch.nn.Module) -> Any:
    return boost(model, adamw_two_groups, precision="fp32", chunk_size=CHUNK, placement=PLACEMENT)


def _named(actions: Any) -> list[tuple[str, int]]:
    return [(a.verb.value, a.chunk) for a in actions]


def _chunk_params(chunked: ChunkedModel) -> list[list[str]]:
    return [[info.name for info in chunk.layout.tensors] for chunk in chunked.manager.chunks]


def _assert_replayed(result: dict[str, Any]) -> None:
    compared = 0
    for step, (real, replayed) in enumerate(zip(result["real"], result["replayed"], strict=True)):
        if replayed is not None:
            assert real == replayed, f"step {step}: the run's actions are not the replay's"
            compared += 1
    assert compared, "no step followed a recorded trace: nothing was compared"
    assert any(verb == Verb.START_REDUCE.value for verb, _ in result["real"][-1])


def test_the_cases_pack_what_they_say() -> None:
    """The layouts the cases rely on (a chunk size change would make them test nothing)."""
    assert _chunk_params(_boost(Unused())[0]) == [
        ["inp.weight", "inp.bias", "mid.weight", "mid.bias"],
        ["out.weight", "out.bias", "unused.weight", "unused.bias"],
    ]
    routed = _chunk_params(_boost(Routed())[0])
    assert routed[1] == ["experts.1.weight", "experts.1.bias", "experts.2.weight", "experts.2.bias"]


@pytest.mark.parametrize("name", list(CASES))
def test_a_run_takes_the_actions_its_replay_predicts(name: str) -> None:
    result = _train(0, 1, name)
    _assert_replayed(result)
    if name == "routed":
        assert result["replayed"][2] is None and result["replayed"][3] is not None, "step 2 was meant to depart"


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["unused", "tied"])
def test_at_two_ranks_every_rank_takes_the_actions_its_replay_predicts(name: str) -> None:
    results = run_ranks(_train, 2, args=(name,))
    for result in results:
        _assert_replayed(result)
    assert results[0]["real"] == results[1]["real"]


def _late(rank: int, world_size: int) -> list[list[Action]]:
    model, ref = copies(LateGradient())
    ref_optimizer = adamw_two_groups(ref)
    chunked, optimizer, booster = _boost(model)
    recorded = []
    for step in range(STEPS):
        parts = [_features(step, r) for r in range(world_size)]
        _reference_step(ref, ref_optimizer, _regression, parts)
        with chunked.runtime.record_actions() as actions:
            booster.backward(_regression(chunked, parts[rank]), optimizer)
        recorded.append(list(actions))
        optimizer.step()
        optimizer.zero_grad()
    assert_state_close(chunked.state_dict(), ref.state_dict(), *tolerance(chunked, rtol=0.0, atol=0.0))
    return recorded


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.multirank)])
def test_a_gradient_after_its_chunks_reduction_started_is_reduced_once_more(world_size: int) -> None:
    """From the second step on, the trace completes chunk 0 after ``inp``'s backward; the weight's
    gradient comes after that and is reduced by a second reduction, added to the first: training
    equals plain PyTorch to the bit."""
    results = run_ranks(_late, world_size) if world_size > 1 else [_late(0, 1)]
    for recorded in results:
        later = [(a.verb, a.chunk) for a in recorded[-1]]
        assert later.count((Verb.START_REDUCE, 0)) == 2, later
