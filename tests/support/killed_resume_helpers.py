"""Pieces of ``system/failures/test_killed_resume.py`` that other tests use too."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
from pathlib import Path
from typing import Any

import torch

_KILLING = threading.Lock()


def _kill(where: str, out: Path) -> None:
    """Kill this process, leaving a file that says where (the test checks the kill came there). One
    thread only: two disk I/O threads in the hook at once would truncate each other's file, the
    process killed between one's truncation and its write (seen: an empty file)."""
    _KILLING.acquire()  # never released: a second thread waits here until the process is gone
    (out / "killed").write_text(where)
    os.kill(os.getpid(), signal.SIGKILL)


class _KillInBackward(torch.autograd.Function):
    """The identity; its backward kills this process."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out: Path) -> torch.Tensor:
        ctx.out = out
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _kill("backward", ctx.out)
        return grad, None


def _checkpoint_digest(directory: Path) -> dict[str, str]:
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def _scratch(disk_dir: Path) -> list[Path]:
    return sorted(disk_dir.glob(".chunkmem-scratch-*"))
