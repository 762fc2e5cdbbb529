"""The package's shape, kept by a test so the next feature cannot grow it back (STYLE.md):
functions fit in a screen, modules hold one job, tool CLIs stay thin, and imports run down the
layers (ruff checks complexity, C901 <= 12, and the rest of the lint)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "audioclf"
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 450
MAX_CLI_LINES = 200  # tool entry points: parse, call the library, print
TOOLS = ("evaluate", "export", "embed", "prepare", "train")
# Tools whose library is a package of the same name (`audioclf/search/`): their CLI is
# <tool>/cli.py, run by <tool>/__main__.py, and held to the CLI limit like the others.
PACKAGE_TOOLS = ("search",)
CLI_MODULES = (
    *(f"audioclf.{tool}" for tool in TOOLS),
    *(f"audioclf.{tool}.{part}" for tool in PACKAGE_TOOLS for part in ("cli", "__main__")),
)
# Layers that never import upward: data/ and the run logs/report know nothing of models or tools.
LOWER = ("data", "logs", "report", "spectrogram", "config", "fileio", "sampler")
HIGHER = (
    "audioclf.models",
    "audioclf.trainer",
    "audioclf.inference",
    "audioclf.step",
    *(f"audioclf.{tool}" for tool in (*TOOLS, *PACKAGE_TOOLS)),
)


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py"))


def name_of(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(
        ".__init__"
    )


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", modules(), ids=name_of)
def test_functions_fit_in_a_screen(path):
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"over {MAX_FUNCTION_LINES} lines: {', '.join(long)}"


@pytest.mark.parametrize("path", modules(), ids=name_of)
def test_modules_hold_one_job(path):
    lines = len(path.read_text().splitlines())
    tool = name_of(path) in CLI_MODULES
    limit = MAX_CLI_LINES if tool else MAX_MODULE_LINES
    assert lines <= limit, f"{path.name}: {lines} lines (at most {limit})"


@pytest.mark.parametrize(
    "path",
    [p for p in modules() if name_of(p).split(".")[1:2] and name_of(p).split(".")[1] in LOWER],
    ids=name_of,
)
def test_lower_layers_never_import_upward(path):
    upward = sorted(
        name
        for name in imports(path)
        if any(name == high or name.startswith(high + ".") for high in HIGHER)
    )
    assert not upward, f"{name_of(path)} imports {upward}"


def test_no_library_module_imports_a_tool():
    tools = set(CLI_MODULES)
    offenders = {
        name_of(p): sorted(imports(p) & tools) for p in modules() if name_of(p) not in CLI_MODULES
    }
    assert not {k: v for k, v in offenders.items() if v}


def test_only_distributed_talks_to_torch_distributed():
    talkers = sorted(
        name_of(p)
        for p in modules()
        if any(
            name == "torch.distributed" or name.startswith("torch.distributed.")
            for name in imports(p)
        )
    )
    assert all(name.startswith("audioclf.distributed") for name in talkers), talkers
