"""Other libraries' internals are named in one place, ``chunkmem.compat``, as ``chunkmem.device``
holds ``torch.cuda`` (``test_device_layer``): when torch, Accelerate, transformers, PEFT, Lightning or
Python renames a private name, that package is the one to change.

The library's other modules are read with ``ast`` (``internals``). A private name is one with a
single leading underscore; it is chunkmem's own where chunkmem binds it, else another library's:

* an import of a private module or name from outside chunkmem (``torch.utils._pytree``, ``_StorageInfo``);
* a private attribute: through ``super()`` always (the parent's); on ``self`` or ``cls`` unless chunkmem
  binds that attribute somewhere (a subclass of ``Trainer`` reading ``self._models``); on anything else
  unless its own file binds it (``tensor._version``, ``storage._cdata``, ``torch._C``: a file's own
  objects and their private fields are the file's business, another's are not);
* a string that spells a private name or a dotted path through one which chunkmem does not bind (for
  ``getattr``, ``mock.patch.object`` or a pickle's class path: ``"_from_config"``);
* a private function that nothing in chunkmem names: another library calls it (an override of a private
  hook such as ``Trainer._load_from_checkpoint``), or nothing does;
* a private parameter: a keyword another library passes by name;
* a class recognised by its module's name (``cls.__module__.startswith("transformers.")``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest
from support.paths import ROOT

COMPAT = ROOT / "chunkmem" / "compat"
LIBRARIES = ("torch", "transformers", "accelerate", "peft", "trl", "lightning", "pytorch_lightning", "bitsandbytes")
_PATH = re.compile(r"[A-Za-z0-9_.]+")

# Where naming another library's internal outside chunkmem.compat cannot be avoided, each with why.
ALLOWED = {
    # Trainer.save_model's keyword, passed by name from Trainer's own checkpointing: the override
    # must spell it in its signature (a forwarding save_model in compat would hide the user-facing
    # method and its docstring behind a private one).
    ("chunkmem/integrations/hf.py", "parameter _internal_call"),
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


@dataclass
class _Bindings:
    """What chunkmem binds and names, over all of its files."""

    attributes: set[str] = field(default_factory=set)
    """Attribute names bound anywhere (stores, class bodies, ``__slots__``)."""
    by_file: dict[str, set[str]] = field(default_factory=dict)
    """The same, per file."""
    names: set[str] = field(default_factory=set)
    """Every name bound anywhere (attributes, functions, classes, variables, imports)."""
    named: set[str] = field(default_factory=set)
    """Every name read anywhere (as a name, an attribute or a string)."""


def _bind_class_body(node: ast.ClassDef, attributes: set[str]) -> None:
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            attributes.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            attributes.add(item.target.id)
        for target in item.targets if isinstance(item, ast.Assign) else []:
            if isinstance(target, ast.Name):
                attributes.add(target.id)
            if isinstance(target, ast.Name) and target.id == "__slots__":
                attributes |= {c.value for c in ast.walk(item.value) if isinstance(c, ast.Constant)}


def _read(file: str, tree: ast.AST, known: _Bindings) -> list[ast.AST]:
    """Record what ``tree`` binds and names in ``known``; return the nodes that may name an internal."""
    attributes = known.by_file.setdefault(file, set())
    candidates: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if isinstance(node.ctx, ast.Load):
                known.named.add(node.attr)
            else:
                attributes.add(node.attr)
            if _private(node.attr):
                candidates.append(node)
        elif isinstance(node, ast.Name):
            (known.names if isinstance(node.ctx, ast.Store) else known.named).add(node.id)
        elif isinstance(node, ast.Constant):
            if isinstance(node.value, str):
                known.named.add(node.value)
                if "_" in node.value and _PATH.fullmatch(node.value):
                    candidates.append(node)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            known.names.add(node.name)
            if isinstance(node, ast.ClassDef):
                _bind_class_body(node, attributes)
            elif _private(node.name) and not node.decorator_list:
                candidates.append(node)
        elif isinstance(node, ast.alias):
            known.names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            if _private(node.arg):
                candidates.append(node)
        elif isinstance(node, ast.Import | ast.ImportFrom | ast.Compare | ast.Call):
            candidates.append(node)
    known.attributes |= attributes
    return candidates


def _names_a_library(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(LIBRARIES)


def _recognises_by_module(node: ast.AST) -> bool:
    """``x.__module__ == "peft.tuners"`` or ``x.__module__.startswith("transformers.")``."""
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        return any(isinstance(s, ast.Attribute) and s.attr == "__module__" for s in sides) and any(
            _names_a_library(s) for s in sides
        )
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "startswith":
        target = node.func.value
        on_module = isinstance(target, ast.Attribute) and target.attr == "__module__"
        return on_module and any(map(_names_a_library, node.args))
    return False


def _what(node: ast.AST, own: set[str], known: _Bindings) -> str | None:
    """What ``node`` (a candidate of ``_read``, in a file binding the attributes ``own``) names of
    another library's, if anything (see the module docstring)."""
    if isinstance(node, ast.ImportFrom):
        if node.level or not node.module or node.module.startswith(("chunkmem", "__future__")):
            return None
        if any(map(_private, node.module.split("."))) or any(_private(a.name) for a in node.names):
            return f"import from {node.module}: {', '.join(a.name for a in node.names)}"
    elif isinstance(node, ast.Import):
        private = [a.name for a in node.names if any(map(_private, a.name.split(".")))]
        return f"import {', '.join(private)}" if private else None
    elif isinstance(node, ast.Attribute):
        receiver = node.value
        through_super = (
            isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name) and receiver.func.id == "super"
        )
        on_self = isinstance(receiver, ast.Name) and receiver.id in ("self", "cls")
        if through_super or node.attr not in (known.attributes if on_self else own):
            return f"attribute {ast.unparse(node)}"
    elif isinstance(node, ast.Constant):
        if any(_private(part) and part not in known.names for part in str(node.value).split(".")):
            return f"string {node.value!r}"
    elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return f"function {node.name}, which nothing in chunkmem calls" if node.name not in known.named else None
    elif isinstance(node, ast.arg):
        return f"parameter {node.arg}"
    elif _recognises_by_module(node):
        return f"recognition by module {ast.unparse(node)}"
    return None


def internals(sources: Mapping[str, str], scanned: set[str] | None = None) -> list[tuple[str, int, str]]:
    """Every access to another library's internal in ``sources`` (file -> text; all of chunkmem,
    for what it binds), in the files of ``scanned`` (all of them by default): (file, line, what)."""
    known = _Bindings()
    candidates = {file: _read(file, ast.parse(text, file), known) for file, text in sources.items()}
    known.names |= known.attributes
    out = []
    for file, nodes in candidates.items():
        if scanned is not None and file not in scanned:
            continue
        own = known.by_file[file]
        found = {(node.lineno, what) for node in nodes if (what := _what(node, own, known)) is not None}
        out += [(file, line, what) for line, what in sorted(found)]
    return out


def _library() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "chunkmem").rglob("*.py"))}


@pytest.mark.slow  # parses and walks every module of the library: 1.5-2 s
def test_only_the_compat_package_names_other_libraries_internals() -> None:
    sources = _library()
    outside = {file for file in sources if not (ROOT / file).is_relative_to(COMPAT)}
    assert len(outside) > 100 and len(sources) > len(outside), "the library's files or chunkmem/compat were not found"
    found = [(file, line, what) for file, line, what in internals(sources, outside) if (file, what) not in ALLOWED]
    listed = "\n".join(f"{file}:{line}: {what}" for file, line, what in found)
    assert found == [], f"other libraries' internals outside chunkmem/compat (add a named function there):\n{listed}"
    seen = {(file, what) for file, _, what in internals(sources, outside)}
    assert seen >= ALLOWED, f"allowed accesses no longer there (remove them from ALLOWED): {sorted(ALLOWED - seen)}"


def test_the_check_sees_what_it_forbids() -> None:
    """The checker itself, on modules written here (not on the project's own code)."""
    own = (
        "class Mine:\n"
        "    __slots__ = ('_slot',)\n"
        "    def __init__(self, other):\n"
        "        self._field = 1\n"
        "        other._field = 2\n"
        "        self._helper()\n"
        "    def _helper(self):\n"
        "        return self._slot, getattr(self, '_field')\n"
        "def _used():\n"
        "    return Mine(None)._field\n"
        "_used()\n"
    )
    assert internals({"own.py": own}) == []
    forbidden = {
        "from torch.utils._pytree import tree_map": "import from torch.utils._pytree: tree_map",
        "from torch.nn.modules.module import _IncompatibleKeys": (
            "import from torch.nn.modules.module: _IncompatibleKeys"
        ),
        "import torch._dynamo": "import torch._dynamo",
        "k = tensor.untyped_storage()._cdata": "attribute tensor.untyped_storage()._cdata",
        "v = t._version": "attribute t._version",
        "torch._C.DisableTorchFunctionSubclass()": "attribute torch._C",
        "class T(Trainer):\n    def f(self):\n        self._models.append(1)": "attribute self._models",
        "class F(Base):\n    def g(self, a):\n        return super()._get_help_string(a)": (
            "attribute super()._get_help_string"
        ),
        "hasattr(cls, '_from_config')": "string '_from_config'",
        "names = {'torch.serialization._get_layout'}": "string 'torch.serialization._get_layout'",
        "class H:\n    def _load_from_checkpoint(self, path):\n        pass": (
            "function _load_from_checkpoint, which nothing in chunkmem calls"
        ),
        "def save_model(self, output_dir=None, _internal_call=False):\n    pass": "parameter _internal_call",
        "ok = type(v).__module__.startswith('transformers.')": (
            "recognition by module type(v).__module__.startswith('transformers.')"
        ),
        "ok = cls.__module__ == 'peft.tuners'": "recognition by module cls.__module__ == 'peft.tuners'",
    }
    for source, what in forbidden.items():
        found = [w for _, _, w in internals({"own.py": own, "other.py": source}, {"other.py"})]
        assert what in found, (source, found)
    # Another file's private field is not this one's, even where chunkmem binds it.
    assert [w for _, _, w in internals({"own.py": own, "other.py": "x = y._field"}, {"other.py"})] == [
        "attribute y._field"
    ]


def test_every_compat_name_says_what_it_reads() -> None:
    """Each module names the versions it was checked on; each function and class says what it reads."""
    modules = sorted(COMPAT.glob("*.py"))
    assert len(modules) > 5, "chunkmem/compat was not found"
    for path in modules:
        tree = ast.parse(path.read_text())
        docstring = ast.get_docstring(tree) or ""
        if path.name != "__init__.py":
            assert "Checked on" in docstring, f"{path.name}: the module docstring names no versions it was checked on"
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                assert ast.get_docstring(node), f"{path.name}: {node.name} has no docstring"
