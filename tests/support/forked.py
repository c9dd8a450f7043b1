"""Run a short Python script in another process without paying for its imports each time.

``run_script(code, *argv)`` behaves like ``subprocess.run([sys.executable, "-c", code, *argv],
capture_output=True, text=True)`` for the scripts the tests kill or let finish (its exit status,
stdout and stderr), but the process is forked from a server that imported torch and chunkmem once
(``forkserver``): a script starts in a tenth of a second instead of re-importing them (three to
ten seconds on a 2-core machine), which is what dominates tests that kill a save at every point.

What differs from a fresh interpreter, and so is not for scripts that test it: the process leaves
through ``os._exit`` (``atexit`` handlers do not run; multiprocessing's finalizers do), its stdin is
``/dev/null``, and it sees the environment of when the server started.

``start_script(code, *argv)`` starts such a process and returns at once, like ``subprocess.Popen``
with ``stdout=PIPE``, for the scripts a test runs beside itself (a save still running, a saver in a
loop) and kills: it answers ``stdout.readline()``, ``poll()``, ``kill()``, ``wait()`` and
``communicate()``.

``run_main(script_or_module, *argv, cwd=..., env=...)`` runs a script (``python path.py``) or a
module (``python -m name``) as its ``__main__``, forked the same way, in ``cwd`` with the environment
``env``: the benchmark scripts and the planner's command line without a fresh interpreter's imports.
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from support.distributed import forked_context

__all__ = ["Finished", "Running", "run_main", "run_script", "start_script"]


@dataclass(frozen=True)
class Finished:
    returncode: int  # as subprocess reports it: the exit status, or minus the signal that ended it
    stdout: str
    stderr: str


def _main(code: str, argv: list[str], out: str | Any, err: str) -> None:
    """Run ``code`` with stdout and stderr in the files ``out`` and ``err`` (``out`` may instead be
    the writing end of a pipe, a multiprocessing connection)."""
    for fd, path in ((1, out), (2, err)):
        if isinstance(path, str):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        else:
            target = os.dup(path.fileno())
            path.close()
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own stdout
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.argv = ["-c", *argv]
    exec(compile(code, "<script>", "exec"), {"__name__": "__main__"})


def run_script(code: str, *argv: str, timeout: float = 120.0, children: bool = False) -> Finished:
    """Run ``code`` as ``python -c code *argv`` would, in a forked process; wait for it. With
    ``children``, the script may start processes of its own (a daemonic process may not; this one
    is then left for the test process to wait for at its exit should ``timeout`` pass)."""
    ctx = forked_context()
    with tempfile.TemporaryDirectory() as scratch:
        out, err = Path(scratch, "stdout"), Path(scratch, "stderr")
        process = ctx.Process(target=_main, args=(code, list(argv), str(out), str(err)), daemon=not children)
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise TimeoutError(f"the script ran past {timeout}s:\n{err.read_text() if err.exists() else ''}")
        read = [path.read_text() if path.exists() else "" for path in (out, err)]
        return Finished(process.exitcode, *read)


class Running:
    """A script started by ``start_script``, still running or finished: the parts of
    ``subprocess.Popen`` the tests use (``stdout`` is a text pipe, stderr is kept in a file)."""

    def __init__(self, process: Any, stdout: TextIO, scratch: tempfile.TemporaryDirectory[str], err: Path) -> None:
        self._process = process
        self.stdout = stdout
        self._scratch = scratch
        self._err = err

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()

    def wait(self, timeout: float | None = None) -> int | None:
        self._process.join(timeout)
        return self._process.exitcode

    def communicate(self) -> tuple[str, str]:
        """Wait for the end; the rest of stdout, and stderr."""
        self.wait()
        out = self.stdout.read()
        self.stdout.close()
        err = self._err.read_text() if self._err.exists() else ""
        self._scratch.cleanup()
        return out, err


def start_script(code: str, *argv: str) -> Running:
    """Start ``code`` as ``python -c code *argv`` would, in a forked process; return at once."""
    ctx = forked_context()
    scratch = tempfile.TemporaryDirectory()
    err = Path(scratch.name, "stderr")
    reader, writer = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_main, args=(code, list(argv), writer, str(err)), daemon=True)
    process.start()
    writer.close()  # the child's copy is the only writer left: its exit ends the pipe
    stdout = os.fdopen(os.dup(reader.fileno()), "r")
    reader.close()
    return Running(process, stdout, scratch, err)


_AS_MAIN = """
import os, runpy, sys
os.environ.clear()
os.environ.update({env!r})
os.chdir({cwd!r})
if {is_path!r}:
    sys.argv[0] = {target!r}
    sys.path.insert(0, os.path.dirname({target!r}))  # as the interpreter does for a script
    runpy.run_path({target!r}, run_name="__main__")
else:
    sys.argv[0] = {target!r}
    runpy.run_module({target!r}, run_name="__main__", alter_sys=True)
"""


def run_main(target: str, *argv: str, cwd: str, env: dict[str, str], timeout: float = 600.0) -> Finished:
    """``python TARGET *argv`` (a ``.py`` path) or ``python -m TARGET *argv`` (a module), run in
    ``cwd`` with the environment ``env``, forked (it may start processes of its own); wait for it."""
    code = _AS_MAIN.format(env=env, cwd=cwd, is_path=target.endswith(".py"), target=target)
    return run_script(code, *argv, timeout=timeout, children=True)
