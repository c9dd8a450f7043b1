"""A plan answers a meta op it has seen with the same arguments from memory (``MetaResults``):
what it answers is what the op's own meta kernel gives (shape, strides, dtype), the kernel runs
once per distinct argument layout, and what must not be remembered still runs: views alias their
base, in-place ops return their argument, a tensor class that refuses ops still refuses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from chunkmem.planning import meta_cache
from chunkmem.planning.meta_cache import MetaResults

_calls = [0]


@pytest.fixture(autouse=True)
def _forgotten() -> None:
    """Each test starts from an empty memory (it is shared by the whole process)."""
    meta_cache._SEEN.clear()


@torch.library.custom_op("chunkmem_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@_scaled.register_fake
def _(x: torch.Tensor, factor: float) -> torch.Tensor:
    _calls[0] += 1
    return torch.empty_like(x, dtype=torch.float64 if factor > 1 else x.dtype)


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.shape), t.stride(), t.dtype, t.device


def test_each_argument_layout_runs_the_kernel_once() -> None:
    _calls[0] = 0
    x, wide = _meta(4, 6), _meta(4, 8)
    with MetaResults():
        first = _scaled(x, 0.5)
        again = _scaled(_meta(4, 6), 0.5)
        assert _calls[0] == 1
        assert _layout(again) == _layout(first) and again is not first
        _scaled(wide, 0.5)  # another shape
        _scaled(x.t(), 0.5)  # other strides
        assert _scaled(x, 2.0).dtype == torch.float64  # another argument, another answer
        assert _calls[0] == 4
    _scaled(x, 0.5)  # outside the mode: the kernel runs
    assert _calls[0] == 5


CASES: dict[str, Callable[[], torch.Tensor | tuple[torch.Tensor, ...]]] = {
    # A bool tensor plus 1 is int64, plus True bool; an int64 one times 2 int64, times 2.0 float.
    "int scalar": lambda: _meta(3, dtype=torch.bool) + 1,
    "bool scalar": lambda: _meta(3, dtype=torch.bool) + True,
    "int times int": lambda: _meta(3, dtype=torch.int64) * 2,
    "int times float": lambda: _meta(3, dtype=torch.int64) * 2.0,
    "transposed input": lambda: _meta(5, 7).t() * 2,
    "broadcast": lambda: _meta(5, 1) + _meta(1, 7),
    "matmul": lambda: _meta(5, 7) @ _meta(7, 3, dtype=torch.float32),
    "sum over dims": lambda: _meta(2, 3, 4).sum(dim=[0, 2]),
    "cat": lambda: torch.cat([_meta(2, 3), _meta(4, 3)]),
    "max with indices": lambda: tuple(_meta(3, 4).max(dim=1)),
    "layer norm": lambda: torch.nn.functional.layer_norm(_meta(2, 8), [8]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_remembered_result_is_the_kernels(case: str) -> None:
    expected = CASES[case]()
    with MetaResults():
        answers = [CASES[case](), CASES[case]()]  # the second from memory
    for answer in answers:
        if isinstance(expected, tuple):
            assert [_layout(t) for t in answer] == [_layout(t) for t in expected]
        else:
            assert _layout(answer) == _layout(expected)


class _Refusing(torch.Tensor):
    @staticmethod
    def __new__(cls, like: torch.Tensor) -> _Refusing:
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        raise RuntimeError(f"{func} refused")


def test_views_in_place_ops_and_refusing_tensors_are_not_remembered() -> None:
    x = _meta(4, 6)
    with MetaResults():
        for _ in range(2):
            view = x[1:]  # its storage is x's, from its second row on
            assert view.storage_offset() == 6 and view.untyped_storage().nbytes() == x.untyped_storage().nbytes()
            assert x.add_(1) is x
            turned = _meta(4, 6)
            assert turned.t_() is turned and turned.shape == (6, 4)  # an in-place op that changes the layout
        _ = x * 2
        with pytest.raises(RuntimeError, match="refused"):
            _ = _Refusing(x) * 2
    assert torch.empty(3).device.type == "cpu"  # the mode is left: nothing of it stays


def test_the_default_dtype_and_an_output_that_shares_its_input_are_not_mixed_up() -> None:
    # An int tensor times a float scalar takes the default dtype, which the arguments do not say.
    ints = torch.empty(3, dtype=torch.int64, device="meta")
    with MetaResults():
        assert (ints * 1.5).dtype == torch.float32
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            assert (ints * 1.5).dtype == torch.float64
        finally:
            torch.set_default_dtype(previous)
    # ``_unsafe_view`` returns its input's storage without an alias in its schema: never an empty stand-in.
    x = _meta(4, 6)
    with MetaResults() as seen:
        for _ in range(2):
            out = torch.ops.aten._unsafe_view(x, [24])
            assert out.untyped_storage()._cdata == x.untyped_storage()._cdata
        assert seen.hits == 0
