"""Load time and peak memory of `audioclf.load` for a model folder (safetensors), the checkpoint
it was exported from (torch's weights-only pickle loader) and a TorchScript export, each in a
fresh process: a CNN (width 32, depth 4: the default) and an ECAPA-TDNN with C = 512 (configs/ecapa.yaml's size).

    python benchmarks/model_load.py            # both models, 5 fresh processes per cell
    python benchmarks/model_load.py --smoke    # a tiny CNN, 1 process per cell (the tests)

Per cell: the median seconds of `audioclf.load(path)` alone (imports done before the clock
starts), the median peak resident memory that call added (MB: Linux's VmHWM, reset through
/proc/self/clear_refs just before it, minus VmRSS then), and the size on disk. The ratios compare each format with the checkpoint of the same
model measured in the same run; the embeddings of the three are compared too (equal: PASS).
Untrained weights: the load cost depends on the shapes, not the values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from audioclf.config import config_from_dict, to_dict  # noqa: E402
from audioclf.inference.exporting import export_model  # noqa: E402
from audioclf.models import build_net  # noqa: E402

MODELS = {  # name -> the config sections that build it
    "cnn w32 d4": {
        "features": {"sample_rate": 16000},
        "model": {"name": "cnn", "embedding_dim": 64},
    },
    "ecapa C=512": {
        "features": {"sample_rate": 16000, "n_mels": 80},
        "model": {"name": "ecapa", "embedding_dim": 192, "ecapa": {"channels": 512}},
    },
}
SMOKE_MODEL = {
    "tiny cnn": {
        "features": {"sample_rate": 8000, "n_mels": 32},
        "model": {"name": "cnn", "embedding_dim": 16, "cnn": {"width": 4, "depth": 2}},
    }
}
# What each fresh process runs: imports, then the timed load, then one embedding to compare.
PROBE = """
import json, sys, time
import numpy as np
import audioclf, audioclf.api

def status(field):  # kB in /proc/self/status
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

with open("/proc/self/clear_refs", "w") as refs:
    refs.write("5")  # the peak resident size (VmHWM) starts again from the current one
before = status("VmRSS")
start = time.perf_counter()
model = audioclf.load(sys.argv[1], device="cpu")
seconds = time.perf_counter() - start
peak = status("VmHWM")
wave = 0.1 * np.random.default_rng(0).standard_normal(16000).astype("f4")
emb = model.embed_waveforms([wave], sample_rate=16000)[0]
print(json.dumps({"seconds": seconds, "peak_mb": (peak - before) / 1024, "emb": emb.tolist()}))
"""


def write_models(sections: dict, folder: Path) -> dict[str, Path]:
    """The checkpoint of an untrained model and its folder and TorchScript exports."""
    cfg = config_from_dict(sections)
    net = build_net(cfg, 0)
    checkpoint = folder / "model.pt"
    torch.save(
        {"model": net.state_dict(), "config": to_dict(cfg), "epoch": 1, "step": 1}, checkpoint
    )
    export_model(checkpoint, "folder", folder / "folder")
    export_model(checkpoint, "torchscript", folder / "script.pt")
    return {
        "checkpoint": checkpoint,
        "folder": folder / "folder",
        "torchscript": folder / "script.pt",
    }


def probe(path: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""},
    )
    if done.returncode != 0:
        raise SystemExit(f"model_load: loading {path} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def size_mb(path: Path) -> float:
    files = path.rglob("*") if path.is_dir() else [path]
    return sum(p.stat().st_size for p in files if p.is_file()) / 2**20


def measure(name: str, paths: dict[str, Path], repeats: int) -> bool:
    runs = {fmt: [probe(path) for _ in range(repeats)] for fmt, path in paths.items()}
    base = statistics.median(r["seconds"] for r in runs["checkpoint"])
    base_mb = statistics.median(r["peak_mb"] for r in runs["checkpoint"])
    reference = torch.tensor(runs["checkpoint"][0]["emb"])
    equal = True
    for fmt, results in runs.items():
        seconds = statistics.median(r["seconds"] for r in results)
        peak = statistics.median(r["peak_mb"] for r in results)
        difference = float((torch.tensor(results[0]["emb"]) - reference).abs().max())
        equal &= difference <= 1e-4
        print(
            f"{name:12} {fmt:12} {seconds * 1000:9.1f} ms {seconds / base:6.2f}x  "
            f"{peak:7.1f} MB {peak / base_mb if base_mb else float('nan'):6.2f}x  "
            f"{size_mb(paths[fmt]):7.1f} MB  max |diff| {difference:.2g}"
        )
    return equal


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny CNN, 1 process per cell")
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per cell")
    args = parser.parse_args(argv)
    models, repeats = (SMOKE_MODEL, 1) if args.smoke else (MODELS, args.repeats)
    print("model        format            load   ratio     peak   ratio     size  embeddings")
    equal = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, sections in models.items():
            folder = Path(tmp) / name.replace(" ", "_").replace("=", "")
            folder.mkdir()
            equal &= measure(name, write_models(sections, folder), repeats)
    print("PASS: every format embeds as its checkpoint" if equal else "FAIL: embeddings differ")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
