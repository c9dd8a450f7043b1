"""Sphinx configuration of chunkmem's manual: MyST Markdown pages, an API reference from the
docstrings (autodoc + napoleon), and two pages generated at build time from the repository
(``_ext/chunkmem_docs.py``: the benchmark tables from ``benchmarks/results/*.json`` and the
examples from ``examples/*.py``).

Build it with warnings as errors, as CI does::

    python -m sphinx -W --keep-going -n -b html docs docs/_build/html
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # the checkout's chunkmem, not an installed copy
sys.path.insert(0, str(DOCS / "_ext"))

from sphinx.errors import PycodeError  # noqa: E402
from sphinx.ext.napoleon.docstring import GoogleDocstring  # noqa: E402
from sphinx.pycode import ModuleAnalyzer  # noqa: E402

import chunkmem  # noqa: E402

project = "chunkmem"
author = "the chunkmem authors"
copyright = "the chunkmem authors, Apache-2.0"
release = getattr(chunkmem, "__version__", "0.1.0")
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "chunkmem_docs",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_generated", "_ext"]

# Markdown: headings get anchors (``page.md#a-heading``) so links into a section are checked too.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

# Every reference must resolve (``-n``). What the docstrings name from other libraries cannot be
# resolved without their inventories (the build is offline), and neither can internals that the
# reference does not document: those are named, not linked.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|pydantic|transformers|accelerate|lightning|peft|trl|typing|collections|enum|os|pathlib)\b.*"),
    (
        r"py:.*",
        r"chunkmem\.(activations|boosted|chunks|device|execution|materialize|optim|placement|planning|ranks|tiers|usage|hooks|checkpoint|quantized)\..*",
    ),
    (r"py:.*", r"(Any|Path|Callable|Iterator|Mapping|Sequence|Module|Optimizer|Tensor|dtype|device|Literal|Self)"),
    (r"py:.*", r"(int|float|str|bool|bytes|None|NoneType|object|type|dict|list|tuple|optional)"),
    # pydantic fields' annotations: the configs' own aliases (Annotated[..., Field(...)]) and their bounds.
    (
        r"py:class",
        r"(Fraction|Budget|Count|Blocks|BlockClass|Field|FieldInfo|ByteSize|BeforeValidator|PydanticUndefined|[0-9.]+)",
    ),
    (r"py:class", r"(annotated_types\.)?(Gt|Ge|Lt|Le)"),
    # internals in signatures, named but not documented here
    (r"py:class", r"(ProcessGroup|Communicator|ChunkRuntime|ChunkManager|TrainingProgress|ActivationPlan)"),
    # the bases of the integrations' classes, from the mocked trainer libraries
    (r"py:class", r"(ClusterEnvironment|CheckpointIO|Trainer|Accelerator|ParallelStrategy|Precision)"),
]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options: dict[str, object] = {}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# The build imports chunkmem (torch); the trainer libraries are stood in for: the reference shows
# what chunkmem's integrations add, and importing transformers and Lightning takes most of a build.
autodoc_mock_imports = ["transformers", "accelerate", "lightning", "lightning_utilities", "torchmetrics"]
_for_module = ModuleAnalyzer.for_module.__func__


def _no_source_of_mocked_modules(cls: type[ModuleAnalyzer], modname: str) -> ModuleAnalyzer:
    """autodoc reads the source of every class in a documented class's MRO, importing its module
    outside the mock: the real transformers and Lightning. Their sources are not documented here."""
    if modname.split(".")[0] in autodoc_mock_imports:
        raise PycodeError(f"{modname} is stood in for while the docs build")
    return _for_module(cls, modname)


ModuleAnalyzer.for_module = classmethod(_no_source_of_mocked_modules)  # type: ignore[method-assign,assignment]


# chunkmem's field docstrings are prose ("Seconds the reads took (summed over ...): ..."); napoleon
# reads an attribute docstring's first line up to a colon as its type. Keep them as written.
GoogleDocstring._parse_attribute_docstring = lambda self: self._consume_to_end()


html_theme = "furo"
html_title = f"chunkmem {release}"
html_static_path: list[str] = []
