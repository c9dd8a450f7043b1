"""Chunk-size search: padding on real model shapes (built on the meta device), the choice against a
brute-force loop that simulates the packing here, tie-breaking, and invalid ranges."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.tier import examples, slow_cases
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from chunkmem.chunks.search import CANDIDATE_BLOCK, default_search_range, search_chunk_size


@functools.cache
def meta_params(name: str) -> tuple[torch.Tensor, ...]:
    configs = {
        "gpt2-small": (GPT2LMHeadModel, GPT2Config()),
        "gpt2-medium": (GPT2LMHeadModel, GPT2Config(n_embd=1024, n_layer=24, n_head=16)),
        "llama-7b": (
            LlamaForCausalLM,
            LlamaConfig(
                vocab_size=32000,
                hidden_size=4096,
                intermediate_size=11008,
                num_hidden_layers=32,
                num_attention_heads=32,
            ),
        ),
        "llama-small": (
            LlamaForCausalLM,
            LlamaConfig(
                vocab_size=32000,
                hidden_size=512,
                intermediate_size=1376,
                num_hidden_layers=8,
                num_attention_heads=8,
                num_key_value_heads=4,
            ),
        ),
    }
    cls, config = configs[name]
    with torch.device("meta"):
        model = cls(config)
    return tuple(model.parameters())  # shared (tied) parameters once, as the plugin registers them


def simulate_waste(sizes: list[tuple[int, object]], chunk_size: int, world: int) -> int:
    """Padding of the manager's packing, simulated one parameter at a time."""
    capacity = -(-chunk_size // world) * world
    waste = 0
    fill: dict[object, int] = {}  # open chunk per group: elements used
    for numel, key in sizes:
        if numel > capacity:
            waste += -(-numel // world) * world - numel
        elif key in fill and fill[key] + numel <= capacity:
            fill[key] += numel
        else:
            if key in fill:
                waste += capacity - fill[key]
            fill[key] = numel
    return waste + sum(capacity - used for used in fill.values())


def brute_force(sizes: list[tuple[int, object]], low: int, high: int, granularity: int, world: int) -> tuple[int, int]:
    """(waste, size) of the best candidate; the first (smallest) one on ties."""
    best: tuple[int, int] | None = None
    for size in range(low, high + 1, granularity):
        rounded = -(-size // world) * world
        waste = simulate_waste(sizes, size, world)
        if best is None or waste < best[0]:
            best = (waste, rounded)
    assert best is not None
    return best


@pytest.mark.parametrize("name", slow_cases(["gpt2-small", "gpt2-medium", "llama-7b", "llama-small"], "llama-7b"))
def test_waste_on_real_models(name: str) -> None:
    params = meta_params(name)
    assert all(p.is_meta for p in params)
    total = sum(p.numel() for p in params)
    low, high = default_search_range(total)
    assert 0 < low <= high <= 2**26
    for world in (1, 2, 8):
        result = search_chunk_size(params, low, high, world_size=world)
        assert result.param_elements == total
        assert result.chunk_size % world == 0
        assert low <= result.chunk_size < high + world
        assert result.waste_percent < 5, f"{name} at world size {world}: {result.describe()}"
        assert result.waste_bytes == 2 * result.waste_elements
        # The reported figures are those of the packing simulated here, at the chosen size.
        sizes = [(p.numel(), (p.dtype, p.requires_grad)) for p in params]
        assert result.waste_elements == simulate_waste(sizes, result.chunk_size, world)


def test_waste_on_a_frozen_embedding_model() -> None:
    """Groups pack separately: freezing the embeddings changes the packing, not the accounting."""
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=4, n_head=4))
    model.transformer.wte.requires_grad_(False)
    model.transformer.wpe.requires_grad_(False)
    params = list(model.parameters())
    low, high = default_search_range(sum(p.numel() for p in params))
    for world in (1, 8):
        result = search_chunk_size(params, low, high, granularity=256, world_size=world)
        sizes = [(p.numel(), (p.dtype, p.requires_grad)) for p in params]
        assert (result.waste_elements, result.chunk_size) == brute_force(sizes, low, high, 256, world)


@settings(max_examples=examples(60), deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.integers(0, 200), st.sampled_from([torch.float32, torch.bfloat16]), st.booleans()),
        min_size=1,
        max_size=15,
    ),
    low=st.integers(1, 150),
    span=st.integers(0, 200),
    granularity=st.integers(1, 17),
    world=st.integers(1, 8),
)
def test_choice_matches_brute_force(
    specs: list[tuple[int, torch.dtype, bool]], low: int, span: int, granularity: int, world: int
) -> None:
    params = [torch.empty(n, dtype=dtype, device="meta").requires_grad_(t) for n, dtype, t in specs]
    sizes = [(n, (dtype, t)) for n, dtype, t in specs]
    high = low + span
    result = search_chunk_size(params, low, high, granularity=granularity, world_size=world)
    waste, size = brute_force(sizes, low, high, granularity, world)
    assert result.waste_elements <= waste
    assert (result.waste_elements, result.chunk_size) == (waste, size)
    assert result.param_elements == sum(n for n, _, _ in specs)


def test_ties_go_to_the_smaller_size() -> None:
    params = [torch.empty(4, device="meta") for _ in range(4)]
    # 8: two full chunks; 12: 12 + 4 wastes 8; 16: one full chunk. 8 and 16 tie at 0.
    result = search_chunk_size(params, 8, 16, granularity=4)
    assert (result.chunk_size, result.waste_elements, result.num_chunks) == (8, 0, 2)
    # A parameter larger than every candidate gets its own chunk whatever the size: all tie at 0.
    result = search_chunk_size([torch.empty(20, device="meta")], 10, 13, granularity=1)
    assert (result.chunk_size, result.waste_elements, result.num_chunks) == (10, 0, 1)
    # Rounding to the world size can make neighbouring candidates identical; the first is reported.
    result = search_chunk_size([torch.empty(3, device="meta")] * 3, 5, 8, granularity=1, world_size=4)
    assert result.chunk_size == 8 and result.waste_elements == 8 - 3 * 2 + 8 - 3


def test_an_empty_parameter_opens_a_chunk_as_the_manager_packs_it() -> None:
    # The manager gives an empty parameter a chunk when none is open (all of it padding), and puts it
    # in the open chunk when one is, even a full one.
    result = search_chunk_size([torch.empty(0, device="meta")], 4, 4)
    assert (result.waste_elements, result.num_chunks) == (4, 1)
    result = search_chunk_size([torch.empty(4, device="meta"), torch.empty(0, device="meta")], 4, 4)
    assert (result.waste_elements, result.num_chunks) == (0, 1)
    result = search_chunk_size([torch.empty(8, device="meta"), torch.empty(0, device="meta")], 4, 4)
    assert (result.waste_elements, result.num_chunks) == (4, 2)


def test_invalid_ranges_raise() -> None:
    params = [torch.empty(10, device="meta")]
    for low, high in ((0, 10), (-5, 10), (11, 10)):
        with pytest.raises(ValueError, match="min_size <= max_size"):
            search_chunk_size(params, low, high)
    with pytest.raises(ValueError, match="granularity"):
        search_chunk_size(params, 1, 10, granularity=0)
    with pytest.raises(ValueError, match="world_size"):
        search_chunk_size(params, 1, 10, world_size=0)
    with pytest.raises(ValueError, match="no parameters"):
        search_chunk_size([], 1, 10)


def test_default_search_range() -> None:
    assert default_search_range(10) == (1024, 1024)  # tiny models: one granule
    # Small models: chunks of at least 4 MiB (of the compute dtype), at most a quarter of the model.
    assert default_search_range(4 * 2**20) == (2**20, 2**20)
    assert default_search_range(2**26, element_size=2) == (2**21, 2**24)
    assert default_search_range(2**26, element_size=4) == (2**20, 2**24)
    assert default_search_range(2**30) == (2**22, 2**26)  # large models: 1/64 of the model is larger
    assert default_search_range(2**40) == (2**22, 2**26)  # capped
    for total in (1, 10**6, 124_439_808, 6_738_415_616):
        low, high = default_search_range(total)
        assert 1024 <= low <= high <= 2**26


@pytest.mark.parametrize("seed", [0, 1])
def test_a_range_of_several_blocks_matches_brute_force(seed: int) -> None:
    """More candidates than one block (``CANDIDATE_BLOCK``, evaluated apart so that no op goes parallel):
    the best of all blocks, as trying every size one by one finds it."""
    g = torch.Generator().manual_seed(seed)
    numels = [int(n) for n in torch.randint(1, 60_000, (8,), generator=g)]
    params = [torch.empty(n, device="meta") for n in numels]
    high = 2 * CANDIDATE_BLOCK + 5_000
    result = search_chunk_size(params, 1, high, granularity=1, world_size=8)
    sizes = [(n, (torch.float32, False)) for n in numels]
    assert (result.waste_elements, result.chunk_size) == brute_force(sizes, 1, high, 1, 8)
