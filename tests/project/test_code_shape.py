"""The package's shape, kept by tests that each list every offender at once: functions fit in a
screen and take at most ten parameters, the root holds tools and shared parts, imports run down
the layers and never into a tool's CLI, tests live in the room they test. A module's length
follows its job and is not counted. Ruff checks complexity (C901 <= 12) and the rest of the lint;
pylint's duplicate-code check (./run.sh test) finds copied code."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

PACKAGE = ROOT / "audioclf"
MAX_FUNCTION_LINES = 80
# More: group the options into a small frozen dataclass their module owns (EvaluateOptions,
# RankOptions), or pass the object the caller already has instead of its fields one by one.
MAX_PARAMETERS = 10
MAX_ROOT_MODULES = 14  # tools and the parts every job shares; a job's internals live in its package
TOOLS = ("evaluate", "export", "embed", "prepare", "train")
# Tools whose library is a package of the same name (`audioclf/search/`): their CLI is
# <tool>/cli.py, run by <tool>/__main__.py.
PACKAGE_TOOLS = ("search", "serve")
# The tools' CLIs and the `audioclf` command (cli.py): nothing in the package imports them, but
# a package tool's own __main__, which runs its CLI.
TOOL_CLIS = (
    *(f"audioclf.{tool}" for tool in TOOLS),
    *(f"audioclf.{tool}.cli" for tool in PACKAGE_TOOLS),
    "audioclf.cli",
)
RUNNERS = {f"audioclf.{tool}.__main__": f"audioclf.{tool}.cli" for tool in PACKAGE_TOOLS}
# Layers that never import upward: data/ and the shared formats know nothing of models or tools.
LOWER = ("data", "spectrogram", "config", "fileio", "errors")
HIGHER = (
    "audioclf.models",
    "audioclf.training",
    "audioclf.inference",
    "audioclf.evaluation",
    "audioclf.embedding",
    *(f"audioclf.{tool}" for tool in (*TOOLS, *PACKAGE_TOOLS)),
)
# Using a model and scoring embeddings sit below search: search uses them, never the reverse
# (evaluation, above both, injects the chosen search into the metrics).
BELOW_SEARCH = ("inference", "metrics")


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py"))


def name_of(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(
        ".__init__"
    )


def top_of(path: Path) -> str:
    """The package (data, ...) or root module (logs, ...) below audioclf a module belongs to."""
    return path.relative_to(PACKAGE).with_suffix("").parts[0]


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def inside(name: str, packages) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def offenders(found: dict[str, list]) -> list[str]:
    return [f"{module}: {', '.join(map(str, items))}" for module, items in found.items() if items]


def test_functions_fit_in_a_screen():
    long = {
        name_of(path): [
            f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
        ]
        for path in modules()
    }
    assert not offenders(long), f"over {MAX_FUNCTION_LINES} lines: {offenders(long)}"


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's parameters but self / cls; *args and **kwargs count one each."""
    args = node.args
    named = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    starred = [a for a in (args.vararg, args.kwarg) if a is not None]
    return len([n for n in named if n not in ("self", "cls")]) + len(starred)


def test_no_function_takes_more_than_ten_parameters():
    wide = {
        name_of(path): [
            f"{node.name} ({parameters(node)} parameters, line {node.lineno})"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and parameters(node) > MAX_PARAMETERS
        ]
        for path in modules()
    }
    assert not offenders(wide), f"over {MAX_PARAMETERS} parameters: {offenders(wide)}"


def test_the_root_holds_tools_and_shared_parts_only():
    root = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root


def test_lower_layers_never_import_upward():
    upward = {
        name_of(path): sorted(n for n in imports(path) if inside(n, HIGHER))
        for path in modules()
        if top_of(path) in LOWER
    }
    assert not offenders(upward), offenders(upward)


def test_inference_and_metrics_never_import_search():
    into_search = {
        name_of(path): sorted(n for n in imports(path) if inside(n, ["audioclf.search"]))
        for path in modules()
        if top_of(path) in BELOW_SEARCH
    }
    assert not offenders(into_search), offenders(into_search)


def test_nothing_imports_a_tool_cli():
    into_tools = {
        name_of(path): sorted(
            n for n in imports(path) if n in TOOL_CLIS and RUNNERS.get(name_of(path)) != n
        )
        for path in modules()
    }
    assert not offenders(into_tools), offenders(into_tools)


def test_only_distributed_talks_to_torch_distributed():
    talkers = sorted(
        name_of(p)
        for p in modules()
        if any(inside(name, ["torch.distributed"]) for name in imports(p))
        and top_of(p) != "distributed"
    )
    assert not talkers, talkers


def test_tests_live_in_the_room_they_test():
    # tests/<room>/ for each package room (tests/data for audioclf/data, ...), tests/project for
    # what checks the project itself (docs, benchmarks, faults, this file), tests/fixtures for
    # files tests read; the root keeps only the shared conftest and helpers.
    rooms = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    tests = ROOT / "tests"
    strays = sorted(
        path.relative_to(tests).as_posix()
        for path in tests.rglob("test_*.py")
        if path.parent == tests or path.relative_to(tests).parts[0] not in {*rooms, "project"}
    )
    assert not strays, f"test files outside tests/<room>/: {strays}"


def test_the_checks_see_what_they_guard():
    # Each check above reads the modules it must: a layer missing from the walk would pass.
    names = {name_of(p) for p in modules()}
    assert set(TOOL_CLIS) | set(RUNNERS) <= names
    assert {*LOWER, *BELOW_SEARCH, "distributed"} <= {top_of(p) for p in modules()}
    assert imports(PACKAGE / "search" / "__main__.py") & set(TOOL_CLIS)  # the runner is seen


# Rank and search answer from a gallery and a collection opened in one place each, which the
# CLI, the API and the server all call (issue 44): a second opener is where they drift apart.
OPENERS = {
    "load_gallery": "audioclf.embedding.gallery:Gallery.open",
    "open_index": "audioclf.search.queries:Searcher.open",
}


def callers(name: str) -> set[str]:
    """module:Class.function of every function in audioclf/ that calls `name` (bare or as an
    attribute)."""
    found = set()

    def visit(node: ast.AST, where: list[str], module: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                inner = [*where, child.name]
            elif isinstance(child, ast.Call):
                called = child.func
                called = called.attr if isinstance(called, ast.Attribute) else called
                if getattr(called, "id", called) == name:
                    found.add(f"{module}:{'.'.join(where)}")
            visit(child, inner, module)

    for path in modules():
        visit(ast.parse(path.read_text()), [], name_of(path))
    return found


def test_one_place_opens_a_gallery_and_one_opens_a_collection():
    for name, opener in OPENERS.items():
        assert callers(name) == {opener}, f"{name} is called by {sorted(callers(name))}"
