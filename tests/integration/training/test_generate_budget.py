"""``generate()`` on a boosted model under a device budget below the model's size: the KV cache in
the ledger (against the analytic size of transformers' dynamic cache and the bytes a plain
``generate`` leaves in its cache), a cache that cannot fit refused before decoding, decode steps
prefetching every chunk in the recorded order (counted, not timed), and greedy and sampled tokens
equal to plain ``generate()``'s on the same seed, at W=1 and W=2."""

from __future__ import annotations

import itertools
import re
from collections import Counter
from typing import Any

import pytest
import torch
from support.distributed import run_ranks
from support.models import copies, gpt2, llama, reference_device

from chunkmem import Booster, BudgetExceededError, ChunkedModel, ChunkPlugin
from chunkmem.placement import StaticPlacementConfig
from chunkmem.placement.actions import Verb

pytestmark = pytest.mark.slow  # a boost and a few generates each: the full tier

CHUNK = 12_000


def _boosted(model: torch.nn.Module) -> tuple[ChunkedModel, int]:
    """``model`` boosted in fp32 with every chunk offloaded, under a budget of half its size."""
    budget = sum(p.numel() * 4 for p in model.parameters()) // 2
    placement = StaticPlacementConfig(device_budget=budget, offload_param_frac=1.0, offload_optim_frac=1.0)
    chunked, *_ = Booster(plugin=ChunkPlugin(precision="fp32", chunk_size=CHUNK, placement=placement)).boost(model)
    return chunked, budget


def _prompt(batch: int, length: int, seed: int = 4) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _on(prompt: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {name: value.to(device) for name, value in prompt.items()}


def _cache_bytes(model: torch.nn.Module, sequences: int, positions: int) -> int:
    """The dynamic cache's size, from the config: a key and a value per layer and position."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * sequences * positions * kv_heads * head_dim * 4


class _Sampler:
    """A streamer: ``stats()`` of the boosted model each time generate hands out tokens."""

    def __init__(self, chunked: ChunkedModel) -> None:
        self.chunked = chunked
        self.seen: list[tuple[int, int]] = []

    def put(self, value: torch.Tensor) -> None:
        stats = self.chunked.stats()
        self.seen.append((stats.kv_cache_bytes, stats.device_bytes))

    def end(self) -> None:
        pass


def test_the_kv_cache_is_in_the_ledger_and_tokens_equal_plain_generate() -> None:
    model, ref = copies(llama())
    ref.to(reference_device())
    chunked, budget = _boosted(model)
    resting = chunked.stats().device_bytes
    prompt = _prompt(2, 5)
    sampler = _Sampler(chunked)
    out = chunked.generate(**prompt, max_new_tokens=6, do_sample=False, streamer=sampler)
    plain = ref.generate(
        **_on(prompt, reference_device()), max_new_tokens=6, do_sample=False, return_dict_in_generate=True
    )
    assert torch.equal(out.cpu(), plain.sequences.cpu())
    # Reserved from the start at its longest: the prompt and the new tokens but the last (never fed back).
    expected = _cache_bytes(ref, 2, 5 + 6 - 1)
    held = sum(t.untyped_storage().nbytes() for layer in plain.cache.layers for t in (layer.keys, layer.values))
    assert held == expected  # what plain generate's cache holds at the end
    assert [kv for kv, _ in sampler.seen] == [expected] * 7  # the prompt, then each of 6 tokens
    assert all(kv <= device <= budget for kv, device in sampler.seen)
    stats = chunked.stats()
    assert stats.peak_device_bytes <= budget
    assert (stats.kv_cache_bytes, stats.device_bytes) == (0, resting)  # given back, every chunk released

    for seed in (0,):  # sampling: the same draws as plain generate on the same seed
        torch.manual_seed(seed)
        sampled = chunked.generate(**prompt, max_new_tokens=6, do_sample=True, top_k=20, top_p=0.9)
        torch.manual_seed(seed)
        expected_tokens = ref.generate(
            **_on(prompt, reference_device()), max_new_tokens=6, do_sample=True, top_k=20, top_p=0.9
        )
        assert torch.equal(sampled.cpu(), expected_tokens.cpu()), seed
    assert chunked.stats().peak_device_bytes <= budget


def test_a_cache_that_cannot_fit_is_refused_before_decoding() -> None:
    model, ref = copies(llama())
    chunked, budget = _boosted(model)
    calls: list[int] = []
    chunked.module.register_forward_pre_hook(lambda module, args: calls.append(1))
    prompt = _prompt(32, 4)
    with pytest.raises(BudgetExceededError) as refused:
        chunked.generate(**prompt, max_new_tokens=60, do_sample=False)
    message = str(refused.value)
    assert f"device_budget={budget}" in message
    assert f"{_cache_bytes(ref, 32, 4 + 60 - 1) / 1024:.2f} KiB for the KV cache" in message
    assert "smaller batch" in message and calls == []  # decided before the prompt's forward
    assert refused.value.minimum is not None and refused.value.minimum > budget
    fits = re.search(r"max_new_tokens=(\d+) fits at this batch", message)
    assert fits is not None, message
    tokens = int(fits.group(1))
    assert 0 < tokens < 60
    with pytest.raises(BudgetExceededError, match="for the KV cache"):
        chunked.generate(**prompt, max_new_tokens=tokens + 1, do_sample=False)
    out = chunked.generate(**prompt, max_new_tokens=tokens, do_sample=False, pad_token_id=0)  # the fix it named
    assert out.shape == (32, 4 + tokens)
    assert chunked.stats().peak_device_bytes <= budget

    # The real cache is checked as it grows: a config that says less than the model keeps is caught.
    chunked.config.head_dim = 8  # the layers were built with 16
    with pytest.raises(BudgetExceededError, match=r"more than the .* reserved for it"):
        chunked.generate(**_prompt(2, 5), max_new_tokens=3, do_sample=False)
    assert chunked.stats().kv_cache_bytes == 0


def _decode_counts(chunked: ChunkedModel, prompt: dict[str, torch.Tensor], tokens: int) -> tuple[Any, list[Counter]]:
    """Generate greedily; per module call (the prompt's, then each decode step's), how many times
    each action was taken per chunk: ``Counter((verb, chunk))``."""
    marks: list[int] = []
    record: list[Any] = []
    handle = chunked.module.register_forward_pre_hook(lambda module, args: marks.append(len(record)))
    try:
        with chunked.runtime.record_actions() as record:
            out = chunked.generate(**prompt, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    finally:
        handle.remove()
    marks.append(len(record))
    steps = [Counter((a.verb, a.chunk) for a in record[start:stop]) for start, stop in itertools.pairwise(marks)]
    return out, steps


def test_decode_steps_prefetch_every_chunk_in_the_recorded_order() -> None:
    """GPT-2 (tied embeddings: its first and last ops share a chunk). The first decode step records
    the decode trace; from the third on, every chunk of the model is gathered ahead exactly once per
    step (the first ones at the end of the step before) and none on demand."""
    model, ref = copies(gpt2())
    ref.to(reference_device())
    chunked, budget = _boosted(model)
    prompt = _prompt(2, 5)
    out, steps = _decode_counts(chunked, prompt, 7)
    expected = ref.generate(**_on(prompt, reference_device()), max_new_tokens=7, do_sample=False, pad_token_id=0)
    assert torch.equal(out.cpu(), expected.cpu())
    assert len(steps) == 7
    chunks = {chunk.chunk_id for chunk in chunked.chunks}
    for index, step in enumerate(steps[3:], start=3):
        on_demand = sum(n for (verb, _), n in step.items() if verb is Verb.GATHER)
        ahead = {c: n for (verb, c), n in step.items() if verb is Verb.PREFETCH}
        hits = {c: n for (verb, c), n in step.items() if verb is Verb.CLAIM}
        assert (on_demand, ahead, hits) == (0, dict.fromkeys(chunks, 1), dict.fromkeys(chunks, 1)), index
    stats = chunked.stats()
    assert stats.peak_device_bytes <= budget
    assert stats.divergences == 0  # the prompt's forward and the decode steps each follow a trace of their own
    # A later generate follows the decode trace from its first decode step.
    _, again = _decode_counts(chunked, prompt, 4)
    assert all(sum(n for (verb, _), n in step.items() if verb is Verb.GATHER) == 0 for step in again[2:])
    assert chunked.stats().device_bytes == 0  # the last step's prefetches released


def _generate_on_two_ranks(rank: int, world_size: int) -> dict[str, Any]:
    model, ref = copies(gpt2(seed=2))
    ref.to(reference_device())
    chunked, budget = _boosted(model)
    prompt = _prompt(2, 5 + 2 * rank, seed=rank)  # each rank its own prompt, of its own length
    sampler = _Sampler(chunked)
    out, steps = _decode_counts(chunked, prompt, 6)
    plain = ref.generate(**_on(prompt, reference_device()), max_new_tokens=6, do_sample=False, pad_token_id=0)
    kwargs: dict[str, Any] = {"max_new_tokens": 6, "do_sample": True, "top_k": 30, "top_p": 0.8, "pad_token_id": 0}
    torch.manual_seed(10 + rank)
    sampled = chunked.generate(**prompt, streamer=sampler, **kwargs)
    torch.manual_seed(10 + rank)
    plain_sampled = ref.generate(**_on(prompt, reference_device()), **kwargs)
    return {
        "greedy_equal": torch.equal(out.cpu(), plain.cpu()),
        "sampled_equal": torch.equal(sampled.cpu(), plain_sampled.cpu()),
        "kv": sorted({kv for kv, _ in sampler.seen}),
        "expected_kv": _cache_bytes(ref, 2, 7 + 6 - 1),  # the longest prompt over the ranks: 7
        "within": chunked.stats().peak_device_bytes <= budget,
        "on_demand": [sum(n for (verb, _), n in step.items() if verb is Verb.GATHER) for step in steps[3:]],
    }


@pytest.mark.multirank
def test_generate_under_the_budget_on_two_ranks() -> None:
    results = run_ranks(_generate_on_two_ranks)
    for rank, result in enumerate(results):
        assert result["greedy_equal"] and result["sampled_equal"], rank
        assert result["kv"] == [result["expected_kv"]], rank  # agreed over ranks: the same on both
        assert result["within"] and result["on_demand"] == [0, 0, 0], rank  # decode steps 3 to 5
