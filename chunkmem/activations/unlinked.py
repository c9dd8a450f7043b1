"""``unlinked``: what a saved-tensor pack hook keeps of a tensor it leaves where it is.

Autograd hands a pack hook the tensor itself, with its ``grad_fn``. When an op saves its own output
(``exp``, ``tanh``, ``softmax``, ...) that ``grad_fn`` is the node which keeps the packed object: a
handle that holds the tensor as given closes a cycle through autograd's C++ nodes, which Python's
collector cannot see, and a graph dropped without its backward (an evaluation forward without
``torch.no_grad()``, its output dropped) then lives for good, with everything it saved. Without
hooks, autograd saves an output without its ``grad_fn`` for the same reason; here the handle holds
the tensor detached (the same storage and version counter: unpacking rebuilds the tensor from its
data and autograd's own metadata, so the backward is the same). A leaf has no ``grad_fn`` to link
back and a tensor subclass (the runtime's hooked parameters and their value copies) keeps its type,
so both are kept as they are.
"""

from __future__ import annotations

import torch

__all__ = ["unlinked"]


def unlinked(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` without the link to its graph, for a pack hook to keep (see the module docstring)."""
    if tensor.grad_fn is None or type(tensor) is not torch.Tensor:
        return tensor
    return tensor.detach()
