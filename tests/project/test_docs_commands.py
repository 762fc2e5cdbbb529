"""Every command in the ```bash blocks of README.md and docs/*.md runs as written.

The commands run in order, one document after another, in a copy of the checkout (the files
`git ls-files` lists, so nothing is written into the real tree), on a small generated demo set.
A command that an earlier document already ran as it is runs once. Each command is one of:

- skipped: listed in SKIP (the exact command, comments stripped) with the reason it cannot run
  here (GPUs, a cluster, a background job, a placeholder path);
- run as written, with the arguments of every OVERRIDES pattern it matches appended (a training
  command gets one short epoch of a tiny model; the demo generator a small set).

A command in neither table runs as written, so a new doc command is either runnable here or is
classified; a training command that no OVERRIDES pattern shrinks is refused.
`./run.sh demo` is skipped (tests/distributed/test_run_sh.py runs it); SETUP stands in for its first two
stages (data/demo and runs/demo_cnn, which the later commands read), and its stages 3-5 are the
README's own evaluate / export / embed commands.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from audioclf.embed import parse_args as embed_args
from audioclf.evaluate import parse_args as evaluate_args
from audioclf.export import parse_args as export_args
from audioclf.prepare import parse_args as prepare_args
from audioclf.search.cli import parse_args as search_args
from audioclf.train import parse_args as train_args
from tests.helpers import ROOT, TINY, doc_commands

DOCUMENTS = ("README.md", *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md")))

SMALL_DEMO = ["--classes", "8", "--items", "3", "--ids", "4"]
ONE_EPOCH = [
    "train.epochs=1",
    "train.limit_batches=2",
    "sampler.batch_size=4",  # 2 classes x 2 items: the small set leaves each of 2 ranks 3 classes
    "sampler.m=2",
    "clips.crop_seconds=0.5",
    "eval.batch_size=16",
]
# (pattern searched in the command, arguments appended to it); every matching row applies.
OVERRIDES = [
    (r"-m audioclf\.data\.demo\b", SMALL_DEMO),
    (r"configs/(demo_cnn|cpu_small)\.yaml", [*ONE_EPOCH, "model.embedding_dim=16", *TINY["cnn"]]),
    (r"configs/demo_conformer\.yaml", [*ONE_EPOCH, "model.embedding_dim=16", *TINY["conformer"]]),
    # batches of 4 hold no views beside 2 classes of 2: 4 labelled rows and 2 views of 1 clip
    (r"data\.unlabelled=", ["sampler.batch_size=6", "unlabelled.share=0.34"]),
]
TRAINS = re.compile(r"(run\.sh|-m audioclf\.train)\b.*\.yaml")  # must match an OVERRIDES row

FOUR_GPUS = "needs 4 GPUs, and configs/cnn.yaml / conformer.yaml read data/train/index.xlsx"
BACKGROUND = (
    "a background job on 4 GPUs (tests/distributed/test_run_sh.py runs --bg and stop on the CPU)"
)
SLURM = "needs a SLURM cluster (tests/distributed/test_slurm.py checks the batch script)"
PLACEHOLDER = "placeholder paths (N, big.xlsx, out/big, clips/) to replace with your own"
INSTALLED = "the installed audioclf command (pip install .): tests/inference/test_api.py runs it from a wheel"
SERVED = (
    "a server that runs until stopped, and requests to it: tests/serve/test_serve.py"
    "::test_the_serving_docs_run_as_written starts it and runs them"
)
SKIP = {
    "./run.sh demo": "all five stages on the full demo set; tests/distributed/test_run_sh.py runs them "
    "(SETUP stands in for stages 1-2, the README's commands below are stages 3-5)",
    "./run.sh test": "the whole test suite, this test included (what CI runs)",
    "torchrun --nproc_per_node=4 -m audioclf.train --config configs/cnn.yaml": FOUR_GPUS,
    "torchrun --nproc_per_node=4 -m audioclf.train --config configs/conformer.yaml": FOUR_GPUS,
    "torchrun --nproc_per_node=4 -m audioclf.train --config configs/cnn.yaml train.epochs=30 "
    "sampler.m=4": FOUR_GPUS,
    "./run.sh --bg --nproc 4 configs/cnn.yaml train.name=cnn1": BACKGROUND,
    "./run.sh --bg --nproc 4 configs/conformer.yaml train.name=conf1": BACKGROUND,
    "./run.sh --bg --nproc 4 configs/conformer.yaml train.name=conf1 checkpoint.resume=auto": (
        BACKGROUND
    ),
    "tail -f runs/cnn1/nohup.log": "follows the background job's log until interrupted",
    "tail -f runs/conf1/nohup.log": "follows the background job's log until interrupted",
    "./run.sh stop cnn1": "stops the background job above (not started here)",
    "./run.sh stop conf1": "stops the background job above (not started here)",
    "torchrun --nproc_per_node=N -m audioclf.embed --model runs/demo_cnn/best.pt --index big.xlsx "
    "--save out/big": PLACEHOLDER,
    "python -m audioclf.search build out/big --method ivf --model runs/demo_cnn/best.pt": (
        PLACEHOLDER
    ),
    "python -m audioclf.search query out/big clips/ --model runs/demo_cnn/best.pt --k 10": (
        PLACEHOLDER
    ),
    "python -m audioclf.evaluate --checkpoint runs/demo_cnn/best.pt --index big.xlsx --search "
    "auto": PLACEHOLDER,
    "sbatch scripts/slurm/train.sbatch configs/conformer.yaml train.name=conf1 train.epochs=60": (
        SLURM
    ),
    "sbatch --nodes=4 --gpus-per-node=8 --cpus-per-task=64 --time=48:00:00 "
    "scripts/slurm/train.sbatch configs/conformer.yaml train.name=conf4": SLURM,
    "srun --kill-on-bad-exit=1 python -m audioclf.train --config configs/conformer.yaml "
    "checkpoint.resume=auto": SLURM,
    "audioclf --help": INSTALLED,
    "audioclf demo --out data/demo": INSTALLED,
    "audioclf train --config demo_cnn train.epochs=1 train.name=api_demo": INSTALLED,
    "audioclf evaluate --checkpoint runs/api_demo/best.pt --out runs/api_demo/eval": INSTALLED,
    "audioclf export --checkpoint runs/api_demo/best.pt --format folder --out "
    "runs/api_demo/export/folder": INSTALLED,
    "audioclf embed --model runs/api_demo/best.pt --index data/demo/index.xlsx "
    "--save runs/api_demo/embed/all": INSTALLED,
    "python -m audioclf.serve runs/demo_cnn/best.pt --gallery data/demo/index.xlsx --collection "
    "runs/demo_cnn/embed/all --cohort runs/demo_cnn/embed/all": SERVED,
    "curl -s http://127.0.0.1:8000/health": SERVED,
    "curl -s -F a=@data/demo/wav/c03/c03_i0/c03_i0_00.wav -F "
    "b=@data/demo/wav/c05/c05_i1/c05_i1_02.wav http://127.0.0.1:8000/embed": SERVED,
    "curl -s -F clip=@data/demo/wav/c03/c03_i0/c03_i0_00.wav 'http://127.0.0.1:8000/rank?top=3'": (
        SERVED
    ),
    "curl -s --data-binary @data/demo/wav/c03/c03_i0/c03_i0_00.wav "
    "'http://127.0.0.1:8000/search?k=5'": SERVED,
    "curl -s http://127.0.0.1:8000/metrics": SERVED,
    "benchmarks/gpu_wheels.sh /path/wheels": "downloads wheels from a package index",
    "benchmarks/gpu_rehearsal.sh": "builds a venv from a package index (4-12 minutes); "
    "tests/project/test_benchmarks_smoke.py runs its --smoke",
    "PYTHON=python3 benchmarks/gpu_check.sh --wheels /path/wheels": "needs a CUDA GPU and the "
    "wheels of gpu_wheels.sh",
}
# What `./run.sh demo` stages 1-2 leave for the commands after it, on the small set.
SETUP = [
    "python -m audioclf.data.demo --out data/demo",
    "./run.sh --nproc 2 configs/demo_cnn.yaml",
]


def with_overrides(command: str) -> str:
    extra = [arg for pattern, args in OVERRIDES if re.search(pattern, command) for arg in args]
    if TRAINS.search(command) and not extra:
        raise AssertionError(f"{command!r} trains: add an OVERRIDES row that shrinks it")
    return shlex.join([*shlex.split(command), *extra])


def test_every_doc_command_is_classified_or_shrunk():
    commands = [c for doc in DOCUMENTS for c in doc_commands(doc)]
    assert (
        "python -m audioclf.evaluate --checkpoint runs/demo_cnn/best.pt --out runs/demo_cnn/eval"
        in commands
    )
    stale = sorted(set(SKIP) - set(commands))
    assert not stale, f"SKIP lists commands no document holds any more: {stale}"
    for command in [*SETUP, *commands]:
        if command not in SKIP:
            with_overrides(command)  # raises for a training command left full size


@pytest.mark.parametrize(
    ("parse", "argv", "expected"),
    [
        (
            search_args,
            ["query", "P", "--model", "m.pt", "a.wav", "--k", "3", "d/"],
            {"prefix": "P", "inputs": ["a.wav", "d/"], "k": 3},
        ),
        (
            search_args,
            ["build", "--method", "exact", "P", "--seed", "1"],
            {"command": "build", "prefix": "P", "seed": 1},
        ),
        (
            embed_args,
            ["a.wav", "--model", "m.pt", "--top", "3", "d/"],
            {"files": ["a.wav", "d/"], "top": 3},
        ),
        (
            evaluate_args,
            ["--out", "e", "--checkpoint", "c.pt", "--split", "test"],
            {"split": "test"},
        ),
        (
            export_args,
            ["--out", "o.pt", "--format", "onnx", "--checkpoint", "c.pt"],
            {"format": "onnx"},
        ),
        (
            prepare_args,
            ["a.b=1", "--index", "i.xlsx", "c.d=2", "--out", "o", "e.f=3"],
            {"overrides": ["a.b=1", "c.d=2", "e.f=3"]},
        ),
        (
            train_args,
            ["train.epochs=1", "--config", "c.yaml", "train.name=x"],
            {"overrides": ["train.epochs=1", "train.name=x"], "config": "c.yaml"},
        ),
    ],
    ids=["search-query", "search-build", "embed", "evaluate", "export", "prepare", "train"],
)
def test_tools_take_options_and_files_in_any_order(parse, argv, expected):
    args = vars(parse(argv))
    assert {key: args[key] for key in expected} == expected


def test_search_still_refuses_what_it_refused(capsys):
    for argv, message in (
        (["--quiet", "query", "P"], "unrecognized arguments: --quiet"),
        (["query", "P", "--bogus", "a.wav"], "unrecognized arguments: --bogus"),
        (["find", "P"], "invalid choice: 'find'"),
    ):
        with pytest.raises(SystemExit) as exit_:
            search_args(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> tuple[Path, set[str]]:
    """A copy of the checkout's files, with the small demo set and runs/demo_cnn made, and the
    commands run in it so far."""
    if not (ROOT / ".venv" / ".requirements.sha256").is_file():
        pytest.skip("./run.sh would install a .venv first: run ./run.sh setup")
    try:
        git = ["git", "ls-files", "-z"]
        listed = subprocess.run(git, cwd=ROOT, capture_output=True, check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: git ls-files lists no files to copy")
    repo = tmp_path_factory.mktemp("docs") / "repo"
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    (repo / ".venv").symlink_to(ROOT / ".venv")
    for command in SETUP:
        rc, out = run_command(repo, command)
        assert rc == 0, f"setup `{with_overrides(command)}` exited {rc}:\n{out}"
    return repo, set()


def run_command(repo: Path, command: str) -> tuple[int, str]:
    # `python` and `torchrun` are the environment's (README: source .venv/bin/activate).
    path = os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", "")))
    env = dict(os.environ, PATH=path, PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(
        ["bash", "-c", with_overrides(command)],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return done.returncode, (done.stdout + done.stderr)[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("document", DOCUMENTS)
def test_doc_commands_run(checkout, document):
    repo, done = checkout  # a command run already gives the same result again: run it once
    failures = []
    for command in doc_commands(document):
        if command in SKIP or command in done:
            continue
        start = time.perf_counter()
        rc, out = run_command(repo, command)
        print(f"{time.perf_counter() - start:5.1f} s  rc {rc}  {command}")
        if rc != 0:
            failures.append(f"`{with_overrides(command)}` exited {rc}:\n{out}")
        else:
            done.add(command)
    assert not failures, f"{document}:\n" + "\n\n".join(failures)
