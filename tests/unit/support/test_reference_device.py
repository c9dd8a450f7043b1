"""The plain-PyTorch references of the parity tests run where chunkmem computes: the helper that
places them (``models.reference_device``) agrees with the device the plugin picks, seen through
what a boosted model does (its outputs, its masters), not through the plugin's own function; and
the tolerance table widens nothing on the CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from support.models import (
    DEVICE_TOLERANCE,
    EXACT,
    Step,
    Tolerance,
    adamw_two_groups,
    batches,
    boost,
    copies,
    device_of,
    gpt2,
    lm_loss,
    optimizer_step_side,
    reference_device,
    tolerance,
)

from chunkmem.placement import StaticPlacementConfig
from chunkmem.usage.accounting import Location


@pytest.fixture
def keep_current_gpu() -> Iterator[None]:
    """The plugin selects the GPU it picks (``torch.cuda.set_device``): undo that for later tests."""
    current = torch.cuda.current_device() if torch.cuda.is_available() else None
    yield
    if current is not None:
        torch.cuda.set_device(current)


@pytest.mark.usefixtures("keep_current_gpu")
@pytest.mark.parametrize("local_rank", [None, "0", "1"], ids=["no-LOCAL_RANK", "LOCAL_RANK=0", "LOCAL_RANK=1"])
def test_reference_device_is_where_the_boosted_model_computes(
    monkeypatch: pytest.MonkeyPatch, local_rank: str | None
) -> None:
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)  # as torchrun sets it
    model, ref = copies(gpt2(n_layer=1))
    chunked, _, _ = boost(model, adamw_two_groups, precision="fp32", chunk_size=8_000)
    device = reference_device()
    ids = batches(1)[0]  # on the CPU: the boosted model moves it
    with torch.no_grad():
        out = chunked(input_ids=ids).logits
        expected = ref(input_ids=ids.to(device)).logits
    assert out.device == device
    assert expected.device == out.device and device_of(ref) == device
    assert chunked.compute_device == device
    # Static placement keeps every master on the compute device.
    for chunk in chunked.manager.chunks:
        assert chunk.store.master_location is Location.DEVICE
        assert chunk.store.master.device == device


def test_the_optimizer_side_follows_where_the_placement_puts_masters() -> None:
    on_device, _, _ = boost(gpt2(n_layer=1), adamw_two_groups, precision="fp32", chunk_size=8_000)
    offloaded, optimizer, booster = boost(
        gpt2(n_layer=1),
        adamw_two_groups,
        precision="fp32",
        chunk_size=8_000,
        placement=StaticPlacementConfig(offload_optim_frac=1.0),
    )
    assert optimizer_step_side(on_device) is Step.DEVICE
    assert optimizer_step_side(offloaded) is Step.HOST
    # The host side is the CPU: the optimizer state the step creates lives there.
    booster.backward(lm_loss(offloaded, batches(1)[0]), optimizer)
    optimizer.step()
    assert {v.device.type for s in optimizer.state.values() for v in s.values() if v.dim() > 0} == {"cpu"}


def test_no_tolerance_is_widened_on_the_cpu_and_every_run_here_has_an_entry() -> None:
    for (precision, side, device_type), value in DEVICE_TOLERANCE.items():
        if device_type == "cpu":
            assert value == EXACT, (precision, side)
    here = reference_device().type
    for precision in ("fp32", "bf16", "fp16"):
        for side in Step:
            assert (precision, side, here) in DEVICE_TOLERANCE, (precision, side, here)
    chunked, _, _ = boost(gpt2(n_layer=1), adamw_two_groups, precision="fp32", chunk_size=8_000)
    own, widened = Tolerance(1e-4, 1e-5), tolerance(chunked, rtol=1e-4, atol=1e-5)
    assert widened.rtol >= own.rtol and widened.atol >= own.atol  # never tighter than the test asks
    if here == "cpu":
        assert widened == own
