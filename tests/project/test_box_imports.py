"""The GPU machine cannot drift from the code: every third-party package that audioclf/ or tests/
imports at module level (what pytest's collection and `import audioclf...` need) is either on the
machine's image or fetched as a pinned wheel by benchmarks/gpu_wheels.sh, as
benchmarks/gpu_preflight.py lists them. A new module-level import of another package fails here,
on the CPU, instead of stopping benchmarks/gpu_check.sh at collection on the GPU."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from tests.helpers import ROOT, script_module

PREFLIGHT = ROOT / "benchmarks/gpu_preflight.py"
OWN = {"audioclf", "tests", "benchmarks"}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(body: list[ast.stmt]) -> set[str]:
    """Top-level package names imported when the module is imported: the statements of the
    module body and of its if/try/with blocks, not of functions or classes' methods, and not
    under `if TYPE_CHECKING`."""
    found: set[str] = set()
    for node in body:
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                found |= _module_level_imports(node.body)
            found |= _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                found |= _module_level_imports(block)
            for handler in node.handlers:
                found |= _module_level_imports(handler.body)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            found |= _module_level_imports(node.body)
    return found


def third_party_imports(roots: list[Path]) -> dict[str, list[str]]:
    """{package: files importing it at module level} over every .py file under `roots`."""
    out: dict[str, list[str]] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for name in _module_level_imports(tree.body):
                if name not in sys.stdlib_module_names and name not in OWN:
                    out.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return out


def not_on_the_box(imports: dict[str, list[str]], required) -> list[str]:
    """'package (files)' for each imported package that no Requirement provides."""
    provided = {req.module.split(".")[0] for req in required}
    return [
        f"{name} (imported by {', '.join(files[:3])})"
        for name, files in sorted(imports.items())
        if name not in provided
    ]


def test_every_module_level_import_is_on_the_gpu_machine_or_a_pinned_wheel():
    preflight = script_module(PREFLIGHT)
    imports = third_party_imports([ROOT / "audioclf", ROOT / "tests"])
    assert "torch" in imports and "starlette" in imports  # the walk sees the package and serve
    missing = not_on_the_box(imports, preflight.REQUIRED)
    assert not missing, (
        f"imported at module level but neither on the GPU machine's image nor a pinned wheel: "
        f"{'; '.join(missing)}. Add a Requirement with its pin to benchmarks/gpu_preflight.py "
        "(gpu_wheels.sh fetches it), or import it inside the function that needs it."
    )


def test_each_unpinned_requirement_is_on_the_image_and_each_pin_is_a_version():
    preflight = script_module(PREFLIGHT)
    box = set(preflight.BOX_PACKAGES)
    for req in preflight.REQUIRED:
        if req.pin:
            assert req.pin[0].isdigit() and req.wheel not in box, req
        else:
            assert req.wheel in box, f"{req.wheel} is neither pinned nor on the image"


def test_the_walk_skips_functions_and_type_checking_and_sees_try_blocks():
    source = (
        "import os, numpy.linalg\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import pandas\n"
        "try:\n    import starlette\nexcept ImportError:\n    import uvicorn\n"
        "def f():\n    import faiss\n"
        "from . import sibling\n"
    )
    found = _module_level_imports(ast.parse(source).body)
    assert found == {"os", "numpy", "typing", "starlette", "uvicorn"}
    imports = {"numpy": ["a.py"], "starlette": ["b.py"]}
    required = script_module(PREFLIGHT).REQUIRED[:3]  # torch, torchaudio, numpy
    assert not_on_the_box(imports, required) == ["starlette (imported by b.py)"]
