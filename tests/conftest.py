"""Shared pytest configuration: the ``cuda`` marker skips without a GPU; quiet, single-threaded
torch so that two-rank tests do not oversubscribe small machines."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Every multi-rank test agrees each placement plan across ranks: a rank-local input to a decision
# fails the test at the op where the plans first differ.
os.environ.setdefault("CHUNKMEM_CHECK_PLANS", "1")
logging.getLogger("transformers").setLevel(logging.ERROR)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
