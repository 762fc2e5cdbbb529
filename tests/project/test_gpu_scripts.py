"""The GPU check's scripts on the CPU, offline: benchmarks/gpu_throughput.py's table of every
cell, gpu_preflight.py's one-line message, gpu_wheels.sh against a local folder of wheels, and
gpu_check.sh --cpu-smoke --wheels DIR (the throughput table and a 2-rank gloo DDP run with its
resume, with a wheel installed offline on PYTHONPATH). No GPU here: what needs one runs in
benchmarks/gpu_check.sh on a CUDA machine."""

from __future__ import annotations

import base64
import hashlib
import math
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT, child_env, run_group, script_module

pytestmark = pytest.mark.slow  # every test here starts processes

THROUGHPUT = ROOT / "benchmarks/gpu_throughput.py"
PREFLIGHT = ROOT / "benchmarks/gpu_preflight.py"
TINY = [
    "sampler.batch_size=8",
    "sampler.m=2",
    "data.num_workers=0",
    "clips.crop_seconds=0.5",
    "model.embedding_dim=16",
    "model.cnn.width=8",
    "model.cnn.depth=2",
    "model.conformer.d_model=32",
    "model.conformer.num_heads=2",
    "model.conformer.ffn_dim=64",
    "model.conformer.num_layers=1",
    "model.conformer.kernel_size=7",
]


def make_wheel(folder: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A pure py3-none-any wheel of `files` (path in site-packages: text), built by hand: no
    build backend, no network."""
    dist = f"{name.replace('-', '_')}-{version}"
    info = f"{dist}.dist-info"
    entries = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    for path, text in entries.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{info}/RECORD,,")
    wheel = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in entries.items():
            archive.writestr(path, text)
        archive.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return wheel


def table_rows(output: str) -> dict[tuple[str, str], list[str]]:
    """{(model, precision): the other columns} of the table gpu_throughput.py prints."""
    rows = {}
    for line in output.splitlines():
        cells = line.split()
        if len(cells) == 7 and cells[0] in ("cnn", "conformer"):
            rows[cells[0], cells[1]] = cells[2:]
    return rows


# ------------------------------------------------------------------------------- throughput


def test_throughput_measures_every_model_and_precision_on_the_cpu():
    cmd = [sys.executable, str(THROUGHPUT), "--device", "cpu", "--steps", "1", "--files", "128"]
    returncode, output = run_group([*cmd, "--set", *TINY], child_env(), timeout=300)
    assert returncode == 0, output[-3000:]
    rows = table_rows(output)
    cells = ("fp32", "tf32", "bf16", "fp16", "fp32+pack")
    assert set(rows) == {(m, p) for m in ("cnn", "conformer") for p in cells}
    for (model, precision), (synthetic, x_fp32, _peak, loader, busy) in rows.items():
        assert float(synthetic) > 0, (model, precision, output[-2000:])
        if precision in ("fp32", "fp32+pack"):  # auto's precision on a CPU: the loaders ran
            assert float(loader) > 0 and 0 < float(busy) <= 1
            assert precision != "fp32" or float(x_fp32) == 1
        else:
            assert loader == busy == "-"
    assert "gpu_throughput: 10 of 10 cells measured on cpu, 0 FAIL line(s)" in output
    assert re.search(r"^SKIP conformer bf16 speed-up: [0-9.]+x IEEE fp32 samples/s", output, re.M)
    for model in ("cnn", "conformer"):
        for cell in ("fp32", "fp32\\+pack"):
            busy = rf"^SKIP {model} loader: keeps the GPU \d+ % busy at {cell} "
            assert re.search(busy, output, re.M), output[-2000:]


def test_throughput_targets_pass_and_fail_on_a_gpu_and_skip_without_cells():
    throughput = script_module(THROUGHPUT)
    import torch

    def row(model, precision, sps, busy=math.nan):
        return {"model": model, "precision": precision, "synthetic_sps": sps, "busy": busy}

    cuda = torch.device("cuda")
    fast = [row("conformer", "fp32", 100.0), row("conformer", "bf16", 190.0, busy=0.95)]
    assert throughput.verdicts(fast, cuda) == [
        "PASS conformer bf16 speed-up: 1.90x IEEE fp32 samples/s (target >= 1.8x)",
        "PASS conformer loader: keeps the GPU 95 % busy at bf16 (target >= 90 %)",
    ]
    slow = [row("conformer", "fp32", 100.0), row("conformer", "bf16", 150.0, busy=0.5)]
    assert [line.split(":")[0] for line in throughput.verdicts(slow, cuda)] == [
        "FAIL conformer bf16 speed-up",
        "FAIL conformer loader",
    ]
    skipped = [row("conformer", "fp32", 100.0), row("conformer", "bf16", math.nan)]
    assert throughput.verdicts(skipped, cuda) == [
        "SKIP conformer bf16 speed-up: no measured conformer fp32 and bf16 cells to compare"
    ]
    assert throughput.verdicts(fast, torch.device("cpu"))[0].startswith("SKIP")


def test_the_speed_up_baseline_is_ieee_fp32_and_tf32_a_cell_beside_it(tmp_path):
    # The recipes turn TF32 on (train.tf32=true); a baseline measured so would leave bf16 a
    # small gain on a healthy GPU and fail the target.
    throughput = script_module(THROUGHPUT)
    import torch

    def settings(model, cell):
        cfg = throughput.recipe(model, cell, torch.device("cpu"), tmp_path / "i.csv", [])
        return cfg.train.precision, cfg.train.tf32

    assert throughput.PRECISIONS == ("fp32", "tf32", "bf16", "fp16")
    for model in ("cnn", "conformer"):
        assert settings(model, "fp32") == ("fp32", False)
        assert settings(model, "tf32") == ("fp32", True)
        assert settings(model, "bf16") == ("bf16", True)


# ------------------------------------------------------------------------------- preflight


def test_preflight_names_each_missing_module_with_its_wheel_in_one_line(tmp_path):
    pins = dict(spec.split("==") for spec in script_module(PREFLIGHT).fetched_wheels())
    hidden = tmp_path / "hide"
    hidden.mkdir()  # a Python whose openpyxl and faiss do not import, whatever is installed
    (hidden / "sitecustomize.py").write_text(
        'import sys\nsys.modules["openpyxl"] = None\nsys.modules["faiss"] = None\n'
    )
    env = dict(child_env(), PYTHONPATH=f"{hidden}:{ROOT}")
    out = subprocess.run(
        [sys.executable, str(PREFLIGHT), "--cpu"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gpu_check: {sys.executable} lacks "), lines
    assert f"openpyxl (wheel openpyxl=={pins['openpyxl']})" in lines[0]
    assert f"faiss (wheel faiss-cpu=={pins['faiss-cpu']})" in lines[0]
    assert "soundfile" not in lines[0]  # only what is missing
    assert "benchmarks/gpu_wheels.sh DIR" in lines[0] and "gpu_check.sh --wheels DIR" in lines[0]

    whole = subprocess.run(
        [sys.executable, str(PREFLIGHT), "--cpu"], env=child_env(), capture_output=True, text=True
    )
    assert whole.returncode == 0 and "modules import" in whole.stdout, whole.stdout + whole.stderr


def test_preflight_reads_the_floors_of_the_requirements():
    preflight = script_module(PREFLIGHT)
    requirements = (ROOT / "requirements.txt").read_text()
    torch_floor = re.search(r"^torch>=(\S+)", requirements, re.M).group(1)
    assert preflight.floors()["torch"] == torch_floor
    assert preflight.below_floor("2.5.1+cu121", "2.11")
    assert not preflight.below_floor("2.11.0+cu128", "2.11")
    assert not preflight.below_floor("2.12.0a0+git1234", "2.11")


# ------------------------------------------------------------------------------- the wheels


def test_gpu_wheels_fetches_the_pinned_list_and_refuses_a_folder_with_others(tmp_path):
    index = tmp_path / "index"  # a local folder stands for the package index
    index.mkdir()
    pins = script_module(PREFLIGHT).fetched_wheels()
    for spec in pins:
        name, version = spec.split("==")
        make_wheel(index, name, version, {f"{name.replace('-', '_')}_stub.py": ""})
    env = dict(
        child_env(),
        PIP_CONFIG_FILE="/dev/null",
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(index),
        PYTHON=sys.executable,
    )
    fetch = [str(ROOT / "benchmarks/gpu_wheels.sh"), str(tmp_path / "wheels")]
    out = subprocess.run(fetch, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(list((tmp_path / "wheels").glob("*.whl"))) == len(pins)
    assert f"gpu_wheels: {len(pins)} wheels, 0.0 MiB in {tmp_path / 'wheels'}" in out.stdout
    assert "faiss_cpu-" in out.stdout and "soundfile-" in out.stdout

    make_wheel(tmp_path / "wheels", "stray", "1.0", {"stray.py": ""})
    again = subprocess.run(fetch, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "also holds stray-1.0-py3-none-any.whl" in again.stderr


# ------------------------------------------------------------------------------- the whole check

PROBE = """\
import os
log = os.environ.get("GPU_CHECK_PROBE")
if log:
    with open(log, "a") as f:
        f.write(open("/proc/self/cmdline", "rb").read().replace(b"\\0", b" ").decode() + "\\n")
"""


def test_the_check_runs_every_test_file_with_cuda_tests():
    # test_search.py's exact search on the GPU was never run by the check.
    script = (ROOT / "benchmarks/gpu_check.sh").read_text()
    command = next(line for line in script.splitlines() if "-m cuda tests/" in line)
    holders = sorted(
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"^\s*@?pytest\.mark\.cuda\b", path.read_text(), re.M)  # decorator, pytestmark
    )
    assert "tests/search/test_search.py" in holders and "tests/project/test_cuda.py" in holders
    assert [name for name in holders if name not in command] == []


def test_the_test_processes_run_torch_on_one_thread():
    # conftest set OMP_NUM_THREADS after importing torch, which had read it already: each CPU
    # shard of the check took every core of the GPU box.
    env = {k: v for k, v in child_env().items() if not k.endswith("_NUM_THREADS")}
    code = "import tests.conftest, torch; print(torch.get_num_threads())"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1"], out.stdout


def test_cpu_smoke_of_the_whole_check_with_a_wheel_installed_offline(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()  # a wheel whose sitecustomize logs every Python that starts with it
    make_wheel(wheels, "gpucheck-probe", "0.1", {"sitecustomize.py": PROBE})
    probe = tmp_path / "started.txt"
    env = dict(child_env(), PYTHON=sys.executable, GPU_CHECK_PROBE=str(probe), TMPDIR=str(tmp_path))
    cmd = [str(ROOT / "benchmarks/gpu_check.sh"), "--cpu-smoke", "--wheels", str(wheels)]
    returncode, output = run_group(cmd, env, timeout=400)
    assert returncode == 0, output[-4000:]
    site = re.search(r"^gpu_check: 1 wheels from \S+ in (\S+) \(on PYTHONPATH", output, re.M)
    assert site, output[:2000]
    assert not Path(site.group(1)).exists()  # the temporary target went with the run
    started = probe.read_text()
    for part in ("gpu_preflight.py", "gpu_throughput.py", "-m audioclf.train"):
        assert part in started, started  # every step's Python saw the wheel, torchrun's ranks too
    assert not list(Path(sys.prefix).glob("lib/python*/site-packages/gpucheck_probe*"))

    summary = output[output.index("== summary") :]
    assert re.search(r"^SKIP cuda tests +--cpu-smoke", summary, re.M)
    assert re.search(r"^SKIP cpu tests ", summary, re.M)
    assert re.search(r"^SKIP throughput conformer bf16 speed-up +[0-9.]+x", summary, re.M)
    assert re.search(r"^SKIP throughput cnn loader +keeps the GPU", summary, re.M)
    assert re.search(r"^PASS ddp 2 rank\(s\) gloo +rank 0 of 2, ddp, device cpu", summary, re.M)
    assert re.search(
        r"^PASS train and resume +loss [0-9.]+.*map_at_r=[0-9.]+ in epoch 2 after a resume at epoch 1",
        summary,
        re.M,
    ), summary
    assert "FAIL" not in summary


def test_throughput_prints_each_cell_and_verdict_as_it_finishes_and_compiles_last(tmp_path, capsys):
    # A run stopped at gpu_check.sh's limit (here: the third cell never returns) keeps every
    # finished cell's line and each verdict its cells complete; they were printed at the end.
    throughput = script_module(THROUGHPUT)
    import argparse

    import torch

    cpu = torch.device("cpu")
    args = argparse.Namespace(
        models=["cnn", "conformer"],
        precisions=["fp32", "bf16"],
        compile=["cnn"],
        steps=1,
        files=64,
        set=TINY,
    )
    cells = throughput.plan_cells(args, cpu, tmp_path)
    names = [(c.model, c.name) for c in cells]
    assert names[-1] == ("cnn", "fp32+compile")  # after every conformer cell
    assert names.index(("conformer", "fp32")) < names.index(("cnn", "fp32+compile"))

    def fake_run(cell, device, steps, report):
        if (cell.model, cell.name) == ("conformer", "fp32+pack"):
            raise TimeoutError("stopped by the time limit")  # as `timeout` would stop it
        row = {"model": cell.model, "precision": cell.name, "synthetic_sps": 100.0}
        row.update(peak_gib=math.nan, loader_sps=90.0, busy=0.9 if cell.with_loader else math.nan)
        if not cell.with_loader:
            row["loader_sps"] = math.nan
        report.say(throughput.describe(row))
        return row

    with pytest.raises(TimeoutError):
        throughput.measure_cells(cells, cpu, 1, run=fake_run)
    printed = capsys.readouterr().out.splitlines()
    assert any(line.startswith("cnn       fp32 synthetic") for line in printed)
    assert any(line.startswith("conformer bf16 synthetic") for line in printed)
    assert any(line.startswith("SKIP conformer bf16 speed-up: 1.00x") for line in printed)
    assert any(line.startswith("SKIP cnn loader: keeps the GPU 90 % busy") for line in printed)
    assert not any("compile" in line for line in printed)
