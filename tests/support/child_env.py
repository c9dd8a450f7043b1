"""The environment of a child Python process a test starts: this process's own, with the checkout
under test first on ``PYTHONPATH``. Whatever ``PYTHONPATH`` held stays after it: on a machine whose
packages come from ``PYTHONPATH`` (pydantic under /tmp/site on the GPU machine), a child that lost
it could not import chunkmem's dependencies."""

from __future__ import annotations

import os

from support.paths import ROOT


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` with ``ROOT`` prepended to ``PYTHONPATH``, and ``extra`` set."""
    path = os.pathsep.join(entry for entry in (str(ROOT), os.environ.get("PYTHONPATH", "")) if entry)
    return {**os.environ, "PYTHONPATH": path, **extra}
