"""Every benchmark script runs in its smallest mode (seconds to a minute each on a CPU) and
prints its table and verdict lines, so an API change that breaks a benchmark fails here instead
of in the next measurement (STYLE habit 13). The figures of so small a run mean nothing and are
not checked; a smoke run exits 0 unless what it checks for correctness (equal outputs, equal
values) fails."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT, child_env

pytestmark = pytest.mark.slow  # every test here starts a benchmark process

BENCHMARKS = ROOT / "benchmarks"
# script (or package) -> (its arguments, lines its output must hold: regexes, one per line)
SMOKE = {
    "adabn.py": (
        ["--smoke"],
        [
            r"^AdaBN of 200 clips \(",
            r"^one clip at a time +[\d.]+ +\d+",
            r"^batches of one length +[\d.]+ +\d+",
            r"^PASS: statistics equal to rounding",
        ],
    ),
    "augment_cost.py": (
        ["--smoke"],
        [r"^configuration +crops/s", r"^all on \(room pieces p=1\) ", r"^(PASS|FAIL): all on "],
    ),
    "gpu_rehearsal.sh": (  # a venv of the GPU image's packages (pip's cache: about 2.5 min)
        ["--smoke"],
        [r"^PASS collection: \d+/\d+ tests collected", r"^gpu_rehearsal: PASS in "],
    ),
    "model_load.py": (
        ["--smoke"],
        [r"^tiny cnn +checkpoint +[\d.]+ ms", r"^tiny cnn +folder ", r"^PASS: every format"],
    ),
    "embed_index.py": (
        ["--smoke"],
        [
            r"^\| 1 \| [\d.]+ \|",
            r"^\| 2 \| [\d.]+ \|",
            r"outputs identical: True$",
            r"^(PASS|FAIL)$",
        ],
    ),
    "eval_metrics.py": (
        ["--smoke"],
        [
            r"^cross-item \(2 items per class\): ",
            r"^map_at_r ",
            r"^(PASS|FAIL): .*values equal within [^:]+: True$",
        ],
    ),
    "faults": (
        ["--smoke"],
        [
            r"^case +\| exit +\| message the user saw",
            r"^5 kill -9 during a checkpoint write, resume +\| -9, then 0 ",
            r"^2 cases: .* 2 as expected",
        ],
    ),
    "feature_read.py": (
        ["--smoke"],
        [r"^warm +read_npy_crop +[\d.]+ crops/s", r"^(PASS|FAIL): (cold-ish|warm) speed-up"],
    ),
    "index_load.py": (
        ["--smoke"],
        [r"^first read .* (PASS|FAIL) ", r"^cached .* (PASS|FAIL) ", r"^file check, 200 files"],
    ),
    "measured_irs.py": (
        ["--smoke"],
        [r"^wrote 4 responses to \S+ \(from \S+\); read back at 16 kHz: 4, \d+-\d+ taps$"],
    ),
    "quality.py": (
        ["--smoke", "--adapt"],
        [
            r"^\| model \| train time \| every clip P@1 \| MAP@R \|$",
            r"^\| MFCC mean\+std",
            r"^\| \S+ \+ AdaBN \| [\d.]+ min \| ",
            r"^quality: wrote ",
        ],
    ),
    "sampler.py": (
        ["--quick"],
        [r"^ratios: pandas/audioclf = ", r"^(PASS|FAIL)  audioclf rank-epoch"],
    ),
    "search.py": (
        ["--smoke"],
        [
            r"^\| backend \| build s \|",
            r"^\| exact \| ",
            r"^targets \(issue 20",
            r"^  3000 .*auto = exact",
        ],
    ),
    "sound_sources.py": (["--smoke"], [r"^train: \S+train\.xlsx \(4 clips\)$"]),
    "train_throughput.py": (
        ["--smoke"],
        [r"^overhead +[-+]", r"^(PASS|FAIL)  overhead <= 5 %", r"^2 / 1 process ratio "],
    ),
    "tts_words.py": (["--smoke"], [r"^train: \S+train\.xlsx \(4 clips\)$"]),
}
# Dataset builders that need programs a machine may lack: exit 2 with a line naming them.
NEEDS_TOOLS = {"sound_sources.py", "tts_words.py"}
# Benchmarks whose smallest mode another test runs.
COVERED_ELSEWHERE = {
    "gpu_check.sh": "tests/project/test_gpu_scripts.py (--cpu-smoke)",
    "gpu_preflight.py": "tests/project/test_gpu_scripts.py (--cpu)",
    "gpu_throughput.py": "tests/project/test_gpu_scripts.py (--device cpu)",
    "gpu_wheels.sh": "tests/project/test_gpu_scripts.py (a local folder of wheels)",
    "data_scale.py": "tests/data/test_pack.py (--smoke, issue 32)",
    "serve.py": "tests/serve/test_serve.py (--quick, issue 37)",
}


def test_every_benchmark_has_a_smoke_run():
    scripts = {
        p.name
        for p in BENCHMARKS.iterdir()
        if p.suffix in (".py", ".sh") or (p / "__main__.py").is_file()
    }
    assert scripts == set(SMOKE) | set(COVERED_ELSEWHERE)


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_smallest_mode_prints_its_table_and_verdict(script):
    args, lines = SMOKE[script]
    path = BENCHMARKS / script
    if path.suffix == ".sh":
        program = ["bash", str(path)]
    else:
        program = [sys.executable, *(["-m", f"benchmarks.{script}"] if path.is_dir() else [path])]
    done = subprocess.run(
        [*map(str, program), *args],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if script in NEEDS_TOOLS and done.returncode == 2:
        pytest.skip(done.stdout.strip() or done.stderr.strip())
    shown = f"{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    assert done.returncode == 0, shown
    missing = [line for line in lines if not re.search(line, done.stdout, re.M)]
    assert not missing, f"{missing} not in the output:\n{shown}"


def test_quality_smoke_with_unlabelled_audio():
    """quality.py --unlabelled (issue 45): the held-out set's halves, training with
    data.unlabelled, and the pseudo-labels scored against the hidden labels."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "quality.py"), "--smoke", "--unlabelled"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    shown = f"{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    assert done.returncode == 0, shown
    for line in (
        r"^quality: --unlabelled: 36 held-out clips train without labels",
        r"data\.unlabelled=\S+unlabelled\.csv: 36 usable unlabelled clips",
        r"^\| quality_demo_cnn \| [\d.]+ min \| ",
        r"^quality: pseudo-labels of quality_demo_cnn's model cut at fixed cosine 0\.3: NMI ",
        r"^quality: pseudo-labels of quality_demo_cnn's model cut at 0\.5 x the class gap "
        r"\(\d\.\d{3}\), \d+ of \d+ clusters: NMI [\d.]+, purity [\d.]+, [\d.]+% of the clips kept",
        r"^quality: wrote ",
    ):
        assert re.search(line, done.stdout, re.M), f"{line} not in the output:\n{shown}"
