"""Directories chunkmem makes among a user's files (the disk tier's scratch space, as a save's
workspace): a boost removes only those of runs that are gone, never one another rank or process is
creating or using, never one that merely looks like chunkmem's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.disk_tier_helpers import ON_DISK, _boost, _scratch, _train
from support.distributed import run_ranks
from support.forked import Running, run_script, start_script

_SCRATCH = """
import os, signal, sys, time
from chunkmem.tiers.disk import ScratchDir
scratch = ScratchDir(sys.argv[1], 0)
(scratch.path / "sides.bin").write_bytes(b"x" * 100)
print(scratch.path, flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""


def _scratch_process(disk_dir: Path, how: str) -> tuple[Running, Path]:
    """A process with a scratch directory in ``disk_dir``: killed at once (``"kill"``), or running."""
    process = start_script(_SCRATCH, str(disk_dir), how)
    return process, Path(process.stdout.readline().strip())


def test_a_boost_leaves_look_alikes_and_scratch_being_created_or_used(tmp_path: Path) -> None:
    from chunkmem.tiers.disk import ScratchDir

    # A user's directory that looks like scratch: chunkmem's name, a marker file, the user's work.
    look_alike = tmp_path / ".chunkmem-scratch-0123456789abcdef-rank0"
    look_alike.mkdir()
    (look_alike / "chunkmem-scratch.json").write_text("{}")
    (look_alike / "thesis.tex").write_text("\\chapter{Introduction}")
    # One another rank is creating: its marker is there, not yet locked nor written.
    being_made = tmp_path / ".chunkmem-scratch-fedcba9876543210-rank1"
    being_made.mkdir()
    (being_made / "chunkmem-scratch.json").write_bytes(b"")
    no_marker = tmp_path / ".chunkmem-scratch-mine"
    no_marker.mkdir()
    (no_marker / "notes.txt").write_text("keep me")
    in_use = ScratchDir(tmp_path, 1)  # another rank's, in this process
    _run = _boost(ON_DISK, "fp32", tmp_path)
    assert (look_alike / "thesis.tex").read_text() == "\\chapter{Introduction}", "a user's directory was removed"
    assert being_made.exists(), "a scratch directory being created was removed"
    assert (no_marker / "notes.txt").read_text() == "keep me"
    assert in_use.path.exists(), "a scratch directory in use was removed"
    assert len(_scratch(tmp_path)) == 5  # this run's, the one in use and the three others


@pytest.mark.slow
def test_a_boost_removes_a_killed_runs_scratch_but_not_a_running_ones(tmp_path: Path) -> None:
    killed, dead = _scratch_process(tmp_path, "kill")
    assert killed.wait(timeout=60) == -9 and (dead / "sides.bin").exists()
    running, alive = _scratch_process(tmp_path, "run")
    try:
        _run = _boost(ON_DISK, "fp32", tmp_path)
        assert not dead.exists(), "the scratch directory of a killed run was left"
        assert (alive / "sides.bin").exists(), "the scratch directory of a running process was removed"
        assert len(_scratch(tmp_path)) == 2
    finally:
        running.kill()
        running.wait()


_REAPER = """
import sys, time
from pathlib import Path
from chunkmem.tiers.disk import remove_stale_scratch
print("reaping", flush=True)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    remove_stale_scratch(Path(sys.argv[1]))
"""


@pytest.mark.slow
def test_scratch_being_created_survives_another_process_reaping_the_same_disk_dir(tmp_path: Path) -> None:
    """What a rank does at boost (remove dead scratch) while another creates its own, over and over."""
    from chunkmem.tiers.disk import ScratchDir

    reaper = start_script(_REAPER, str(tmp_path), "60")
    lost = []
    try:
        assert reaper.stdout.readline().strip() == "reaping"
        for _ in range(300):
            scratch = ScratchDir(tmp_path, 0)  # raises DiskTierError if its directory went under it
            (scratch.path / "sides.bin").write_bytes(b"x")
            if not (scratch.path / "sides.bin").exists():
                lost.append(scratch.path)
            scratch.close()
    finally:
        reaper.kill()
        reaper.wait()
    assert not lost, f"{len(lost)} of 300 scratch directories were removed by another process while in use"


def _fresh_launch(rank: int, world_size: int, disk_dir: str) -> float:
    chunked, optimizer, booster = _boost(ON_DISK, "fp32", Path(disk_dir))
    _train(chunked, optimizer, booster, 1)
    return float(sum(p.detach().double().sum() for p in chunked.state_dict().values()))


@pytest.mark.multirank
@pytest.mark.parametrize("launch", range(3))
def test_fresh_ranks_sharing_a_disk_dir_boost_and_train(tmp_path: Path, launch: int) -> None:
    """Ranks started together, each removing dead scratch while the other creates its own."""
    shared = tmp_path / "shared"
    shared.mkdir()
    results: list[Any] = run_ranks(_fresh_launch, 2, args=(str(shared),), fresh=True)
    assert results[0] == results[1] and torch.isfinite(torch.tensor(results[0]))
    assert _scratch(shared) == [], "the ranks' scratch directories outlived their processes"


# Forked from the tests' server (its imports done), where a process leaves through os._exit: the
# atexit handlers a normal interpreter exit runs are run explicitly, in the child and the parent.
_FORKED_CHILD = """
import atexit, os, sys
from chunkmem.tiers.disk import ScratchDir
scratch = ScratchDir(sys.argv[1], 0)
child = os.fork()
if child == 0:
    atexit._run_exitfuncs()  # a bare fork's child leaving normally runs the atexit handlers it inherited
    os._exit(0)
os.waitpid(child, 0)
print(scratch.path.is_dir())
atexit._run_exitfuncs()
"""


def test_a_forked_child_leaving_normally_keeps_its_parents_scratch(tmp_path: Path) -> None:
    done = run_script(_FORKED_CHILD, str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True", "the forked child removed its parent's scratch directory"
    assert _scratch(tmp_path) == [], "the parent's own exit removes it"
