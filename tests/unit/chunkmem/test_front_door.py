"""What ``import chunkmem`` offers: the front door (``chunkmem.__all__``) is the names a training
script uses and only those, the machinery is importable from its subpackages, ``__version__`` is
the installed one (or pyproject's from a checkout), and the two console scripts are entry points."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import shutil
import sys
from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from support.paths import ROOT

import chunkmem
from chunkmem import errors

# The user-facing names, written out here (not read from chunkmem): a name added to or dropped from
# the front door fails this test until the list, and the user guide, say so.
FRONT_DOOR = {
    "Booster",
    "ChunkPlugin",
    "ChunkedModel",
    "ChunkOptimizer",
    "StaticPlacementConfig",
    "AutoPlacementConfig",
    "PlacementConfig",
    "load_placement_config",
    "ActivationPlacement",
    "BlockPlacement",
    "CompileBlocks",
    "LossScaleConfig",
    "StepAfterBackward",
    "StepDuringBackward",
    "Stats",
    "plan",
    "Plan",
    "StepCounters",
    "checkpoint",
}

# Internals that used to sit in chunkmem.__all__, and the module each one is imported from now.
INTERNALS = {
    "Chunk": "chunkmem.chunks.chunk",
    "ChunkManager": "chunkmem.chunks.manager",
    "ChunkSizeSearch": "chunkmem.chunks.search",
    "search_chunk_size": "chunkmem.chunks.search",
    "TensorInfo": "chunkmem.chunks.tensor_state",
    "TensorState": "chunkmem.chunks.tensor_state",
    "ChunkRuntime": "chunkmem.execution.runtime",
    "Communicator": "chunkmem.ranks.comm",
    "PendingGather": "chunkmem.ranks.comm",
    "PlanningCommunicator": "chunkmem.planning.planner",
    "Location": "chunkmem.usage.accounting",
    "MemoryKind": "chunkmem.usage.accounting",
    "MemoryLedger": "chunkmem.usage.accounting",
    "describe_devices": "chunkmem.usage.memory",
    "device_capacity": "chunkmem.usage.memory",
    "device_free": "chunkmem.usage.memory",
    "host_memory": "chunkmem.usage.memory",
    "process_capacity": "chunkmem.usage.memory",
}


def _error_classes() -> set[str]:
    """Every exception class chunkmem.errors defines, found by looking at the module."""
    return {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value) and issubclass(value, Exception) and value.__module__ == errors.__name__
    }


def test_the_front_door_is_the_user_facing_names_and_the_errors() -> None:
    assert len(chunkmem.__all__) == len(set(chunkmem.__all__)), "a name listed twice"
    assert set(chunkmem.__all__) == FRONT_DOOR | _error_classes()
    for name in chunkmem.__all__:
        assert getattr(chunkmem, name) is not None, name
    assert inspect.ismodule(chunkmem.checkpoint)
    # errors.__all__ lists every class it defines, so `from chunkmem.errors import *` has them all
    assert set(errors.__all__) == _error_classes()


def test_internals_are_importable_from_their_subpackages_not_the_front_door() -> None:
    for name, module in INTERNALS.items():
        assert hasattr(importlib.import_module(module), name), f"{name} not in {module}"
        assert not hasattr(chunkmem, name), f"chunkmem.{name} is an internal: import it from {module}"


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_is_the_installed_one_else_pyprojects(monkeypatch: pytest.MonkeyPatch) -> None:
    version = _pyproject()["project"]["version"]
    try:
        installed = metadata.version("chunkmem")
    except metadata.PackageNotFoundError:
        installed = None
    assert chunkmem.__version__ == (installed or version)

    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    # From a checkout nobody installed: the version pyproject.toml declares.
    monkeypatch.setattr(metadata, "version", not_installed)
    assert chunkmem._version() == version


def test_console_scripts_point_at_the_command_lines() -> None:
    scripts = _pyproject()["project"]["scripts"]
    assert set(scripts) == {"chunkmem-plan", "chunkmem-env"}
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), name


@pytest.mark.slow  # setuptools reads the project: half a second idle, seconds on a loaded machine
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # setuptools on pyproject's license table
def test_a_built_distribution_installs_both_console_scripts(tmp_path: Path) -> None:
    """The metadata a wheel of this checkout carries (what ``pip install .`` installs) names the
    two scripts, built from a copy so the checkout gets no build files."""
    from setuptools import build_meta

    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "chunkmem", source / "chunkmem", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "metadata"
    out.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(source)
        patch.setattr(sys, "argv", ["setup.py"])
        info = build_meta.prepare_metadata_for_build_wheel(str(out))
    points = metadata.PathDistribution(out / info).entry_points.select(group="console_scripts")
    expected = {"chunkmem-plan": "chunkmem.plan_command:cli", "chunkmem-env": "chunkmem.env:cli"}
    assert {p.name: p.value for p in points} == expected
    for point in points:
        assert callable(point.load()), point.name


@pytest.mark.parametrize("script", ["chunkmem-plan", "chunkmem-env"])
def test_each_console_script_answers_help(
    script: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module, _, function = _pyproject()["project"]["scripts"][script].partition(":")
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exit_:
        getattr(importlib.import_module(module), function)()
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {script} ")


def _bound_from_other_modules(init: Path) -> set[str]:
    """The names a package's ``__init__`` binds with ``from .module import name`` where ``module`` is
    not a submodule of that name (``from .simulate import simulate`` imports the submodule first and
    binds the function over it: safe)."""
    tree = ast.parse(init.read_text())
    return {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
        for alias in node.names
        if node.module.split(".")[0] != (alias.asname or alias.name)
    }


def test_no_submodule_has_the_name_of_what_its_package_exports() -> None:
    """Importing a submodule binds it on its package: ``chunkmem/plan.py`` (the command line) replaced
    the function ``chunkmem.plan`` (from ``chunkmem.planning.planner``) for the rest of the process
    once anything imported the command line (``from chunkmem import plan`` then gave the module:
    "'module' object is not callable")."""
    package_dir = Path(chunkmem.__file__).parent
    clashes = []
    for init in sorted(package_dir.rglob("__init__.py")):
        here = init.parent
        for name in _bound_from_other_modules(init):
            if (here / f"{name}.py").exists() or (here / name / "__init__.py").exists():
                clashes.append(f"{here.relative_to(package_dir.parent)}: {name}")
    assert clashes == [], clashes
    for info in pkgutil.walk_packages(chunkmem.__path__, "chunkmem."):
        importlib.import_module(info.name)
    assert callable(chunkmem.plan) and not inspect.ismodule(chunkmem.plan)
