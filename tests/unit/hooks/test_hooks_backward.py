"""Unit tests for the generic ``hooks`` package, backward side: the autograd bridges call
``pre_backward`` before and ``post_backward`` after each op's own backward, once per op (and not
for ops that record no graph); gather and freed-storage emulations built on those hooks give the
same outputs and gradients as plain PyTorch, with and without activation checkpointing, whose
recomputation fires ``pre_op`` again.

Every numeric check compares against plain PyTorch computed here on unhooked copies; the shared
helpers are in ``hook_helpers.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.hook_helpers import (
    Event,
    FreeStorage,
    Gather,
    Recorder,
    TiedLM,
    _seed_and_no_leftover_region,  # noqa: F401  (autouse fixture: imported to apply here)
    assert_grads_equal,
    clones,
    hook_params,
    op_node,
    watch_node,
)
from torch import nn

from chunkmem.hooks import bind, param_op_hooks, to_hooked

# --------------------------------------------------------------------------------------------
# backward: pre_backward before and post_backward after each op's own backward, once per op
# --------------------------------------------------------------------------------------------


def test_linear_backward_brackets_the_ops_own_backward() -> None:
    lin, ref = clones(nn.Linear(4, 3))
    log: list[Event] = []
    rec = Recorder(hook_params(lin), log)
    x = torch.randn(2, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    with param_op_hooks(rec):
        y = lin(x)
    watch_node(op_node(y), log, "addmm")
    log.clear()
    y.square().sum().backward()
    assert log == [
        ("pre_backward", ("weight", "bias")),
        ("op_backward_begin", "addmm"),
        ("op_backward_end", "addmm"),
        ("post_backward", ("weight", "bias")),
    ]
    ref(x_ref).square().sum().backward()
    assert_grads_equal(lin, ref)
    assert torch.equal(x.grad, x_ref.grad)


def test_post_backward_fires_before_the_inputs_receive_their_gradient() -> None:
    """Tensor hooks on the op's input and output: the output's gradient arrives before
    pre_backward; the input's gradient is produced only after post_backward."""
    lin = nn.Linear(3, 3)
    log: list[Event] = []
    rec = Recorder(hook_params(lin), log)
    a = torch.randn(2, 3, requires_grad=True)
    x = a * 1.5
    x.register_hook(lambda g: log.append(("input_grad",)))
    with param_op_hooks(rec):
        y = lin(x)
    y.register_hook(lambda g: log.append(("output_grad",)))
    log.clear()
    y.sum().backward()
    assert log == [
        ("output_grad",),
        ("pre_backward", ("weight", "bias")),
        ("post_backward", ("weight", "bias")),
        ("input_grad",),
    ]


def _check_bracketing(log: list[Event], labels: dict[str, tuple[str, ...]]) -> None:
    """Each labelled op node ran after a pre_backward and before a post_backward of its params,
    and every pre_backward is closed by a matching post_backward after it."""
    for label, params in labels.items():
        begin = log.index(("op_backward_begin", label))
        end = log.index(("op_backward_end", label))
        assert any(e == ("pre_backward", params) for e in log[:begin]), label
        assert any(e == ("post_backward", params) for e in log[end + 1 :]), label
    open_: list[tuple[str, ...]] = []
    for e in log:
        if e[0] == "pre_backward":
            open_.append(e[1])
        elif e[0] == "post_backward":
            assert e[1] in open_, e
            open_.remove(e[1])
    assert open_ == []


def test_model_backward_fires_once_per_op_around_each_ops_backward() -> None:
    model, ref = clones(TiedLM())
    log: list[Event] = []
    rec = Recorder(hook_params(model), log)
    idx = torch.tensor([[1, 4, 9], [0, 10, 3]])
    with param_op_hooks(rec):
        h_emb = model.emb(idx)
        h_ln = model.ln(h_emb)
        h_fc = model.fc(h_ln)
        h_proj = model.proj(F.gelu(h_fc))
        wt = model.emb.weight.T
        out = h_proj @ wt
    labels = {
        "embedding": ("emb.weight",),
        "layer_norm": ("ln.weight", "ln.bias"),
        "fc": ("fc.weight", "fc.bias"),
        "proj": ("proj.weight", "proj.bias"),
        "T": ("emb.weight",),
    }
    for label, t in zip(labels, [h_emb, h_ln, h_fc, h_proj, wt], strict=True):
        watch_node(op_node(t), log, label)
    log.clear()
    out.square().mean().backward()
    expected_counts = {("emb.weight",): 2, ("ln.weight", "ln.bias"): 1, ("fc.weight", "fc.bias"): 1}
    expected_counts[("proj.weight", "proj.bias")] = 1
    for kind in ("pre_backward", "post_backward"):
        got = rec.kinds(kind)
        assert len(got) == 5, kind
        assert {p: got.count(p) for p in got} == expected_counts, kind
    assert rec.kinds("pre_op") == [] and rec.kinds("post_op") == []
    _check_bracketing(log, labels)
    ref(idx).square().mean().backward()
    assert_grads_equal(model, ref)


def test_frozen_params_still_bridge_when_the_input_needs_a_gradient() -> None:
    lin, ref = clones(nn.Linear(3, 2))
    lin.requires_grad_(False)
    ref.requires_grad_(False)
    rec = Recorder(hook_params(lin))
    x = torch.randn(4, 3, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    with param_op_hooks(rec):
        y = lin(x)
    y.sum().backward()
    ref(x_ref).sum().backward()
    assert rec.kinds("pre_backward") == [("weight", "bias")]
    assert rec.kinds("post_backward") == [("weight", "bias")]
    assert torch.equal(x.grad, x_ref.grad)
    assert lin.weight.grad is None


def test_no_grad_forward_does_not_bridge() -> None:
    lin1, lin2 = nn.Linear(3, 3), nn.Linear(3, 2)
    names = {id(p): "lin1." + n for n, p in lin1.named_parameters()}
    names |= {id(p): "lin2." + n for n, p in lin2.named_parameters()}
    to_hooked([*lin1.parameters(), *lin2.parameters()])
    rec = Recorder(names)
    x = torch.randn(2, 3, requires_grad=True)
    with param_op_hooks(rec):
        with torch.no_grad():
            h = lin1(x)
        assert h.grad_fn is None and not h.requires_grad
        assert rec.kinds("pre_op") == [("lin1.weight", "lin1.bias")]
        y = lin2(h)
    y.sum().backward()
    assert rec.kinds("pre_backward") == [("lin2.weight", "lin2.bias")]
    assert rec.kinds("post_backward") == [("lin2.weight", "lin2.bias")]
    assert lin1.weight.grad is None and x.grad is None


def test_nothing_requires_grad_does_not_bridge() -> None:
    lin = nn.Linear(3, 3).requires_grad_(False)
    rec = Recorder(hook_params(lin))
    with param_op_hooks(rec):
        y = lin(torch.randn(2, 3))
    assert y.grad_fn is None and not y.requires_grad
    assert [e[0] for e in rec.events] == ["pre_op", "post_op"]


# --------------------------------------------------------------------------------------------
# gather emulation: pre_op / pre_backward swap the real values in
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("install", ["bound", "region"])
def test_gather_emulation_matches_unhooked_reference(install: str) -> None:
    model, ref = clones(TiedLM())
    hook_params(model)
    gather = Gather(model.parameters())
    assert gather.all_released()
    idx = torch.tensor([[1, 4, 9, 2], [0, 10, 3, 3]])
    if install == "bound":
        bind(model.parameters(), gather)
        out = model(idx)
    else:
        with param_op_hooks(gather):
            out = model(idx)
    assert gather.all_released()
    out_ref = ref(idx)
    assert torch.equal(out, out_ref)
    loss = out.square().mean()
    loss_ref = out_ref.square().mean()
    loss.backward()
    loss_ref.backward()
    assert gather.all_released()
    assert_grads_equal(model, ref)
    # a second step accumulates the same way
    if install == "bound":
        model(idx).square().mean().backward()
    else:
        with param_op_hooks(gather):
            out = model(idx)
        out.square().mean().backward()
    ref(idx).square().mean().backward()
    assert_grads_equal(model, ref)
    assert gather.all_released()


@pytest.mark.parametrize("ckpt", [None, True, False], ids=["plain", "reentrant", "non-reentrant"])
def test_freed_storage_emulation_matches_reference(ckpt: bool | None) -> None:
    """The op's backward reads its saved parameter aliases: only pre_backward makes them readable."""
    model, ref = clones(TiedLM(tie="linear", ckpt=ckpt))
    ref.ckpt = None
    hook_params(model)
    free = FreeStorage(model.parameters())
    bind(model.parameters(), free)
    idx = torch.tensor([[1, 4, 9, 2], [0, 10, 3, 3]])
    out, out_ref = model(idx), ref(idx)
    assert torch.equal(out, out_ref)
    assert free.all_released()
    out.square().mean().backward()
    out_ref.square().mean().backward()
    assert free.all_released()
    assert_grads_equal(model, ref)


def test_freed_storage_emulation_fails_without_the_backward_gather() -> None:
    """Control for the test above: it does depend on pre_backward."""
    model = TiedLM(tie="linear")
    hook_params(model)
    free = FreeStorage(model.parameters(), gather_in_backward=False)
    bind(model.parameters(), free)
    out = model(torch.tensor([[1, 4, 9, 2]]))
    with pytest.raises(RuntimeError, match=r"storage|allocated"):
        out.square().mean().backward()


def test_gather_emulation_with_frozen_params_gives_input_gradient() -> None:
    lin, ref = clones(nn.Linear(5, 4))
    lin.requires_grad_(False)
    hook_params(lin)
    gather = Gather(lin.parameters())
    bind(lin.parameters(), gather)
    x = torch.randn(3, 5, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = lin(x)
    y_ref = ref(x_ref)
    assert torch.equal(y, y_ref)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    assert gather.all_released()


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpoint_recomputation_fires_pre_op_and_gradients_match(use_reentrant: bool) -> None:
    model, ref = clones(TiedLM(ckpt=use_reentrant))
    ref.ckpt = None
    names = hook_params(model)
    log: list[Event] = []
    rec = Recorder(names, log)
    gather = Gather(model.parameters())
    bind(model.parameters(), gather)
    bind(model.parameters(), rec)
    idx = torch.tensor([[1, 4, 9, 2], [0, 10, 3, 3]])
    out = model(idx)
    out_ref = ref(idx)
    assert torch.equal(out, out_ref)
    forward_ops = rec.kinds("pre_op")
    assert ("fc.weight", "fc.bias") in forward_ops
    assert gather.all_released()
    log.clear()
    out.square().mean().backward()
    out_ref.square().mean().backward()
    recomputed = rec.kinds("pre_op")
    assert ("ln.weight", "ln.bias") in recomputed
    assert ("fc.weight", "fc.bias") in recomputed
    assert ("emb.weight",) not in recomputed  # outside the checkpointed block
    assert len(rec.kinds("post_op")) == len(recomputed)
    pre_bw, post_bw = rec.kinds("pre_backward"), rec.kinds("post_backward")
    assert sorted(pre_bw) == sorted(post_bw)
    for params in [("ln.weight", "ln.bias"), ("fc.weight", "fc.bias"), ("proj.weight", "proj.bias")]:
        assert pre_bw.count(params) == 1, params
    assert pre_bw.count(("emb.weight",)) == 2
    assert gather.all_released()
    assert_grads_equal(model, ref)
