"""The preflight of benchmarks/gpu_check.sh: can this Python run the GPU check?

    python3 benchmarks/gpu_preflight.py              # every module, the version floors, a GPU
    python3 benchmarks/gpu_preflight.py --cpu        # the same without asking for a GPU
    python3 benchmarks/gpu_preflight.py --list-wheels   # name==version of what gpu_wheels.sh fetches
    python3 benchmarks/gpu_preflight.py --list-box      # the GPU image's packages relied on

Imports every module the check needs (the package, its tests, ONNX export) and names all the
missing ones in one line, each with the wheel that provides it, and how to bring the wheels to an
offline machine (benchmarks/gpu_wheels.sh). torch and torchaudio below the floors of
requirements.txt stop the check too; another package below its floor is a warning. Exit status 0
when the check can run, 2 when it cannot. Only the standard library is imported at the top, so
--list-wheels runs on any python3.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIN_PYTHON = (3, 10)  # pyproject.toml's requires-python
FLOOR_FILES = ("requirements.txt", "requirements-dev.txt")
STOPPING_FLOORS = ("torch", "torchaudio")  # below these the check would test another torch
WHEELS_HINT = (
    "fetch them on a machine with a package index: benchmarks/gpu_wheels.sh DIR; copy DIR "
    "here and run benchmarks/gpu_check.sh --wheels DIR"
)


@dataclass(frozen=True)
class Requirement:
    module: str  # what is imported
    wheel: str  # the distribution that provides it
    pin: str = ""  # the version gpu_wheels.sh fetches; "" = the GPU machine's own (not fetched)


# A GPU machine's own Python brings torch with CUDA and the usual scientific stack (each unpinned
# wheel is in BOX_PACKAGES); the pinned rest (and what they import: cffi and pycparser for
# soundfile, et-xmlfile for openpyxl) comes from gpu_wheels.sh, at the versions the CPU suite
# passes with. tests/project/test_box_imports.py fails when audioclf/ or tests/ imports a package
# at module level that is in neither.
REQUIRED = (
    Requirement("torch", "torch"),
    Requirement("torchaudio", "torchaudio"),
    Requirement("numpy", "numpy"),
    Requirement("pandas", "pandas"),
    Requirement("pyarrow", "pyarrow"),
    Requirement("yaml", "pyyaml"),
    Requirement("tqdm", "tqdm"),
    Requirement("tensorboard", "tensorboard"),
    Requirement("sklearn", "scikit-learn"),
    Requirement("scipy", "scipy"),
    Requirement("matplotlib", "matplotlib"),
    Requirement("onnx", "onnx"),
    Requirement("onnxscript", "onnxscript"),
    Requirement("onnxruntime", "onnxruntime"),
    Requirement("pytest", "pytest"),
    Requirement("hypothesis", "hypothesis"),
    Requirement("soundfile", "soundfile", "0.14.0"),
    Requirement("_cffi_backend", "cffi", "2.1.1"),
    Requirement("pycparser", "pycparser", "3.12"),
    Requirement("openpyxl", "openpyxl", "3.1.5"),
    Requirement("et_xmlfile", "et-xmlfile", "2.0.0"),
    Requirement("python_calamine", "python-calamine", "0.9.1"),
    Requirement("pytorch_metric_learning", "pytorch-metric-learning", "2.9.0"),
    Requirement("faiss", "faiss-cpu", "1.15.1"),
    # audioclf serve and tests/serve; what they import in turn (anyio, h11, click) is the box's.
    Requirement("starlette", "starlette", "1.10.0"),
    Requirement("uvicorn", "uvicorn", "0.55.0"),
    Requirement("python_multipart", "python-multipart", "0.0.34"),
    Requirement("prometheus_client", "prometheus-client", "0.26.0"),  # serve's /metrics
    Requirement("safetensors", "safetensors", "0.8.0"),  # export --format folder, audioclf.load
    Requirement("anyio", "anyio"),
    Requirement("h11", "h11"),
    Requirement("click", "click"),
)

# The GPU machine's image (its device notes, read 2026-11-17): Python 3.12, torch 2.11.0+cu130,
# and of its packages those that audioclf, its tests or a pinned wheel above import (the rest of
# the image is not relied on). Every unpinned Requirement is one of these; the rehearsal
# (benchmarks/gpu_rehearsal.py) builds a venv of them plus the pinned wheels.
BOX_PYTHON = (3, 12)
BOX_PACKAGES = (
    "torch",
    "torchaudio",
    "numpy",
    "pandas",
    "pyarrow",
    "pyyaml",
    "tqdm",
    "tensorboard",
    "scikit-learn",
    "scipy",
    "matplotlib",
    "onnx",
    "onnxruntime",
    "onnxscript",
    "pytest",
    "pytest-xdist",
    "hypothesis",
    "anyio",
    "h11",
    "click",
)


def fetched_wheels() -> list[str]:
    """name==version of every wheel gpu_wheels.sh downloads."""
    return [f"{r.wheel}=={r.pin}" for r in REQUIRED if r.pin]


def missing_modules() -> list[str]:
    """'module (wheel ...)' for each module that does not import, with why when it is not
    simply absent (a missing dependency, a library that will not load)."""
    missing = []
    for req in REQUIRED:
        try:
            importlib.import_module(req.module)
        except Exception as exc:  # an absent module, or one whose own import fails
            source = f"wheel {req.wheel}=={req.pin}" if req.pin else _own_wheel(req.wheel)
            absent = isinstance(exc, ModuleNotFoundError) and exc.name == req.module
            why = "" if absent else f": {type(exc).__name__}: {str(exc).splitlines()[0]}"
            missing.append(f"{req.module} ({source}{why})")
    return missing


def _own_wheel(wheel: str) -> str:
    floor = floors().get(wheel)
    shown = f"{wheel}>={floor}" if floor else wheel
    return f"wheel {shown}, the machine's own build: gpu_wheels.sh does not fetch it"


def floors() -> dict[str, str]:
    """{distribution: lowest version} from the `name>=version` lines of the requirements files."""
    out = {}
    for name in FLOOR_FILES:
        for line in (ROOT / name).read_text().splitlines():
            match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9][^\s,;#]*)", line)
            if match:
                out[match.group(1).lower()] = match.group(2)
    return out


def release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version: '2.11.0+cu128' -> (2, 11, 0), '2.6.0a0' -> (2, 6, 0)."""
    numbers = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(n) for n in numbers.group(0).split(".")) if numbers else ()


def below_floor(installed: str, floor: str) -> bool:
    have, need = release(installed), release(floor)
    width = max(len(have), len(need))
    return have + (0,) * (width - len(have)) < need + (0,) * (width - len(need))


def old_versions() -> list[tuple[str, str, str]]:
    """(distribution, installed, floor) of each required package below its floor."""
    wanted = floors()
    out = []
    for req in REQUIRED:
        floor = wanted.get(req.wheel)
        if floor is None:
            continue
        try:
            installed = importlib.metadata.version(req.wheel)
        except importlib.metadata.PackageNotFoundError:
            continue  # reported as missing, or importable without metadata
        if below_floor(installed, floor):
            out.append((req.wheel, installed, floor))
    return out


def gpu_problem() -> str:
    """Why torch sees no usable GPU here, or ""."""
    import torch

    if torch.version.cuda is None and not torch.version.hip:
        return f"torch {torch.__version__} is a CPU-only build; install its CUDA build"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return (
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: check "
            "nvidia-smi and CUDA_VISIBLE_DEVICES"
        )
    return ""


def describe(cpu: bool) -> str:
    """One line: the Python, torch and the GPUs the check will use."""
    import torch

    python = ".".join(map(str, sys.version_info[:3]))
    where = "CPU only (--cpu)"
    if not cpu:
        gpus = []
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            gpus.append(f"{torch.cuda.get_device_name(i)} (compute capability {major}.{minor})")
        where = f"CUDA {torch.version.cuda}, {len(gpus)} GPU(s): " + "; ".join(gpus)
    return (
        f"preflight: Python {python} ({sys.executable}), torch {torch.__version__}, {where}; "
        f"all {len(REQUIRED)} modules import"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu", action="store_true", help="do not ask for a GPU")
    parser.add_argument(
        "--list-wheels", action="store_true", help="print what gpu_wheels.sh fetches and stop"
    )
    parser.add_argument(
        "--list-box",
        action="store_true",
        help="print the GPU image's packages that are relied on (gpu_rehearsal.sh) and stop",
    )
    args = parser.parse_args(argv)
    if args.list_wheels or args.list_box:
        print("\n".join(fetched_wheels() if args.list_wheels else BOX_PACKAGES))
        return 0
    if sys.version_info < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        print(
            f"gpu_check: {sys.executable} is Python {sys.version.split()[0]}; audioclf needs {need}+"
        )
        return 2
    missing = missing_modules()
    if missing:
        print(f"gpu_check: {sys.executable} lacks {', '.join(missing)}; {WHEELS_HINT}")
        return 2
    stopping = False
    for wheel, installed, floor in old_versions():
        stops = wheel in STOPPING_FLOORS
        stopping |= stops
        print(
            f"gpu_check: {'' if stops else 'warning: '}{wheel} {installed} is below the floor "
            f"{wheel}>={floor} of requirements.txt"
        )
    problem = "" if args.cpu else gpu_problem()
    if problem:
        print(f"gpu_check: {problem}; run this on a GPU machine (or pass --cpu-smoke)")
    if stopping or problem:
        return 2
    print(describe(args.cpu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
