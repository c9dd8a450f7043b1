"""torch's initialisers that do nothing on the meta device, recorded as whole calls.

``torch.nn.init.trunc_normal_``, ``orthogonal_``, ``sparse_`` and ``dirac_`` return at once when
given a meta tensor (they check ``tensor.is_meta`` in Python, before any op), so on meta they
neither record ops nor draw random numbers, where the CPU would have. While recording, these
functions (and ``transformers``' table of torch initialisers, which holds the originals) are
replaced by wrappers that hand a meta tensor to :meth:`GraphRecorder.record_call`: the whole call
becomes one recorded write, replayed by calling the original function on the real tensor.

Code that bound one of these names before recording (``from torch.nn.init import orthogonal_`` at
import time) keeps the original, which skips meta tensors silently; the functions ``torch.nn``'s
layers and ``transformers`` models use are all reached through the patched names.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Protocol
from unittest import mock

import torch
import torch.nn.init

from ..compat.torch import TRUNC_NORMAL_HELPER

__all__ = ["whole_calls_on_meta"]

# The functions that skip meta tensors; trunc_normal_'s check is in the helper it calls.
_SKIPPING = (TRUNC_NORMAL_HELPER, "orthogonal_", "sparse_", "dirac_")
_TRANSFORMERS_TABLE = ("transformers.initialization", "TORCH_INIT_FUNCTIONS")


class CallRecorder(Protocol):
    def record_call(self, fn: Callable[..., Any], tensor: torch.Tensor, args: tuple[Any, ...], kwargs: Any) -> None: ...


def _wrapper(original: Callable[..., Any], recorder: CallRecorder) -> Callable[..., Any]:
    def on_meta(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            recorder.record_call(original, tensor, args, kwargs)
            return tensor
        return original(tensor, *args, **kwargs)

    on_meta.__name__ = original.__name__
    return on_meta


@contextmanager
def whole_calls_on_meta(recorder: CallRecorder) -> Iterator[None]:
    """Within the block, the functions above record meta tensors through ``recorder``."""
    with ExitStack() as stack:
        originals = {name: getattr(torch.nn.init, name) for name in _SKIPPING}
        for name, original in originals.items():
            stack.enter_context(mock.patch.object(torch.nn.init, name, _wrapper(original, recorder)))
        table = getattr(sys.modules.get(_TRANSFORMERS_TABLE[0]), _TRANSFORMERS_TABLE[1], None)
        if isinstance(table, dict):
            patched = {
                name: _wrapper(fn, recorder) for name, fn in table.items() if getattr(fn, "__name__", "") in _SKIPPING
            }
            stack.enter_context(mock.patch.dict(table, patched))
        yield
