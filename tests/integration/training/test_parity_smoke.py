"""chunkmem training matches plain PyTorch (world size 1), the fast smoke version."""

from __future__ import annotations

import pytest
from support.models import (
    adamw_two_groups,
    assert_state_close,
    batches,
    boost,
    copies,
    gpt2,
    tolerance,
    train_chunked,
    train_reference,
)

from chunkmem.placement import AutoPlacementConfig, StaticPlacementConfig


@pytest.mark.parametrize(
    "placement",
    [
        StaticPlacementConfig(),
        StaticPlacementConfig(offload_optim_frac=1.0, offload_param_frac=1.0),
        AutoPlacementConfig(device_budget=600_000, max_prefetch=1),
    ],
    ids=["static", "static-offload", "auto-budget"],
)
def test_gpt2_fp32_matches_pytorch(placement: object) -> None:
    model, ref = copies(gpt2())
    data = batches(5)
    expected = train_reference(ref, adamw_two_groups, data)
    chunked, optimizer, booster = boost(
        model, adamw_two_groups, placement=placement, precision="fp32", chunk_size=20_000
    )
    losses = train_chunked(chunked, optimizer, booster, data)
    assert losses == tolerance(chunked, rtol=1e-5, atol=1e-6).approx(expected)
    assert_state_close(chunked.state_dict(), ref.state_dict(), *tolerance(chunked, rtol=1e-4, atol=1e-5))
