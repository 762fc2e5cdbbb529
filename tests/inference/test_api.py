"""The installed `audioclf` command and the Python API, as docs/api.md shows them: a wheel
built from the checkout, installed into a throwaway target, run from a folder outside the
checkout (so package data left out of the wheel fails here), then every code block of the page
run as it is written."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow
PAGE = ROOT / "docs" / "api.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """The environment of a shell where `pip install .` put audioclf (its dependencies are the
    test venv's); the checkout is not on the path."""
    tmp = tmp_path_factory.mktemp("install")
    source = tmp / "source"  # a copy of the tracked files: the build writes nothing here
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    for name in filter(None, tracked):
        src, dst = ROOT / name, source / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        elif src.is_file():
            shutil.copy2(src, dst)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp / "wheel"), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = (tmp / "wheel").glob("audioclf-*.whl")
    target = tmp / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
         "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr[-2000:]
    env = dict(os.environ, PYTHONPATH=str(target), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PATH"] = (
        f"{target / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    )
    return {"env": env, "target": target, "wheel": wheel}


def test_the_wheel_holds_the_recipes_and_the_report_template(installed):
    files = {p.relative_to(installed["target"]).as_posix() for p in installed["target"].rglob("*")}
    for name in ("cpu_small", "demo_cnn", "demo_conformer", "cnn", "conformer", "ecapa"):
        assert f"audioclf/recipes/{name}.yaml" in files
    assert "audioclf/evaluation/embeddings.html" in files and "bin/audioclf" in files
    assert "audioclf/serve/page.html" in files  # audioclf serve's page


def test_the_page_runs_as_written_with_the_installed_command(installed, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = installed["env"]
    for block in blocks("bash"):
        for line in block.strip().splitlines():
            command = shlex.split(line.split("  #")[0])
            done = subprocess.run(
                command, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600
            )
            assert done.returncode == 0, f"{line}\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}"
            if command[:2] == ["audioclf", "--help"]:
                assert "train" in done.stdout and "search" in done.stdout
    assert (elsewhere / "runs" / "api_demo" / "eval" / "report.json").is_file()
    program = "\n".join(blocks("python"))
    ran = subprocess.run(
        [sys.executable, "-c", program],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    printed = ran.stdout.splitlines()
    assert re.fullmatch(r"\d+ \(\d+, 64\)", printed[0])  # files found, [N, 64] embeddings
    assert -1.0 <= float(printed[1]) <= 1.0  # a cosine
    assert printed[2] == "True"  # a waveform read from a file embeds as the file does
    assert printed[3] == "(2, 64)"
    assert printed[4].startswith("[")  # the best class of each ranked clip
    assert "query" in printed[5] and "score" in printed[5]  # the search table's header
    assert printed[-4] == "True"  # the exported folder embeds as the checkpoint did
    assert printed[-3].startswith("['ami', 'centroid_accuracy', 'eer'] ")  # Model.evaluate
    assert printed[-2] == f"report: {Path('runs/api_demo/eval/report.md')}"
    clips, layers = map(int, printed[-1].split())  # Model.adapt: clips, BatchNorm layers
    assert clips > 0 and layers > 0
