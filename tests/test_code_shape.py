"""The package's shape, kept by a test so the next feature cannot grow it back (STYLE.md):
functions fit in a screen, modules hold one job, tool CLIs stay thin, and imports run down the
layers (ruff checks complexity, C901 <= 12, and the rest of the lint)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "audioclf"
MAX_FUNCTION_LINES = 80
MAX_CLI_LINES = 200  # tool entry points: parse, call the library, print
# A module's length follows its job (STYLE.md, habit 3), not a cap: most hold a small job and
# stay under the default; a larger job is named here with its reason, so growing past it is a
# decision made in this file rather than a split made to fit.
DEFAULT_MODULE_LINES = 400
MODULE_BUDGETS = {
    "audioclf.training.trainer": (
        650,
        "the Trainer's set-up and loop in one file (torchtitan's trainer.py): the parts are "
        "built by their owners, wired here",
    ),
    "audioclf.data.sampler": (
        450,
        "the m-per-class sampler: classes dealt to ranks, items per class, small classes, state",
    ),
    "audioclf.embedding.index": (
        450,
        "embed --index: the rank protocol (chunks dealt, a failure vote per round, rank 0 "
        "assembles) reads top-down in one module",
    ),
    "audioclf.inference.exporting": (
        410,
        "export: the exported module, the parity check, the sidecar, the write under its lock",
    ),
    "audioclf.data.demo": (430, "the generated demo dataset: procedural sources, items, sheet"),
    "audioclf.prepare": (
        240,
        "a CLI whose --help (the module docstring) is the manual of four jobs: features, "
        "shards, imports and packs",
    ),
    "audioclf.precompute.pack": (
        480,
        "prepare --pack: the class-major order, the ordered worker pool, the durable appends and "
        "the resume, the pack's files written last",
    ),
    "audioclf.evaluation.run": (
        440,
        "evaluate's rows (split, gallery, cohort), their embedding and scoring, the report "
        "folder under its lock",
    ),
}
# Packages by job: their lines together, each with its reason.
PACKAGE_BUDGETS = {
    "audioclf.training": (2010, "trainer, step, validation, averaging, the run folder, trackers"),
    "audioclf.data": (
        5200,
        "index sheets, readers, datasets, loaders, sampler, augmentation, importing the "
        "peer toolkits' datasets (Kaldi, NeMo, Lhotse, WeSpeaker) with their segments, and the "
        "feature pack with its batch-at-a-time loader",
    ),
    "audioclf.evaluation": (
        1420,
        "evaluate's selection, metrics assembly, score normalisation, report folder",
    ),
    "audioclf.embedding": (
        1050,
        "embed --index across ranks and gallery ranking (kNN or centroid)",
    ),
    "audioclf.inference": (1350, "loading artefacts, extraction, the export formats"),
    "audioclf.search": (1600, "exact and faiss indexes, the search tool"),
    "audioclf.metrics": (
        775,
        "the metric definitions, score normalisation of verification (and its cohort top N, "
        "shared by evaluate and search)",
    ),
    "audioclf.models": (950, "front end, embedders (cnn, resnet, conformer, ecapa), heads"),
    "audioclf.config": (950, "the typed config, its loading and generated reference"),
    "audioclf.distributed": (920, "the only talker to torch.distributed; the local launcher"),
    "audioclf.precompute": (
        1200,
        "python -m audioclf.prepare's feature writing, segment spans, and the feature pack",
    ),
}
MAX_ROOT_MODULES = 17  # tools and the parts every job shares; a job's internals live in its package
TOOLS = ("evaluate", "export", "embed", "prepare", "train")
# Tools whose library is a package of the same name (`audioclf/search/`): their CLI is
# <tool>/cli.py, run by <tool>/__main__.py, and held to the CLI limit like the others.
PACKAGE_TOOLS = ("search",)
CLI_MODULES = (
    *(f"audioclf.{tool}" for tool in TOOLS),
    *(f"audioclf.{tool}.{part}" for tool in PACKAGE_TOOLS for part in ("cli", "__main__")),
)
# Layers that never import upward: data/ and the run logs know nothing of models or tools.
LOWER = ("data", "logs", "spectrogram", "config", "fileio", "errors")
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
def test_modules_keep_to_their_budget(path):
    lines = len(path.read_text().splitlines())
    name = name_of(path)
    default = MAX_CLI_LINES if name in CLI_MODULES else DEFAULT_MODULE_LINES
    limit = MODULE_BUDGETS.get(name, (default,))[0]
    assert lines <= limit, f"{path.name}: {lines} lines (budget {limit}: see MODULE_BUDGETS)"


def test_every_budget_names_a_module_that_exists():
    names = {name_of(p) for p in modules()}
    assert set(MODULE_BUDGETS) <= names and set(PACKAGE_BUDGETS) <= names


@pytest.mark.parametrize("package", sorted(PACKAGE_BUDGETS))
def test_packages_keep_to_their_budget(package):
    folder = PACKAGE / package.removeprefix("audioclf.").replace(".", "/")
    lines = sum(len(p.read_text().splitlines()) for p in folder.rglob("*.py"))
    limit, why = PACKAGE_BUDGETS[package]
    assert lines <= limit, f"{package}: {lines} lines (budget {limit}: {why})"


def test_the_root_holds_tools_and_shared_parts_only():
    root = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, root


@pytest.mark.parametrize(
    "path",
    [p for p in modules() if name_of(p).split(".")[1:2] in [[b] for b in BELOW_SEARCH]],
    ids=name_of,
)
def test_inference_and_metrics_never_import_search(path):
    assert not [
        n for n in imports(path) if n == "audioclf.search" or n.startswith("audioclf.search.")
    ]


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
