"""Shared pytest configuration: each test is marked with the kind its folder holds (``unit``,
``integration``, ``system``); the ``cuda`` marker skips without a GPU, the ``cpu_compute`` marker
skips where chunkmem computes on a GPU; ``multirank`` and ``benchmark`` tests are marked ``slow``
unless they are chosen for the fast tier (``fast_tier``); quiet torch."""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # for ``import support``
KINDS = ("unit", "integration", "system")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Every multi-rank test agrees each placement plan across ranks: a rank-local input to a decision
# fails the test at the op where the plans first differ.
os.environ.setdefault("CHUNKMEM_CHECK_PLANS", "1")
# A benchmark run by a test writes its JSON and plots into a temporary directory, never into the
# checkout's benchmarks/results/ (benchmarks/common.py reads this before choosing its default). Set
# before anything imports benchmarks.common; pytest-xdist's workers inherit the controller's.
if not os.environ.get("CHUNKMEM_BENCHMARK_RESULTS"):
    _results = tempfile.mkdtemp(prefix="chunkmem-benchmark-results-")
    os.environ["CHUNKMEM_BENCHMARK_RESULTS"] = _results
    atexit.register(shutil.rmtree, _results, True)
logging.getLogger("transformers").setLevel(logging.ERROR)
# In a pytest-xdist worker (``-n 2``: as many workers as this machine's cores) each worker is one
# core's worth: torch's default of one intra-op thread a core oversubscribes the machine, and its
# threads spin waiting for each other. The tests' models are tiny: one thread loses nothing.
# torch is imported only where tests run (a worker, or a run without xdist): xdist's controller
# process runs no test, and importing torch there (seconds) delays the start of the workers.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "cpu_compute(reason): measures what only holds while chunkmem computes on the CPU (skipped where "
        "it picks a GPU); the reason says why",
    )
    # The fast tier (``-m "not slow"``) gives property tests a smaller budget (see ``tier``); set
    # before test modules are imported, which read it at import.
    if is_fast_tier(config.getoption("markexpr", "") or ""):
        os.environ.setdefault("CHUNKMEM_TEST_TIER", "fast")


def is_fast_tier(markexpr: str) -> bool:
    """``-m markexpr`` chooses the fast tier: it keeps a test with no marker and leaves out one
    marked only ``slow`` (``not slow``, ``not (slow or cuda)``, ``not slow and not cuda`` alike; not
    ``simulated``, which keeps no unmarked test). The expression is evaluated as pytest evaluates
    it, over marker names, so no spelling of it is matched as text."""
    if not markexpr.strip():
        return False
    return _selects(markexpr, set()) and not _selects(markexpr, {"slow"})


def _selects(markexpr: str, markers: set[str]) -> bool:
    # pytest's grammar: names, ``not``/``and``/``or`` and parentheses (a name's keyword arguments,
    # ``name(key=value)``, are read as the name alone).
    tokens = re.findall(r"\(|\)|[^\s()]+", re.sub(r"(\w)\([^()]*\)", r"\1", markexpr))
    words = []
    for token in tokens:
        if token in ("(", ")", "and", "or", "not"):
            words.append(token)
        else:
            words.append(str(token in markers))
    return bool(eval(" ".join(words), {"__builtins__": {}}, {}))  # the words are True/False/and/or/not only


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch
    from support.models import reference_device  # after the path insert above

    has_gpu = torch.cuda.is_available()
    computes_on_gpu = reference_device().type != "cpu"
    for item in items:
        # The folder a test module is in says what kind of test it is: ``-m unit`` and the like.
        kind = Path(item.path).relative_to(TESTS).parts[0]
        if kind in KINDS:
            item.add_marker(kind)
        if ("multirank" in item.keywords or "benchmark" in item.keywords) and "fast_tier" not in item.keywords:
            item.add_marker(pytest.mark.slow)
        if "cuda" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        marker = item.get_closest_marker("cpu_compute")
        if marker is not None and computes_on_gpu:
            why = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "")
            item.add_marker(pytest.mark.skip(reason=f"chunkmem computes on a GPU here: {why}"))
    # The longest tests first: under xdist each starts while the other workers run the short ones,
    # instead of one of them running alone at the end (a stable sort: every worker collects the
    # same order, as xdist requires).
    items.sort(key=lambda item: "long" not in item.keywords)


def pytest_collection_finish(session: pytest.Session) -> None:
    # Collection imported the test modules and no test has run yet: the moment to fork this process
    # into the fork server that ranks and scripts start from (tests/support/distributed.py).
    distributed = sys.modules.get("support.distributed")
    if distributed is not None and session.items and not session.config.option.collectonly:
        distributed.serve_forks_from_here()
