"""What chunkmem records about a checkpoint (a :class:`Manifest`, beside a file or inside a sharded
directory), and the checks a load makes of it.

The checkpoint itself stays in plain PyTorch's formats (a ``torch.save`` file, a DCP directory); the
manifest is what lets a load refuse a corrupted, truncated, swapped or mismatched checkpoint before
anything is written. What a checkpoint was saved for (the model's fingerprint, the tensors it lists)
is checked here too, with a readable account of how two tensor lists differ.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from ..errors import CheckpointCorruptedError, CheckpointMismatchError, CheckpointUnverifiedError

if TYPE_CHECKING:
    from ..boosted.model import ChunkedModel
    from ..chunks.manager import ChunkManager
    from ..optim import ChunkOptimizer

__all__ = [
    "A_KIND",
    "DCP_LAYOUT",
    "DIRECTORY_FORMAT",
    "MANIFEST_NAME",
    "MANIFEST_SUFFIX",
    "FileDigest",
    "Kind",
    "Manifest",
    "Record",
    "TensorEntry",
    "check_digest",
    "check_kind",
    "check_saved_for_model",
    "check_saved_for_optimizer",
    "digest_of",
    "manifest_for_load",
    "manifest_path",
    "model_fingerprint",
    "model_tensors",
    "optimizer_tensors",
    "plain_name",
    "read_manifest",
    "seal",
]

log = logging.getLogger("chunkmem")

MANIFEST_SUFFIX = ".chunkmem.json"
"""Beside a checkpoint file: ``<file>.chunkmem.json``."""
MANIFEST_NAME = "chunkmem.json"
"""Inside a sharded checkpoint directory."""
Kind = Literal["model", "optimizer", "lr_scheduler"]
TensorEntry = tuple[str, tuple[int, ...], str]
"""A named tensor's name, shape and dtype (``"torch.float32"``)."""
_FILE = "chunkmem-checkpoint"
DIRECTORY_FORMAT = "chunkmem-sharded-checkpoint"
DCP_LAYOUT = "torch.distributed.checkpoint"
# Each format's fields that its manifests must have, and those of the other format, which they
# neither have nor write.
_OWN_FIELDS = {_FILE: ("file", "digest"), DIRECTORY_FORMAT: ("layout", "files")}
_OTHERS_FIELDS = {_FILE: frozenset({"layout", "files"}), DIRECTORY_FORMAT: frozenset({"file", "digest", "previous"})}
_READ_BLOCK = 1 << 20


class FileDigest(BaseModel):
    """Size and SHA-256 of a file as written."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


def plain_name(name: str) -> bool:
    """Whether ``name`` names an entry of a directory itself: not a path, ``.`` or ``..``."""
    return name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


class Manifest(BaseModel):
    """What chunkmem records about a checkpoint, a single file's (``format``
    ``chunkmem-checkpoint``) or a sharded directory's (``chunkmem-sharded-checkpoint``). The
    fields marked "a file's" or "a directory's" belong to that format only: the other format's
    manifest neither has them nor writes them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["chunkmem-checkpoint", "chunkmem-sharded-checkpoint"] = _FILE
    version: Literal[1, 2] = 2
    """2: sealed by ``checksum``; 1: written before manifests were sealed (loaded only with
    ``verify=False``: nothing tells an old manifest from one edited to say ``version: 1``)."""
    checksum: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """SHA-256 of every other field (:func:`seal`): an edited step, digest or file list is refused."""
    layout: Literal["torch.distributed.checkpoint"] | None = None
    """A directory's: how the state is stored (a DCP checkpoint of the module's or optimizer's state dict)."""
    kind: Kind
    """Which save wrote it: a model, an optimizer or an LR scheduler state (a directory: not a scheduler)."""
    file: str | None = None
    """A file's: its name (in the same directory)."""
    digest: FileDigest | None = None
    """A file's: its size and SHA-256."""
    files: dict[str, FileDigest] | None = None
    """A directory's: size and SHA-256 of every other file of the directory, by name."""
    step: int = Field(ge=0)
    """Optimizer steps (``step()`` calls, skipped fp16 steps included) behind the saved state."""
    model_fingerprint: str
    """SHA-256 of the model's parameters (names, shapes, fp32) in registration order."""
    world_size: int = Field(ge=1)
    """World size of the run that saved it (informative: checkpoints load at any world size)."""
    tensors: list[TensorEntry]
    """For a model, every state-dict entry; for an optimizer, its parameters in param group order
    (what a file's integer parameter ids stand for)."""
    previous: Manifest | None = None
    """A file's: the manifest of the file this one replaces, for a reader between the save's renames
    of its manifest and its file (:mod:`.files`)."""

    @field_validator("file", "files")
    @classmethod
    def _names_inside(cls, names: str | dict[str, FileDigest] | None) -> str | dict[str, FileDigest] | None:
        outside = [name for name in ([names] if isinstance(names, str) else names or {}) if not plain_name(name)]
        if outside:
            raise ValueError(f"{outside[:3]} are not file names inside the checkpoint (no '/', '..' or absolute paths)")
        return names

    @model_validator(mode="after")
    def _one_format(self) -> Manifest:
        other = _OTHERS_FIELDS[self.format] & self.model_fields_set
        if other:
            raise ValueError(f"a {self.format} manifest has no {sorted(other)}")
        missing = [name for name in _OWN_FIELDS[self.format] if getattr(self, name) is None]
        if missing:
            raise ValueError(f"a {self.format} manifest needs {missing}")
        if self.format == DIRECTORY_FORMAT and self.kind == "lr_scheduler":
            raise ValueError("a sharded checkpoint holds a model or an optimizer state, not an lr_scheduler state")
        return self

    @model_serializer(mode="wrap")
    def _only_its_format(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        fields: dict[str, Any] = handler(self)
        return {name: value for name, value in fields.items() if name not in _OTHERS_FIELDS[self.format]}


Manifest.model_rebuild()


@dataclass(frozen=True)
class Record:
    """What every manifest records about the saved state, whichever format stores it."""

    kind: Kind
    step: int
    model_fingerprint: str
    world_size: int
    tensors: list[TensorEntry]

    def manifest(self, **storage: Any) -> Manifest:
        """The sealed manifest of this state stored as ``storage`` says (a file's ``file``,
        ``digest`` and ``previous``; a directory's ``format``, ``layout`` and ``files``)."""
        tensors = [(name, tuple(shape), dtype) for name, shape, dtype in self.tensors]
        fields = {"step": self.step, "model_fingerprint": self.model_fingerprint, "world_size": self.world_size}
        return seal(Manifest(kind=self.kind, tensors=tensors, **fields, **storage))


def _checksum(manifest: Manifest) -> str:
    fields = manifest.model_dump(mode="json", exclude={"checksum"})
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(manifest: Manifest) -> Manifest:
    """``manifest`` with its ``checksum`` over every other field."""
    return manifest.model_copy(update={"checksum": _checksum(manifest)})


def manifest_path(path: str | os.PathLike[str]) -> Path:
    """Where the manifest of the checkpoint file ``path`` is."""
    target = Path(path)
    return target.with_name(target.name + MANIFEST_SUFFIX)


def read_manifest(path: str | os.PathLike[str], directory: bool = False) -> Manifest | None:
    """The manifest of the checkpoint file ``path`` (beside it), or with ``directory`` of the
    sharded checkpoint ``path`` (inside it); ``None`` when there is none (a file or DCP checkpoint
    written without chunkmem). A damaged, edited or unreadable manifest is refused."""
    target = Path(path)
    side, what, form = (
        (target / MANIFEST_NAME, f"checkpoint directory {target}", DIRECTORY_FORMAT)
        if directory
        else (manifest_path(target), f"checkpoint file {target}", _FILE)
    )
    try:
        text = side.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise CheckpointCorruptedError(f"cannot read the manifest {side} of {what}: {error}") from error
    try:
        manifest: Manifest | None = Manifest.model_validate_json(text)
        problem = f"1 problem(s): it is a {manifest.format} manifest" if manifest.format != form else ""
    except ValidationError as error:
        manifest, problem = None, f"{error.error_count()} problem(s): {error.errors()[0]['msg']}"
    if manifest is None or problem:
        raise CheckpointCorruptedError(
            f"the manifest {side} of {what} is damaged ({problem}). Restore it from the same checkpoint, or delete it "
            f"and load {target} with verify=False."
        )
    if manifest.version != 1 and manifest.checksum != _checksum(manifest):
        raise CheckpointCorruptedError(
            f"the manifest {side} of {what} was changed after it was written: its checksum does not match its "
            "fields (step, digests, model). Restore it from the same checkpoint, or load an earlier checkpoint."
        )
    return manifest


def manifest_for_load(target: Path, verify: bool, directory: bool = False) -> Manifest | None:
    """The manifest of the checkpoint ``target`` (:func:`read_manifest`) for a load. A checkpoint
    without one, or whose manifest has no seal (``version: 1``: an edit to say so must not be a way
    around the seal), is refused unless ``verify`` is false, and then logged as unverified."""
    manifest = read_manifest(target, directory)
    side = target / MANIFEST_NAME if directory else manifest_path(target)
    if manifest is None and verify:
        raise CheckpointUnverifiedError(
            f"{target} has no manifest ({side.name}), so chunkmem cannot check that it is intact and saved for "
            "this model. If it comes from plain PyTorch or another tool, load it with verify=False (it is then "
            f"logged as unverified); if chunkmem saved it, copy {side.name} with it."
        )
    if manifest is not None and manifest.version == 1 and verify:
        raise CheckpointUnverifiedError(
            f"the manifest {side} has no seal (version 1: written by a chunkmem from before manifests were sealed, or "
            f"edited to say so), so chunkmem cannot check that its step, digests and model were not changed. If it "
            f"is yours, load {target} with verify=False (its checksums are still checked; the load is logged as "
            "unverified) and save again to write a sealed manifest."
        )
    if manifest is None:
        log.warning("loading %s unverified (verify=False): it has no %s", target, side.name)
    elif manifest.version == 1:
        log.warning("loading %s with an unsealed (version 1) manifest %s (verify=False)", target, side)
    return manifest


A_KIND: dict[Kind, str] = {"model": "a model", "optimizer": "an optimizer", "lr_scheduler": "an lr_scheduler"}
"""Each kind with its article, for messages ("an optimizer", not "a optimizer")."""


def check_kind(target: Path, manifest: Manifest, kind: Kind) -> None:
    """Refuse a checkpoint that another kind of save wrote."""
    if manifest.kind != kind:
        raise CheckpointMismatchError(
            f"{target} holds {A_KIND[manifest.kind]} state (written by save_{manifest.kind}), not {A_KIND[kind]} "
            f"state; load it with load_{manifest.kind}"
        )


def digest_of(path: Path | int) -> FileDigest:
    """Size and SHA-256 of the file at ``path`` (or of an open file descriptor, from its start),
    read through one reused block (hashing a large checkpoint holds a megabyte, not a fresh buffer
    per read)."""
    digest = hashlib.sha256()
    size = 0
    block = bytearray(_READ_BLOCK)
    view = memoryview(block)
    with open(path, "rb", buffering=0, closefd=not isinstance(path, int)) as f:
        f.seek(0)
        while count := f.readinto(block):
            digest.update(view[:count])
            size += count
    return FileDigest(size=size, sha256=digest.hexdigest())


def check_digest(path: Path, actual: FileDigest, expected: FileDigest, side: Path, subject: Path) -> None:
    """Refuse the file ``path`` when its size or SHA-256 (``actual``) is not what the manifest
    ``side`` recorded; ``subject`` is what to load unverified instead (the file, or its directory)."""
    if actual.size != expected.size:
        what = "truncated" if actual.size < expected.size else "longer than saved"
        raise CheckpointCorruptedError(
            f"checkpoint file {path} is {what}: {actual.size} bytes, its manifest {side} says {expected.size}. It was "
            "damaged after saving or its save or copy was interrupted; load an intact copy or an earlier checkpoint."
        )
    if actual.sha256 != expected.sha256:
        raise CheckpointCorruptedError(
            f"checkpoint file {path} is corrupted: its SHA-256 {actual.sha256[:16]}... differs from the "
            f"{expected.sha256[:16]}... recorded when it was saved. Load an intact copy or an earlier checkpoint; if "
            f"you replaced it on purpose, delete {side} and load {subject} with verify=False."
        )


# --- what a checkpoint was saved for -----------------------------------------------------------
def model_fingerprint(manager: ChunkManager) -> str:
    """Hash of the model's parameters (names, shapes, fp32) in registration order: equal for the
    same model structure."""
    entries = [[info.name, list(info.shape), "torch.float32"] for info in manager.infos]
    text = json.dumps(entries, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def model_tensors(model: ChunkedModel) -> list[TensorEntry]:
    """Every ``state_dict`` entry of the model (parameters as fp32 masters, buffers in their
    original dtype), in its order."""
    return [(name, shape, str(dtype)) for name, (shape, dtype) in model.state_shapes().items()]


def optimizer_tensors(optimizer: ChunkOptimizer) -> list[TensorEntry]:
    """The optimizer's parameters in param group order (what a PyTorch-format state counts)."""
    return [(info.name, tuple(info.shape), "torch.float32") for infos in optimizer.group_infos for info in infos]


def describe_difference(saved: list[TensorEntry], here: list[TensorEntry]) -> str:
    """How the tensors a checkpoint lists differ from this model's (names only on one side, other
    shapes or dtypes, or another order)."""
    saved_map = {name: (tuple(shape), dtype) for name, shape, dtype in saved}
    here_map = {name: (tuple(shape), dtype) for name, shape, dtype in here}
    only_saved = [n for n in saved_map if n not in here_map]
    only_here = [n for n in here_map if n not in saved_map]
    changed = [
        f"'{n}' {saved_map[n]} there, {here_map[n]} here"
        for n in saved_map
        if n in here_map and saved_map[n] != here_map[n]
    ]
    parts = []
    if only_saved:
        parts.append(f"only in the checkpoint: {only_saved[:5]}{' ...' if len(only_saved) > 5 else ''}")
    if only_here:
        parts.append(f"only in this model: {only_here[:5]}{' ...' if len(only_here) > 5 else ''}")
    if changed:
        parts.append(f"different: {'; '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}")
    if not parts and [n for n, _, _ in saved] != [n for n, _, _ in here]:
        parts.append("the same tensors in another order")
    return "; ".join(parts) or "the same tensors"


def check_saved_for_model(manifest: Manifest, model: ChunkedModel, target: Path) -> None:
    """Refuse a model checkpoint of another model."""
    if manifest.model_fingerprint != model_fingerprint(model.manager):
        raise CheckpointMismatchError(
            f"{target} was saved for another model ({describe_difference(manifest.tensors, model_tensors(model))}). "
            "Load a checkpoint of this model, or boost the model the checkpoint was saved from."
        )


def check_saved_for_optimizer(manifest: Manifest, optimizer: ChunkOptimizer, target: Path) -> None:
    """Refuse an optimizer checkpoint of another model, or over other parameters."""
    here = optimizer_tensors(optimizer)
    if manifest.model_fingerprint != model_fingerprint(optimizer.manager) or manifest.tensors != here:
        raise CheckpointMismatchError(
            f"optimizer checkpoint {target} was saved for an optimizer over other parameters "
            f"({describe_difference(manifest.tensors, here)}). Load the optimizer checkpoint saved with this model."
        )
