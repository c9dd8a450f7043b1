"""Host steps during the backward (``StepDuringBackward``): each chunk with a host master steps on a
worker thread as soon as its last gradient of the iteration is on the host, before the backward
ends, and the result is bit for bit the one of stepping after the backward whatever the loop does
between the backward and ``optimizer.step()`` (clip, fp16 inf, zero_grad, another micro-batch, an
evaluation forward, a changed learning rate, a state dict): the early steps are then undone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.distributed import run_ranks
from support.models import assert_state_close, copies, device_of, tolerance
from support.tier import slow_cases

from chunkmem import Booster, ChunkPlugin, StepAfterBackward, StepDuringBackward
from chunkmem.placement import StaticPlacementConfig
from chunkmem.usage.accounting import Location

WIDTH, LAYERS, CHUNK = 64, 8, 4_200  # one layer a chunk
HOST = StaticPlacementConfig(offload_optim_frac=1.0, max_prefetch=0)


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _data(steps: int, seed: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(32, WIDTH, generator=g) for _ in range(steps)]


def _boost(model: torch.nn.Module, host_step: Any, precision: str = "fp32", placement: Any = HOST) -> Any:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    booster = Booster(
        plugin=ChunkPlugin(placement=placement, precision=precision, chunk_size=CHUNK, host_step=host_step)
    )
    chunked, boosted, *_ = booster.boost(model, optimizer)
    return chunked, boosted, booster


Loop = Callable[[Any, Any, Any, list[torch.Tensor]], list[Any]]


def _plain_loop(chunked: Any, optimizer: Any, booster: Any, data: list[torch.Tensor]) -> list[Any]:
    for x in data:
        booster.backward(chunked(x).square().mean(), optimizer)
        optimizer.step()
        optimizer.zero_grad()
    return []


def _clip(max_norm: float) -> Loop:
    def loop(chunked: Any, optimizer: Any, booster: Any, data: list[torch.Tensor]) -> list[Any]:
        norms = []
        for x in data:
            booster.backward(chunked(x).square().mean(), optimizer)
            norms.append(float(optimizer.clip_grad_norm(max_norm)))
            optimizer.step()
            optimizer.zero_grad()
        return norms

    return loop


def _zero_grad_on_step_2(chunked: Any, optimizer: Any, booster: Any, data: list[torch.Tensor]) -> list[Any]:
    for step, x in enumerate(data):
        booster.backward(chunked(x).square().mean(), optimizer)
        if step == 2:
            optimizer.zero_grad()  # a skipped step (a loss the user did not like)
            continue
        optimizer.step()
        optimizer.zero_grad()
    return []


def _extra_micro_batch_on_step_3(chunked: Any, optimizer: Any, booster: Any, data: list[torch.Tensor]) -> list[Any]:
    for step, x in enumerate(data):
        booster.backward(chunked(x).square().mean(), optimizer)
        if step == 3:  # accumulation without no_sync, one iteration only
            booster.backward(chunked(x.flip(0)).square().mean(), optimizer)
        optimizer.step()
        optimizer.zero_grad()
    return []


def _evaluate_before_the_step(chunked: Any, optimizer: Any, booster: Any, data: list[torch.Tensor]) -> list[Any]:
    outputs = []
    for x in data:
        booster.backward(chunked(x).square().mean(), optimizer)
        with torch.no_grad():
            outputs.append(chunked(x[:4]).detach().cpu().clone())  # the weights before the step
        optimizer.step()
        optimizer.zero_grad()
    return outputs


def _lr_changed_before_the_step(chunked: Any, optimizer: Any, booster: Any, data: list[torch.Tensor]) -> list[Any]:
    for step, x in enumerate(data):
        booster.backward(chunked(x).square().mean(), optimizer)
        optimizer.param_groups[0]["lr"] = 1e-2 / (step + 1)
        optimizer.step()
        optimizer.zero_grad()
    return []


def _state_dict_before_the_step(chunked: Any, optimizer: Any, booster: Any, data: list[torch.Tensor]) -> list[Any]:
    states = []
    for x in data:
        booster.backward(chunked(x).square().mean(), optimizer)
        states.append(chunked.state_dict()["0.weight"].clone())
        optimizer.step()
        optimizer.zero_grad()
    return states


def _optimizer_state_read_before_the_step(
    chunked: Any, optimizer: Any, booster: Any, data: list[torch.Tensor]
) -> list[Any]:
    """Reads the state through the optimizer itself (what a checkpoint reads), not through an
    entry point of the runtime: the state is the one the last step left."""
    states = []
    for x in data:
        booster.backward(chunked(x).square().mean(), optimizer)
        states.append([{k: v.clone() for k, v in optimizer.piece_state(p).items()} for p in optimizer.pieces])
        optimizer.step()
        optimizer.zero_grad()
    return states


LOOPS: dict[str, tuple[Loop, bool | None]] = {
    # loop, whether early steps survive to the step; None: those that began before the loop's change
    # are undone, those that began after it stepped with what it set and stay (on a GPU the worker
    # often starts after the backward has returned: H200, 16 of 40 kept)
    "plain": (_plain_loop, True),
    "clip-applies": (_clip(1e-3), False),
    "clip-does-not-apply": (_clip(1e6), True),
    "zero-grad-instead-of-step": (_zero_grad_on_step_2, True),
    "extra-micro-batch": (_extra_micro_batch_on_step_3, True),
    "evaluate-before-the-step": (_evaluate_before_the_step, False),
    "lr-changed-before-the-step": (_lr_changed_before_the_step, None),
    "state-dict-before-the-step": (_state_dict_before_the_step, False),
    "optimizer-state-read-before-the-step": (_optimizer_state_read_before_the_step, False),
}


def _run(host_step: Any, loop: Loop, steps: int = 6, precision: str = "fp32") -> tuple[Any, list[Any], Any]:
    chunked, optimizer, booster = _boost(_mlp(), host_step, precision)
    out = loop(chunked, optimizer, booster, _data(steps))
    return chunked.state_dict(), out, (chunked.stats(), optimizer.state_dict())


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a.cpu(), b.cpu())
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("name", slow_cases(LOOPS, "lr-changed-before-the-step"))
def test_early_steps_give_the_bits_of_stepping_after_the_backward(name: str) -> None:
    loop, kept = LOOPS[name]
    early_state, early_out, (stats, early_optimizer) = _run(StepDuringBackward(), loop)
    after_state, after_out, (after_stats, after_optimizer) = _run(StepAfterBackward(), loop)
    _assert_same(early_state, after_state)
    _assert_same(early_out, after_out)
    _assert_same(early_optimizer, after_optimizer)
    assert after_stats.early_steps == 0
    assert stats.early_steps > 0, "no chunk stepped during the backward"
    if kept:
        assert stats.early_steps_undone < stats.early_steps
    elif kept is None:
        assert stats.early_steps_undone <= stats.early_steps
    else:
        assert stats.early_steps_undone == stats.early_steps


def test_every_host_chunk_steps_early_from_the_second_step_and_some_before_the_backward_ends() -> None:
    steps = 6
    chunked, optimizer, booster = _boost(_mlp(), StepDuringBackward())
    host = [c for c in chunked.manager.chunks if c.store.master_location is Location.HOST]
    assert len(host) == LAYERS
    _plain_loop(chunked, optimizer, booster, _data(steps))
    stats = chunked.stats()
    # The first step records the trace; each later one steps every host chunk early and keeps it.
    assert stats.early_steps == len(host) * (steps - 1)
    assert stats.early_steps_undone == 0
    assert stats.early_steps_in_backward > 0, "every early step started after the backward had ended"
    assert stats.host_step_seconds > 0


def test_a_budget_too_small_for_restore_points_steps_after_the_backward() -> None:
    chunked, optimizer, booster = _boost(_mlp(), StepDuringBackward(backup_budget=1))
    _plain_loop(chunked, optimizer, booster, _data(3))
    stats = chunked.stats()
    assert stats.early_steps == 0 and stats.early_steps_declined > 0


@pytest.mark.cpu_compute(reason="an infinite fp16 loss on the CPU")
def test_fp16_inf_undoes_the_early_steps_and_skips_the_step() -> None:
    def loop(chunked: Any, optimizer: Any, booster: Any, data: list[torch.Tensor]) -> list[Any]:
        scales = []
        for step, x in enumerate(data):
            loss = chunked(x).float().square().mean()
            if step == 3:
                loss = loss * float("inf")
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            scales.append(optimizer.loss_scale)
        return scales

    early_state, early_scales, (stats, _) = _run(StepDuringBackward(), loop, precision="fp16")
    after_state, after_scales, _ = _run(StepAfterBackward(), loop, precision="fp16")
    _assert_same(early_state, after_state)
    assert early_scales == after_scales and early_scales[3] < early_scales[2]
    assert stats.skipped_steps == 1 and stats.early_steps_undone > 0


def test_early_steps_match_plain_pytorch() -> None:
    model, ref = copies(_mlp())
    chunked, optimizer, booster = _boost(model, StepDuringBackward())
    # The kernel chunkmem steps host runs with when the user left it unset: PyTorch's CPU default
    # when the model computes on the CPU, the fused CPU kernel when it computes on a GPU.
    kernel = {} if chunked.compute_device.type == "cpu" else {"fused": True}
    reference = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, **kernel)
    data = _data(5)
    _plain_loop(chunked, optimizer, booster, data)
    for x in data:
        ref(x.to(device_of(ref))).square().mean().backward()
        reference.step()
        reference.zero_grad()
    # Bit for bit on a CPU; where the reference's AdamW runs on a GPU and chunkmem's on the host,
    # within what that costs (DEVICE_TOLERANCE).
    assert_state_close(chunked.state_dict(), ref.state_dict(), *tolerance(chunked, rtol=0.0))


def _ranks(rank: int, world_size: int, name: str) -> list[Any]:
    loop, _ = LOOPS[name]
    torch.manual_seed(0)
    early, _, (stats, _) = _run(StepDuringBackward(), loop)
    after, _, _ = _run(StepAfterBackward(), loop)
    _assert_same(early, after)
    return [stats.early_steps, stats.early_steps_undone]


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["plain", "clip-applies", "extra-micro-batch"])
def test_early_steps_at_two_ranks(name: str) -> None:
    counts = run_ranks(_ranks, 2, args=(name,))
    assert counts[0] == counts[1] and counts[0][0] > 0


def test_the_host_step_config_is_validated_by_type_and_field() -> None:
    import pydantic

    plugin = ChunkPlugin(host_step={"when": "during_backward", "backup_budget": "512MiB"})
    assert plugin.host_step == StepDuringBackward(backup_budget=512 * 2**20)
    assert ChunkPlugin(host_step={"when": "after_backward"}).host_step == StepAfterBackward()
    with pytest.raises(pydantic.ValidationError, match="when"):
        ChunkPlugin(host_step={"when": "sometimes"})
    with pytest.raises(pydantic.ValidationError, match="backup_budget"):
        StepDuringBackward(backup_budget=0)
    with pytest.raises(TypeError, match="host_step"):
        ChunkPlugin(host_step="during_backward")  # type: ignore[arg-type]
