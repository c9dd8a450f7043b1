"""Python's own private names that chunkmem reads or overrides. Checked on CPython 3.11 to 3.13."""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from types import FrameType

__all__ = ["DefaultsWhereSetHelpFormatter", "current_frame", "executor_thread_prefix", "executor_workers"]


def current_frame(thread_id: int) -> FrameType | None:
    """The innermost frame the thread runs now (``sys._current_frames()``, documented as for
    debugging: the cross-rank checks say where a stuck thread is); ``None`` when it is gone."""
    return sys._current_frames().get(thread_id)


def executor_workers(executor: ThreadPoolExecutor) -> int:
    """``executor._max_workers``: how many threads the pool may run (0 where it does not say); the
    simulated device runs the tasks of a one-thread pool in order."""
    return getattr(executor, "_max_workers", 0)


def executor_thread_prefix(executor: ThreadPoolExecutor) -> str:
    """``executor._thread_name_prefix``: the name its threads were given ("" where none), to name
    the simulated device's actors."""
    return getattr(executor, "_thread_name_prefix", "")


class DefaultsWhereSetHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown, except where there is none (``None``, an empty list): the help says what happens
    then. Overrides ``_get_help_string``, the hook ``ArgumentDefaultsHelpFormatter`` itself overrides
    (argparse has no public one)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)
