"""The rank pool's fork server started as it starts where torch sees a GPU (``tests/support/distributed.py``):
a fresh interpreter that imports the preload list, not a fork of the test process (CUDA, once
queried, does not work in a fork). On a machine without a GPU the test process forks itself into
the server, so that path would only run on GPU machines: here a fresh interpreter is made to see
a GPU, and starts two gloo ranks from the server it then gets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.child_env import child_env
from support.paths import TESTS

HERE = Path(__file__).resolve().parent

SCRIPT = """
import json, sys
sys.path[:0] = [{here!r}, {tests!r}]
import torch
torch.cuda.is_available = lambda: True  # what decides how the server starts
from support import distributed
from multiprocessing import forkserver
assert not distributed.serve_forks_from_here(), "with a GPU the test process must not fork itself into the server"
from test_fork_server import where_a_rank_runs
ranks = distributed.run_ranks(where_a_rank_runs, 2)
server = forkserver._forkserver._forkserver_pid
with open(f"/proc/{{server}}/cmdline", "rb") as command:
    line = command.read().replace(b"\\0", b" ").decode()
print("RESULT", json.dumps({{"server": server, "ranks": ranks, "command": line, "here": __import__("os").getpid()}}))
"""


def where_a_rank_runs(rank: int, world_size: int) -> tuple[int, bool, float]:
    """This rank's parent, whether it found the preload's imports already made, and a collective."""
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return os.getppid(), "transformers" in sys.modules and "chunkmem.checkpoint" in sys.modules, float(total[0])


@pytest.mark.long
@pytest.mark.slow
def test_ranks_start_from_a_fresh_interpreter_server_as_where_torch_sees_a_gpu() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(here=str(HERE), tests=str(TESTS))],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    # Both ranks are children of the server, found the preload imported, and formed a group.
    assert result["ranks"] == [[result["server"], True, 3.0]] * 2, result
    # The server is a new interpreter running multiprocessing's fork-server loop, not a fork of the
    # process that started the ranks (whose command line it would share).
    assert "from multiprocessing.forkserver import main" in result["command"], result["command"]
    assert result["server"] != result["here"]
