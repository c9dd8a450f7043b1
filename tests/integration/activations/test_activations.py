"""Activation placement per block (``ActivationPlacement``): offloaded and kept blocks train bit for
bit as plain PyTorch, recomputed ones as plain PyTorch with the same ``torch.utils.checkpoint``
(dropout included), and ``stats()`` counts the bytes autograd saves in the offloaded blocks,
measured on the plain model with a saved-tensor hooks counter and derived from the shapes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from support.activations_helpers import (
    BATCH,
    BLOCKS,
    HIDDEN,
    STEPS,
    WIDTH,
    Block,
    Stack,
    _assert_identical,
    _data,
    _loss,
    _plain,
    _saved_bytes,
    _trained,
)
from support.distributed import run_ranks
from support.models import (
    adamw_two_groups,
    as_reference,
    batches,
    boost,
    enable_checkpointing,
    gpt2,
    lm_loss,
    train_accumulating,
    train_chunked,
)
from support.tier import slow_cases

from chunkmem import ChunkedModel, ChunkPlugin, NotSupportedError
from chunkmem.placement import ActivationPlacement

FP32 = 4


def _chunked(model: torch.nn.Module, activations: Any, precision: str = "fp32") -> tuple[dict[str, Any], Any]:
    chunked, optimizer, booster = boost(
        model, adamw_two_groups, precision=precision, chunk_size=4_000, activations=activations
    )
    return _trained(chunked, optimizer, booster), chunked.stats()


def _saved_bytes_per_block(model: Stack, keep_below: int) -> int:
    return _saved_bytes([model.blocks[0]], lambda: model.blocks[0](_data()[0]), keep_below)


# --- config -----------------------------------------------------------------------------------
def test_the_config_refuses_what_it_cannot_mean_naming_the_field() -> None:
    with pytest.raises(ValidationError, match="offload must be a list of block classes"):
        ActivationPlacement(offload="GPT2Block")
    with pytest.raises(ValidationError, match=r"offload and recompute both name \['Block'\]"):
        ActivationPlacement(offload=["Block"], recompute=["Block"])
    with pytest.raises(ValidationError, match="recompute holds ''"):
        ActivationPlacement(recompute=[""])
    with pytest.raises(ValidationError, match="max_prefetch"):
        ActivationPlacement(max_prefetch=-1)
    with pytest.raises(ValidationError, match="extra"):
        ActivationPlacement(offlaod=["Block"])
    assert ChunkPlugin(activations={"offload": ["Block"]}).activations == ActivationPlacement(offload=("Block",))
    with pytest.raises(TypeError, match="activations must be an ActivationPlacement"):
        ChunkPlugin(activations=["Block"])  # type: ignore[arg-type]


def test_boost_refuses_a_class_the_model_lacks_and_a_block_inside_a_block() -> None:
    with pytest.raises(ValueError, match=r"'GPT2Block', but no module of the model is one; .*'Block'"):
        boost(Stack(), adamw_two_groups, activations=ActivationPlacement(offload=["GPT2Block"]))
    with pytest.raises(ValueError, match=r"blocks.0.fc1 \(Linear\) and of blocks.0, which holds it"):
        boost(Stack(), adamw_two_groups, activations=ActivationPlacement(offload=[Block], recompute=["Linear"]))


# --- exact, and counted -----------------------------------------------------------------------
@pytest.mark.parametrize("prefetch", [0, 3])  # 1, the default, in the test below
@pytest.mark.slow  # the fast tier's case: offload at the default depth
def test_prefetch_depth_changes_neither_results_nor_bytes(prefetch: int) -> None:
    result, stats = _chunked(Stack(), ActivationPlacement(offload=[Block], max_prefetch=prefetch))
    _assert_identical(result, _plain(Stack()))
    assert stats.activation_h2d_bytes == STEPS * BLOCKS * _saved_bytes_per_block(Stack(), 1024)


@pytest.mark.parametrize("keep_below", slow_cases([1024, 2048], 2048))
def test_offload_is_bit_exact_and_counts_the_bytes_autograd_saves(keep_below: int) -> None:
    per_block = _saved_bytes_per_block(Stack(), keep_below)
    # fc1's input (kept under 2048 bytes), GELU's input, the product's operand (saved twice, one
    # storage) and fc2's input.
    assert per_block == BATCH * FP32 * ((WIDTH if keep_below <= BATCH * WIDTH * FP32 else 0) + 3 * HIDDEN)
    result, stats = _chunked(Stack(), ActivationPlacement(offload=[Block], min_offload_bytes=keep_below))
    _assert_identical(result, _plain(Stack()))
    assert stats.activation_d2h_bytes == stats.activation_h2d_bytes == STEPS * BLOCKS * per_block
    assert stats.d2h_bytes == stats.h2d_bytes == 0  # no chunk traffic: the default placement keeps chunks
    assert stats.recomputed_blocks == 0


@pytest.mark.slow  # the fast tier's case: offload, bit exact
def test_recompute_with_dropout_equals_plain_checkpointing_and_counts_the_recomputations() -> None:
    result, stats = _chunked(Stack(dropout=0.2), ActivationPlacement(recompute=["Block"]))
    reference = _plain(Stack(dropout=0.2, outer_checkpoint=True))
    _assert_identical(result, reference)
    assert stats.recomputed_blocks == STEPS * BLOCKS
    assert stats.activation_d2h_bytes == 0


def test_a_checkpoint_inside_an_offloaded_block_is_left_alone() -> None:
    """What the ops inside the inner checkpoint save goes through its own hooks and stays (it is
    recomputed); what the block saves around it is offloaded: fc1's input, GELU's input, and the
    checkpoint's input (which PyTorch's checkpoint saves outside its own hooks)."""
    per_block = _saved_bytes_per_block(Stack(inner_checkpoint=True), 1024)
    assert per_block == BATCH * FP32 * (WIDTH + 2 * HIDDEN)
    result, stats = _chunked(Stack(inner_checkpoint=True), ActivationPlacement(offload=["Block"]))
    _assert_identical(result, _plain(Stack(inner_checkpoint=True)))
    assert stats.activation_d2h_bytes == STEPS * BLOCKS * per_block


@pytest.mark.parametrize("how", ["offload", "recompute"])
def test_double_checkpointing_is_refused(how: str) -> None:
    from chunkmem.activations.blocks import SEES_CHECKPOINTS

    if SEES_CHECKPOINTS:  # a checkpoint of the user's own around the block: seen from PyTorch 2.8
        chunked, optimizer, booster = boost(
            Stack(outer_checkpoint=True), adamw_two_groups, activations=ActivationPlacement(**{how: ["Block"]})
        )
        twice = r"block blocks.0 is \w+ by ActivationPlacement.*checkpoint it twice"
        with pytest.raises(NotSupportedError, match=twice):
            booster.backward(_loss(chunked, _data()[0]), optimizer)
    model = gpt2(n_embd=32)
    enable_checkpointing(model, reentrant=False)
    chunked, optimizer, booster = boost(
        model, adamw_two_groups, activations=ActivationPlacement(**{how: ["GPT2Block"]})
    )
    with pytest.raises(NotSupportedError, match="gradient_checkpointing_disable"):
        lm_loss(chunked, batches(1)[0])


def test_a_plain_copy_runs_the_blocks_own_forward() -> None:
    chunked, _, _ = boost(Stack(), adamw_two_groups, activations=ActivationPlacement(offload=["Block"]))
    plain = chunked.plain_copy()
    assert plain is not None and all("forward" not in vars(block) for block in plain.blocks)
    assert all("forward" in vars(block) for block in chunked.module.blocks)


# --- GPT-2, ranks, precisions, no_sync --------------------------------------------------------
def _gpt2_run(rank: int, world_size: int, activations: Any, precision: str, no_sync: bool) -> dict[str, Any]:
    chunked, optimizer, booster = boost(
        gpt2(n_embd=32), adamw_two_groups, precision=precision, chunk_size=4_000, activations=activations
    )
    if not no_sync:
        return {"losses": train_chunked(chunked, optimizer, booster, batches(2), rank, world_size), **_end(chunked)}
    losses = train_accumulating(chunked, optimizer, booster, batches(2, batch=8), rank, world_size)
    return {"losses": losses, **_end(chunked)}


def _end(chunked: ChunkedModel) -> dict[str, Any]:
    stats = chunked.stats()
    return {
        "state": chunked.state_dict(),
        "offloaded": stats.activation_d2h_bytes,
        "recomputed": stats.recomputed_blocks,
    }


PLACEMENTS: dict[str, Callable[[], ActivationPlacement | None]] = {
    "keep": lambda: None,
    "offload": lambda: ActivationPlacement(offload=["GPT2Block"], max_prefetch=1),
    "recompute": lambda: ActivationPlacement(recompute=["GPT2Block"]),
}


def _gpt2_every_placement(rank: int, world_size: int, precision: str) -> None:
    """With ``no_sync`` micro-batches, offload and recompute equal keep bit for bit (no dropout:
    recomputing is exact)."""
    runs = {name: _gpt2_run(rank, world_size, make(), precision, True) for name, make in PLACEMENTS.items()}
    for name, run in runs.items():
        _assert_identical(run, runs["keep"])
        assert (run["offloaded"] > 0) == name.startswith("offload"), name
        assert (run["recomputed"] > 0) == (name == "recompute"), name


@pytest.mark.slow
def test_gpt2_keep_offload_and_recompute_equal_plain_pytorch_bit_for_bit() -> None:
    from support.models import train_reference

    reference = as_reference(gpt2(n_embd=32))
    losses = train_reference(reference, adamw_two_groups, batches(2))
    plain = {"losses": losses, "state": reference.state_dict()}
    checkpointed = as_reference(gpt2(n_embd=32))
    enable_checkpointing(checkpointed, reentrant=False)
    plain_checkpointed = {"losses": train_reference(checkpointed, adamw_two_groups, batches(2))}
    plain_checkpointed["state"] = checkpointed.state_dict()
    _assert_identical(_gpt2_run(0, 1, PLACEMENTS["keep"](), "fp32", False), plain)
    offloaded = _gpt2_run(0, 1, PLACEMENTS["offload"](), "fp32", False)
    _assert_identical(offloaded, plain)
    # Counted where the run computed: a GPU's kernels save other tensors than the CPU's.
    model = as_reference(gpt2(n_embd=32))
    per_step = _saved_bytes(model.transformer.h, lambda: lm_loss(model, batches(1)[0]))
    assert offloaded["offloaded"] == 2 * per_step > 0
    _assert_identical(_gpt2_run(0, 1, PLACEMENTS["recompute"](), "fp32", False), plain_checkpointed)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_two_ranks_offload_and_recompute_equal_keep_bit_for_bit_with_no_sync(precision: str) -> None:
    run_ranks(_gpt2_every_placement, 2, args=(precision,))


def test_no_grad_forward_of_an_offloaded_block_copies_nothing() -> None:
    chunked, _, _ = boost(Stack(), adamw_two_groups, activations=ActivationPlacement(offload=["Block"]))
    with torch.no_grad():
        chunked(_data()[0])
    assert chunked.stats().activation_d2h_bytes == 0


def test_a_storage_freed_in_the_block_and_one_made_at_its_address_are_two_copies() -> None:
    """Each saved tensor is freed once packed (autograd keeps the handle): the next tensor may get
    its storage's address, and must not be taken for it."""
    from chunkmem.activations import ActivationOffload
    from chunkmem.device import device_layer
    from chunkmem.tiers.transfers import HostTransfers
    from chunkmem.usage.stats import Stats

    offload = ActivationOffload(HostTransfers(Stats(), device_layer(torch.device("cpu"))), torch.device("cpu"), 1, 0)
    weight = torch.ones(256, requires_grad=True)
    total = torch.zeros(())
    with offload.hooks(offload.call("block", torch.nn.Module())):
        for i in range(20):
            total = total + (torch.full((256,), float(i)) * weight).sum()  # saves the filled tensor
    total.backward()
    assert torch.equal(weight.grad, torch.full((256,), float(sum(range(20)))))
