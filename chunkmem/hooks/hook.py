"""Parameter-op hooks: what to call when a torch op touches a hooked parameter, and which hooks
are active.

Hooks come from two places, combined for every op:

* hooks **bound** to a parameter (``bind``): they follow the parameter everywhere, so an op on it
  is hooked inside and outside any region, in forward, in backward and in recomputation under
  activation checkpointing;
* hooks installed for a **region** by ``param_op_hooks(...)``: they see every op on any hooked
  parameter while the region is open.

The active set is process-global, not thread-local: the autograd engine runs backward (and
checkpoint recomputation) on its own threads.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch

__all__ = ["ParamOpHook", "bind", "bound_hooks", "hooks_for", "param_op_hooks", "unbind"]


class ParamOpHook(ABC):
    """Receives the hooked parameters an op touches, before and after it runs, and the same
    parameters around that op's backward."""

    @abstractmethod
    def pre_op(self, params: Sequence[torch.Tensor]) -> None:
        """Before an op runs: its parameters must hold their data when this returns."""

    @abstractmethod
    def post_op(self, params: Sequence[torch.Tensor]) -> None:
        """After an op ran (also when it raised)."""

    @abstractmethod
    def pre_backward(self, params: Sequence[torch.Tensor]) -> None:
        """Before the op's backward runs: its parameters must hold their data when this returns."""

    @abstractmethod
    def post_backward(self, params: Sequence[torch.Tensor]) -> None:
        """After the op's backward ran (the parameters' gradients may not be accumulated yet)."""

    @property
    def observes_ops(self) -> bool:
        """Whether this hook wants ``pre_op`` / ``post_op`` and the backward bracket. A hook that
        answers False is only asked about in-place writes (``mutating_op``); an op all of whose
        hooks answer False runs as on a plain parameter, with no autograd bridges."""
        return True

    def mutating_op(self, params: Sequence[torch.Tensor], op_name: str) -> None:  # noqa: B027
        """Before an op that writes into ``params`` in place. The default allows it; a hook that
        keeps the authoritative copy elsewhere raises here."""

    def traced_op(self, params: Sequence[torch.Tensor]) -> None:  # noqa: B027
        """A compiler (``torch.compile``, ``torch.export``) is tracing an op on ``params``, or
        reading their metadata to build its graph. The default allows it; a hook whose work a
        compiled graph would skip raises here."""


class _BoundTable:
    """Hooks per parameter, keyed by identity, holding parameters weakly. Looked up on every op,
    so a lookup is one dict access and one weak-reference call (``WeakIdKeyDictionary`` builds a
    weak reference per lookup)."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[torch.Tensor], tuple[ParamOpHook, ...]]] = {}

    def get(self, param: torch.Tensor) -> tuple[ParamOpHook, ...]:
        entry = self._entries.get(id(param))
        if entry is None or entry[0]() is not param:
            return ()
        return entry[1]

    def set(self, param: torch.Tensor, hooks: tuple[ParamOpHook, ...]) -> None:
        key = id(param)
        if not hooks:
            self._entries.pop(key, None)
            return
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is param:
            self._entries[key] = (entry[0], hooks)
            return
        entries = self._entries

        def forget(ref: weakref.ref[torch.Tensor]) -> None:
            # Only this parameter's entry: its id may already belong to a new object.
            current = entries.get(key)
            if current is not None and current[0] is ref:
                del entries[key]

        self._entries[key] = (weakref.ref(param, forget), hooks)


_region: list[ParamOpHook] = []
_bound = _BoundTable()


@contextmanager
def param_op_hooks(*hooks: ParamOpHook) -> Iterator[None]:
    """Install ``hooks`` for every op on a hooked parameter while the block runs."""
    _region.extend(hooks)
    try:
        yield
    finally:
        del _region[len(_region) - len(hooks) :]


def bind(params: Iterable[torch.Tensor], hook: ParamOpHook) -> None:
    """Make ``hook`` fire for every op on each of ``params``, wherever it runs."""
    for p in params:
        existing = _bound.get(p)
        if hook not in existing:
            _bound.set(p, (*existing, hook))


def unbind(params: Iterable[torch.Tensor], hook: ParamOpHook) -> None:
    """Stop ``hook`` from firing for ``params``."""
    for p in params:
        _bound.set(p, tuple(h for h in _bound.get(p) if h is not hook))


def bound_hooks(param: torch.Tensor) -> tuple[ParamOpHook, ...]:
    """The hooks bound to ``param``."""
    return _bound.get(param)


def hooks_for(params: Sequence[torch.Tensor]) -> tuple[tuple[ParamOpHook, tuple[torch.Tensor, ...]], ...]:
    """The hooks an op on ``params`` calls, each with the parameters it should see: a bound hook
    sees the parameters bound to it (an op may mix parameters of several owners), a region hook
    sees all of them. Bound hooks first, in first-seen order; each hook once."""
    if not _region and params:
        # The common case, one owner: every parameter bound to the same hooks.
        get = _bound.get
        first = get(params[0])
        for p in params[1:]:
            if get(p) != first:
                break
        else:
            seen = tuple(params)
            return tuple([(h, seen) for h in first])
    calls: dict[int, tuple[ParamOpHook, list[torch.Tensor]]] = {}
    for p in params:
        for h in _bound.get(p):
            calls.setdefault(id(h), (h, []))[1].append(p)
    for h in _region:
        calls[id(h)] = (h, list(params))
    return tuple((h, tuple(ps)) for h, ps in calls.values())
