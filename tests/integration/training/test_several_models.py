"""Several models under one budget (issue 44): a trained policy and a frozen reference boosted
together (``Booster.boost(policy, optimizer, frozen=reference)``) compute a DPO loss in a plain
training loop. Against plain PyTorch (the same models, the same loop): losses and trained weights
equal bit for bit, the reference's values never change, the device budget holds with both models'
chunks in the ledger (byte counts from the chunks' element counts), one trace spans both models'
ops, and each chunk is gathered as often a step as that trace and the placement say."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.distributed import run_ranks
from support.models import VOCAB, llama

from chunkmem import Booster, ChunkedModel, ChunkPlugin
from chunkmem.errors import NotSupportedError
from chunkmem.placement import AutoPlacementConfig, Phase, StaticPlacementConfig
from chunkmem.placement.actions import Action, Verb
from chunkmem.usage.accounting import Location, MemoryKind

STEPS = 2
BETA = 0.1
CHUNK = 4096  # elements: each tiny LLaMA is ten chunks or so
FP32 = 4


def pairs(steps: int = STEPS, batch: int = 2, seq: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(chosen, rejected) token batches from a CPU generator."""
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randint(0, VOCAB, (batch, seq), generator=g), torch.randint(0, VOCAB, (batch, seq), generator=g))
        for _ in range(steps)
    ]


def logps(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Each sequence's summed log-probability of its own next tokens."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)


def dpo_step(
    policy: torch.nn.Module, reference: torch.nn.Module, chosen: torch.Tensor, rejected: torch.Tensor, ref_first: bool
) -> torch.Tensor:
    """The DPO loss of one batch: the reference's forward under no_grad, before the policy's or
    after it (TRL runs it after)."""
    ids = torch.cat([chosen, rejected])

    def ref() -> torch.Tensor:
        with torch.no_grad():
            return logps(reference, ids)

    ref_logps = ref() if ref_first else None
    pc, pr = logps(policy, ids).chunk(2)
    rc, rr = (ref_logps if ref_logps is not None else ref()).chunk(2)
    return -F.logsigmoid(BETA * ((pc - rc) - (pr - rr))).mean()


def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A policy and a reference with values of their own (a mix-up of their chunks would show)."""
    policy = llama(n_layer=1, hidden=32, seed=0)
    reference = llama(n_layer=1, hidden=32, seed=1)
    return policy, reference


def plain_run(ref_first: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    policy, reference = models()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    losses = []
    for chosen, rejected in pairs():
        loss = dpo_step(policy, reference, chosen, rejected, ref_first)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in policy.state_dict().items()}


def gathered_bytes(model: ChunkedModel) -> int:
    return sum(chunk.layout.gathered_bytes for chunk in model.chunks)


def boosted_pair(
    placement: StaticPlacementConfig, process_group: Any = None
) -> tuple[ChunkedModel, ChunkedModel, Any, Booster, dict[str, torch.Tensor]]:
    policy, reference = models()
    initial_reference = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    booster = Booster(ChunkPlugin(placement, precision="fp32", chunk_size=CHUNK, check_plans=True))
    chunked, boosted_optimizer, *_ = booster.boost(policy, optimizer, frozen=reference)
    (chunked_reference,) = chunked.frozen_models
    return chunked, chunked_reference, boosted_optimizer, booster, initial_reference


def chunked_run(
    placement: StaticPlacementConfig, ref_first: bool, steps: int = STEPS
) -> tuple[ChunkedModel, ChunkedModel, list[float], list[list[Action]], dict[str, torch.Tensor]]:
    chunked, reference, optimizer, booster, initial = boosted_pair(placement)
    losses, actions = [], []
    for chosen, rejected in pairs(steps):
        with chunked.runtime.record_actions() as record:
            loss = dpo_step(chunked, reference, chosen, rejected, ref_first)
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        actions.append(list(record))
    return chunked, reference, losses, actions, initial


def gathers_per_chunk(actions: list[Action], verbs: tuple[Verb, ...] = (Verb.GATHER, Verb.PREFETCH)) -> Counter[int]:
    """How often each chunk was gathered (on demand or ahead of its op) in ``actions``."""
    return Counter(action.chunk for action in actions if action.verb in verbs)


def tight_budget() -> StaticPlacementConfig:
    """Room for a few gathered chunks with their gradient buffers, not for both models' chunks at
    once: the reference's chunks must leave for the policy's backward and come back."""
    return StaticPlacementConfig(
        device_budget=6 * CHUNK * FP32, offload_optim_frac=1.0, offload_param_frac=1.0, max_prefetch=1
    )


@pytest.mark.slow
@pytest.mark.parametrize("ref_first", [False, True], ids=["ref-after", "ref-first"])
def test_dpo_pair_equals_plain_pytorch_under_one_budget(ref_first: bool) -> None:
    expected_losses, expected_state = plain_run(ref_first)
    placement = tight_budget()
    chunked, reference, losses, actions, initial = chunked_run(placement, ref_first)
    assert losses == expected_losses, "a DPO step with both models boosted under one budget is plain PyTorch's"
    state = chunked.state_dict()
    for name, value in expected_state.items():
        assert torch.equal(state[name], value), f"policy parameter {name} differs from plain PyTorch's"
    reference_state = reference.state_dict()
    assert set(reference_state) == set(initial), "the reference's state dict holds its own parameters only"
    for name, value in initial.items():
        assert torch.equal(reference_state[name], value), f"the reference's {name} changed"
    stats = chunked.stats()
    assert stats.peak_device_bytes <= placement.device_budget, "the budget covers both models"
    # Both models' chunks could not be resident at once: the budget made room across models.
    assert gathered_bytes(chunked) + gathered_bytes(reference) > placement.device_budget
    assert stats.trace_recordings == 1 and stats.divergences == 0, "one trace, followed every step"
    # From the trace (steps after the first): each reference chunk is gathered once a step, ahead of
    # the reference's forward (prefetched across models), on demand only for the step's first op.
    reference_ids = {chunk.chunk_id for chunk in reference.chunks}
    trace = chunked.runtime.trace
    assert trace is not None
    first = set(trace.steps[0].chunks)
    for step, done in enumerate(actions[1:], 1):
        counts = gathers_per_chunk(done)
        assert {c: counts[c] for c in reference_ids} == dict.fromkeys(reference_ids, 1), f"step {step}: {counts}"
        on_demand = set(gathers_per_chunk(done, (Verb.GATHER,))) & reference_ids - first
        assert not on_demand, f"step {step}: reference chunks {sorted(on_demand)} were gathered on demand"


@pytest.mark.slow
def test_one_trace_spans_both_models_and_frozen_chunks_hold_values_only() -> None:
    # No device budget (every chunk fits); everything at rest on the host.
    placement = StaticPlacementConfig(offload_optim_frac=1.0, offload_param_frac=1.0)
    chunked, reference, _, actions, _ = chunked_run(placement, ref_first=False)
    trace = chunked.runtime.trace
    assert trace is not None
    reference_ids = {chunk.chunk_id for chunk in reference.chunks}
    policy_ids = {chunk.chunk_id for chunk in chunked.chunks}
    assert reference_ids and policy_ids and not reference_ids & policy_ids, "each chunk holds one model's"
    seen = {(step.phase, c) for step in trace.steps for c in step.chunks}
    assert {(Phase.FORWARD, c) for c in reference_ids} <= seen, "the reference's forward is in the step's trace"
    assert not {(Phase.BACKWARD, c) for c in reference_ids} & seen, "the reference has no backward"
    # Without a budget nothing is evicted: a chunk is gathered at most once per phase that uses
    # it, so once a step for the reference's (its forward), once or twice for the policy's.
    for step, done in enumerate(actions):
        counts = gathers_per_chunk(done)
        assert {c: counts[c] for c in reference_ids} == dict.fromkeys(reference_ids, 1), f"step {step}: {counts}"
        assert all(1 <= counts[c] <= 2 for c in policy_ids), f"step {step}: {counts}"
    # At rest (host; nothing on the device between steps): the policy's fp32 masters, gradient
    # shards and AdamW's two states; the reference's values alone (fp32 here: the compute dtype).
    ledger = chunked.manager.ledger
    policy_elems = sum(c.layout.shard_numel for c in chunked.chunks)
    reference_elems = sum(c.layout.shard_numel for c in reference.chunks)
    assert ledger.bytes(Location.HOST, MemoryKind.MASTER) == FP32 * (policy_elems + reference_elems)
    # AdamW: exp_avg and exp_avg_sq per element, and a 4-byte step per parameter.
    policy_params = sum(len(c.layout.tensors) for c in chunked.chunks)
    assert ledger.bytes(Location.HOST, MemoryKind.OPTIM_STATE) == 2 * FP32 * policy_elems + FP32 * policy_params
    assert ledger.bytes(Location.HOST, MemoryKind.GRAD_SHARD) == FP32 * policy_elems
    assert ledger.device_bytes == 0


def test_frozen_model_cast_to_the_compute_dtype_keeps_no_fp32_master() -> None:
    policy, reference = models()
    booster = Booster(ChunkPlugin(StaticPlacementConfig(), precision="bf16", chunk_size=CHUNK))
    chunked, *_ = booster.boost(policy, torch.optim.AdamW(policy.parameters()), frozen=[reference])
    (boosted_reference,) = chunked.frozen_models
    assert boosted_reference.is_frozen and not chunked.is_frozen
    assert all(not p.requires_grad for p in reference.parameters())
    dtypes = {dtype for _, dtype in boosted_reference.state_shapes().values()}
    assert dtypes == {torch.bfloat16}, "a frozen model's values are kept in the compute dtype only"


def test_frozen_model_refusals_leave_the_models_as_they_were() -> None:
    policy, reference = models()
    booster = Booster(ChunkPlugin(StaticPlacementConfig(), precision="bf16", chunk_size=CHUNK))
    with pytest.raises(ValueError, match="the trained model itself"):
        booster.boost(policy, None, frozen=policy)
    optimizer = torch.optim.AdamW([*policy.parameters(), *reference.parameters()])
    with pytest.raises(ValueError, match="frozen models are never stepped"):
        booster.boost(policy, optimizer, frozen=reference)
    shared = copy.copy(reference)  # a shallow copy: the same parameter objects
    with pytest.raises(ValueError, match="also a parameter of frozen model 0"):
        booster.boost(policy, None, frozen=[reference, shared])
    tiny = Booster(ChunkPlugin(StaticPlacementConfig(device_budget=1024), precision="bf16", chunk_size=CHUNK))
    with pytest.raises(Exception, match="budget"):
        tiny.boost(policy, None, frozen=reference)
    auto = Booster(ChunkPlugin(AutoPlacementConfig(device_budget=10**7), precision="bf16", chunk_size=CHUNK))
    with pytest.raises(NotSupportedError, match="saved-tensor hooks"):  # the CPU: no allocator statistics
        auto.boost(policy, None, frozen=reference)
    assert all(p.requires_grad and p.dtype == torch.float32 for p in reference.parameters()), "put back"
    with torch.device("meta"):
        meta = llama(n_layer=2, hidden=32)
    with pytest.raises(NotSupportedError, match="meta device"):
        booster.boost(policy, None, frozen=meta)


def _dpo_on_ranks(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    chunked, reference, losses, actions, initial = chunked_run(tight_budget(), ref_first=False)
    reference_ids = [chunk.chunk_id for chunk in reference.chunks]
    state = chunked.state_dict()
    reference_state = reference.state_dict()
    return {
        "losses": losses,
        "state": state,
        "reference_unchanged": all(torch.equal(reference_state[k], v) for k, v in initial.items()),
        "peak": chunked.stats().peak_device_bytes,
        "divergences": chunked.stats().divergences,
        "reference_gathers": [[gathers_per_chunk(done)[c] for c in reference_ids] for done in actions],
    }


@pytest.mark.multirank
def test_dpo_pair_at_two_ranks_equals_plain_pytorch() -> None:
    """Every rank computes the same full batch: the averaged gradient is each rank's (g + g) / 2,
    exact in floating point, so the run equals plain PyTorch's bit for bit."""
    expected_losses, expected_state = plain_run(ref_first=False)
    results = run_ranks(_dpo_on_ranks, 2)
    for rank, result in enumerate(results):
        assert result["losses"] == expected_losses, f"rank {rank}"
        for name, value in expected_state.items():
            assert torch.equal(result["state"][name], value), f"rank {rank}: policy parameter {name}"
        assert result["reference_unchanged"], f"rank {rank}: the reference's values changed"
        assert result["peak"] <= tight_budget().device_budget, f"rank {rank}: over the budget"
        assert result["divergences"] == 0, f"rank {rank}"
        gathers = result["reference_gathers"]
        assert all(count == 1 for count in gathers[-1]), f"rank {rank}: reference gathers per chunk {gathers}"
