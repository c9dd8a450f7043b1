"""Saves that die or keep running in another process, leaving their workspaces beside a target."""

from __future__ import annotations

import textwrap
from pathlib import Path

from support.forked import Running, run_script, start_script

_START = """
import os, sys
from pathlib import Path
from chunkmem.checkpoint.workspace import PREVIOUS, Workspace
target = Path({target!r})
workspace = Workspace(target)
(workspace / "checkpoint").mkdir()
(workspace / "checkpoint" / "partial").write_bytes(b"half a checkpoint")
if {move_previous!r}:
    os.rename(target, workspace / PREVIOUS)
print(workspace.path, flush=True)
"""


def dead_workspace(target: Path, move_previous: bool = False) -> Path:
    """The workspace of a save to ``target`` killed mid-write (after moving the previous
    checkpoint into it, with ``move_previous``): its process exited, so its lock is free."""
    script = _START.format(target=str(target), move_previous=move_previous) + "os._exit(9)\n"
    done = run_script(textwrap.dedent(script))
    assert done.returncode == 9 and done.stdout.strip(), done.stderr
    return Path(done.stdout.strip())


def live_workspace(target: Path) -> tuple[Running, Path]:
    """A save to ``target`` still writing in another process (kill it when done; it ends by itself
    after ten minutes)."""
    script = _START.format(target=str(target), move_previous=False) + "import time\ntime.sleep(600)\n"
    process = start_script(textwrap.dedent(script))
    return process, Path(process.stdout.readline().strip())
