"""Helpers shared by several test files (test modules do not import each other): tiny
configs and checkpoints, real process groups (gloo over spawn, no mocks), launching the tools
as a user would, a stand-in epoch loop over TrainStep, small index sheets, and a served app
with plain HTTP and headless Chromium (Playwright) to talk to it."""

from __future__ import annotations

import contextlib
import datetime
import http.client
import importlib.util
import json
import math
import os
import pickle
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import soundfile
import torch
import torch.multiprocessing as mp
from torch import nn

from audioclf.config import Config, config_from_dict, load_config, to_dict
from audioclf.training.step import NonFiniteGuard, TrainStep

ROOT = Path(__file__).resolve().parents[1]
# the peer toolkits' data dirs, an old release's checkpoint, stub packages
FIXTURES = ROOT / "tests" / "fixtures"

# the tiny models' log-mel front end: 8 kHz, 32 bins
TINY_FEATURES = {
    "sample_rate": 8000,
    "n_fft": 256,
    "win_length": 200,
    "hop_length": 80,
    "n_mels": 32,
}
TINY_MODELS = {
    "cnn": {"name": "cnn", "embedding_dim": 16, "cnn": {"width": 8, "depth": 2}},
    "conformer": {
        "name": "conformer",
        "embedding_dim": 16,
        "conformer": {
            "d_model": 32,
            "num_heads": 2,
            "ffn_dim": 64,
            "num_layers": 2,
            "kernel_size": 7,
        },
    },
}


def script_module(path: Path):
    """A benchmarks/ script imported as a module (its main() not run), once per process."""
    name = f"benchmarks_{path.stem}"
    if name not in sys.modules:  # registered first: its dataclasses look their module up
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def count_host_syncs(run) -> int:
    """Reads of device values by the host (`.item()`, `bool()`, `.tolist()`), per the profiler.

    Reads inside the optimizer step are left out: torch's fused CPU kernels read their scalars
    (lr, found_inf) on the host, where there is no device to stall; the CUDA kernels read them on
    the GPU.
    """
    # acc_events: one cycle here, so nothing to accumulate; torch 2.11 warns without it
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, acc_events=True) as prof:
        run()

    def in_optimizer_step(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("Optimizer.step"):
                return True
            parent = parent.cpu_parent
        return False

    return sum(
        1
        for e in prof.events()
        if e.name == "aten::_local_scalar_dense" and not in_optimizer_step(e)
    )


def make_checkpoint(
    path: Path,
    name: str = "cnn",
    classes: tuple[str, ...] = (),
    seed: int = 0,
    model: dict | None = None,
) -> Path:
    """A checkpoint as the trainer writes it (model, config, classes), of an untrained model
    with non-trivial BatchNorm statistics; `model` adds model.* keys (e.g. early_norm)."""
    from audioclf.models import build_net

    cfg = config_from_dict(
        {
            "features": TINY_FEATURES,
            "model": {
                **TINY_MODELS[name],
                "head": "softmax" if classes else "none",
                **(model or {}),
            },
        }
    )
    torch.manual_seed(seed)
    net = build_net(cfg, len(classes))
    for module in net.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.running_mean.uniform_(-0.2, 0.2)
            module.running_var.uniform_(0.5, 2.0)
    torch.save(
        {
            "model": net.state_dict(),
            "config": to_dict(cfg),
            "classes": list(classes),
            "epoch": 3,
            "step": 30,
        },
        path,
    )
    return path


# ---------------------------------------------------------------------------------------------
# Tiny training configs


TINY = {
    "cnn": ["model.name=cnn", "model.cnn.width=8", "model.cnn.depth=2"],
    "conformer": [
        "model.name=conformer",
        "model.conformer.d_model=32",
        "model.conformer.num_heads=2",
        "model.conformer.ffn_dim=64",
        "model.conformer.num_layers=1",
        "model.conformer.kernel_size=7",
    ],
}


def tiny_config(index: Path, runs_dir: Path, model: str = "cnn", *extra: str) -> Config:
    """A config that trains in seconds on CPU: tiny model, short crops, small batches."""
    return load_config(
        None,
        [
            f"data.index={index}",
            "data.num_workers=0",
            "data.val_ratio=0.25",
            "sampler.batch_size=8",
            "sampler.m=2",
            "features.n_mels=32",
            "clips.crop_seconds=0.5",
            "clips.eval_max_seconds=1.0",
            "model.embedding_dim=16",
            *TINY[model],
            "optim.lr=0.003",
            "optim.warmup_steps=0",
            f"train.runs_dir={runs_dir}",
            "train.device=cpu",  # also on a GPU machine (the cuda tests ask for cuda)
            "train.name=t",
            "train.epochs=2",
            "train.log_every_steps=0",
            "eval.every=1",
            "eval.batch_size=16",
            "checkpoint.keep_last=1",
            *extra,
        ],
    )


def tiny_net_config(model: str, *extra: str) -> Config:
    """A tiny net over 32-bin precomputed features, batch 16 = 4 classes x 4."""
    return load_config(
        None,
        [
            "features.kind=npy",
            "features.n_mels=32",
            "model.embedding_dim=16",
            "sampler.batch_size=16",
            "sampler.m=4",
            *TINY[model],
            *extra,
        ],
    )


def feature_batches(steps: int) -> list:
    """`steps` batches of 16 log-mel crops (120 frames x 32, lengths 60-120), 4 classes x 4."""
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(4).repeat_interleave(4)
    return [
        (
            torch.randn(16, 120, 32, generator=g),
            torch.randint(60, 121, (16,), generator=g),
            labels,
            torch.arange(16),
        )
        for _ in range(steps)
    ]


def mixed_precision_steps(model: str, precision: str, device: torch.device) -> dict:
    """Six training steps of a tiny `model` in `precision` on `device` through TrainStep with the
    fused AdamW; what they did (the CUDA test and its CPU twin assert on it)."""
    from audioclf.losses import build_loss
    from audioclf.models import build_net
    from audioclf.precision import resolve_precision
    from audioclf.training.optim import build_optimizer

    cfg = tiny_net_config(model, f"train.precision={precision}", "loss.miner=all")
    torch.manual_seed(0)
    net = build_net(cfg, 0).to(device)
    before = [p.detach().clone() for p in net.parameters()]
    optimizer = build_optimizer(net.parameters(), cfg.optim, device)
    loss_core = build_loss(cfg)
    layer, outputs = set(), set()
    net.embedder.embedding.register_forward_hook(lambda m, i, o: layer.add(o.dtype))

    def objective(output, labels, positions=None):
        outputs.add(output[0].dtype)
        return loss_core(output[0], labels, output[1])

    guard = NonFiniteGuard(5)
    result, steps = run_epoch(
        net,
        feature_batches(6),
        objective,
        optimizer,
        resolve_precision(cfg.train, device),
        guard=guard,
        sync_every=3,
    )
    return {
        "steps": steps,
        "loss_finite": math.isfinite(result.loss),
        "consecutive_bad": guard.consecutive,
        "learned": any(not torch.equal(a, b) for a, b in zip(before, net.parameters())),
        "weights_finite": all(bool(p.isfinite().all()) for p in net.parameters()),
        "fused": optimizer.param_groups[0]["fused"] is True,
        "embedding_layer_dtypes": layer,
        "output_dtypes": outputs,
    }


def train_resume_export(index: Path, tmp_path: Path, device: str, precision: str) -> dict:
    """One epoch on `device` in `precision`, resumed for a second epoch on the CPU in fp32, then
    exported to TorchScript and ONNX; what happened (the CUDA test and its CPU twin assert)."""
    from audioclf import checkpoint
    from audioclf.export import export_model

    runs = tmp_path / "runs"
    first = fit(
        tiny_config(
            index,
            runs,
            "cnn",
            "train.epochs=1",
            f"train.device={device}",
            f"train.precision={precision}",
        )
    )
    saved = checkpoint.load(Path(first["run_dir"]) / "last.pt")
    resumed = fit(
        tiny_config(
            index, runs, "cnn", "train.epochs=2", "train.precision=fp32", "checkpoint.resume=auto"
        )
    )
    parity = {
        fmt: export_model(Path(resumed["run_dir"]) / "best.pt", fmt, tmp_path / name).parity[
            "max_abs_diff"
        ]
        for fmt, name in (("torchscript", "model.pt"), ("onnx", "model.onnx"))
    }
    return {
        "fused": saved["optimizer"]["param_groups"][0]["fused"] is True,
        "first_steps": first["step"],
        "steps": resumed["step"],
        "parity": parity,
    }


def run_datasets(cfg: Config) -> tuple:
    """(train index, train dataset, validation dataset) of a run, as the Trainer builds them."""
    from audioclf.data.dataset import split_datasets
    from audioclf.data.index import load_index

    train, _, train_set, val_set = split_datasets(cfg, load_index(cfg.data))
    return train, train_set, val_set


def fit(cfg: Config, hooks=None) -> dict:
    """audioclf.training.trainer.fit in this process."""
    from audioclf.training.trainer import fit as train  # noqa: PLC0415 - the trainer's stack only when a test trains

    return train(cfg, hooks=hooks)


# ---------------------------------------------------------------------------------------------
# Real process groups and launched processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, out_dir, backend, group_timeout_s=60.0):
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    try:
        extra = {"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=group_timeout_s),
            **extra,
        )
        result = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # reported to the parent, which asserts
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_in_group(
    fn,
    tmp_path,
    *args,
    world_size: int = 2,
    timeout: float = 120.0,
    backend: str = "gloo",
    group_timeout_s: float = 60.0,
) -> list:
    """fn(rank, world_size, *args) on each rank; returns results by rank; raises on any error.
    group_timeout_s: the process group's timeout (each collective's)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    entry_args = (port, fn, args, str(tmp_path), backend, group_timeout_s)
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, *entry_args)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, f"{len(alive)} rank(s) still running after {timeout} s (hang)"
    results = []
    for r in range(world_size):
        status, value = pickle.loads(Path(tmp_path, f"rank{r}.pkl").read_bytes())
        if status != "ok":
            raise AssertionError(f"rank {r} failed: {value}")
        results.append(value)
    return results


def cli_args(config: Config) -> list[str]:
    """The config as command-line overrides for `python -m audioclf.train`."""
    from audioclf.config import to_dict

    def text(value) -> str:
        if isinstance(value, (list, tuple)):
            return json.dumps(list(value))
        return "null" if value is None else str(value)

    out = []
    for section, values in to_dict(config).items():
        for key, value in values.items():
            if isinstance(value, dict):
                out += [f"{section}.{key}.{k}={text(v)}" for k, v in value.items()]
            else:
                out.append(f"{section}.{key}={text(value)}")
    return [o for o in out if not o.endswith("=")]


def torchrun_command(
    module_args: list[str], *, nproc: int = 2, nnodes: int = 1, endpoint: str = "", extra=()
) -> list[str]:
    """`torchrun` as one node of `nnodes` over the c10d rendezvous at `endpoint` (host:port; a
    free loopback port when empty) runs `module_args` (e.g. ["-m", "audioclf.train", ...]) on
    `nproc` ranks; `extra` are more torchrun options (--max-restarts=1)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={endpoint or f'127.0.0.1:{free_port()}'}",
        "--rdzv_id=audioclf-test",
        *extra,
        *module_args,
    ]


def rank_of(pid: int) -> int | None:
    """The RANK a launcher gave process `pid` (from its environment in /proc); None when gone."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    found = [e.split(b"=", 1)[1] for e in env if e.startswith(b"RANK=")]
    return int(found[0]) if found else None


def run_group(cmd: list[str], env: dict, timeout: float) -> tuple[int, str]:
    """Run a launcher in its own session; on timeout kill the whole group (no orphan workers)."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -9, out + f"\n[timed out after {timeout} s]"
    return proc.returncode, out


def wait_for_text(path: Path, text: str, seconds: float = 120) -> bool:
    """Wait until the file at `path` (a train.log) holds `text`, at most `seconds`; whether it
    does (the caller asserts, with what explains a failure)."""
    deadline = time.time() + seconds
    while time.time() < deadline and text not in (path.read_text() if path.exists() else ""):
        time.sleep(0.5)
    return path.exists() and text in path.read_text()


def as_a_terminal_starts_it() -> None:
    """preexec_fn for a child that stands for a terminal's foreground job: Ctrl-C, Ctrl-\\ and
    the terminal's hang-up at their defaults. A runner that starts pytest from a shell without
    job control (`cmd &`) passes SIGINT down ignored, `nohup` SIGHUP, and bash cannot trap a
    signal it inherited ignored."""
    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def child_env() -> dict:
    """The environment of a launched tool: the checkout importable, one thread, and no GPU
    (the CPU suite stays on the CPU on a GPU machine)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")


# ---------------------------------------------------------------------------------------------
# The Trainer's epoch loop over plain batches


def run_epoch(
    model,
    batches,
    objective,
    optimizer,
    precision,
    *,
    accumulate=1,
    guard=None,
    sync_every=1,
    batch_size=0,
    placeholder=None,
    should_stop=None,
):
    """The Trainer's epoch loop over a list of batches: micro-batches, an update every
    `accumulate`, a sync every `sync_every` updates and at the end. Returns (EpochResult,
    optimizer steps taken)."""
    step = TrainStep(
        model,
        optimizer,
        precision,
        objective,
        guard=guard or NonFiniteGuard(patience=10**9),
        accumulate=accumulate,
        batch_size=batch_size,
        placeholder=placeholder,
    )
    step.start_epoch()
    steps = 0
    for position, batch in enumerate(batches, start=1):
        closes_group = position % accumulate == 0
        step.micro_batch(batch, sync_grads=closes_group)
        if closes_group:
            step.update()
            steps += 1
            if steps % sync_every == 0:
                step.sync(bool(should_stop and should_stop()), steps)
    if steps % sync_every:
        step.sync(False, steps)
    return step.end_epoch(1.0, stopped=False), steps


class Linear(nn.Module):
    """Takes (x, lengths) like the real nets; no BatchNorm so accumulation is exact."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 3)

    def forward(self, x, lengths, labels=None):
        return self.fc(x)


def mse(output, labels, positions=None):
    target = nn.functional.one_hot(labels, 3).float()
    return nn.functional.mse_loss(output.float(), target)


def random_batches(n_batches, size, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        x = torch.randn(size, 4, generator=g)
        labels = torch.randint(0, 3, (size,), generator=g)
        out.append((x, torch.full((size,), 4), labels, torch.arange(size)))
    return out


# ---------------------------------------------------------------------------------------------
# Small index sheets

CLASSES, ITEMS, IDS = ["bird", "cat", "dog"], 2, 2  # sample_rows: classes x items x ids


def sample_rows() -> pd.DataFrame:
    """3 classes x 2 items x 2 ids; ids with leading zeros, paths relative to the sheet."""
    rows = []
    for cls in CLASSES:
        for i in range(ITEMS):
            for _ in range(IDS):
                sample_id = f"{len(rows) + 1:03d}"
                item = f"{cls}_rec{i}"
                rows.append(
                    {
                        "a_cls": cls,
                        "a_item": item,
                        "a_id": sample_id,
                        "path": f"wav/{cls}/{item}/{sample_id}.wav",
                    }
                )
    return pd.DataFrame(rows)


def broken_copy(tiny_demo: Path, root: Path) -> Path:
    """The tiny demo with every training file unreadable (validation files intact)."""
    table = pd.read_excel(tiny_demo, dtype=str, engine="openpyxl")
    (root / "bad").mkdir(parents=True)
    table["path"] = [str(tiny_demo.parent / p) for p in table["path"]]
    for i in range(len(table)):
        broken = root / "bad" / f"{i}.wav"
        broken.write_bytes(b"RIFF not audio")
        table.loc[i, "path"] = str(broken)
    sheet = root / "broken.csv"
    table.to_csv(sheet, index=False)
    return sheet


def write_sheet(frame: pd.DataFrame, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".xlsx":
        frame.to_excel(path, index=False, engine="openpyxl")
    elif path.suffix == ".csv":
        frame.to_csv(path, index=False)
    else:
        frame.to_parquet(path, index=False)
    return path


def make_files(frame: pd.DataFrame, root: Path) -> None:
    for rel in frame["path"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).touch()


_HOLD_LOCK = (
    "import sys, time\nfrom audioclf.outputs import FolderLock\n"
    "lock = FolderLock(sys.argv[1], what='x', by='y', fix='z').acquire()\n"
    "print('held', flush=True)\ntime.sleep(float(sys.argv[2]))\n"
)


class LockHolder:
    """Another process holding the lock file `path` (outputs.FolderLock, as every writer of an
    output and a run's RunLock take it) until killed: the kernel then frees it. A context
    manager; `pid` is the holder's, which the refusals name."""

    def __init__(self, path: Path, *, env: dict | None = None, seconds: float = 120):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOLD_LOCK, str(path), str(seconds)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        if self.proc.stdout.readline().strip() != "held":
            self.release()
            raise RuntimeError(f"the lock holder of {path} did not start")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def release(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def __enter__(self) -> LockHolder:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# ---------------------------------------------------------------------------------------------
# The commands of the documentation


FENCE = re.compile(r"^( *)```bash\n(.*?)^ *```", re.MULTILINE | re.DOTALL)


def doc_commands(document: str) -> list[str]:
    """The commands of a document's ```bash blocks (a path from the checkout's root), in
    order: comments stripped, lines continued with a backslash joined, comment-only lines left
    out."""
    commands = []
    for match in FENCE.finditer((ROOT / document).read_text()):
        for line in match.group(2).replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


def answers_in_threads(call, inputs: list, threads: int = 4, rounds: int = 10) -> list[list]:
    """`call(x)` for every x of `inputs`, `rounds` times over in each of `threads` threads
    started together (each thread from another offset, so different inputs run at once):
    per thread, its answers in `inputs`' order, round after round. Compare them with the
    serial `[call(x) for x in inputs] * rounds` to find what threads share unsafely."""
    start = threading.Barrier(threads)

    def one(offset: int) -> list:
        order = [(offset + i) % len(inputs) for i in range(len(inputs))]
        start.wait()
        answers = []
        for _ in range(rounds):
            found = {i: call(inputs[i]) for i in order}
            answers += [found[i] for i in range(len(inputs))]
        return answers

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, range(threads)))


# ---------------------------------------------------------------------------------------------
# audioclf serve: an app served on the loopback, plain HTTP, and headless Chromium


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """`app` (audioclf.serve.app.build_app) served by uvicorn in a thread, on 127.0.0.1 at a
    free port; yields its base URL, and always stops it (its lifespan closes the batcher)."""
    from audioclf.serve.server import listen, make_server

    sock = listen("127.0.0.1", 0)
    server = make_server(app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
        assert not thread.is_alive(), "the server did not stop within 60 s"


def http_request(
    method: str, url: str, body=None, headers: dict | None = None, timeout: float = 60
) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one request (a fresh connection; `body` may be bytes or an
    iterable of bytes, sent chunked)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        chunked = body is not None and not isinstance(body, bytes | str)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        conn.request(method, path, body=body, headers=headers or {}, encode_chunked=chunked)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def multipart(files: list[tuple[str, str, bytes]]) -> tuple[bytes, dict]:
    """(body, headers) of a multipart/form-data request holding each (field, filename, bytes)
    as a file part."""
    boundary = "audioclf-test-boundary-7d3f"
    body = b""
    for field, filename, data in files:
        body += (
            (
                f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; '
                f'filename="{filename}"\r\nContent-Type: application/octet-stream\r\n\r\n'
            ).encode()
            + data
            + b"\r\n"
        )
    body += f"--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def chromium_binary() -> str | None:
    """Debian's chromium (apt-get install chromium), or another on PATH; None without one."""
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if found := shutil.which(name):
            return found
    return None


def browser_missing() -> str | None:
    """Why the browser tests cannot run here (one reason), or None when they can: Playwright
    for Python (requirements-dev.txt) drives the system's Chromium offline, no browser download."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed: pip install playwright (requirements-dev.txt)"
    if chromium_binary() is None:
        return "no chromium on PATH: apt-get install chromium"
    return None


@contextlib.contextmanager
def chromium() -> Iterator:
    """A headless Playwright Browser over the system's Chromium (executable_path: offline)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium_binary(), args=["--no-sandbox", "--mute-audio"]
        )
        try:
            yield browser
        finally:
            browser.close()


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def offline_page(browser, width: int = 1000, height: int = 1100) -> tuple:
    """(a new Playwright Page, the URLs it asked of any host but this machine's loopback): each
    such request is recorded and refused, so a test asserts the list stays empty."""
    page = browser.new_page(viewport={"width": width, "height": height})
    elsewhere: list[str] = []

    def route(handle) -> None:
        url = urllib.parse.urlsplit(handle.request.url)
        if url.scheme in ("http", "https", "ws", "wss") and url.hostname not in LOOPBACK:
            elsewhere.append(handle.request.url)
            handle.abort()
        else:
            handle.continue_()

    page.route("**/*", route)
    return page, elsewhere


# Watching a launcher and its ranks (Linux /proc)


def child_pids(pid: int) -> list[int]:
    """The live children of process `pid` (every thread's), from /proc; [] once it is gone."""
    found: list[int] = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(c) for c in children.read_text().split()]
        except OSError:
            continue
    return found


def run_lock_is_free(run_dir: Path) -> bool:
    """Whether the next run (checkpoint.resume=auto) may take `run_dir`: poll it with
    wait_until after a kill -9, since a killed process shows as a zombie while its other
    threads still hold its files."""
    from audioclf.outputs import FolderBusy
    from audioclf.training.rundir import RunLock

    try:
        RunLock(run_dir).check_free()
    except FolderBusy:
        return False
    return True


def wait_until(condition, seconds: float = 120) -> bool:
    """Poll `condition()` every 0.1 s until it holds, at most `seconds`; whether it held (the
    caller asserts: a bound on a hang, not a timed assertion)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return bool(condition())


def has_loaded(pid: int, library: str) -> bool:
    """Whether process `pid` has mapped a shared library whose path holds `library` (e.g. it
    is importing torch: "libtorch_cpu")."""
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def is_alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, dead but not reaped, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def write_unknown_length_audio(path: Path, wave: np.ndarray, rate: int) -> Path:
    """`wave` written as a pipe's encoder leaves it: a .flac whose STREAMINFO says 0 samples
    (unknown) and no MD5, or a .wav whose RIFF and data sizes are 0xFFFFFFFF."""
    soundfile.write(path, wave, rate)
    data = bytearray(path.read_bytes())
    if path.suffix == ".flac":
        assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # STREAMINFO, the first block
        fields = int.from_bytes(data[18:26], "big") & ~((1 << 36) - 1)  # total samples: 0
        data[18:26] = fields.to_bytes(8, "big")
        data[26:42] = bytes(16)  # MD5 unknown
    else:
        assert data[:4] == b"RIFF" and data[36:40] == b"data"
        data[4:8] = data[40:44] = b"\xff\xff\xff\xff"
    path.write_bytes(bytes(data))
    return path
