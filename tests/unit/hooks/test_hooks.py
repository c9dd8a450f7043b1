"""Unit tests for the generic ``hooks`` package, forward side: ``HookedParameter`` ops call the
active ``ParamOpHook``s around forward ops (which hooks fire, with which parameters, and what comes
out), metadata access stays unhooked, hooks are installed either bound to parameters or for a
region, in-place ops on parameters call ``mutating_op`` first, and ``to_hooked``/``to_plain``
convert parameters. The backward side is in ``test_hooks_backward.py``.

Every numeric check compares against plain PyTorch computed here on unhooked copies; the shared
helpers are in ``hook_helpers.py``."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support.hook_helpers import (
    Event,
    FreeStorage,
    Recorder,
    TiedLM,
    _seed_and_no_leftover_region,  # noqa: F401  (autouse fixture: imported to apply here)
    assert_grads_equal,
    clones,
    hook_params,
)
from torch import nn

from chunkmem.hooks import (
    HookedParameter,
    ValueCopy,
    bind,
    bound_hooks,
    hooks_for,
    param_op_hooks,
    to_hooked,
    to_plain,
    unbind,
    unhooked,
)

# --------------------------------------------------------------------------------------------
# forward: which hooks fire, with which params, and what comes out
# --------------------------------------------------------------------------------------------


def test_linear_forward_fires_pre_and_post_op_with_weight_and_bias() -> None:
    lin, ref = clones(nn.Linear(4, 3))
    rec = Recorder(hook_params(lin))
    x = torch.randn(2, 4)
    with param_op_hooks(rec):
        y = lin(x)
    assert rec.events == [("pre_op", ("weight", "bias")), ("post_op", ("weight", "bias"))]
    assert type(y) is torch.Tensor
    assert torch.equal(y, ref(x))


def test_embedding_forward_fires_with_weight_only() -> None:
    emb, ref = clones(nn.Embedding(7, 5))
    rec = Recorder(hook_params(emb))
    idx = torch.tensor([[0, 3, 6], [2, 2, 1]])
    with param_op_hooks(rec):
        y = emb(idx)
    assert rec.events == [("pre_op", ("weight",)), ("post_op", ("weight",))]
    assert type(y) is torch.Tensor
    assert torch.equal(y, ref(idx))


def test_layernorm_forward_fires_with_weight_and_bias() -> None:
    ln, ref = clones(nn.LayerNorm(6))
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.5, 0.5)
        ref.load_state_dict(ln.state_dict())
    rec = Recorder(hook_params(ln))
    x = torch.randn(3, 6)
    with param_op_hooks(rec):
        y = ln(x)
    assert rec.events == [("pre_op", ("weight", "bias")), ("post_op", ("weight", "bias"))]
    assert type(y) is torch.Tensor
    assert torch.equal(y, ref(x))


def test_tied_output_projection_outside_module_fires_for_the_weight_use() -> None:
    model, ref = clones(TiedLM())
    rec = Recorder(hook_params(model))
    idx = torch.tensor([[1, 4, 9], [0, 10, 3]])
    with param_op_hooks(rec):
        out = model(idx)
    # embedding, layer_norm, fc, proj, then `.T` on the tied weight (the matmul then runs on a plain
    # tensor and is not a parameter op).
    assert rec.kinds("pre_op") == [
        ("emb.weight",),
        ("ln.weight", "ln.bias"),
        ("fc.weight", "fc.bias"),
        ("proj.weight", "proj.bias"),
        ("emb.weight",),
    ]
    assert rec.kinds("post_op") == rec.kinds("pre_op")
    assert [e[0] for e in rec.events] == ["pre_op", "post_op"] * 5
    assert type(out) is torch.Tensor
    assert torch.equal(out, ref(idx))


def test_functional_linear_with_foreign_weight_fires_once_with_that_weight() -> None:
    emb, ref = clones(nn.Embedding(9, 4))
    rec = Recorder(hook_params(emb))
    h = torch.randn(2, 4)
    with param_op_hooks(rec):
        logits = F.linear(h, emb.weight)
    assert rec.events == [("pre_op", ("weight",)), ("post_op", ("weight",))]
    assert type(logits) is torch.Tensor
    assert torch.equal(logits, F.linear(h, ref.weight))


def test_op_lists_each_param_once_and_all_params_it_touches() -> None:
    a = nn.Parameter(torch.randn(3))
    b = nn.Parameter(torch.randn(3))
    a_ref, b_ref = a.detach().clone(), b.detach().clone()
    to_hooked([a, b])
    rec = Recorder({id(a): "a", id(b): "b"})
    with param_op_hooks(rec):
        sq = a * a
        s = torch.stack([a, b, a])
        plain = torch.randn(3) + 1  # touches no hooked parameter
    assert rec.kinds("pre_op") == [("a",), ("a", "b")]
    assert rec.kinds("post_op") == [("a",), ("a", "b")]
    assert type(plain) is torch.Tensor
    assert type(sq) is torch.Tensor and type(s) is torch.Tensor
    assert torch.equal(sq, a_ref * a_ref)
    assert torch.equal(s, torch.stack([a_ref, b_ref, a_ref]))


@pytest.mark.parametrize("active", [True, False], ids=["hooks-active", "no-hooks"])
def test_outputs_are_plain_tensors(active: bool) -> None:
    w = nn.Parameter(torch.randn(2, 3))
    to_hooked([w])
    rec = Recorder({id(w): "w"})
    ctx = param_op_hooks(rec) if active else param_op_hooks()
    with ctx:
        computed = [w * 2, w.clone(), w.sum()]
        aliases = [w.detach(), w[0], w.view(3, 2), *w.split(1)]
    for out in computed:
        assert type(out) is torch.Tensor
    # Views of the parameter are copies where hooks observe ops; plain views otherwise.
    for out in aliases:
        assert type(out) is (ValueCopy if active else torch.Tensor)
        assert not isinstance(out, nn.Parameter)
    assert len(rec.kinds("pre_op")) == (len(computed) + len(aliases) - 1 if active else 0)  # split: one op


def test_post_op_fires_when_the_op_raises() -> None:
    w = nn.Parameter(torch.randn(3, 4))
    to_hooked([w])
    rec = Recorder({id(w): "w"})
    with param_op_hooks(rec), pytest.raises(RuntimeError):
        _ = w @ torch.randn(5, 2)
    assert rec.events == [("pre_op", ("w",)), ("post_op", ("w",))]


# --------------------------------------------------------------------------------------------
# metadata access is unhooked; `.T` is an op
# --------------------------------------------------------------------------------------------


def test_metadata_access_fires_no_hooks() -> None:
    w = nn.Parameter(torch.randn(3, 4))
    to_hooked([w])
    w.grad = torch.ones(3, 4)
    rec = Recorder({id(w): "w"})
    with param_op_hooks(rec):
        assert w.shape == (3, 4)
        assert w.dtype == torch.float32
        assert w.device.type == "cpu"
        assert w.grad is not None
        assert w.size() == (3, 4) and w.size(1) == 4
        assert w.numel() == 12 and w.nelement() == 12
        assert w.requires_grad
        assert w.dim() == 2 and w.ndim == 2 and len(w) == 3
        assert w.is_leaf and w.is_contiguous() and w.is_floating_point()
        assert w.stride() == (4, 1)
        assert w.data_ptr() != 0
        w.requires_grad_(True)
    assert rec.events == []


def test_reading_data_is_an_op_that_returns_a_copy() -> None:
    """``.data`` reads the values: hooks run around it, and the result is a copy, valid after the
    hook frees the parameter's storage."""
    w = nn.Parameter(torch.randn(3, 4))
    expected = w.detach().clone()
    to_hooked([w])
    storage = FreeStorage([w])
    bind([w], storage)
    data = w.data
    assert type(data) is ValueCopy and torch.equal(data, expected)
    assert storage.all_released()
    unbind([w], storage)


def test_assigning_data_is_a_mutation() -> None:
    w = nn.Parameter(torch.randn(3))
    to_hooked([w])
    rec = Recorder({id(w): "w"})
    with param_op_hooks(rec):
        w.data = torch.zeros(3)
    assert rec.events[0] == ("mutating_op", ("w",), "__set__")


def test_transpose_property_fires_hooks() -> None:
    w = nn.Parameter(torch.randn(3, 4))
    ref = w.detach().clone()
    to_hooked([w])
    rec = Recorder({id(w): "w"})
    with param_op_hooks(rec):
        t = w.T
    assert rec.events == [("pre_op", ("w",)), ("post_op", ("w",))]
    assert type(t) is ValueCopy
    assert torch.equal(t, ref.T)


# In plain PyTorch each of these writes into the parameter (they are views of it); where hooks
# observe ops they write into a copy, so they are refused.
_WRITES_THROUGH_A_COPY: dict[str, Callable[[torch.Tensor], Any]] = {
    "data.mul_": lambda w: w.data.mul_(2),
    "detach.zero_": lambda w: w.detach().zero_(),
    "row.fill_": lambda w: w[0].fill_(1.0),
    "view.add_": lambda w: w.view(-1).add_(1.0),
    "data.setitem": lambda w: w.data.__setitem__(0, 5.0),
    "T.copy_": lambda w: w.T.copy_(torch.zeros(4, 3)),
    "out=": lambda w: torch.add(torch.ones(3, 4), 1.0, out=w.detach()),
    "data.cpu.mul_": lambda w: w.data.cpu().mul_(3),
    # Views of the copy are copies of the parameter too.
    "data.row.zero_": lambda w: w.data[:, 0].zero_(),
    "detach.view.mul_": lambda w: w.detach().view(-1).mul_(2),
    "data.data.add_": lambda w: w.data.data.add_(1.0),
    "data.unbind.fill_": lambda w: w.data.unbind(0)[1].fill_(0.0),
    # Writes that name their target otherwise than as self.
    "init.normal_": lambda w: nn.init.normal_(w.data),
    "init.kaiming_uniform_.T": lambda w: nn.init.kaiming_uniform_(w.T),
    "foreach": lambda w: torch._foreach_mul_([w.data], 2.0),
    "relu-inplace": lambda w: F.relu(w.detach(), inplace=True),
}


@pytest.mark.parametrize("write", list(_WRITES_THROUGH_A_COPY))
def test_a_write_through_a_copy_of_a_hooked_parameter_is_refused(write: str) -> None:
    w = nn.Parameter(torch.randn(3, 4))
    expected = w.detach().clone()
    to_hooked([w])
    storage = FreeStorage([w])
    rec = Recorder({id(w): "w"})
    bind([w], storage)
    bind([w], rec)
    with torch.no_grad(), pytest.raises(RuntimeError, match="would change the copy and not the parameter"):
        _WRITES_THROUGH_A_COPY[write](w)
    # The parameter's own hooks were asked first (so a hook can refuse naming the parameter).
    [(names, op_name)] = [e[1:] for e in rec.events if e[0] == "mutating_op"]
    assert names == ("w",) and "through a copy of its values" in op_name
    storage.gather([w])
    with unhooked():
        assert torch.equal(w.data, expected)


def test_a_copy_of_a_hooked_parameter_reads_like_it_and_gives_plain_tensors(tmp_path: Any) -> None:
    w, v = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(4, 2))
    w_ref, v_ref = w.detach().clone(), v.detach().clone()
    to_hooked([w, v])
    rec = Recorder({id(w): "w", id(v): "v"})
    bind([w, v], rec)
    data = w.data
    assert type(data) is ValueCopy and torch.equal(data, w_ref)
    assert type(data * 2) is torch.Tensor and torch.equal(data * 2, w_ref * 2)
    assert type(data[0]) is ValueCopy and torch.equal(data[0], w_ref[0])
    values, indices = data.max(dim=1)
    assert type(values) is torch.Tensor and torch.equal(indices, w_ref.max(dim=1).indices)
    rec.events.clear()
    # An op mixing the copy with another hooked parameter still calls that parameter's hooks.
    product = torch.mm(data, v)
    assert type(product) is torch.Tensor and torch.equal(product, w_ref @ v_ref)
    assert rec.events == [("pre_op", ("v",)), ("post_op", ("v",))]
    # Copies made from it are independent tensors, writable like any other.
    for independent in (data.clone(), copy.deepcopy(data), copy.deepcopy(w.detach().requires_grad_())):
        assert type(independent) is torch.Tensor and independent.is_leaf
        with torch.no_grad():
            independent.zero_()
    torch.save(data, tmp_path / "w.pt")
    loaded = torch.load(tmp_path / "w.pt")
    assert type(loaded) is torch.Tensor and torch.equal(loaded, w_ref)
    # Gradients flow through a view taken while recording, as through plain PyTorch's view.
    w_plain = nn.Parameter(w_ref.clone())
    (w.T * torch.arange(3.0)).sum().backward()
    (w_plain.T * torch.arange(3.0)).sum().backward()
    assert torch.equal(w.grad, w_plain.grad)


# --------------------------------------------------------------------------------------------
# region hooks vs bound hooks
# --------------------------------------------------------------------------------------------


def test_region_hooks_fire_only_inside_the_block() -> None:
    lin = nn.Linear(3, 3)
    rec = Recorder(hook_params(lin))
    x = torch.randn(2, 3)
    lin(x)
    assert rec.events == []
    with param_op_hooks(rec):
        assert [h for h, _ in hooks_for(list(lin.parameters()))] == [rec]
        lin(x)
    assert len(rec.events) == 2
    lin(x)
    lin.weight * 2
    assert len(rec.events) == 2
    assert hooks_for(list(lin.parameters())) == ()


def test_each_bound_hook_sees_only_its_own_parameters() -> None:
    """An op mixing parameters of two owners (e.g. a regulariser against another model's weights)
    calls each owner's hook with its own parameters; a region hook sees all of them."""
    a, b = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
    to_hooked([a, b])
    first, second, everything = (
        Recorder({id(a): "a", id(b): "b"}),
        Recorder({id(a): "a", id(b): "b"}),
        Recorder({id(a): "a", id(b): "b"}),
    )
    bind([a], first)
    bind([b], second)
    with param_op_hooks(everything):
        (a - b).pow(2).sum().backward()
    assert first.kinds("pre_op") == [("a",)] and first.kinds("pre_backward") == [("a",)]
    assert second.kinds("pre_op") == [("b",)] and second.kinds("post_backward") == [("b",)]
    assert everything.kinds("pre_op") == [("a", "b")]
    unbind([a], first)
    unbind([b], second)


def test_region_hooks_are_removed_when_the_block_raises() -> None:
    lin = nn.Linear(3, 3)
    rec = Recorder(hook_params(lin))
    with pytest.raises(ValueError), param_op_hooks(rec):
        raise ValueError
    lin(torch.randn(1, 3))
    assert rec.events == []


def test_nested_regions_restore_the_outer_hooks() -> None:
    lin = nn.Linear(3, 3)
    names = hook_params(lin)
    outer, inner = Recorder(names, tag="outer"), Recorder(names, tag="inner")
    params = list(lin.parameters())
    with param_op_hooks(outer):
        with param_op_hooks(inner):
            assert [h for h, _ in hooks_for(params)] == [outer, inner]
        assert [h for h, _ in hooks_for(params)] == [outer]
        lin(torch.randn(1, 3))
    assert inner.events == []
    assert len(outer.events) == 2


def test_backward_of_a_region_forward_still_calls_the_region_hooks() -> None:
    """The bridges capture the hooks active at forward time."""
    lin = nn.Linear(3, 3)
    rec = Recorder(hook_params(lin))
    x = torch.randn(2, 3, requires_grad=True)
    with param_op_hooks(rec):
        y = lin(x)
    y.sum().backward()
    assert rec.kinds("pre_backward") == [("weight", "bias")]
    assert rec.kinds("post_backward") == [("weight", "bias")]


def test_bound_hooks_fire_everywhere_and_unbind_stops_them() -> None:
    lin = nn.Linear(3, 3)
    rec = Recorder(hook_params(lin))
    bind(lin.parameters(), rec)
    assert bound_hooks(lin.weight) == (rec,) and bound_hooks(lin.bias) == (rec,)
    x = torch.randn(2, 3, requires_grad=True)
    y = lin(x)
    y.sum().backward()
    assert [e[0] for e in rec.events] == ["pre_op", "post_op", "pre_backward", "post_backward"]
    rec.events.clear()
    other = Recorder({})
    with param_op_hooks(other):
        lin(x)
    assert [e[0] for e in rec.events] == ["pre_op", "post_op"]
    rec.events.clear()
    unbind(lin.parameters(), rec)
    assert bound_hooks(lin.weight) == ()
    lin(x).sum().backward()
    lin.weight * 2
    assert rec.events == []


def test_hook_bound_to_one_param_fires_for_ops_touching_it() -> None:
    lin = nn.Linear(3, 3)
    rec = Recorder(hook_params(lin))
    bind([lin.weight], rec)
    lin(torch.randn(2, 3))  # touches weight and bias: the hook sees the parameter bound to it
    lin.bias * 2  # touches only bias: not reported
    assert rec.events == [("pre_op", ("weight",)), ("post_op", ("weight",))]


def test_binding_twice_fires_once() -> None:
    w = nn.Parameter(torch.randn(3))
    to_hooked([w])
    rec = Recorder({id(w): "w"})
    bind([w], rec)
    bind([w], rec)
    assert bound_hooks(w) == (rec,)
    w * 2
    assert len(rec.events) == 2


def test_region_and_bound_hooks_each_fire_once_bound_first() -> None:
    lin = nn.Linear(3, 3)
    names = hook_params(lin)
    log: list[Event] = []
    bound, region = Recorder(names, log, tag="bound"), Recorder(names, log, tag="region")
    bind(lin.parameters(), bound)
    x = torch.randn(2, 3, requires_grad=True)
    with param_op_hooks(region):
        y = lin(x)
    y.sum().backward()
    wb = ("weight", "bias")
    assert log == [
        ("bound", "pre_op", wb),
        ("region", "pre_op", wb),
        ("bound", "post_op", wb),
        ("region", "post_op", wb),
        ("bound", "pre_backward", wb),
        ("region", "pre_backward", wb),
        ("bound", "post_backward", wb),
        ("region", "post_backward", wb),
    ]


def test_hook_both_bound_and_in_region_fires_once() -> None:
    lin = nn.Linear(3, 3)
    rec = Recorder(hook_params(lin))
    bind(lin.parameters(), rec)
    x = torch.randn(2, 3, requires_grad=True)
    with param_op_hooks(rec, rec):
        y = lin(x)
    y.sum().backward()
    assert [e[0] for e in rec.events] == ["pre_op", "post_op", "pre_backward", "post_backward"]


# --------------------------------------------------------------------------------------------
# in-place ops
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "op", "plain"),
    [
        ("add_", lambda p: p.add_(1.0), lambda t: t + 1.0),
        ("mul_", lambda p: p.mul_(3.0), lambda t: t * 3.0),
        ("add_", lambda p: p.__iadd__(2.0), lambda t: t + 2.0),  # `p += 2` reaches torch as add_
        ("__setitem__", lambda p: p.__setitem__(0, 5.0), lambda t: torch.cat([torch.tensor([5.0]), t[1:]])),
        ("zero_", lambda p: p.zero_(), torch.zeros_like),
        # nn.init passes the tensor by keyword; foreach ops take lists; functionals say inplace=True.
        ("constant_", lambda p: nn.init.constant_(p, 2.0), lambda t: torch.full_like(t, 2.0)),
        ("_foreach_mul_", lambda p: torch._foreach_mul_([p], 2.0), lambda t: t * 2.0),
        ("relu", lambda p: F.relu(p, inplace=True), torch.relu),
    ],
    ids=["add_", "mul_", "iadd", "setitem", "zero_", "init.constant_", "foreach", "relu-inplace"],
)
def test_inplace_op_on_param_calls_mutating_op_before_it(
    name: str, op: Callable[[torch.Tensor], Any], plain: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    p = nn.Parameter(torch.randn(4))
    expected = plain(p.detach().clone())
    before = p.detach().clone()
    to_hooked([p])

    class Snoop(Recorder):
        def mutating_op(self, params: Sequence[torch.Tensor], op_name: str) -> None:
            with unhooked():
                assert torch.equal(params[0], before), "mutating_op must run before the write"
            super().mutating_op(params, op_name)

    rec = Snoop({id(p): "p"})
    with torch.no_grad(), param_op_hooks(rec):
        op(p)
    assert rec.events == [("mutating_op", ("p",), name), ("pre_op", ("p",)), ("post_op", ("p",))]
    assert type(p) is HookedParameter
    assert torch.equal(p.detach(), expected)


class _Guard(Recorder):
    """Observes no ops: only asked about in-place writes."""

    @property
    def observes_ops(self) -> bool:
        return False


def test_a_hook_that_observes_no_ops_sees_only_writes_and_ops_run_plain() -> None:
    lin, ref = clones(nn.Linear(4, 3))
    guard = _Guard(hook_params(lin))
    x = torch.randn(2, 4)
    with param_op_hooks(guard):
        y = lin(x)
        y.sum().backward()
        view = lin.weight.T
        with torch.no_grad():
            lin.bias.add_(1.0)
    ref(x).sum().backward()
    assert torch.equal(y, ref(x))
    assert_grads_equal(lin, ref)
    # No op events, no autograd bridges (the backward ran no hook), and outputs are what plain
    # torch returns: a view of the parameter stays a view.
    assert guard.events == [("mutating_op", ("bias",), "add_")]
    assert view.untyped_storage().data_ptr() == lin.weight.untyped_storage().data_ptr()
    assert torch.equal(lin.bias.detach(), ref.bias.detach() + 1.0)


def test_an_observing_hook_beside_a_guard_still_gets_every_event() -> None:
    lin = nn.Linear(4, 3)
    names = hook_params(lin)
    guard, rec = _Guard(names), Recorder(names)
    with param_op_hooks(guard, rec):
        lin(torch.randn(2, 4)).sum().backward()
    assert guard.events == []
    kinds = [event[0] for event in rec.events]
    assert kinds == ["pre_op", "post_op", "pre_backward", "post_backward"]


def test_out_kwarg_into_param_calls_mutating_op() -> None:
    p = nn.Parameter(torch.zeros(3))
    to_hooked([p])
    rec = Recorder({id(p): "p"})
    a, b = torch.randn(3), torch.randn(3)
    with torch.no_grad(), param_op_hooks(rec):
        torch.add(a, b, out=p)
    assert rec.events[0] == ("mutating_op", ("p",), "add")
    assert torch.equal(p.detach(), a + b)


def test_mutating_op_that_raises_prevents_the_write() -> None:
    class ReadOnly(Recorder):
        def mutating_op(self, params: Sequence[torch.Tensor], op_name: str) -> None:
            super().mutating_op(params, op_name)
            raise RuntimeError(f"read-only: {op_name}")

    p = nn.Parameter(torch.randn(4))
    before = p.detach().clone()
    to_hooked([p])
    hook = ReadOnly({id(p): "p"})
    bind([p], hook)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="read-only: add_"):
            p.add_(1.0)
        with pytest.raises(RuntimeError, match="read-only: mul_"):
            p.mul_(2.0)
        with pytest.raises(RuntimeError, match="read-only: copy_"):
            p.copy_(torch.zeros(4))
    assert [e[0] for e in hook.events] == ["mutating_op"] * 3  # the ops never started
    with unhooked():
        assert torch.equal(p, before)
    # out-of-place ops are not mutations and still run
    assert torch.equal(p + 1.0, before + 1.0)
    assert [e[0] for e in hook.events[3:]] == ["pre_op", "post_op"]


def test_inplace_op_on_other_tensor_with_param_operand_is_not_a_mutation() -> None:
    p = nn.Parameter(torch.randn(3))
    p_ref = p.detach().clone()
    to_hooked([p])
    rec = Recorder({id(p): "p"})
    x = torch.randn(3)
    x_ref = x.clone()
    with torch.no_grad(), param_op_hooks(rec):
        x.add_(p)
    assert rec.events == [("pre_op", ("p",)), ("post_op", ("p",))]
    assert torch.equal(x, x_ref + p_ref)
    assert torch.equal(p.detach(), p_ref)


def test_inplace_on_param_requiring_grad_raises_like_plain_torch() -> None:
    p = nn.Parameter(torch.randn(3))
    q = nn.Parameter(p.detach().clone())
    with pytest.raises(RuntimeError):
        q.mul_(2.0)
    to_hooked([p])
    bind([p], Recorder({id(p): "p"}))
    with pytest.raises(RuntimeError):
        p.mul_(2.0)
    assert torch.equal(p.detach(), q.detach())


def test_inplace_into_plain_tensor_with_param_operand_gives_correct_gradients() -> None:
    """The written tensor does not require grad: the op runs unbridged on its output, and the
    input bridge announces pre_backward itself so pre/post stay paired."""
    w = nn.Parameter(torch.randn(4))
    w_ref = nn.Parameter(w.detach().clone())
    to_hooked([w])
    rec = Recorder({id(w): "w"})
    bind([w], rec)
    x = torch.randn(4)
    x_ref = x.clone()
    y = x.mul_(w)
    y_ref = x_ref.mul_(w_ref)
    assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    (x * torch.arange(4.0)).sum().backward()
    (x_ref * torch.arange(4.0)).sum().backward()
    assert torch.equal(w.grad, w_ref.grad)
    assert [e[0] for e in rec.events] == ["pre_op", "post_op", "pre_backward", "post_backward"]


@pytest.mark.parametrize("param_requires_grad", [True, False])
def test_inplace_into_activation_with_param_operand_gives_correct_gradients(param_requires_grad: bool) -> None:
    w = nn.Parameter(torch.randn(4), requires_grad=param_requires_grad)
    w_ref = nn.Parameter(w.detach().clone(), requires_grad=param_requires_grad)
    to_hooked([w])
    rec = Recorder({id(w): "w"})
    bind([w], rec)
    a = torch.randn(4, requires_grad=True)
    a_ref = a.detach().clone().requires_grad_(True)
    x = a * 2.0
    x.mul_(w)
    x_ref = a_ref * 2.0
    x_ref.mul_(w_ref)
    assert torch.equal(x, x_ref)
    (x * torch.arange(4.0)).sum().backward()
    (x_ref * torch.arange(4.0)).sum().backward()
    assert torch.equal(a.grad, a_ref.grad)
    if param_requires_grad:
        assert torch.equal(w.grad, w_ref.grad)
    assert rec.kinds("pre_backward") == [("w",)]
    assert rec.kinds("post_backward") == [("w",)]


@pytest.mark.parametrize("inplace", ["relu_", "iadd"])
def test_inplace_on_output_of_hooked_op(inplace: str) -> None:
    lin, ref = clones(nn.Linear(3, 3))
    rec = Recorder(hook_params(lin))
    bind(lin.parameters(), rec)
    x = torch.randn(2, 3, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    outs = []
    for layer, inp in ((lin, x), (ref, x_ref)):
        y = layer(inp)
        if inplace == "relu_":
            y.relu_()
        else:
            y += 1.0
        y.square().sum().backward()
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(x.grad, x_ref.grad)
    assert_grads_equal(lin, ref)
    assert rec.kinds("pre_backward") == [("weight", "bias")]


# --------------------------------------------------------------------------------------------
# to_hooked / to_plain
# --------------------------------------------------------------------------------------------


def test_to_hooked_keeps_identity_and_requires_grad() -> None:
    lin = nn.Linear(3, 2)
    lin.bias.requires_grad_(False)
    weight, bias = lin.weight, lin.bias
    ids = [id(weight), id(bias)]
    values = [weight.detach().clone(), bias.detach().clone()]
    to_hooked(lin.parameters())
    assert lin.weight is weight and lin.bias is bias
    assert [id(p) for p in lin.parameters()] == ids
    assert type(weight) is HookedParameter and type(bias) is HookedParameter
    assert isinstance(weight, nn.Parameter)
    assert weight.requires_grad and not bias.requires_grad
    assert torch.equal(weight.detach(), values[0]) and torch.equal(bias.detach(), values[1])
    to_hooked(lin.parameters())  # idempotent
    assert type(weight) is HookedParameter


def test_to_plain_undoes_to_hooked() -> None:
    lin = nn.Linear(3, 2)
    weight = lin.weight
    rec = Recorder(hook_params(lin))
    bind(lin.parameters(), rec)
    to_plain(lin.parameters())
    assert lin.weight is weight
    assert type(weight) is nn.Parameter and type(lin.bias) is nn.Parameter
    assert weight.requires_grad
    x = torch.randn(2, 3, requires_grad=True)
    with param_op_hooks(rec):
        lin(x).sum().backward()
    assert rec.events == []
    assert weight.grad is not None


def test_to_hooked_refuses_parameter_subclass_and_plain_tensors() -> None:
    class MyParam(nn.Parameter):
        pass

    p = MyParam(torch.randn(3))
    with pytest.raises(TypeError, match="MyParam"):
        to_hooked([p])
    assert type(p) is MyParam
    t = torch.randn(3)
    with pytest.raises(TypeError):
        to_hooked([t])  # type: ignore[list-item]
    assert type(t) is torch.Tensor
