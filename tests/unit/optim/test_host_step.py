"""The optimizer step over flat runs: adjacent parameters of one param group in one chunk shard are
stepped as one tensor; host runs whose kernel the user left unset step with PyTorch's fused CPU
kernel on an accelerator (PyTorch's own default on a CPU compute device, as plain PyTorch); device
and host runs never share a call; an explicit choice is kept; a parameter without a
gradient splits its run and keeps its own state, as in plain PyTorch. Each against plain PyTorch
over the same parameters."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch
from support.models import copies, device_of

from chunkmem import Booster, ChunkPlugin, StepAfterBackward, StepDuringBackward
from chunkmem.device import DeviceLayer
from chunkmem.device.simulated import simulated_device
from chunkmem.optim.host_kernels import HostKernels
from chunkmem.placement import StaticPlacementConfig
from chunkmem.usage.accounting import Location

HOST = StaticPlacementConfig(offload_optim_frac=1.0, max_prefetch=0)


def _mlp(seed: int = 0, layers: int = 6, width: int = 32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


class _Skip(torch.nn.Module):
    """Three layers; the middle one is skipped on some steps, so it gets no gradient there."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        if not skip:
            x = torch.tanh(self.b(x))
        return self.c(x)


def _data(steps: int, width: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(4, width, generator=g) for _ in range(steps)]


def _train(
    model: Any, optimizer: torch.optim.Optimizer, data: list[torch.Tensor], skips: list[bool] | None = None
) -> None:
    device = device_of(model)  # a plain reference's parameters' device; a boosted model's compute device
    for step, x in enumerate(data):
        kwargs = {"skip": skips[step]} if skips is not None else {}
        model(x.to(device), **kwargs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _boost(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    placement: Any,
    chunk_size: int,
    host_step: StepAfterBackward | StepDuringBackward | None = None,
) -> Any:
    plugin = ChunkPlugin(placement=placement, precision="fp32", chunk_size=chunk_size, host_step=host_step)
    booster = Booster(plugin=plugin)
    chunked, boosted, *_ = booster.boost(model, optimizer)
    return chunked, boosted


@contextmanager
def _counting(name: str) -> Iterator[list[tuple[torch.Tensor, ...]]]:
    """Record the parameter lists a torch kernel is called with."""
    calls: list[tuple[torch.Tensor, ...]] = []
    real = getattr(torch, name)

    def spy(params: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(tuple(params))
        return real(params, *args, **kwargs)

    with mock.patch.object(torch, name, spy):
        yield calls


def _assert_identical(chunked: Any, optimizer: torch.optim.Optimizer, ref: torch.nn.Module, ref_opt: Any) -> None:
    state = chunked.state_dict()
    for name, value in ref.state_dict().items():
        assert torch.equal(state[name].cpu(), value.cpu()), name
    mine, theirs = optimizer.state_dict(), ref_opt.state_dict()
    assert mine["state"].keys() == theirs["state"].keys()
    for pid, entry in theirs["state"].items():
        assert mine["state"][pid].keys() == entry.keys(), pid
        for key, value in entry.items():
            assert torch.equal(mine["state"][pid][key].cpu(), value.cpu()), (pid, key)


OPTIMIZERS = [
    lambda params, **kw: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **kw),
    lambda params, **kw: torch.optim.Adam(params, lr=1e-2, amsgrad=True, **kw),
    lambda params, **kw: torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.01, **kw),
    lambda params, **kw: torch.optim.Adagrad(params, lr=1e-2, **kw),
]
OPTIMIZER_IDS = ["AdamW", "Adam-amsgrad", "SGD-momentum", "Adagrad"]
FUSED_KERNEL = {"AdamW": "_fused_adamw_", "Adam": "_fused_adam_", "SGD": "_fused_sgd_", "Adagrad": "_fused_adagrad_"}


@pytest.mark.cpu_compute(reason="plain PyTorch's fused CPU kernel is the reference, over the same CPU parameters")
@pytest.mark.parametrize("make", OPTIMIZERS, ids=OPTIMIZER_IDS)
def test_host_runs_step_fused_in_one_call_per_step_and_equal_plain_fused_bit_for_bit(
    make: Callable[..., torch.optim.Optimizer],
) -> None:
    model, ref = copies(_mlp())
    reference = make(ref.parameters(), fused=True)
    chunked, optimizer = _boost(model, make(model.parameters(), fused=True), HOST, chunk_size=2_200)
    chunks = chunked.manager.chunks
    assert len(chunks) > 2 and all(c.store.master_location is Location.HOST for c in chunks)
    data = _data(4, 32)
    with _counting(FUSED_KERNEL[type(reference).__name__]) as calls:
        _train(chunked, optimizer, data)
    _train(ref, reference, data)
    _assert_identical(chunked, optimizer, ref, reference)
    # One fused call per step over every run, each run holding several parameters.
    assert len(calls) == len(data)
    runs = sum(len(group["params"]) for group in optimizer.param_groups)
    assert all(len(call) == runs for call in calls)
    assert runs < len(list(ref.parameters()))


@pytest.mark.cpu_compute(reason="on a CPU compute device plain PyTorch steps the same CPU tensors with its default")
@pytest.mark.parametrize("make", OPTIMIZERS, ids=OPTIMIZER_IDS)
def test_host_runs_left_to_pytorch_on_a_cpu_compute_device_step_as_plain_pytorch_bit_for_bit(
    make: Callable[..., torch.optim.Optimizer],
) -> None:
    model, ref = copies(_mlp())
    reference = make(ref.parameters())
    chunked, optimizer = _boost(model, make(model.parameters()), HOST, chunk_size=2_200)
    data = _data(4, 32)
    with _counting(FUSED_KERNEL[type(reference).__name__]) as calls:
        _train(chunked, optimizer, data)
    assert not calls, "the user left the kernel to PyTorch, whose CPU default is not the fused kernel"
    _train(ref, reference, data)
    _assert_identical(chunked, optimizer, ref, reference)
    assert all(group["fused"] is None for group in optimizer.param_groups)


@pytest.mark.parametrize("make", OPTIMIZERS, ids=OPTIMIZER_IDS)
def test_with_an_accelerator_host_runs_left_to_pytorch_step_fused(make: Callable[..., torch.optim.Optimizer]) -> None:
    """Plain PyTorch never steps host tensors of a model on an accelerator: with both left unset the
    fused CPU kernel is chosen there (when the class and settings have one); an explicit choice is
    the user's, and on a CPU compute device PyTorch's own default is kept."""
    probe = torch.nn.Linear(2, 2)
    unset = make(probe.parameters()).param_groups[0]
    gpu, cpu = DeviceLayer(torch.device("cuda")), DeviceLayer(torch.device("cpu"))
    assert HostKernels(type(make(probe.parameters())), gpu).fuse(unset)
    assert not HostKernels(type(make(probe.parameters())), cpu).fuse(unset)
    for choice in ({"fused": False}, {"foreach": True}, {"foreach": False}):
        chosen = make(probe.parameters(), **choice)
        assert not HostKernels(type(chosen), gpu).fuse(chosen.param_groups[0]), choice
    # A setting without a fused kernel keeps PyTorch's default (differentiable has none).
    differentiable = torch.optim.AdamW(probe.parameters(), differentiable=True)
    assert not HostKernels(torch.optim.AdamW, gpu).fuse(differentiable.param_groups[0])


@pytest.mark.simulated
@pytest.mark.parametrize("host_step", [StepAfterBackward(), StepDuringBackward()], ids=["after", "during"])
def test_on_the_simulated_device_host_runs_left_to_pytorch_step_fused_as_on_a_gpu(
    host_step: StepAfterBackward | StepDuringBackward,
) -> None:
    """The simulated device stands for a GPU: host runs whose kernel the user left unset take the
    fused CPU kernel there too, after the backward and on the early-step worker, one call per step,
    and equal plain PyTorch's fused AdamW bit for bit."""
    model, ref = copies(_mlp())
    reference = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    data = _data(3, 32)
    with simulated_device(), _counting("_fused_adamw_") as calls:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        chunked, boosted = _boost(model, optimizer, HOST, chunk_size=2_200, host_step=host_step)
        assert chunked.manager.comm.layer.asynchronous
        _train(chunked, boosted, data)
    assert calls, "the host runs left to PyTorch did not take the fused kernel on the simulated device"
    _train(ref, reference, data)
    _assert_identical(chunked, boosted, ref, reference)


@pytest.mark.cpu_compute(reason="the reference steps the same CPU parameters with the user's kernel")
@pytest.mark.parametrize(
    ("choice", "kernel"), [({"fused": False}, None), ({"foreach": True}, "_foreach_add_"), ({"fused": True}, None)]
)
def test_an_explicit_kernel_choice_is_kept_on_the_host(choice: dict[str, bool], kernel: str | None) -> None:
    model, ref = copies(_mlp())
    reference = torch.optim.AdamW(ref.parameters(), lr=1e-2, **choice)
    chunked, optimizer = _boost(model, torch.optim.AdamW(model.parameters(), lr=1e-2, **choice), HOST, 2_200)
    data = _data(3, 32)
    with _counting("_fused_adamw_") as fused:
        if kernel is not None:
            with _counting(kernel) as chosen:
                _train(chunked, optimizer, data)
            assert chosen, f"{choice}: the {kernel} kernel never ran"
        else:
            _train(chunked, optimizer, data)
    assert bool(fused) == bool(choice.get("fused")), choice
    _train(ref, reference, data)
    _assert_identical(chunked, optimizer, ref, reference)


@pytest.mark.parametrize(
    "host_step", [StepAfterBackward(), StepDuringBackward()], ids=["after-backward", "during-backward"]
)
def test_device_and_host_runs_never_share_a_call(host_step: StepAfterBackward | StepDuringBackward) -> None:
    """Half the chunks keep their optimizer side on the device: their runs step in a call of their
    own, the host runs in others (a host tensor in a call with device tensors would turn PyTorch's
    default for all of them into its per-tensor loop). Stepped after the backward (the default on a
    CPU), a step's host runs share one call; during the backward (the default on a GPU), each host
    chunk steps in a call of its own as its gradient lands, once the first step recorded the order."""
    model = _mlp(layers=8)
    placement = StaticPlacementConfig(offload_optim_frac=0.5, max_prefetch=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    chunked, optimizer = _boost(model, optimizer, placement, 2_200, host_step)
    chunks = chunked.manager.chunks
    host = {c.chunk_id for c in chunks if c.store.master_location is Location.HOST}
    device = {c.chunk_id for c in chunks} - host
    assert len(host) > 1 and device

    def owner(tensor: torch.Tensor) -> int:
        for chunk in chunks:
            master = chunk.store.master
            start = master.untyped_storage().data_ptr()
            if start <= tensor.data_ptr() < start + master.untyped_storage().nbytes():
                return chunk.chunk_id
        raise AssertionError("a stepped tensor outside every master shard")

    steps = 2
    with _counting("_fused_adamw_") as calls:
        _train(chunked, optimizer, _data(steps, 32))
    owners = [{owner(t) for t in call} for call in calls]
    host_calls = [o for o in owners if o & host]
    assert all(o <= host for o in host_calls), f"a call mixed device and host runs: {owners}"
    assert [o for o in owners if not o & host] == [device] * steps  # every device run, one call a step
    # Every host chunk stepped once a step, whatever the calls.
    assert Counter(c for o in host_calls for c in o) == dict.fromkeys(host, steps)
    if isinstance(host_step, StepAfterBackward):
        assert host_calls == [host] * steps
    else:
        assert host_calls[-len(host) :] == [{c} for c in sorted(host, reverse=True)]  # backward order
        assert chunked.stats().early_steps == len(host)


def test_a_parameter_without_a_gradient_splits_its_run_and_keeps_its_own_state() -> None:
    """PyTorch skips a parameter that got no gradient (its step count stays behind): the run holding
    it is cut there for good, and every parameter's state, saved and loaded, stays plain PyTorch's."""
    model, ref = copies(_Skip())

    def make(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    reference = make(ref.parameters())
    chunked, optimizer = _boost(model, make(model.parameters()), StaticPlacementConfig(max_prefetch=0), 1_000)
    assert len(chunked.manager.chunks) == 1
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 1  # all six parameters, one run
    data, skips = _data(6, 16), [False, True, False, True, True, False]
    _train(chunked, optimizer, data[:3], skips[:3])
    _train(ref, reference, data[:3], skips[:3])
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 3  # a | b | c
    _assert_identical(chunked, optimizer, ref, reference)
    steps = [entry["step"].item() for entry in optimizer.state_dict()["state"].values()]
    assert steps == [3, 3, 2, 2, 3, 3]
    # A state whose parameters differ in step count loads into a fresh model as runs that keep it.
    saved = optimizer.state_dict()
    other_model = _Skip()
    other, other_optimizer = _boost(
        other_model, make(other_model.parameters()), StaticPlacementConfig(max_prefetch=0), 1_000
    )
    other.load_state_dict(chunked.state_dict())
    other_optimizer.load_state_dict(saved)
    assert sum(len(g["params"]) for g in other_optimizer.param_groups) == 3
    _train(other, other_optimizer, data[3:], skips[3:])
    _train(ref, reference, data[3:], skips[3:])
    _assert_identical(other, other_optimizer, ref, reference)
