"""``chunkmem-env`` (or ``python -m chunkmem.env``): what chunkmem finds on this machine and what to fix.

    chunkmem-env                      # the report
    chunkmem-env --disk-dir /nvme     # probe the directory you will pass as ChunkPlugin(disk_dir=...)
    chunkmem-env --json               # the same facts as JSON

It reports the versions of Python, PyTorch, CUDA, cuDNN and NCCL; the trainer libraries chunkmem
works with (installed or not, and whether within the range chunkmem's extras pin); the device layer
a ``ChunkPlugin`` would compute on and why; whether host memory can be pinned and how fast a pinned
host-to-device copy is (on a GPU); how fast the disk tier's directory writes and reads. Each problem
found ends in the list "what to fix" with its fix.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from .device.environment import LayerChoice, PinnedCopy, Toolkit, layer_choice, locked_memory_limit, pinned_copy
from .device.environment import toolkit as read_toolkit
from .tiers.disk_probe import DiskSpeed, probe_disk
from .usage.memory import host_memory

__all__ = ["LIBRARIES", "Finding", "Library", "Report", "collect", "library", "main", "render"]

_MiB = 2**20

# The libraries chunkmem works with, the extra that pins each one's range (``None``: no extra pins
# it), the command that installs it, and what chunkmem uses it for (``None``: reported, not used, so
# its absence is nothing to fix).
LIBRARIES: tuple[tuple[str, str | None, str, str | None], ...] = (
    ("transformers", "hf", "pip install 'chunkmem[hf]'", "ChunkTrainer, models built from configs, the planner"),
    ("accelerate", "hf", "pip install 'chunkmem[hf]'", "ChunkTrainer (transformers' Trainer needs it)"),
    ("peft", None, "pip install peft", "LoRA adapters over a boosted base"),
    ("trl", None, "pip install trl", "SFTTrainer through ChunkTrainerMixin"),
    ("lightning", "lightning", "pip install 'chunkmem[lightning]'", "ChunkStrategy"),
    ("bitsandbytes", "qlora", "pip install 'chunkmem[qlora]'", "4-bit (NF4 / FP4) bases in quantized chunks (QLoRA)"),
)


@dataclass(frozen=True)
class Finding:
    """Something to fix: what is wrong and the fix. ``optional``: only needed to use a feature."""

    problem: str
    fix: str
    optional: bool = False


@dataclass(frozen=True)
class Library:
    name: str
    version: str | None
    """The installed version, ``None`` when not installed."""
    extra: str | None
    pinned: str | None
    """The range chunkmem's ``extra`` pins (a PEP 440 specifier), ``None`` when nothing pins it."""
    within: bool | None
    """Whether ``version`` is within ``pinned`` (``None``: not installed, nothing pinned, or not checkable)."""
    install: str
    purpose: str | None
    """What chunkmem uses it for; ``None``: nothing (reported because a model may bring it)."""


@dataclass
class Report:
    chunkmem: str
    chunkmem_path: str
    python: str
    python_executable: str
    torch: str
    platform: str
    toolkit: Toolkit
    device: str
    layer: str
    layer_reason: str
    host_memory_bytes: int
    host_available_bytes: int
    locked_memory_limit: int | None
    pinned: PinnedCopy
    disk: DiskSpeed
    disk_dir_given: bool
    libraries: list[Library]
    pins_from: str
    findings: list[Finding] = field(default_factory=list)


# --- the ranges chunkmem's extras pin --------------------------------------------------------------
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*)")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins_from_requirements(lines: list[str]) -> dict[tuple[str | None, str], str]:
    """(extra or ``None`` for a core dependency, distribution) -> its specifier, from
    ``Requires-Dist`` lines."""
    pins: dict[tuple[str | None, str], str] = {}
    for line in lines:
        named, marker = _NAME.match(line), _EXTRA.search(line)
        if named:
            pins[(marker[1] if marker else None, _canonical(named[1]))] = named[2].strip().strip("()").replace(" ", "")
    return pins


def _checkout_pyproject() -> Path | None:
    """The ``pyproject.toml`` of the checkout this chunkmem was imported from, if it is one."""
    candidate = Path(__file__).resolve().parent.parent / "pyproject.toml"
    return candidate if candidate.is_file() and 'name = "chunkmem"' in candidate.read_text() else None


def requirement_pins() -> tuple[dict[tuple[str | None, str], str], str]:
    """What chunkmem requires and its extras pin, and where that was read: the checkout's
    ``pyproject.toml`` when chunkmem runs from one (the installed metadata may be another
    checkout's), else the installed metadata."""
    pyproject = _checkout_pyproject()
    if pyproject is not None and sys.version_info >= (3, 11):
        import tomllib

        project = tomllib.loads(pyproject.read_text()).get("project", {})
        lines = list(project.get("dependencies", []))
        for extra, reqs in project.get("optional-dependencies", {}).items():
            lines += [f'{req}; extra == "{extra}"' for req in reqs]
        return _pins_from_requirements(lines), str(pyproject)
    try:
        return _pins_from_requirements(metadata.requires("chunkmem") or []), "the installed chunkmem's metadata"
    except metadata.PackageNotFoundError:
        return {}, "nowhere (chunkmem is neither installed nor a checkout)"


def _within(version: str, specifier: str) -> bool | None:
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return None
    try:
        return Version(version) in SpecifierSet(specifier)
    except (InvalidSpecifier, InvalidVersion):
        return None


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (its metadata: nothing is imported), or ``None``."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def library(
    name: str, extra: str | None, install: str, purpose: str | None, pins: dict[tuple[str | None, str], str]
) -> Library:
    version = installed_version(name)
    pinned = pins.get((extra, _canonical(name))) if extra else None
    within = _within(version, pinned) if version is not None and pinned else None
    return Library(name, version, extra, pinned or None, within, install, purpose)


# --- the report ----------------------------------------------------------------------------------
def _torch_outside(pins: dict[tuple[str | None, str], str]) -> str | None:
    """chunkmem's own torch range, when this torch is outside it."""
    wanted = pins.get((None, "torch"))
    return wanted if wanted and _within(torch.__version__.split("+")[0], wanted) is False else None


def _findings(report: Report, pins: dict[tuple[str | None, str], str]) -> list[Finding]:
    out: list[Finding] = []
    too_old = _torch_outside(pins)
    if too_old:
        out.append(
            Finding(f"torch {torch.__version__} is outside chunkmem's torch{too_old}", f"pip install 'torch{too_old}'")
        )
    for lib in report.libraries:
        if lib.version is None and lib.purpose is not None:
            out.append(Finding(f"{lib.name} is not installed (for {lib.purpose})", lib.install, optional=True))
        elif lib.within is False:
            tested = f"the range chunkmem[{lib.extra}] is tested with ({lib.pinned})"
            out.append(
                Finding(f"{lib.name} {lib.version} is outside {tested}", f"{lib.install} ({lib.name}{lib.pinned})")
            )
    kit = report.toolkit
    if not kit.cuda_available and kit.nvml_gpus:
        if kit.cuda_build is None:
            out.append(
                Finding(
                    f"the driver reports {kit.nvml_gpus} GPU(s), but this torch is built without CUDA",
                    "install a CUDA build of torch (https://pytorch.org/get-started/locally/)",
                )
            )
        elif kit.visible_devices is not None and kit.visible_devices.strip() in ("", "-1"):
            out.append(
                Finding(f"CUDA_VISIBLE_DEVICES={kit.visible_devices!r} hides every GPU", "unset CUDA_VISIBLE_DEVICES")
            )
        else:
            out.append(
                Finding(
                    f"the driver reports {kit.nvml_gpus} GPU(s), but torch cannot use CUDA",
                    "check the driver against torch's CUDA build (nvidia-smi; torch.version.cuda)",
                )
            )
    if kit.cuda_available and kit.nccl is None:
        out.append(
            Finding(
                "torch.distributed has no NCCL: ranks on GPUs cannot communicate", "install a torch built with NCCL"
            )
        )
    if not kit.gloo:
        out.append(
            Finding("torch.distributed has no gloo: ranks on the CPU cannot communicate", "install a full torch")
        )
    if os.environ.get("CHUNKMEM_DEVICE") and kit.cuda_available:
        value = os.environ["CHUNKMEM_DEVICE"]
        out.append(Finding(f"CHUNKMEM_DEVICE={value} makes chunkmem compute on the CPU", "unset CHUNKMEM_DEVICE"))
    pinned = report.pinned
    if pinned.pins and not pinned.pinned:
        limit = report.locked_memory_limit
        out.append(
            Finding(
                f"host memory cannot be pinned ({pinned.error}; locked-memory limit "
                f"{'unlimited' if limit is None else f'{limit} bytes'})",
                "raise the locked-memory limit (ulimit -l unlimited; Docker: --ulimit memlock=-1; Slurm: "
                "PropagateResourceLimits), or free host memory",
            )
        )
    disk = report.disk
    if disk.error is not None:
        out.append(
            Finding(
                f"the disk tier cannot use {disk.directory}: {disk.error}",
                "pass ChunkPlugin(disk_dir=...) a writable directory on a local disk with free space",
                optional=not report.disk_dir_given,
            )
        )
    return out


def collect(disk_dir: str | None = None, disk_probe_bytes: int = 64 * _MiB, copy_bytes: int = 256 * _MiB) -> Report:
    """Every fact of the report, probes run: a ``disk_probe_bytes`` file in ``disk_dir`` (default:
    the system's temporary directory), a ``copy_bytes`` copy to the device."""
    import chunkmem

    kit = read_toolkit()
    choice: LayerChoice = layer_choice(kit)
    host = host_memory()
    pins, pins_from = requirement_pins()
    report = Report(
        chunkmem=chunkmem.__version__,
        chunkmem_path=str(Path(chunkmem.__file__).parent),
        python=platform.python_version(),
        python_executable=sys.executable,
        torch=torch.__version__,
        platform=platform.platform(),
        toolkit=kit,
        device=str(choice.device),
        layer=type(choice.layer).__name__,
        layer_reason=choice.reason,
        host_memory_bytes=host.total,
        host_available_bytes=host.free,
        locked_memory_limit=locked_memory_limit(),
        pinned=pinned_copy(choice.layer, copy_bytes),
        disk=probe_disk(disk_dir or tempfile.gettempdir(), disk_probe_bytes),
        disk_dir_given=disk_dir is not None,
        libraries=[library(name, extra, how, why, pins) for name, extra, how, why in LIBRARIES],
        pins_from=pins_from,
    )
    report.findings = _findings(report, pins)
    return report


def _rate(nbytes: int, seconds: float | None) -> str:
    return "-" if not seconds else f"{nbytes / seconds / 1e6:,.0f} MB/s"


def _library_line(lib: Library) -> str:
    if lib.version is None:
        used = "" if lib.purpose is not None else "; chunkmem does not use it"
        state = f"not installed ({lib.install}{used})"
    elif lib.pinned is None:
        state = f"{lib.version} (no range pinned by chunkmem's extras)"
    elif lib.within is None:
        state = f"{lib.version} (chunkmem[{lib.extra}] pins {lib.pinned}; not checked: pip install packaging)"
    else:
        verdict = "within" if lib.within else "OUTSIDE"
        state = f"{lib.version} ({verdict} chunkmem[{lib.extra}]'s {lib.pinned})"
    return f"{lib.name}: {state}"


def render(report: Report) -> str:
    kit = report.toolkit
    lines = [f"chunkmem {report.chunkmem} ({report.chunkmem_path})", "", "versions"]
    lines.append(f"  python: {report.python} ({report.python_executable}) on {report.platform}")
    lines.append(f"  torch: {report.torch}")
    cuda = "none: torch is built without CUDA" if kit.cuda_build is None else f"{kit.cuda_build} (torch's build)"
    gpus = ", ".join(kit.gpus) if kit.gpus else "none torch can use"
    nvml = "NVML unavailable" if kit.nvml_gpus is None else f"{kit.nvml_gpus} reported by the driver (NVML)"
    lines.append(f"  CUDA: {cuda}; available: {kit.cuda_available}; GPUs: {gpus}; {nvml}")
    lines.append(f"  cuDNN: {kit.cudnn if kit.cudnn is not None else 'none'}")
    lines.append(f"  NCCL: {kit.nccl or 'none'}; gloo: {'available' if kit.gloo else 'none'}")
    lines += ["", f"libraries (ranges from {report.pins_from})"]
    lines += [f"  {_library_line(lib)}" for lib in report.libraries]
    lines += ["", "device"]
    lines.append(f"  compute device: {report.device}, {report.layer}: {report.layer_reason}")
    lines.append(
        f"  host memory: {report.host_memory_bytes / 2**30:.1f} GiB, {report.host_available_bytes / 2**30:.1f} GiB "
        "available"
    )
    pinned = report.pinned
    if not pinned.pins:
        lines.append(f"  pinned memory: not used: {report.layer} computes on the host, so nothing is pinned or copied")
    elif not pinned.pinned:
        lines.append(f"  pinned memory: cannot pin ({pinned.error})")
        lines.append(f"  pageable host->device copy: {_rate(pinned.nbytes, pinned.pageable_seconds)}")
    else:
        lines.append(
            f"  pinned memory: pins; host->device copy of {pinned.nbytes / _MiB:.0f} MiB: pinned "
            f"{_rate(pinned.nbytes, pinned.pinned_seconds)}, pageable {_rate(pinned.nbytes, pinned.pageable_seconds)}"
        )
    limit = report.locked_memory_limit
    lines.append(f"  locked-memory limit (ulimit -l): {'unlimited' if limit is None else f'{limit} bytes'}")
    disk = report.disk
    lines += ["", "disk tier"]
    whose = (
        "given"
        if report.disk_dir_given
        else "the temporary directory: chunkmem has no default, ChunkPlugin(disk_dir=...)"
    )
    lines.append(f"  directory: {disk.directory} ({whose})")
    if disk.error is not None:
        lines.append(f"  probe: failed: {disk.error}")
    else:
        cache = "page cache dropped before the read" if disk.dropped_cache else "read may come from the page cache"
        lines.append(
            f"  probe of {disk.nbytes / _MiB:.0f} MiB: write {_rate(disk.nbytes, disk.write_seconds)} (to fsync), "
            f"read {_rate(disk.nbytes, disk.read_seconds)} ({cache}); a burst, not a sustained rate"
        )
    if disk.free_bytes is not None:
        lines.append(f"  free: {disk.free_bytes / 2**30:.1f} GiB")
    lines += ["", "what to fix"]
    needed = [f for f in report.findings if not f.optional]
    optional = [f for f in report.findings if f.optional]
    lines += [f"  - {f.problem}: {f.fix}" for f in needed] or ["  nothing"]
    if optional:
        lines += ["", "optional (only for the feature named)"]
        lines += [f"  - {f.problem}: {f.fix}" for f in optional]
    return "\n".join(lines)


def _mebibytes(text: str) -> int:
    """The argparse type of a size flag in MiB (argparse names the flag in its refusal): a whole
    number above zero (a probe of nothing, or of a negative size, measures nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number of MiB, not {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"at least 1 MiB (what the probe moves), not {value}")
    return value


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--disk-dir", default=None, help="the directory to probe (default: the temporary directory)")
    parser.add_argument(
        "--disk-mib", type=_mebibytes, default=64, help="MiB the disk probe writes and reads (default 64)"
    )
    parser.add_argument(
        "--copy-mib", type=_mebibytes, default=256, help="MiB the pinned-copy probe moves (default 256)"
    )
    parser.add_argument("--json", action="store_true", help="print the facts as JSON")
    return parser


def _json(report: Report) -> dict[str, Any]:
    out = asdict(report)
    out["disk"]["write_bytes_per_second"] = report.disk.write_bytes_per_second()
    out["disk"]["read_bytes_per_second"] = report.disk.read_bytes_per_second()
    return out


def main(argv: list[str] | None = None, prog: str = "python -m chunkmem.env") -> Report:
    args = _parser(prog).parse_args(argv)
    report = collect(args.disk_dir, args.disk_mib * _MiB, args.copy_mib * _MiB)
    print(json.dumps(_json(report), indent=2) if args.json else render(report))
    return report


def cli() -> None:
    """The ``chunkmem-env`` console script."""
    main(prog="chunkmem-env")


if __name__ == "__main__":
    main()
