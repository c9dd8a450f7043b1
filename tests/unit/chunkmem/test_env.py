"""``chunkmem-env``: the environment report names every fact it promises, each against a fact read
here another way (platform, torch, a library's own ``__version__``, the files left in the probed
directory); a library that is missing or outside chunkmem's pinned range is a line of "what to fix"
with its install command; a directory the disk tier cannot use is too."""

from __future__ import annotations

import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch

import chunkmem
from chunkmem import env

SMALL = ["--disk-mib", "1", "--copy-mib", "1"]


def _report(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, dict[str, Any]]:
    """The text report and the JSON one, of the same arguments."""
    env.main([*SMALL, *argv])
    text = capsys.readouterr().out
    env.main([*SMALL, *argv, "--json"])
    return text, json.loads(capsys.readouterr().out)


def _pretend_missing(monkeypatch: pytest.MonkeyPatch, versions: dict[str, str | None]) -> None:
    """Installed distributions as ``versions`` says (``None``: not installed); the rest as they are."""
    real = metadata.version

    def version(name: str) -> str:
        if name in versions:
            if versions[name] is None:
                raise metadata.PackageNotFoundError(name)
            return str(versions[name])
        return real(name)

    monkeypatch.setattr(metadata, "version", version)


def test_the_report_names_every_fact_on_this_machine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, facts = _report(capsys, "--disk-dir", str(tmp_path))
    for heading in ("versions", "libraries", "device", "disk tier", "what to fix"):
        assert f"\n{heading}" in text, heading
    for name in ("python", "torch", "CUDA", "cuDNN", "NCCL", "compute device", "pinned memory", "host memory"):
        assert f"  {name}: " in text, name
    for name, *_ in env.LIBRARIES:
        assert f"  {name}: " in text, name
    assert facts["python"] == platform.python_version()
    assert facts["torch"] == torch.__version__
    assert facts["chunkmem"] == chunkmem.__version__
    import transformers

    libraries = {lib["name"]: lib for lib in facts["libraries"]}
    assert set(libraries) == {"transformers", "accelerate", "peft", "trl", "lightning", "bitsandbytes"}
    assert libraries["transformers"]["version"] == transformers.__version__
    assert facts["toolkit"]["cuda_build"] == torch.version.cuda
    assert facts["toolkit"]["cuda_available"] == torch.cuda.is_available()
    # The disk probe wrote and read its 1 MiB in the directory given, and left nothing there.
    disk = facts["disk"]
    assert disk["directory"] == str(tmp_path) and disk["error"] is None
    assert disk["nbytes"] == 2**20 and disk["write_seconds"] > 0 and disk["read_seconds"] > 0
    assert disk["write_bytes_per_second"] == pytest.approx(2**20 / disk["write_seconds"])
    assert list(tmp_path.iterdir()) == []
    assert "MB/s" in text.split("\ndisk tier")[1]


@pytest.mark.cpu_compute(reason="on a GPU the layer pins and the copy is timed (test_cuda_pinned_copy)")
def test_on_the_cpu_the_report_says_nothing_is_pinned(capsys: pytest.CaptureFixture[str]) -> None:
    text, facts = _report(capsys)
    assert facts["device"] == "cpu" and facts["layer"] in ("DeviceLayer", "SimulatedLayer")
    assert facts["pinned"]["pins"] is False and facts["pinned"]["pinned_seconds"] is None
    assert "nothing is pinned or copied" in text
    assert "the CPU computes" in facts["layer_reason"] or "CHUNKMEM_DEVICE" in facts["layer_reason"]


@pytest.mark.cuda
def test_cuda_pinned_copy(capsys: pytest.CaptureFixture[str]) -> None:
    text, facts = _report(capsys)
    assert facts["device"].startswith("cuda") and facts["layer"] == "AcceleratorLayer"
    pinned = facts["pinned"]
    assert pinned["pins"] and pinned["pinned"] and pinned["nbytes"] == 2**20
    assert pinned["pinned_seconds"] > 0 and pinned["pageable_seconds"] > 0
    assert facts["toolkit"]["nccl"] is not None and "pinned memory: pins" in text


def test_a_missing_library_is_reported_with_its_install_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _pretend_missing(monkeypatch, {"trl": None, "lightning": None})
    text, facts = _report(capsys)
    assert "  trl: not installed (pip install trl)" in text
    assert "  lightning: not installed (pip install 'chunkmem[lightning]')" in text
    optional = [f for f in facts["findings"] if f["optional"]]
    assert {f["fix"] for f in optional} >= {"pip install trl", "pip install 'chunkmem[lightning]'"}
    fixes = text.split("\noptional")[1]
    assert "trl is not installed" in fixes and "pip install trl" in fixes


def test_a_library_outside_the_pinned_range_is_something_to_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _pretend_missing(monkeypatch, {"transformers": "4.40.0", "accelerate": "1.15.3"})
    text, facts = _report(capsys)
    libraries = {lib["name"]: lib for lib in facts["libraries"]}
    # The ranges pyproject.toml's extras pin (read here with tomllib, not by the report).
    import tomllib

    extras = tomllib.loads((Path(chunkmem.__file__).parent.parent / "pyproject.toml").read_text())["project"]
    hf = {req.split("<")[0].split(">")[0]: req for req in extras["optional-dependencies"]["hf"]}
    assert hf["transformers"].replace(" ", "").endswith(libraries["transformers"]["pinned"])
    assert libraries["transformers"]["within"] is False and libraries["accelerate"]["within"] is True
    needed = [f for f in facts["findings"] if not f["optional"]]
    assert [f["problem"].split()[:2] for f in needed] == [["transformers", "4.40.0"]]
    assert needed[0]["fix"].startswith("pip install 'chunkmem[hf]'")
    assert "transformers: 4.40.0 (OUTSIDE chunkmem[hf]'s" in text
    assert "  - transformers 4.40.0 is outside" in text.split("\nwhat to fix")[1]


def test_a_disk_dir_the_tier_cannot_use_is_something_to_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "not-there"
    text, facts = _report(capsys, "--disk-dir", str(missing))
    assert facts["disk"]["error"] is not None and "does not exist" in facts["disk"]["error"]
    needed = [f for f in facts["findings"] if not f["optional"]]
    assert any("disk_dir" in f["fix"] and str(missing) in f["problem"] for f in needed), needed
    assert "probe: failed" in text and not missing.exists()


@pytest.mark.parametrize(("flag", "value"), [("--disk-mib", "-5"), ("--copy-mib", "-1"), ("--disk-mib", "0")])
def test_a_probe_size_under_one_mib_is_refused_naming_the_flag(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """argparse's own refusal (exit status 2, the usage line), before any probe runs."""
    with pytest.raises(SystemExit) as refused:
        env.main([*SMALL, flag, value])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: at least 1 MiB (what the probe moves), not {value}" in err, err
