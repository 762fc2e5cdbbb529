"""The fault matrix: what a user sees, and what is left on disk, when things go wrong.

    .venv/bin/python benchmarks/faults.py                    # every case (about 9 min, 2 cores)
    .venv/bin/python benchmarks/faults.py --cases 4,nan-wav  # a subset, by number or name
    .venv/bin/python benchmarks/faults.py --keep /tmp/faults # keep the work folder

It generates a tiny demo set (12 classes x 3 items x 4 ids) in a temporary folder and runs each
case as a user would: subprocesses of `python -m audioclf.train` (torchrun with 2 ranks where the
case is about ranks), `./run.sh`, `audioclf.export` and `audioclf.embed`, all on CPU with one
thread each and the tiny configs of tests/helpers.py. Faults that need a hook inside the run
(a disk that fills up in epoch 2, kill -9 in the middle of torch.save, a stop at step 3) run the
same `audioclf.train` entry point through this file's hidden `--worker` mode.

Cases 15-19 are the safe defaults: a checkpoint crafted with a pickle payload (unpickling it
would create a marker file) given to evaluate, embed, export, model.init_from= and
checkpoint.resume= (refused, the marker never appears), and a harmless foreign pickle loaded
with the opt-in; two runs into one folder (two trains a second apart, a resume into a live run,
./run.sh --bg twice); Ctrl-C (SIGINT to the job's process group, as a terminal sends it) once
and twice, under ./run.sh --nproc 2 and plain python; a sheet with an upper-case header and
one with a title row above the header, against the plain sheet; the GPU recipes on a CPU
(precision auto, and an explicit bf16).

Cases 20-23 are the outputs users keep (issue 28): a second writer into an embed --index
PREFIX, a search index, a prepare shard and an evaluate --out (refused, naming the holder,
before any work); kill -9 halfway through a write of embed --index's assembly, search build, prepare and
evaluate --out (through the hidden worker mode's kill-in-write: a file handle that writes half
its first write and SIGKILLs its process), then a later read (never a half or mixed set taken as
whole) and a rerun (equal to a clean run, the killed run's temporary files gone); a full disk
and a read-only folder under embed --index, search build and evaluate; every artefact cut in
half and given to its reader (search index data, PREFIX.npy / .parquet, a part file, TorchScript
/ ONNX exports and a sidecar, prepare.json, a feature file, the run's tracker.json) and a
gallery cache replaced by garbage.

One line per case:

    case | exit code | the message line the user saw | checkpoint intact | data lost

  message line       the first error line on the console (shortened); for a case that should
                     succeed, the line of train.log / stdout that shows it did what it should
  checkpoint intact  yes: the last.pt the case is about (the one before the fault, or the one
                     the run went on to write) loads with audioclf.checkpoint.load and holds
                     only finite tensors; n.a.: the case has none
  data lost          yes: a metrics.csv row of a finished epoch is missing, a half-written file
                     is left (a *.tmp, a 0-byte .pt), or last.pt is older than the last epoch
                     whose checkpoint was written without an error

then a summary, and the reason for every row that is not as expected (each case also checks
its own promises: exit code, one error line, what the message names, what train.log says;
train.log must hold log records only, no traceback text). Every command's console is kept in
<work>/console/NNN.txt (see --keep); a case that acts while a command runs also keeps its
console in <work>/<case>/jobs/.
Exit status: 0 every row as expected, 1 otherwise.

The full-disk and read-only cases mount small tmpfs folders (needs root; otherwise they fall
back to monkeypatched ENOSPC / EROFS errors inside the run or tool, and say so).
"""

from __future__ import annotations

import argparse
import builtins
import errno
import fnmatch
import importlib
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

MESSAGE_WIDTH = 120
TRAIN_ERROR = "python -m audioclf.train: error:"


# ---------------------------------------------------------------------------------------------
# Rows and checks


@dataclass
class Row:
    case: str
    code: str = "-"
    message: str = ""
    intact: str = "n.a."  # yes / no / n.a.
    lost: str = "no"  # yes / no
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def expect(self, condition: bool, problem: str) -> bool:
        if not condition:
            self.problems.append(problem)
        return condition


@dataclass
class Result:
    code: int
    out: str  # stdout
    err: str  # stderr
    seconds: float

    @property
    def console(self) -> str:
        return self.err + "\n" + self.out


@dataclass
class Work:
    root: Path
    use_mounts: bool
    index: Path | None = None
    base: Path | None = None  # a finished 2-epoch run (best.pt, last.pt)
    embedded: Path | None = None  # PREFIX of embed --index of the demo with base/best.pt
    prepared: Path | None = None  # a prepare output folder of the demo
    mounts: list[Path] = field(default_factory=list)

    def short(self, text: str) -> str:
        return text.replace(str(self.root), "$WORK")


def env() -> dict:
    return dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        AUDIOCLF_DEBUG="0",
        PYTHONUNBUFFERED="1",
    )


CONSOLE_LOGS: list[Path] = []  # [folder] once the work folder is known


def run(cmd: list[str], timeout: float = 180, extra_env: dict | None = None) -> Result:
    """Run a command in its own session; on timeout kill its whole process group. The console
    is kept in <work>/console/NNN.txt."""
    result = _run(cmd, timeout, extra_env)
    keep_console(cmd, result)
    return result


def keep_console(cmd: list[str], result: Result) -> None:
    """<work>/console/NNN.txt: the command, its exit status and its console."""
    if CONSOLE_LOGS:
        folder = CONSOLE_LOGS[0]
        folder.mkdir(parents=True, exist_ok=True)
        number = len(list(folder.iterdir())) + 1
        (folder / f"{number:03d}.txt").write_text(
            f"$ {' '.join(cmd)}\nexit {result.code} after {result.seconds:.1f} s\n"
            f"--- stderr\n{result.err}\n--- stdout\n{result.out}\n"
        )


def _run(cmd: list[str], timeout: float, extra_env: dict | None) -> Result:
    start = time.time()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=dict(env(), **(extra_env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[faults.py: timed out after {timeout:.0f} s, process group killed]"
        return Result(-999, out, err, time.time() - start)
    return Result(proc.returncode, out, err, time.time() - start)


@dataclass
class Job:
    """A command running in its own session (as a terminal starts a foreground job), for the
    cases that act while it runs. Its console goes to files, not pipes: a process it leaves
    behind cannot keep `finish` waiting."""

    cmd: list[str]
    proc: subprocess.Popen
    out: Path
    err: Path
    started: float

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        """To the job's process group, as a terminal's Ctrl-C reaches the foreground job."""
        os.killpg(self.proc.pid, sig)

    def console(self) -> str:
        return read(self.err) + "\n" + read(self.out)

    def finish(self, timeout: float = 180) -> Result:
        """Wait for the job (on timeout kill its process group); its console is kept."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = -999
            self.proc.wait()
        result = Result(code, read(self.out), read(self.err), time.time() - self.started)
        if code == -999:
            result.err += f"\n[faults.py: timed out after {timeout:.0f} s, process group killed]"
        keep_console(self.cmd, result)
        return result


def _as_a_terminal_starts_it() -> None:
    """In the child: Ctrl-C and Ctrl-\\ back to their defaults. A shell without job control
    (`cmd &` in a script, nohup) starts this benchmark with SIGINT ignored, and bash cannot trap
    a signal it inherited ignored, so run.sh's Ctrl-C cases would test the launcher instead."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def start(cmd: list[str], folder: Path, extra_env: dict | None = None) -> Job:
    """Start `cmd` in its own session, as a terminal starts a foreground job; stdout and stderr
    go to files in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    number = len(list(folder.glob("*.err"))) + 1
    out, err = folder / f"{number}.out", folder / f"{number}.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=dict(env(), **(extra_env or {})),
            stdout=stdout,
            stderr=stderr,
            text=True,
            start_new_session=True,
            preexec_fn=_as_a_terminal_starts_it,
        )
    return Job(cmd, proc, out, err, time.time())


def wait_for(path: Path, needle: str, timeout: float) -> bool:
    """Whether `needle` appears in the file at `path` within `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline and needle not in read(path):
        time.sleep(0.2)
    return needle in read(path)


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it, from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    tree = [pid]
    for parent in tree:  # grows while it is walked: breadth first
        tree += [child for child, of in parents.items() if of == parent]
    return tree


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not reaped, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def kill_left(processes: dict[int, str]) -> None:
    """SIGKILL the processes of a case's job ({pid: command line}, see process_tree) that are
    still there, each only while its pid still runs the same command."""
    for pid, cmdline in processes.items():
        if alive(pid) and command_line(pid) == cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def console_lines(text: str) -> list[str]:
    """Lines as a terminal shows them: progress-bar carriage returns split lines too."""
    return [line.strip() for line in re.split(r"[\r\n]+", text) if line.strip()]


def error_lines(text: str) -> list[str]:
    return [line for line in console_lines(text) if re.search(r": error:", line)]


def audioclf_tracebacks(text: str) -> int:
    """Tracebacks on the console other than torchrun's own ChildFailedError report (which
    torchrun prints whenever a worker exits non-zero)."""
    blocks = text.split("Traceback (most recent call last):")[1:]
    return sum("torch/distributed/run.py" not in block.split("\n\n")[0] for block in blocks)


def first_error_line(text: str) -> str:
    """The first `<prog>: error:` line, else the first traceback / ERROR line, else ""."""
    lines = console_lines(text)
    for pattern in (r": error:", r"^Traceback|^\w*(Error|Exception)\b|\bERROR\b"):
        for line in lines:
            if re.search(pattern, line):
                return line
    return ""


def shorten(text: str, width: int = MESSAGE_WIDTH) -> str:
    """One line of at most `width` characters; paths in the work folder as …/<file name>."""
    text = " ".join(text.split()).replace("python -m audioclf.", "")
    text = re.sub(r"\$WORK/(?:[^\s'\"():;,]*/)?", "…/", text)
    return text if len(text) <= width else text[: width - 1] + "…"


def checkpoint_intact(path: Path) -> tuple[str, dict | None, str]:
    """('yes' | 'no', the checkpoint, why not) for a last.pt that should be there."""
    import torch

    from audioclf import checkpoint

    try:
        ckpt = checkpoint.load(path)
    except Exception as exc:  # noqa: BLE001 - any failure to load means "not intact"
        return "no", None, f"{path.name} does not load: {exc}"
    bad = []

    def walk(value, name):
        if torch.is_tensor(value):
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                bad.append(name)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{name}.{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{name}[{i}]")

    walk(ckpt, "")
    if bad:
        return "no", ckpt, f"{path.name} holds non-finite tensors ({len(bad)}, first {bad[0]})"
    return "yes", ckpt, ""


def metrics_rows(run_dir: Path) -> list[dict]:
    import csv

    path = run_dir / "metrics.csv"
    if not path.is_file():
        return []
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def leftovers(folder: Path) -> list[str]:
    """Half-written files: temporary files and empty checkpoints."""
    if not folder.exists():
        return []
    found = [
        p
        for p in folder.rglob("*")
        if p.is_file()
        and (p.name.endswith(".tmp") or (p.suffix == ".pt" and p.stat().st_size == 0))
    ]
    return [str(p.relative_to(folder)) for p in found]


def check_run(
    row: Row,
    run_dir: Path,
    *,
    epochs_done: int,
    checkpoint_epoch: int | None,
    ckpt_path: Path | None = None,
) -> dict | None:
    """Fill row.intact / row.lost for a run folder.

    epochs_done: epochs that finished (their metrics.csv row must be there);
    checkpoint_epoch: the epoch last.pt must hold at least (the last one whose checkpoint was
    written without an error), None when the case expects no last.pt.
    """
    ckpt = None
    if checkpoint_epoch is not None:
        path = ckpt_path or run_dir / "last.pt"
        row.intact, ckpt, why = checkpoint_intact(path)
        row.expect(row.intact == "yes", why)
        if ckpt is not None and ckpt.get("epoch", -1) < checkpoint_epoch:
            row.lost = "yes"
            row.problems.append(
                f"last.pt holds epoch {ckpt.get('epoch')}, older than epoch {checkpoint_epoch}"
            )
    rows = metrics_rows(run_dir)
    if len(rows) < epochs_done:
        row.lost = "yes"
        row.problems.append(
            f"metrics.csv has {len(rows)} epoch row(s), {epochs_done} epoch(s) finished"
        )
    stray = [
        line
        for line in read(run_dir / "train.log").splitlines()
        if line.strip() and not re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", line)
    ]
    row.expect(
        not stray,
        f"train.log holds {len(stray)} line(s) outside its log records "
        f"(traceback text), the first: {stray[0] if stray else ''!r}",
    )
    left = leftovers(run_dir)
    if left:
        row.lost = "yes"
        row.problems.append(f"half-written file(s) left: {', '.join(left)}")
    return ckpt


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


def log_line(text: str, needle: str) -> str:
    """The first line of `text` containing `needle`, without its timestamp."""
    for line in console_lines(text):
        if needle in line:
            return re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", "", line)
    return ""


# ---------------------------------------------------------------------------------------------
# Building blocks: configs, runs, mounts


def train_args(work: Work, runs_dir: Path, *extra: str, index: Path | None = None) -> list[str]:
    """The tiny test config (tests.helpers.tiny_config) as CLI overrides, then `extra`
    (appended as given, so an invalid value reaches the CLI's own validation)."""
    from tests.helpers import cli_args, tiny_config

    return [*cli_args(tiny_config(index or work.index, runs_dir, "cnn")), *extra]


def python_train(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "audioclf.train", *args]


def torchrun(module_args: list[str], nproc: int = 2) -> list[str]:
    from tests.helpers import free_port

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}",
        *module_args,
    ]


def worker(mode: str, args: list[str], *options: str) -> list[str]:
    """`python benchmarks/faults.py --worker MODE ... -- <train args>` (a hook inside the run)."""
    return [sys.executable, str(Path(__file__).resolve()), "--worker", mode, *options, "--", *args]


def mount_tmpfs(work: Work, folder: Path, size: str) -> bool:
    if not work.use_mounts:
        return False
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
        capture_output=True,
        text=True,
    )
    if done.returncode == 0:
        work.mounts.append(folder)
        return True
    return False


def remount_read_only(folder: Path) -> bool:
    return (
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], capture_output=True).returncode
        == 0
    )


def unmount(work: Work, folder: Path, keep: bool) -> None:
    if folder not in work.mounts:
        return
    if keep:  # the tmpfs contents disappear with the mount
        shutil.copytree(folder, folder.with_name(folder.name + "_contents"), dirs_exist_ok=True)
    subprocess.run(["umount", str(folder)], capture_output=True)
    work.mounts.remove(folder)


def ensure_demo(work: Work) -> Path:
    if work.index is None:
        from audioclf.data.demo import generate_demo

        with open(os.devnull, "w") as quiet:
            saved, sys.stdout = sys.stdout, quiet
            try:
                work.index = generate_demo(work.root / "demo", classes=12, items=3, ids=4, seed=0)
            finally:
                sys.stdout = saved
    return work.index


def ensure_base(work: Work) -> Path:
    """A finished 2-epoch run of the tiny CNN (shared, read only by the cases)."""
    if work.base is None:
        runs = work.root / "base"
        result = run(python_train(train_args(work, runs, "train.epochs=2", "train.name=base")))
        if result.code != 0:
            raise RuntimeError("the base run failed:\n" + result.err[-3000:])
        work.base = runs / "base"
    return work.base


def copy_run(source: Path, runs_dir: Path, name: str = "t") -> Path:
    target = runs_dir / name
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(".audioclf_cache"))
    return target


def train_rows(work: Work) -> pd.DataFrame:  # noqa: F821
    """The index rows of the training split, as the trainer splits them."""
    from audioclf.config import load_config
    from audioclf.data.index import load_index, split_index

    cfg = load_config(None, [f"data.index={work.index}", "data.val_ratio=0.25"])
    return split_index(load_index(cfg.data), cfg.data)["train"].table


def sheet_with_bad_class(
    work: Work, folder: Path, corrupt: Callable[[Path, Path], None]
) -> tuple[Path, list[Path]]:
    """A copy of the demo sheet (CSV, absolute paths) whose first training class points to
    corrupted copies of its files: every epoch reads one of them."""
    import pandas as pd

    table = pd.read_excel(work.index, dtype=str, engine="openpyxl")
    train = train_rows(work)
    bad_class = sorted(train["cls"].unique())[0]
    folder.mkdir(parents=True, exist_ok=True)
    bad = []
    for i in range(len(table)):
        source = work.index.parent / table.loc[i, "path"]
        table.loc[i, "path"] = str(source)
        if table.loc[i, "a_cls"] == bad_class:
            target = folder / f"{table.loc[i, 'a_id']}.wav"
            corrupt(source, target)
            table.loc[i, "path"] = str(target)
            bad.append(target)
    sheet = folder / "index.csv"
    table.to_csv(sheet, index=False)
    return sheet, bad


def write_nan_wav(source: Path, target: Path) -> None:
    import numpy as np
    import soundfile

    data, rate = soundfile.read(str(source), dtype="float32")
    data[len(data) // 3 : len(data) // 3 + 50] = np.nan
    soundfile.write(str(target), data, rate, subtype="FLOAT")


def write_truncated_wav(source: Path, target: Path) -> None:
    raw = source.read_bytes()
    data_at = raw.index(b"data") + 8  # header intact: the data chunk still promises every byte
    target.write_bytes(raw[: data_at + (len(raw) - data_at) // 2])


# ---------------------------------------------------------------------------------------------
# The cases. Each returns its rows; `case_dir` is its own folder under the work folder.


def case_nan_wav(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    sheet, bad = sheet_with_bad_class(work, case_dir / "bad", write_nan_wav)
    runs = case_dir / "runs"
    common = [f"data.index={sheet}", "train.epochs=2", "eval.every=0", "train.limit_batches=6"]

    row = Row("1a nan-wav")
    result = run(python_train(train_args(work, runs, *common)))
    row.code, row.message = str(result.code), first_error_line(result.err)
    row.expect(result.code == 2, f"exit {result.code}, expected 2")
    row.expect(
        len(error_lines(result.console)) == 1,
        f"{len(error_lines(result.console))} error lines, expected 1",
    )
    row.expect(any(str(p) in row.message for p in bad), "the message names no bad file")
    row.expect("row" in row.message, "the message names no sheet row")
    row.expect("non-finite" in row.message or "NaN" in row.message, "the message does not say NaN")
    check_run(row, runs / "t", epochs_done=0, checkpoint_epoch=None)
    row.expect(not (runs / "t" / "last.pt").exists(), "a last.pt was written")

    skip = Row("1b nan-wav skip_bad_files")
    runs = case_dir / "runs_skip"
    result = run(python_train(train_args(work, runs, *common, "data.skip_bad_files=true")))
    log = read(runs / "t" / "train.log")
    skip.code = str(result.code)
    skip.message = first_error_line(result.err) or log_line(log, "unreadable file(s) skipped")
    skip.expect(result.code == 0, f"exit {result.code}, expected 0: {first_error_line(result.err)}")
    check_run(skip, runs / "t", epochs_done=2, checkpoint_epoch=2)
    rows = metrics_rows(runs / "t")
    skipped = sum(int(r.get("skipped_files") or 0) for r in rows)
    skip.expect(
        bool(rows) and "skipped_files" in rows[0], "metrics.csv has no skipped_files column"
    )
    skip.expect(skipped > 0, "metrics.csv counts no skipped file")
    skip.expect("unreadable file(s) skipped" in log, "train.log does not count the skips")
    return [row, skip]


def case_export_nan(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    import torch

    base = ensure_base(work)
    case_dir.mkdir(parents=True, exist_ok=True)
    ckpt = torch.load(base / "last.pt", map_location="cpu", weights_only=False)
    ckpt["model"] = {
        k: torch.full_like(v, float("nan")) if v.is_floating_point() else v
        for k, v in ckpt["model"].items()
    }
    nan_pt = case_dir / "nan.pt"
    torch.save(ckpt, nan_pt)
    out_dir = case_dir / "export"

    row = Row("2a export a NaN model")
    result = run(
        [
            sys.executable,
            "-m",
            "audioclf.export",
            "--checkpoint",
            str(nan_pt),
            "--format",
            "torchscript",
            "--out",
            str(out_dir / "model.pt"),
        ]
    )
    row.code, row.message = str(result.code), first_error_line(result.err)
    row.expect(result.code == 2, f"exit {result.code}, expected 2")
    lines = console_lines(result.err)
    row.expect(len(lines) == 1, f"stderr has {len(lines)} lines, expected 1: {lines[:3]}")
    written = (
        sorted(str(p.relative_to(out_dir)) for p in out_dir.rglob("*")) if out_dir.exists() else []
    )
    row.expect(not written, f"export wrote {written}")

    embed = Row("2b embed with a NaN model")
    clip = sorted((work.index.parent / "wav").rglob("*.wav"))[0]
    result = run(
        [
            sys.executable,
            "-m",
            "audioclf.embed",
            "--model",
            str(nan_pt),
            "--gallery",
            str(work.index),
            "--quiet",
            "--no-cache",
            str(clip),
        ]
    )
    embed.code, embed.message = str(result.code), first_error_line(result.err)
    embed.expect(result.code == 2, f"exit {result.code}, expected 2")
    embed.expect(len(error_lines(result.console)) == 1, "not one error line")
    embed.expect("NaN" in embed.message, "the message does not say NaN")
    return [row, embed]


def case_resume_architecture(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    base = ensure_base(work)
    runs = case_dir / "runs"
    run_dir = copy_run(base, runs)
    resume = ["train.epochs=3", "eval.every=0", "checkpoint.resume=auto"]
    rows = []
    for name, change, key in (
        ("3a resume, cnn.width changed", "model.cnn.width=16", "model.cnn.width"),
        ("3b resume, model.name=conformer", "model.name=conformer", "model.name"),
    ):
        row = Row(name)
        result = run(python_train(train_args(work, runs, *resume, change)))
        row.code, row.message = str(result.code), first_error_line(result.err)
        row.expect(result.code == 2, f"exit {result.code}, expected 2")
        row.expect(len(error_lines(result.console)) == 1, "not one error line")
        row.expect(key in row.message, f"the message does not name {key}")
        row.expect("resume_strict=false" in row.message, "the message does not name the way out")
        check_run(row, run_dir, epochs_done=2, checkpoint_epoch=2)
        rows.append(row)

    row = Row("3c resume, width changed, resume_strict=false")
    result = run(
        python_train(
            train_args(work, runs, *resume, "model.cnn.width=16", "checkpoint.resume_strict=false")
        )
    )
    log = read(run_dir / "train.log")
    row.code = str(result.code)
    row.message = first_error_line(result.err) or log_line(log, "resume_strict=false")
    row.expect(result.code == 0, f"exit {result.code}, expected 0")
    row.expect(
        "resume_strict=false" in log and "model.cnn.width" in log,
        "train.log does not say it resumed with the checkpoint's settings",
    )
    check_run(row, run_dir, epochs_done=3, checkpoint_epoch=3)
    rows.append(row)
    return rows


def case_disk(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    rows = []

    # Full disk: the run folder lies on a 4 MiB tmpfs; at the first step of epoch 2 a ballast
    # file fills it to 64 KiB free (the checkpoint is ~130 kB), as another job's output would.
    row = Row("4a disk full at the epoch-2 checkpoint")
    disk = case_dir / "disk"
    mounted = mount_tmpfs(work, disk, "4m")
    try:
        runs = disk / "runs"
        args = train_args(work, runs, "train.epochs=3", "eval.every=0")
        if mounted:
            cmd = worker(
                "fill-disk",
                args,
                "--at-epoch",
                "2",
                "--ballast",
                str(disk / "ballast.bin"),
                "--free-kb",
                "64",
            )
        else:
            row.case += " [no tmpfs: ENOSPC patched]"
            cmd = worker("enospc", args, "--at", "2")
        result = run(cmd)
        row.code, row.message = str(result.code), first_error_line(result.err)
        row.expect(result.code == 2, f"exit {result.code}, expected 2")
        row.expect(
            len(error_lines(result.console)) == 1,
            f"{len(error_lines(result.console))} error lines, expected 1",
        )
        row.expect(
            "last.pt" in row.message and "GiB free on" in row.message,
            "the message does not name the path and the free space",
        )
        row.expect(
            "No space left" in row.message or "disk full" in row.message,
            "the message does not say the disk is full",
        )
        check_run(row, runs / "t", epochs_done=2, checkpoint_epoch=1)
    finally:
        unmount(work, disk, keep)
    rows.append(row)

    # A read-only runs dir: a fresh start, and a resume of a finished run.
    for name, resume in (
        ("4b read-only runs dir, fresh start", False),
        ("4c read-only runs dir, resume", True),
    ):
        row = Row(name)
        ro = case_dir / ("ro_resume" if resume else "ro_fresh")
        mounted = mount_tmpfs(work, ro, "8m")
        try:
            if resume:
                copy_run(ensure_base(work), ro)
            extra = ["train.epochs=3", "checkpoint.resume=auto"] if resume else ["train.epochs=1"]
            args = train_args(work, ro, *extra)
            if mounted and remount_read_only(ro):
                cmd = python_train(args)
            else:
                row.case += " [no tmpfs: EROFS patched]"
                cmd = worker("erofs", args, "--under", str(ro))
            result = run(cmd)
            row.code, row.message = str(result.code), first_error_line(result.err)
            row.expect(result.code == 2, f"exit {result.code}, expected 2")
            row.expect(
                len(error_lines(result.console)) == 1,
                f"{len(error_lines(result.console))} error lines, expected 1",
            )
            row.expect(
                str(ro) in row.message and "Read-only" in row.message,
                "the message does not name the path and the read-only file system",
            )
            row.expect(
                ".tmp" not in row.message,
                "the message names a temporary file, not the file that could not be "
                "written (an error while removing the temporary file hid the real one)",
            )
            if resume:
                check_run(row, ro / "t", epochs_done=2, checkpoint_epoch=2)
            else:
                row.expect(not (ro / "t").exists(), "a run folder was created")
        finally:
            unmount(work, ro, keep)
        rows.append(row)
    return rows


def case_kill_mid_write(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    runs = case_dir / "runs"
    run_dir = runs / "t"
    common = ["train.epochs=2", "eval.every=0", "checkpoint.every_steps=1"]
    row = Row("5 kill -9 during a checkpoint write, resume")
    # SIGKILL from inside torch.save, halfway through the 3rd write (steps 1 and 2 are saved).
    killed = run(worker("kill-in-save", train_args(work, runs, *common), "--at", "3"))
    stale = [p.name for p in run_dir.glob(".*.tmp")]
    row.expect(killed.code == -signal.SIGKILL, f"the killed run exited {killed.code}, not -9")
    row.expect(len(stale) == 1, f"expected one stale temporary file after the kill, found {stale}")
    row.intact, ckpt, why = checkpoint_intact(run_dir / "last.pt")
    row.expect(row.intact == "yes", why)
    row.expect(
        ckpt is not None and ckpt["step"] == 2,
        f"last.pt after the kill holds step {ckpt and ckpt.get('step')}, expected 2",
    )

    result = run(python_train(train_args(work, runs, *common, "checkpoint.resume=auto")))
    log = read(run_dir / "train.log")
    row.code = f"-9, then {result.code}"
    row.message = first_error_line(result.err) or log_line(log, "temporary file")
    row.expect(result.code == 0, f"the resume exited {result.code}")
    row.expect("removed 1 temporary file(s)" in log, "train.log does not say the temp was removed")
    row.expect(
        "at epoch 0, batch 2, step 2" in log,
        "the resume did not continue from the last complete checkpoint (step 2)",
    )
    after_kill = row.intact
    check_run(row, run_dir, epochs_done=2, checkpoint_epoch=2)  # and the one the resume wrote
    row.intact = "yes" if after_kill == row.intact == "yes" else "no"
    return [row]


def case_all_unreadable(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    from tests.test_faults import _broken_copy

    ensure_demo(work)
    sheet = _broken_copy(work.index, case_dir)
    runs = case_dir / "runs"
    row = Row("6 every file unreadable, skip_bad_files, 2 ranks")
    result = run(
        torchrun(
            [
                "-m",
                "audioclf.train",
                *train_args(
                    work,
                    runs,
                    f"data.index={sheet}",
                    "data.skip_bad_files=true",
                    "data.check_files=false",
                    "train.epochs=1",
                    "eval.every=0",
                ),
            ]
        ),
        timeout=180,
    )
    log = read(runs / "t" / "train.log")
    row.code = str(result.code)
    row.message = first_error_line(result.err) or log_line(log, "unreadable file(s) skipped")
    row.expect(result.code == 0, f"exit {result.code}, expected 0 (no hang)")
    rows = metrics_rows(runs / "t")
    row.expect(
        bool(rows) and int(rows[0].get("skipped_batches") or 0) > 0,
        "metrics.csv counts no skipped batch",
    )
    check_run(row, runs / "t", epochs_done=1, checkpoint_epoch=1)
    return [row]


def case_fail_rank1(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    runs = case_dir / "runs"
    row = Row("7 failure on rank 1 at step 2, 2 ranks")
    result = run(
        torchrun(
            [
                "-m",
                "tests.train_hooks",
                "--fail-at-step=2",
                "--rank=1",
                "--",
                *train_args(work, runs, "train.epochs=2", "eval.every=0"),
            ]
        )
    )
    log = read(runs / "t" / "train.log")
    errors = [line for line in console_lines(result.console) if "audioclf.train: error:" in line]
    row.code, row.message = str(result.code), first_error_line(result.console)
    row.expect(result.code != 0, "exit 0 after a failure")
    row.expect(
        errors == [f"{TRAIN_ERROR} injected failure on rank 1 at step 2"],
        f"error lines on the console: {errors}",
    )
    row.expect(
        "rank 1" in log and "injected failure on rank 1" in log, "train.log does not name rank 1"
    )
    row.expect("Traceback" not in log, "train.log holds a traceback")
    row.expect(not audioclf_tracebacks(result.console), "the console shows a traceback")
    check_run(row, runs / "t", epochs_done=0, checkpoint_epoch=None)
    return [row]


def expect_one_error_line(row: Row, result) -> None:
    """Record the exit code and the first error line; expect a failure with exactly one."""
    errors = error_lines(result.console)
    row.code, row.message = str(result.code), first_error_line(result.console)
    row.expect(result.code != 0, "exit 0")
    row.expect(len(errors) == 1, f"{len(errors)} error lines, expected 1")


def case_too_few_classes(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    runs = case_dir / "runs"
    row = Row("8 too few classes per rank (batch 16), 2 ranks")
    result = run(
        torchrun(["-m", "audioclf.train", *train_args(work, runs, "sampler.batch_size=16")])
    )
    expect_one_error_line(row, result)
    row.expect("classes per batch" in row.message, "the message does not name classes per batch")
    row.expect(not (runs / "t").exists(), "a run folder was left behind")
    row.expect(not audioclf_tracebacks(result.console), "the console shows a traceback")
    return [row]


def case_mid_epoch_world(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    runs = case_dir / "runs"
    run_dir = runs / "t"
    common = ["train.epochs=2", "eval.every=0"]
    stopped = run(worker("stop-at", train_args(work, runs, *common), "--at", "3"))
    if stopped.code != 0:
        return [
            Row(
                "9 mid-epoch checkpoint on 2 ranks",
                str(stopped.code),
                first_error_line(stopped.err),
                problems=["the 1-rank run did not stop cleanly"],
            )
        ]
    rows = []
    row = Row("9a mid-epoch ckpt (1 rank) resumed on 2 ranks")
    result = run(
        torchrun(
            ["-m", "audioclf.train", *train_args(work, runs, *common, "checkpoint.resume=auto")]
        )
    )
    expect_one_error_line(row, result)
    row.expect("checkpoint.restart_epoch" in row.message, "the message does not name the key")
    row.intact, ckpt, why = checkpoint_intact(run_dir / "last.pt")
    row.expect(
        row.intact == "yes" and ckpt["position"] == 3,
        why or f"last.pt is at batch {ckpt['position']}, not 3",
    )
    row.lost = "yes" if leftovers(run_dir) else "no"
    rows.append(row)

    row = Row("9b the same with checkpoint.restart_epoch=true")
    result = run(
        torchrun(
            [
                "-m",
                "audioclf.train",
                *train_args(
                    work, runs, *common, "checkpoint.resume=auto", "checkpoint.restart_epoch=true"
                ),
            ]
        )
    )
    log = read(run_dir / "train.log")
    row.code = str(result.code)
    row.message = first_error_line(result.console) or log_line(log, "starts again")
    row.expect(result.code == 0, f"exit {result.code}, expected 0")
    row.expect(
        "epoch 1 starts again from its first batch" in log,
        "train.log does not say the epoch restarts",
    )
    ckpt = check_run(row, run_dir, epochs_done=2, checkpoint_epoch=2)
    row.expect(ckpt is not None and ckpt.get("world_size") == 2, "last.pt is not a 2-rank one")
    rows.append(row)
    return rows


def case_stop_zombie(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    runs = case_dir / "runs"
    (runs / "t").mkdir(parents=True)
    zombie = subprocess.Popen(["true"])  # exits at once; not reaped until wait() below
    try:
        for _ in range(100):
            state = Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state == "Z":
                break
            time.sleep(0.02)
        (runs / "t" / "pid").write_text(f"{zombie.pid}\n")
        row = Row("10 ./run.sh stop, zombie pid in the pid file")
        result = run(
            [str(ROOT / "run.sh"), "stop", "t"], timeout=30, extra_env={"RUNS_DIR": str(runs)}
        )
    finally:
        zombie.wait()
    row.code = str(result.code)
    shown = first_error_line(result.console) or " ".join(console_lines(result.out)[:1])
    row.message = f"{shown} ({result.seconds:.1f} s)"
    row.expect(state == "Z", f"the pid was not a zombie (state {state})")
    row.expect(result.code == 0, f"exit {result.code}, expected 0")
    row.expect("not running" in result.out, "does not say 'not running'")
    row.expect(result.seconds < 5, f"took {result.seconds:.1f} s")
    row.expect(not (runs / "t" / "pid").exists(), "the pid file is still there")
    return [row]


def case_run_sh_stop(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    from audioclf.config import save_config
    from tests.helpers import tiny_config

    ensure_demo(work)
    runs = case_dir / "runs"
    run_dir = runs / "t"
    config = case_dir / "tiny.yaml"
    case_dir.mkdir(parents=True, exist_ok=True)
    save_config(tiny_config(work.index, runs, "cnn", "train.epochs=100", "eval.every=0"), config)
    row = Row("11 SIGTERM: ./run.sh --bg --nproc 2, ./run.sh stop")
    started = run([str(ROOT / "run.sh"), "--bg", "--nproc", "2", str(config)], timeout=60)
    if started.code != 0:
        return [
            Row(
                row.case,
                str(started.code),
                first_error_line(started.console),
                problems=["./run.sh --bg failed: " + started.console[-500:]],
            )
        ]
    pid = int(read(run_dir / "pid").strip())
    try:
        deadline = time.time() + 150
        while time.time() < deadline and "epoch 1/100:" not in read(run_dir / "train.log"):
            time.sleep(0.5)
        row.expect("epoch 1/100:" in read(run_dir / "train.log"), "epoch 1 did not finish in 150 s")
        stop = run(
            [str(ROOT / "run.sh"), "stop", "t"], timeout=150, extra_env={"RUNS_DIR": str(runs)}
        )
    finally:
        if Path(f"/proc/{pid}").exists():  # still there: end the job we started
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    log, nohup = read(run_dir / "train.log"), read(run_dir / "nohup.log")
    row.code = f"{stop.code} (stop)"
    row.message = (
        first_error_line(stop.console)
        or first_error_line(nohup)
        or log_line(log, "stopped on request")
    )
    row.expect(stop.code == 0, f"./run.sh stop exited {stop.code}")
    row.expect("stopped t" in stop.out, "./run.sh stop does not say 'stopped t'")
    row.expect("stopped on request" in log, "train.log does not say 'stopped on request'")
    row.expect(not first_error_line(nohup), f"the job's console shows {first_error_line(nohup)!r}")
    done = len(metrics_rows(run_dir))
    ckpt = check_run(row, run_dir, epochs_done=done, checkpoint_epoch=done)
    row.expect(ckpt is not None and ckpt["step"] > 0, "last.pt holds no training step")
    return [row]


def case_lr_inf(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    runs = case_dir / "runs"
    row = Row("12 optim.lr=inf")
    result = run(python_train(train_args(work, runs, "optim.lr=inf")))
    row.code, row.message = str(result.code), first_error_line(result.err)
    lines = console_lines(result.err)
    row.expect(result.code == 2, f"exit {result.code}, expected 2")
    row.expect(len(lines) == 1, f"stderr has {len(lines)} lines, expected 1")
    row.expect("optim.lr" in row.message, "the message does not name optim.lr")
    row.expect(not runs.exists(), "something was written")
    return [row]


def case_truncated_wav(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    sheet, bad = sheet_with_bad_class(work, case_dir / "bad", write_truncated_wav)
    runs = case_dir / "runs"
    row = Row("13 truncated wav (1 DataLoader worker)")
    result = run(
        python_train(
            train_args(
                work,
                runs,
                f"data.index={sheet}",
                "train.epochs=1",
                "eval.every=0",
                "data.num_workers=1",
            )
        )
    )
    row.code, row.message = str(result.code), first_error_line(result.err)
    row.expect(result.code == 2, f"exit {result.code}, expected 2")
    row.expect(
        len(error_lines(result.console)) == 1,
        f"{len(error_lines(result.console))} error lines, expected 1",
    )
    row.expect(any(str(p) in row.message for p in bad), "the message names no bad file")
    row.expect("truncated" in row.message, "the message does not say truncated")
    check_run(row, runs / "t", epochs_done=0, checkpoint_epoch=None)
    return [row]


def case_embed_corrupt(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    base = ensure_base(work)
    clips = case_dir / "clips"
    clips.mkdir(parents=True)
    good = sorted((work.index.parent / "wav").rglob("*.wav"))[:2]
    for i, source in enumerate(good):
        shutil.copy(source, clips / f"good{i}.wav")
    (clips / "bad.wav").write_bytes(b"RIFF\x24\x00\x00\x00WAVEnot audio at all")
    row = Row("14 embed: one corrupt file among 3")
    result = run(
        [
            sys.executable,
            "-m",
            "audioclf.embed",
            "--model",
            str(base / "best.pt"),
            "--gallery",
            str(work.index),
            "--top",
            "3",
            "--quiet",
            str(clips),
        ]
    )
    row.code = str(result.code)
    row.message = first_error_line(result.err) or (console_lines(result.err) or [""])[0]
    row.expect(result.code == 1, f"exit {result.code}, expected 1")
    for name in ("good0.wav", "good1.wav"):
        row.expect(re.search(rf"{name}\n\s+1\. ", result.out) is not None, f"{name} is not ranked")
    row.expect(
        "bad.wav" in result.err and "bad.wav" not in result.out,
        "the bad file is not named on stderr (only)",
    )
    return [row]


# ---------------------------------------------------------------------------------------------
# Safe by default (issue 18): checkpoints that cannot run code, one live run per folder, a clean
# Ctrl-C, forgiving sheets, precision that fits the device


class Payload:
    """Unpickling it creates `marker`: what a crafted checkpoint would do with os.system."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",)


def checkpoint_with(source: Path, target: Path, key: str, value: object) -> Path:
    """A copy of the audioclf checkpoint `source` with one more entry, pickled by torch.save."""
    import torch

    state = torch.load(source, map_location="cpu", weights_only=True)
    state[key] = value
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, target)
    return target


def files_in(folder: Path) -> list[str]:
    if not folder.exists():
        return []
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def expect_refused_checkpoint(row: Row, result: Result, path: Path, refused: str) -> None:
    """Exit 2 with one error line that names the file, the refused object and the opt-in."""
    errors = error_lines(result.console)
    row.code, row.message = str(result.code), first_error_line(result.console)
    row.expect(result.code == 2, f"exit {result.code}, expected 2")
    row.expect(len(errors) == 1, f"{len(errors)} error lines, expected 1")
    row.expect(not audioclf_tracebacks(result.console), "the console shows a traceback")
    row.expect(
        f"checkpoint {path} holds Python objects" in row.message,
        "the message does not name the file as holding Python objects",
    )
    row.expect(f"({refused})" in row.message, f"the message does not name {refused}")
    row.expect(
        "--trust-checkpoint" in row.message and "checkpoint.trust=true" in row.message,
        "the message does not name the opt-in (--trust-checkpoint / checkpoint.trust=true)",
    )


def tool(name: str, *args: object) -> list[str]:
    return [sys.executable, "-m", f"audioclf.{name}", *map(str, args)]


def case_payload_checkpoint(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    base = ensure_base(work)
    clip = sorted((work.index.parent / "wav").rglob("*.wav"))[0]
    entry_points = {
        "evaluate --checkpoint": lambda pt, d: tool(
            "evaluate", "--checkpoint", pt, "--out", d / "eval", "--quiet"
        ),
        "embed --model": lambda pt, d: tool(
            "embed", "--model", pt, "--gallery", work.index, "--save", d / "out/new", clip
        ),
        "export --checkpoint": lambda pt, d: tool(
            "export", "--checkpoint", pt, "--format", "torchscript", "--out", d / "model.pt"
        ),
        "train model.init_from=": lambda pt, d: python_train(
            train_args(work, d / "runs", f"model.init_from={pt}", "train.epochs=1")
        ),
        "train checkpoint.resume=": lambda pt, d: python_train(
            train_args(work, d / "runs", f"checkpoint.resume={pt}", "train.epochs=3")
        ),
    }
    rows = []
    for letter, (name, command) in zip("abcde", entry_points.items()):
        folder = case_dir / letter
        marker = folder / "payload-ran"
        crafted = checkpoint_with(base / "best.pt", folder / "crafted.pt", "notes", Payload(marker))
        row = Row(f"15{letter} payload checkpoint: {name}")
        result = run(command(crafted, folder))
        expect_refused_checkpoint(row, result, crafted, "exec")
        if not name.startswith("train"):
            lines = console_lines(result.err)
            row.expect(len(lines) == 1, f"stderr has {len(lines)} lines, expected 1: {lines[:3]}")
        row.expect(not marker.exists(), "the payload ran: its marker file is there")
        written = [f for f in files_in(folder) if f != crafted.name]
        row.expect(not written, f"written: {written}")
        rows.append(row)
    return rows + trusted_foreign_rows(work, base, case_dir / "f")


def trusted_foreign_rows(work: Work, base: Path, folder: Path) -> list[Row]:
    """A harmless foreign pickle (an argparse.Namespace beside the weights, as many training
    scripts save one): refused by default, loaded with the opt-in."""
    foreign = checkpoint_with(
        base / "best.pt", folder / "foreign.pt", "args", argparse.Namespace(lr=0.003)
    )
    row = Row("15f harmless pickle: export, then --trust-checkpoint")
    refused = run(
        tool(
            "export",
            "--checkpoint",
            foreign,
            "--format",
            "state_dict",
            "--out",
            folder / "refused.pt",
        )
    )
    expect_refused_checkpoint(row, refused, foreign, "argparse.Namespace")
    out = folder / "export" / "weights.pt"
    trusted = run(
        tool("export", "--checkpoint", foreign, "--format", "state_dict", "--out", out)
        + ["--trust-checkpoint"]
    )
    row.code = f"{refused.code}, then {trusted.code}"
    row.message = first_error_line(trusted.console) or (console_lines(trusted.out) or [""])[0]
    row.expect(not (folder / "refused.pt").exists(), "the refused export wrote its file")
    row.expect(trusted.code == 0, f"export --trust-checkpoint exited {trusted.code}")
    row.intact, _, why = checkpoint_intact(out)  # the export is plain data: it loads as such
    row.expect(row.intact == "yes", why)

    init = Row("15g harmless pickle: init_from, checkpoint.trust=true")
    runs = folder / "runs"
    result = run(
        python_train(
            train_args(
                work,
                runs,
                f"model.init_from={foreign}",
                "checkpoint.trust=true",
                "train.epochs=1",
                "eval.every=0",
            )
        )
    )
    log = read(runs / "t" / "train.log")
    init.code = str(result.code)
    init.message = first_error_line(result.err) or log_line(log, "model.init_from: weights of")
    init.expect(result.code == 0, f"exit {result.code}, expected 0")
    init.expect(f"model.init_from: weights of {foreign}" in log, "train.log does not say init_from")
    check_run(init, runs / "t", epochs_done=1, checkpoint_epoch=1)
    return [row, init]


def expect_folder_busy(row: Row, result: Result, run_dir: Path, holder: int) -> None:
    """Exit 2 with one error line naming the holder (pid, host, start) and the fix."""
    errors = error_lines(result.console)
    message = first_error_line(result.console)
    row.expect(result.code == 2, f"the refused run exited {result.code}, expected 2")
    row.expect(len(errors) == 1, f"{len(errors)} error lines, expected 1")
    row.expect(
        f"{run_dir} is in use by another run (pid {holder} on {socket.gethostname()}, started "
        in message,
        f"the message does not name the holder (pid {holder}, host, start time)",
    )
    row.expect(
        "another train.name" in message and f"./run.sh stop {run_dir.name}" in message,
        "the message does not name the fix (another train.name, ./run.sh stop)",
    )


def expect_one_writer(row: Row, run_dir: Path) -> None:
    """Only one run set up the folder: one 'run directory' record, no resume, no epoch twice."""
    log = read(run_dir / "train.log")
    starts = log.count("INFO run directory ")
    row.expect(starts == 1, f"train.log records {starts} run start(s), expected 1")
    row.expect("resumed from" not in log, "train.log records a resume")
    epochs = [r["epoch"] for r in metrics_rows(run_dir)]
    row.expect(len(epochs) == len(set(epochs)), f"metrics.csv holds an epoch twice: {epochs}")


def case_one_run_per_folder(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    jobs = case_dir / "jobs"

    row = Row("16a two trains into one folder, 1 s apart")
    runs = case_dir / "runs_a"
    args = train_args(work, runs, "train.epochs=4")
    first = start(python_train(args), jobs)
    time.sleep(1)
    second = start(python_train(args), jobs)
    first_result, second_result = first.finish(), second.finish()
    row.code = f"{first_result.code}, {second_result.code}"
    row.message = first_error_line(second_result.console) or first_error_line(first_result.err)
    expect_folder_busy(row, second_result, runs / "t", first.pid)
    row.expect(first_result.code == 0, f"the first run exited {first_result.code}, expected 0")
    check_run(row, runs / "t", epochs_done=4, checkpoint_epoch=4)
    expect_one_writer(row, runs / "t")
    return [row, resume_into_live_run(work, case_dir / "runs_b", jobs), bg_twice(work, case_dir)]


def resume_into_live_run(work: Work, runs: Path, jobs: Path) -> Row:
    row = Row("16b resume=auto into a live run")
    run_dir = runs / "t"
    args = train_args(work, runs, "train.epochs=300", "eval.every=0")
    live = start(python_train(args), jobs)
    try:
        row.expect(wait_for(run_dir / "train.log", "epoch 1/300:", 150), "epoch 1 did not end")
        resume = run(python_train([*args, "checkpoint.resume=auto"]))
        live.signal(signal.SIGTERM)  # the live run stops as ./run.sh stop asks: last.pt, exit 0
        result = live.finish(150)
    finally:
        if live.proc.poll() is None:
            os.killpg(live.pid, signal.SIGKILL)
    row.code = f"{resume.code} (live run: {result.code})"
    row.message = first_error_line(resume.console) or first_error_line(result.err)
    expect_folder_busy(row, resume, run_dir, live.pid)
    row.expect(result.code == 0, f"the live run exited {result.code} after SIGTERM, expected 0")
    row.expect("stopped on request" in read(run_dir / "train.log"), "the live run did not stop")
    done = len(metrics_rows(run_dir))
    check_run(row, run_dir, epochs_done=done, checkpoint_epoch=done)
    expect_one_writer(row, run_dir)
    return row


def bg_twice(work: Work, case_dir: Path) -> Row:
    from audioclf.config import save_config
    from tests.helpers import tiny_config

    row = Row("16c ./run.sh --bg twice into one name")
    runs = case_dir / "runs_c"
    run_dir = runs / "t"
    config = case_dir / "tiny.yaml"
    save_config(tiny_config(work.index, runs, "cnn", "train.epochs=3", "eval.every=0"), config)
    launch = [str(ROOT / "run.sh"), "--bg", "--nproc", "1", str(config)]
    first = run(launch, timeout=60)
    second = run(launch, timeout=60)
    pid = int(read(run_dir / "pid").strip() or 0)
    job = {p: command_line(p) for p in process_tree(pid)} if pid else {}
    try:
        deadline = time.time() + 150
        while pid and alive(pid) and time.time() < deadline:
            time.sleep(0.5)
        row.expect(not (pid and alive(pid)), "the first job did not end in 150 s")
    finally:
        kill_left(job)
    nohup = read(run_dir / "nohup.log")
    row.code = f"{first.code}, {second.code}"
    row.message = first_error_line(second.console) or (console_lines(second.err) or [""])[0]
    row.expect(first.code == 0 and pid > 0, f"the first ./run.sh --bg exited {first.code}")
    row.expect(second.code == 2, f"the second ./run.sh --bg exited {second.code}, expected 2")
    lines = console_lines(second.err)
    row.expect(len(lines) == 1, f"the second's stderr has {len(lines)} lines, expected 1")
    row.expect(
        f"pid {pid}" in row.message and "./run.sh stop t" in row.message,
        "the message does not name the running job's pid and ./run.sh stop",
    )
    row.expect("started" not in second.out, "the second ./run.sh --bg says it started a job")
    row.expect(
        "epoch 3/3:" in nohup and not first_error_line(nohup),
        "the first job's nohup.log does not show its whole run",
    )
    check_run(row, run_dir, epochs_done=3, checkpoint_epoch=3)
    expect_one_writer(row, run_dir)
    return row


STOP_LINE = (
    "stopped at epoch {epoch}, step {step}; last.pt saved; resume with checkpoint.resume=auto"
)
SLOW_STEPS = ["model.cnn.width=96", "clips.crop_seconds=3.0", "train.limit_batches=2"]


def stop_line(ckpt: dict | None) -> str:
    """What a stop that wrote `ckpt` (last.pt) says: the epoch it stopped in, and the step."""
    if ckpt is None:
        return "(no last.pt)"
    mid_epoch = ckpt.get("position", 0) > 0  # stopped inside epoch N+1 after N finished
    epoch = ckpt["epoch"] + 1 if mid_epoch else ckpt["epoch"]
    return STOP_LINE.format(epoch=epoch, step=ckpt["step"])


def interrupt(job: Job, log: Path, ready: str, *, presses: int, gap: float = 0.3) -> dict:
    """Wait for `ready` in train.log, then press Ctrl-C `presses` times, `gap` s apart.
    Returns the job's processes as they were before ({pid: command line})."""
    if not wait_for(log, ready, 150):
        return {}
    processes = {p: command_line(p) for p in process_tree(job.pid)}
    for press in range(presses):
        if press:
            time.sleep(gap)
        job.signal(signal.SIGINT)
    return processes


def left_running(processes: dict[int, str]) -> list[str]:
    """The processes of a finished job that still run, half a second after it ended."""
    time.sleep(0.5)
    return [
        f"pid {p} ({c[:60]})" for p, c in processes.items() if alive(p) and command_line(p) == c
    ]


def expect_clean_stop(row: Row, result: Result, run_dir: Path, processes: dict) -> dict | None:
    """Exit 130, no traceback, nothing of the job left running, last.pt whole, best.pt only
    from a finished epoch."""
    row.code = str(result.code)
    row.expect(bool(processes), "train.log never showed the first epoch's end")
    row.expect(result.code == 130, f"exit {result.code}, expected 130")
    row.expect(
        "Traceback" not in result.console and "SignalException" not in result.console,
        "the console shows a traceback",
    )
    left = left_running(processes)
    kill_left(processes)
    row.expect(not left, f"still running after the job ended: {', '.join(left)}")
    done = len(metrics_rows(run_dir))
    ckpt = check_run(row, run_dir, epochs_done=done, checkpoint_epoch=done)
    log = read(run_dir / "train.log")
    row.expect("best.pt is the final epoch" not in log, "best.pt was replaced after the stop")
    if (run_dir / "best.pt").exists():
        _, best, why = checkpoint_intact(run_dir / "best.pt")
        row.expect(
            best is not None and best.get("position", 0) == 0,
            why or f"best.pt holds a partial epoch (batch {best and best.get('position')})",
        )
    return ckpt


def case_ctrl_c(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    from audioclf.config import save_config
    from tests.helpers import tiny_config

    ensure_demo(work)
    jobs = case_dir / "jobs"
    rows = []
    for letter, name, presses, extra in (
        ("a", "Ctrl-C: ./run.sh --nproc 2 (foreground)", 1, []),
        ("c", "Ctrl-C twice: ./run.sh --nproc 2", 2, SLOW_STEPS),
    ):
        row = Row(f"17{letter} {name}")
        runs = case_dir / f"runs_{letter}"
        config = case_dir / f"fg_{letter}.yaml"
        save_config(
            tiny_config(work.index, runs, "cnn", "train.epochs=500", "train.name=fg", *extra),
            config,
        )
        job = start([str(ROOT / "run.sh"), "--nproc", "2", str(config)], jobs)
        processes = interrupt(job, runs / "fg" / "train.log", "epoch 1/500:", presses=presses)
        result = job.finish(150)
        ckpt = expect_clean_stop(row, result, runs / "fg", processes)
        lines = console_lines(result.err)
        row.message = first_error_line(result.err) or (lines[-1] if lines else "")
        if presses == 1:
            want = "run.sh: " + stop_line(ckpt)
            row.expect(lines[-1:] == [want], f"the last console line is not {want!r}")
        else:
            row.expect(
                "run.sh: second Ctrl-C: killing the run at once" in result.err,
                "the console does not say the second Ctrl-C kills the run",
            )
            row.expect(
                bool(lines) and lines[-1].startswith("run.sh: stopped"),
                "the last console line is not run.sh's 'stopped ...' line",
            )
        rows.append(row)
    for letter, name, presses, extra in (
        ("b", "Ctrl-C: python -m audioclf.train", 1, []),
        ("d", "Ctrl-C twice: python -m audioclf.train", 2, SLOW_STEPS),
    ):
        row = Row(f"17{letter} {name}")
        runs = case_dir / f"runs_{letter}"
        job = start(python_train(train_args(work, runs, "train.epochs=500", *extra)), jobs)
        processes = interrupt(job, runs / "t" / "train.log", "epoch 1/500:", presses=presses)
        result = job.finish(150)
        ckpt = expect_clean_stop(row, result, runs / "t", processes)
        lines = [re.sub(r"^\S+ \S+ \w+ ", "", line) for line in console_lines(result.err)]
        row.message = first_error_line(result.err) or (lines[-1] if lines else "")
        if presses == 1:
            want = "stopped on request at " + stop_line(ckpt).removeprefix("stopped at ")
            row.expect(lines[-1:] == [want], f"the last console line is not {want!r}")
        else:
            row.expect(
                any("second Ctrl-C: stopping at once" in line for line in lines),
                "the console does not say the second Ctrl-C stops at once",
            )
        rows.append(row)
    return sorted(rows, key=lambda r: r.case)


def data_summary(log: str) -> str:
    """train.log's 'data: N train samples in C classes, ...' record."""
    return log_line(log, "INFO data: ").removeprefix("INFO ")


def case_sheet_header(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    import pandas as pd

    ensure_demo(work)
    table = pd.read_excel(work.index, dtype=str, engine="openpyxl")
    table["path"] = [str(work.index.parent / p) for p in table["path"]]
    case_dir.mkdir(parents=True, exist_ok=True)
    plain, upper, titled = (case_dir / f"{n}.xlsx" for n in ("plain", "upper", "titled"))
    table.to_excel(plain, index=False)
    table.rename(columns=str.upper).to_excel(upper, index=False)
    with pd.ExcelWriter(titled, engine="openpyxl") as writer:  # as spreadsheets export them
        table.to_excel(writer, index=False, startrow=1, sheet_name="recordings")
        writer.sheets["recordings"].cell(row=1, column=1, value="Recordings, exported 2026-01-02")
    common = ["train.epochs=1", "eval.every=0"]
    reference = run(
        python_train(train_args(work, case_dir / "runs_plain", f"data.index={plain}", *common))
    )
    plain_log = read(case_dir / "runs_plain" / "t" / "train.log")
    plain_rows = metrics_rows(case_dir / "runs_plain" / "t")
    rows = []
    for letter, name, sheet, said in (
        (
            "a",
            "upper-case header A_CLS, A_ITEM, A_ID, PATH",
            upper,
            "columns matched ignoring case",
        ),
        ("b", "a title row above the header", titled, "the header is row 2"),
    ):
        row = Row(f"18{letter} sheet: {name}")
        runs = case_dir / f"runs_{letter}"
        result = run(python_train(train_args(work, runs, f"data.index={sheet}", *common)))
        log = read(runs / "t" / "train.log")
        row.code = str(result.code)
        row.message = first_error_line(result.err) or log_line(result.err, said)
        row.expect(
            reference.code == 0,
            f"the plain sheet exited {reference.code}: {first_error_line(reference.err)}",
        )
        row.expect(result.code == 0, f"exit {result.code}, expected 0")
        for where, text in (("the console", result.err), ("train.log", log)):
            count = text.count(said)
            row.expect(count == 1, f"{where} says {said!r} {count} times, expected once")
        row.expect(
            data_summary(log) == data_summary(plain_log) != "",
            f"{data_summary(log)!r}, the plain sheet: {data_summary(plain_log)!r}",
        )
        losses = [r["train_loss"] for r in metrics_rows(runs / "t")]
        row.expect(
            losses == [r["train_loss"] for r in plain_rows],
            f"train_loss {losses}, the plain sheet's {[r['train_loss'] for r in plain_rows]}",
        )
        check_run(row, runs / "t", epochs_done=1, checkpoint_epoch=1)
        rows.append(row)
    return rows


def recipe_on_cpu(work: Work, runs: Path, config: str, *extra: str) -> list[str]:
    """A shipped GPU recipe, made small (tiny model, one batch, the demo's audio) for a CPU."""
    model = [
        "model.embedding_dim=16",
        *(
            [
                "model.conformer.d_model=32",
                "model.conformer.num_heads=2",
                "model.conformer.ffn_dim=64",
                "model.conformer.num_layers=1",
                "model.conformer.kernel_size=7",
            ]
            if "conformer" in config
            else ["model.cnn.width=8", "model.cnn.depth=2"]
        ),
    ]
    return python_train(
        [
            "--config",
            str(ROOT / config),
            f"data.index={work.index}",
            "data.num_workers=0",
            "features.kind=audio",
            "sampler.batch_size=8",
            "sampler.m=2",
            "clips.crop_seconds=0.5",
            *model,
            f"train.runs_dir={runs}",
            "train.name=t",
            "train.epochs=1",
            "train.limit_batches=1",
            "eval.every=0",
            *extra,
        ]
    )


def _bf16_warnings(console: str) -> list[str]:
    """The console's warning lines that name bf16 (the INFO line of precision auto names it too)."""
    return [line for line in console_lines(console) if "bf16" in line and "WARNING" in line.upper()]


def case_precision_cpu(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    ensure_demo(work)
    rows = []
    for letter, config in (("a", "configs/conformer.yaml"), ("b", "configs/cnn.yaml")):
        row = Row(f"19{letter} {config} on a CPU (precision auto)")
        runs = case_dir / f"runs_{letter}"
        result = run(recipe_on_cpu(work, runs, config))
        log = read(runs / "t" / "train.log")
        row.code = str(result.code)
        row.message = first_error_line(result.err) or log_line(log, "precision fp32")
        row.message = row.message.split("; ")[-1]  # "precision fp32 (auto on cpu: ...)"
        row.expect(result.code == 0, f"exit {result.code}, expected 0")
        row.expect("precision fp32 (auto on cpu" in log, "train.log does not say it picked fp32")
        row.expect(result.seconds < 90, f"took {result.seconds:.0f} s")
        row.expect(not _bf16_warnings(result.err), "the console warns of bf16")
        check_run(row, runs / "t", epochs_done=1, checkpoint_epoch=1)
        rows.append(row)

    row = Row("19c conformer.yaml, train.precision=bf16 on a CPU")
    runs = case_dir / "runs_c"
    result = run(recipe_on_cpu(work, runs, "configs/conformer.yaml", "train.precision=bf16"))
    log = read(runs / "t" / "train.log")
    warned = _bf16_warnings(result.err)
    row.code = str(result.code)
    row.message = first_error_line(result.err) or (warned[0] if warned else "")
    row.expect(result.code == 0, f"exit {result.code}, expected 0")
    row.expect(len(warned) == 1, f"{len(warned)} bf16 warning lines on the console, expected 1")
    row.expect(
        bool(warned) and "44-51 s against 2.3-4.8 s" in warned[0],
        "the warning does not give the measured cost",
    )
    row.expect(re.search(r"precision bf16\b", log) is not None, "train.log does not say bf16")
    check_run(row, runs / "t", epochs_done=1, checkpoint_epoch=1)
    rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Outputs users keep (issue 28): one writer per output, damaged artefacts met by their readers


def refused_while_held(
    name: str, lock_file: Path, cmd: list[str], what: str, *, at_once: bool = False
) -> Row:
    """`cmd` run while another process holds `lock_file`: exit 2, one line naming the holder;
    `at_once`: before any work (`cmd` shows progress bars: none may have run)."""
    from tests.helpers import LockHolder

    row = Row(name)
    with LockHolder(lock_file, env=env()) as holder:
        result = run(cmd)
    row.code, row.message = str(result.code), first_error_line(result.console)
    row.expect(result.code == 2, f"exit {result.code}, expected 2")
    row.expect(len(error_lines(result.console)) == 1, "not one error line")
    row.expect(
        f"in use by another {what} (pid {holder.pid} on {socket.gethostname()}" in row.message,
        "the holder (pid, host, start) is not named",
    )
    row.expect(not at_once or "%|" not in result.console, "refused only after the work (a "
               "progress bar ran first), not at once")  # fmt: skip
    return row


def one_line_for_damage(name: str, cmd: list[str], names: Path, fix: str) -> Row:
    row = Row(name)
    result = run(cmd)
    row.code, row.message = str(result.code), first_error_line(result.console)
    row.expect(result.code == 2, f"exit {result.code}, expected 2")
    row.expect(len(error_lines(result.console)) == 1, "not one error line")
    row.expect(audioclf_tracebacks(result.console) == 0 and "Traceback" not in result.console,
               "a traceback")  # fmt: skip
    row.expect(str(names) in row.message and fix in row.message, f"names not {names} / {fix}")
    return row


def cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def case_artefacts(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    base = ensure_base(work)
    model, prefix = base / "best.pt", case_dir / "emb"
    embed = tool("embed", "--model", model, "--index", work.index, "--save", prefix, "--quiet")
    clean = run(embed)
    assert clean.code == 0, clean.err

    def outputs() -> dict:  # the files embed --index leaves (lock files aside)
        return {p.name: p.read_bytes() for p in case_dir.glob("emb.*") if p.suffix != ".lock"}

    reference = outputs()
    rows = [
        refused_while_held("20a embed --index into a PREFIX another holds", case_dir / "emb.lock",
                           embed, "embed --index"),
        refused_while_held("20b search build of an index another builds",
                           case_dir / "emb.hnsw.lock",
                           tool("search", "build", prefix, "--method", "hnsw", "--quiet"),
                           "search build"),
        refused_while_held("20c prepare into a shard another prepares",
                           case_dir / "features" / ".prepare-0-of-1.lock",
                           tool("prepare", "--index", work.index, "--out", case_dir / "features"),
                           "prepare"),
    ]  # fmt: skip
    rerun = run(embed)  # the holders are gone: the same output as the clean run
    row = Row("20d embed --index rerun after the refusals")
    row.code, row.message = str(rerun.code), (console_lines(rerun.out) or ["-"])[-1]
    row.expect(outputs() == reference, "the output differs from the clean run's")
    rows.append(row)
    assert run(tool("search", "build", prefix, "--method", "hnsw", "--quiet")).code == 0
    query = tool("search", "query", prefix, "--method", "hnsw", "--query-prefix", prefix)
    cut_in_half(case_dir / "emb.hnsw.faiss")
    rows.append(one_line_for_damage("20e search index data cut in half, queried", query,
                                    case_dir / "emb.hnsw.faiss", "rebuild"))  # fmt: skip
    cut_in_half(prefix.with_name("emb.parquet"))
    rows.append(one_line_for_damage("20f PREFIX.parquet cut in half, queried", query,
                                    prefix.with_name("emb.parquet"), "parquet"))  # fmt: skip
    rows.append(gallery_cache_garbage(model, work, case_dir))
    return rows


def gallery_cache_garbage(model: Path, work: Work, case_dir: Path) -> Row:
    clip = sorted((work.index.parent / "wav").rglob("*.wav"))[0]
    rank = tool("embed", "--model", model, "--gallery", work.index, "--top", 1, "--quiet", clip)
    first = run(rank)
    caches = sorted((model.parent / ".audioclf_cache").glob("gallery-*.npz"))
    row = Row("20g gallery cache replaced by garbage")
    for cache in caches:
        cache.write_bytes(b"\x00garbage" * 64)
    result = run(rank)
    warnings = [line for line in console_lines(result.err) if "gallery cache" in line]
    row.code, row.message = str(result.code), (warnings or ["-"])[0]
    row.expect(first.code == 0 and result.code == 0, f"exit {first.code}, {result.code}")
    row.expect(len(caches) >= 1 and len(warnings) == 1, f"{len(warnings)} cache warning lines")
    # the rankings (the header says whether the gallery came from the cache: an earlier case
    # of the matrix may have left one for the first run)
    ranked = [out.splitlines()[1:] for out in (first.out, result.out)]
    row.expect(ranked[0] == ranked[1], "the ranking differs from the first run's")
    return row


# Kill -9 in the middle of a write, full and read-only disks, every artefact cut in half: the
# outputs users keep (embed --index, search build, prepare, evaluate --out, export).


def ensure_embedded(work: Work) -> Path:
    """PREFIX of `embed --index` of the demo sheet with the base model (read only by the cases)."""
    if work.embedded is None:
        prefix = work.root / "embedded" / "emb"
        model = ensure_base(work) / "best.pt"
        result = run(
            tool("embed", "--model", model, "--index", work.index, "--save", prefix, "--quiet")
        )
        if result.code != 0:
            raise RuntimeError("embed --index of the demo failed:\n" + result.err[-3000:])
        work.embedded = prefix
    return work.embedded


def ensure_prepared(work: Work) -> Path:
    """A `prepare` output folder of the demo sheet, one worker (read only by the cases)."""
    if work.prepared is None:
        out = work.root / "prepared"
        result = run(
            tool("prepare", "--index", ensure_demo(work), "--out", out, "--workers", 1, "--quiet")
        )
        if result.code != 0:
            raise RuntimeError("prepare of the demo failed:\n" + result.err[-3000:])
        work.prepared = out
    return work.prepared


def copy_pair(prefix: Path, folder: Path) -> Path:
    """PREFIX.npy / .parquet copied into `folder` (their times kept: an index records them)."""
    folder.mkdir(parents=True, exist_ok=True)
    for suffix in (".npy", ".parquet"):
        shutil.copy2(f"{prefix}{suffix}", folder / f"{prefix.name}{suffix}")
    return folder / prefix.name


def contents(folder: Path, pattern: str = "*") -> dict[str, bytes]:
    """The bytes of the files in `folder` matching `pattern` (a glob: "**/*.npy" for every
    level), lock files aside."""
    files = sorted(p for p in folder.glob(pattern) if p.is_file() and p.suffix != ".lock")
    return {str(p.relative_to(folder)): p.read_bytes() for p in files}


def later_read(prefix: Path, method: str | None = None) -> tuple[str, tuple | None]:
    """What a later `search query PREFIX` meets: ("", (PREFIX.npy, PREFIX.parquet bytes))
    when it reads PREFIX (and its `method` index) as whole, else (its one error line, None)."""
    from audioclf.errors import one_line
    from audioclf.search.collection import Collection, open_index

    try:
        open_index(Collection.open(prefix), method, device="cpu")
    except (OSError, ValueError) as exc:
        return one_line(exc), None
    return "", tuple(Path(f"{prefix}{s}").read_bytes() for s in (".npy", ".parquet"))


def killed_in(name: str, pattern: str, *args: object, at: int = 1) -> list[str]:
    """`python -m audioclf.<name> args`, SIGKILLed from inside halfway through the first write
    of the at-th file it opens whose name matches `pattern` (an fnmatch glob)."""
    options = ("--tool", name, "--file", pattern, "--at", str(at))
    return worker("kill-in-write", [str(a) for a in args], *options)


def expect_killed(row: Row, result: Result, folder: Path, pattern: str) -> None:
    """Killed by the injection (exit -9), which left its half file under a temporary name."""
    row.expect(result.code == -signal.SIGKILL, f"the killed run exited {result.code}, not -9")
    row.expect(bool(list(folder.rglob(pattern))), f"no {pattern}: the kill missed the write")


def expect_nothing_left(row: Row, folder: Path) -> None:
    left = leftovers(folder) + [str(p.relative_to(folder)) for p in folder.rglob(".*.partial-*")]
    if left:
        row.lost = "yes"
        row.problems.append(f"half-written file(s) left: {', '.join(left)}")


def case_artefacts_kill(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    model = ensure_base(work) / "best.pt"
    rows = kill_embed_rows(work, model, case_dir / "embed")
    rows += [kill_search_row(work, case_dir / "search"), kill_prepare_row(work, case_dir)]
    return rows + kill_evaluate_rows(model, case_dir / "evaluate")


def kill_embed_rows(work: Work, model: Path, folder: Path) -> list[Row]:
    """Over an earlier run's PREFIX, embed --index of the same rows in another order (as many
    rows: a mixed pair would pass Collection.open's row count) killed writing PREFIX.parquet."""
    import pandas as pd

    prefix = copy_pair(ensure_embedded(work), folder)
    earlier = contents(folder)
    table = pd.read_excel(work.index, dtype=str, engine="openpyxl")
    table["path"] = [str(work.index.parent / p) for p in table["path"]]
    sheet = folder / "reordered.csv"
    table.iloc[::-1].to_csv(sheet, index=False)
    embed = ("--model", model, "--index", sheet, "--quiet", "--save")
    clean = run(tool("embed", *embed, folder / "clean" / "emb"))
    killed = run(killed_in("embed", ".emb.parquet.*", *embed, prefix))
    error, pair = later_read(prefix)
    whole = {
        tuple(earlier.values()): "the earlier run's",
        tuple(contents(folder / "clean").values()): "the new",
    }
    row = Row("21a kill -9 writing PREFIX.parquet (embed --index, over an earlier run)")
    row.code = str(killed.code)
    row.message = "then search query: " + (error or f"{whole.get(pair, 'A MIXED')} pair, whole")
    row.expect(clean.code == 0, f"the clean run exited {clean.code}")
    expect_killed(row, killed, folder, ".emb.parquet.*.tmp")
    row.expect(
        bool(error) or pair in whole,
        "a later read takes the new PREFIX.npy beside the earlier run's PREFIX.parquet as one run",
    )

    part = folder / "emb.parts" / "chunk-000000.npz"
    rerun = Row("21b its rerun, the part file cut in half first")
    if not rerun.expect(part.is_file(), f"no {part.name}: the killed run left no part"):
        return [row, rerun]
    cut_in_half(part)
    result = run(tool("embed", *embed, prefix))
    warned = [line for line in console_lines(result.err) if "embedding its rows again" in line]
    rerun.code, rerun.message = str(result.code), (warned or [first_error_line(result.err)])[0]
    rerun.expect(result.code == 0, f"exit {result.code}, expected 0")
    rerun.expect(
        len(warned) == 1 and part.name in warned[0], "no one line says the part is embedded again"
    )
    now = contents(folder, "emb.*")
    rerun.expect(now == contents(folder / "clean"), "the output differs from a clean run's")
    expect_nothing_left(rerun, folder)
    return [row, rerun]


def kill_search_row(work: Work, folder: Path) -> Row:
    prefix, clean = (copy_pair(ensure_embedded(work), folder / name) for name in ("a", "clean"))
    build = ("build", "--method", "hnsw", "--quiet")
    run(tool("search", *build, clean))
    killed = run(killed_in("search", ".emb.hnsw.faiss.*", *build, prefix))
    row = Row("21c kill -9 writing the index data (search build --method hnsw), rerun")
    expect_killed(row, killed, prefix.parent, ".emb.hnsw.faiss.*.tmp")
    error, _ = later_read(prefix, "hnsw")
    rerun = run(tool("search", *build, prefix))
    row.code, row.message = f"-9, then {rerun.code}", f"then search query: {error or 'whole'}"
    row.expect("no hnsw index" in error, "a later read did not refuse the unfinished index")
    row.expect(rerun.code == 0, f"the rerun exited {rerun.code}")
    indexes = [contents(p.parent, "emb.hnsw.*") for p in (prefix, clean)]
    row.expect(
        len(indexes[0]) == 2 and indexes[0] == indexes[1],
        "the rerun's index (json, faiss) differs from a clean build's",
    )
    expect_nothing_left(row, folder)
    return row


def kill_prepare_row(work: Work, case_dir: Path) -> Row:
    import json

    import pandas as pd

    from audioclf.precompute.files import complete_frames

    clean, out = ensure_prepared(work), case_dir / "prepare"
    args = ("--index", work.index, "--out", out, "--workers", 1, "--quiet")
    killed = run(killed_in("prepare", ".*.npy.tmp", *args, at=5))
    row = Row("21d kill -9 writing the 5th feature file (prepare --workers 1), rerun")
    expect_killed(row, killed, out, ".*.npy.tmp")
    n_mels = json.loads(read(clean / "prepare.json"))["features"]["n_mels"]
    named = [p for p in (out / "features").rglob("*.npy") if not p.name.startswith(".")]
    row.expect(
        len(named) == 4 and all(complete_frames(p, n_mels) for p in named),
        f"{len(named)} feature files under their names, expected 4 complete ones",
    )
    row.expect(not (out / "index.xlsx").exists(), "the killed run wrote an index")
    rerun = run(tool("prepare", *args))
    row.code = f"-9, then {rerun.code}"
    row.message = first_error_line(rerun.console) or (console_lines(rerun.out) or ["-"])[0]
    row.expect(rerun.code == 0, f"the rerun exited {rerun.code}")
    row.expect(", 4 already present" in row.message, "the rerun does not take the 4 files")
    row.expect(
        contents(out, "**/*.npy") == contents(clean, "**/*.npy"),
        "the features differ from a clean run's",
    )
    row.expect(
        contents(out, "**/*.json") == contents(clean, "**/*.json"),
        "prepare.json or the shard record differs from a clean run's",
    )
    tables = [
        pd.read_excel(p / "index.xlsx", dtype=str, engine="openpyxl")
        for p in (out, clean)
        if (p / "index.xlsx").is_file()
    ]
    row.expect(
        len(tables) == 2 and tables[0].equals(tables[1]), "the index differs from a clean run's"
    )
    expect_nothing_left(row, out)
    return row


def report_figures(out: Path) -> dict:
    """What evaluate --out must write the same each time: report.json but its run time, and the
    projector files."""
    import json

    report = json.loads(read(out / "report.json") or "{}")
    report.get("evaluation", {}).pop("seconds", None)
    return {"report.json": report, **contents(out, "*.tsv")}


def kill_evaluate_rows(model: Path, folder: Path) -> list[Row]:
    out, clean = folder / "eval", folder / "eval_clean"
    evaluate = ("--checkpoint", model, "--quiet", "--out")
    run(tool("evaluate", *evaluate, clean))
    killed = run(killed_in("evaluate", ".report.json.*", *evaluate, out))
    row = Row("21e kill -9 writing report.json (evaluate --out), rerun")
    expect_killed(row, killed, folder, ".report.json.*.tmp")
    row.expect(not (out / "report.json").exists(), "a report.json is in --out after the kill")
    rerun = run(tool("evaluate", *evaluate, out))
    row.code = f"-9, then {rerun.code}"
    row.message = first_error_line(rerun.console) or (console_lines(rerun.out) or ["-"])[-1]
    row.expect(rerun.code == 0, f"the rerun exited {rerun.code}")
    row.expect(
        report_figures(out) == report_figures(clean) != {"report.json": {}},
        "the rerun's report (figures, projector files) differs from a clean run's",
    )
    expect_nothing_left(row, folder)

    before = contents(out)  # without --quiet: a progress bar shows the work done before the lock
    held = refused_while_held(
        "21f evaluate --out into a folder another evaluate writes",
        out / ".evaluate.lock",
        tool("evaluate", *evaluate[:2], "--out", out),
        "evaluate",
        at_once=True,
    )
    held.expect(contents(out) == before, "the refused run changed --out")
    return [row, held]


def fill(ballast: Path, free_kb: int) -> None:
    """Fill the disk of `ballast`'s folder up to `free_kb` KiB free, as another job's output would."""
    free = shutil.disk_usage(ballast.parent).free - free_kb * 1024
    with open(ballast, "wb") as handle:
        while free > 0:
            chunk = min(free, 1 << 20)
            handle.write(b"\0" * chunk)
            free -= chunk


# (row name, tool, its arguments for the folder, KiB left free on the full disk: room for the
# lock and the first small files, not for the output)
DISK_RUNS = (
    (
        "embed --index",
        "embed",
        lambda m, w, d: ["--model", m, "--index", w.index, "--save", d / "emb", "--quiet"],
        8,
    ),
    (
        "search build",
        "search",
        lambda m, w, d: ["build", d / "emb", "--method", "hnsw", "--quiet"],
        16,
    ),
    (
        "evaluate",
        "evaluate",
        lambda m, w, d: ["--checkpoint", m, "--out", d / "eval", "--quiet"],
        64,
    ),
)


def case_artefacts_disk(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    runs = [(run_, fault) for run_ in DISK_RUNS for fault in ("full disk", "read-only folder")]
    return [
        disk_row(work, f"22{letter} {run_[0]}: {fault}", run_, fault, case_dir / letter, keep)
        for letter, (run_, fault) in zip("abcdef", runs)
    ]


def disk_row(work: Work, name: str, run_: tuple, fault: str, folder: Path, keep: bool) -> Row:
    """The tool run with its output folder on a full (or read-only) tmpfs, PREFIX.npy /
    .parquet there (search build's input; embed --index's earlier run)."""
    _, name_, arguments, free_kb = run_
    model, row = ensure_base(work) / "best.pt", Row(name)
    mounted = mount_tmpfs(work, folder, "2m")
    try:
        prefix = copy_pair(ensure_embedded(work), folder)
        inputs = contents(folder)
        args = [str(a) for a in arguments(model, work, folder)]
        cmd = tool(name_, *args)
        if mounted and fault == "full disk":
            fill(folder / "ballast.bin", free_kb)
        elif not (mounted and remount_read_only(folder)):
            mode, errno_name = ("full-disk", "ENOSPC") if "full" in fault else ("erofs", "EROFS")
            row.case += f" [no tmpfs: {errno_name} patched]"
            cmd = worker(mode, args, "--tool", name_, "--under", str(folder))
        expect_disk_refusal(row, run(cmd), folder, fault)
        now = {name: data for name, data in contents(folder).items() if name in inputs}
        row.expect(now == inputs, "PREFIX.npy / .parquet changed")
        if name_ != "search":
            row.intact, _, why = checkpoint_intact(model)
            row.expect(row.intact == "yes", why)
        error, _ = later_read(prefix, "hnsw" if name_ == "search" else None)
        if name_ == "embed":
            row.expect(not error, f"a later read does not take the earlier run's pair: {error}")
        elif name_ == "search":
            row.expect("no hnsw index" in error, f"a later read: {error or 'an index, whole'}")
        row.expect(not (folder / "eval" / "report.json").exists(), "a report.json was written")
        expect_nothing_left(row, folder)
    finally:
        unmount(work, folder, keep)
    return row


def expect_disk_refusal(row: Row, result: Result, folder: Path, fault: str) -> None:
    """Exit 2, one line naming a file in `folder`, what happened, and the fix."""
    row.code, row.message = str(result.code), first_error_line(result.console)
    row.expect(result.code == 2, f"exit {result.code}, expected 2")
    row.expect(len(error_lines(result.console)) == 1, "not one error line")
    row.expect(not audioclf_tracebacks(result.console), "a traceback")
    said = "No space left" if fault == "full disk" else "Read-only"
    row.expect(
        f"cannot write {folder}" in row.message and said in row.message,
        f"the message does not name the file in {folder.name} and {said!r}",
    )
    row.expect("write to another folder" in row.message, "the message names no fix")


def case_artefacts_damage(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    model = ensure_base(work) / "best.pt"
    prefix = copy_pair(ensure_embedded(work), case_dir)
    cut_in_half(Path(f"{prefix}.npy"))
    query = tool("search", "query", prefix, "--query-prefix", ensure_embedded(work))
    rows = [
        one_line_for_damage(
            "23a PREFIX.npy cut in half, queried",
            query,
            Path(f"{prefix}.npy"),
            "audioclf.embed --index",
        )
    ]
    return rows + damaged_export_rows(work, model, case_dir) + damaged_prepare_rows(work, case_dir)


def damaged_export_rows(work: Work, model: Path, case_dir: Path) -> list[Row]:
    """Each file of a TorchScript and an ONNX export cut in half, given to embed --model."""
    from audioclf.inference.exporting import export_model
    from audioclf.inference.sidecar import sidecar_path

    clip = sorted((work.index.parent / "wav").rglob("*.wav"))[0]
    rows = []
    for letter, (fmt, name, damaged) in zip(
        "bcd",
        [
            ("torchscript", "model.pt", "model"),
            ("torchscript", "model.pt", "sidecar"),
            ("onnx", "model.onnx", "model"),
        ],
    ):
        out = case_dir / fmt / name
        if not out.is_file():
            with open(os.devnull, "w") as quiet:  # the exporters' own progress lines
                saved, sys.stdout = sys.stdout, quiet
                try:
                    export_model(model, fmt, out)
                finally:
                    sys.stdout = saved
        path = out if damaged == "model" else sidecar_path(out)
        whole = path.read_bytes()
        cut_in_half(path)
        embed = tool("embed", "--model", out, "--gallery", work.index, "--quiet", clip)
        rows.append(
            one_line_for_damage(
                f"23{letter} {fmt} export: {path.name} cut in half, embed --model",
                embed,
                path,
                "export the model again",
            )
        )
        path.write_bytes(whole)
    return rows


def damaged_prepare_rows(work: Work, case_dir: Path) -> list[Row]:
    """prepare.json and a feature file cut in half, given to the next prepare."""
    clean, out = ensure_prepared(work), case_dir / "prepared"
    shutil.copytree(clean, out)
    again = tool("prepare", "--index", work.index, "--out", out, "--workers", 1, "--quiet")
    manifest = out / "prepare.json"
    whole = manifest.read_bytes()
    cut_in_half(manifest)
    rows = [
        one_line_for_damage(
            "23e prepare.json cut in half, the next prepare", again, manifest, f"delete {out}"
        )
    ]
    manifest.write_bytes(whole)
    feature = sorted((out / "features").rglob("*.npy"))[7]
    cut_in_half(feature)
    result = run(again)
    row = Row("23f a feature file cut in half, the next prepare")
    row.code = str(result.code)
    row.message = first_error_line(result.console) or (console_lines(result.out) or ["-"])[0]
    row.expect(result.code == 0, f"exit {result.code}, expected 0")
    rows_ = len(list((clean / "features").rglob("*.npy")))
    row.expect(
        f": 1 files written, {rows_ - 1} already present" in row.message,
        "the next prepare does not rewrite exactly the damaged file",
    )
    row.expect(
        contents(out, "**/*.npy") == contents(clean, "**/*.npy"),
        "the features differ from a clean run's",
    )
    expect_nothing_left(row, out)
    return rows + [row, damaged_tracker_row(work, case_dir)]


def damaged_tracker_row(work: Work, case_dir: Path) -> Row:
    """evaluate reads one file of the run folder back besides the checkpoint: tracker.json (the
    MLflow / W&B run to attach its report to)."""
    run_dir = copy_run(ensure_base(work), case_dir / "runs")
    tracker = run_dir / "tracker.json"
    tracker.write_text('{"mlflow": "0123456789abcdef0123456789abcdef"}\n')
    cut_in_half(tracker)
    evaluate = tool(
        "evaluate", "--checkpoint", run_dir / "best.pt", "--out", case_dir / "eval", "--quiet"
    )
    return one_line_for_damage(
        "23g tracker.json of the run cut in half, evaluate", evaluate, tracker, "tracker.json"
    )


CASES: list[tuple[str, Callable[[Work, Path, bool], list[Row]]]] = [
    ("nan-wav", case_nan_wav),
    ("export-nan", case_export_nan),
    ("resume-architecture", case_resume_architecture),
    ("disk", case_disk),
    ("kill-mid-write", case_kill_mid_write),
    ("all-unreadable", case_all_unreadable),
    ("fail-rank1", case_fail_rank1),
    ("too-few-classes", case_too_few_classes),
    ("mid-epoch-world", case_mid_epoch_world),
    ("stop-zombie", case_stop_zombie),
    ("run-sh-stop", case_run_sh_stop),
    ("lr-inf", case_lr_inf),
    ("truncated-wav", case_truncated_wav),
    ("embed-corrupt", case_embed_corrupt),
    ("payload-checkpoint", case_payload_checkpoint),
    ("one-run-per-folder", case_one_run_per_folder),
    ("ctrl-c", case_ctrl_c),
    ("sheet-header", case_sheet_header),
    ("precision-cpu", case_precision_cpu),
    ("artefacts", case_artefacts),
    ("artefacts-kill", case_artefacts_kill),
    ("artefacts-disk", case_artefacts_disk),
    ("artefacts-damage", case_artefacts_damage),
]


# ---------------------------------------------------------------------------------------------
# Hidden worker mode: `audioclf.train` with a fault injected inside the run


def worker_main(argv: list[str]) -> int:
    import torch

    from audioclf import checkpoint
    from audioclf.train import main as train_main
    from audioclf.training.trainer import TrainHooks

    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="faults.py --worker")
    parser.add_argument("--worker", required=True, choices=(*TRAIN_FAULTS, *WRITE_FAULTS))
    parser.add_argument("--tool", default="train", help="the audioclf tool run (write faults)")
    parser.add_argument("--at", type=int, default=0)
    parser.add_argument("--at-epoch", type=int, default=0)
    parser.add_argument("--ballast", type=Path)
    parser.add_argument("--free-kb", type=int, default=64)
    parser.add_argument("--under", type=Path)
    parser.add_argument("--file", default="*", help="kill-in-write: an fnmatch of the file name")
    args = parser.parse_args(argv[:cut])
    tool_args = argv[cut + 1 :]
    if args.worker in WRITE_FAULTS:
        patch_writes(write_fault(args))
        if args.tool != "train":
            module = "audioclf.search.cli" if args.tool == "search" else f"audioclf.{args.tool}"
            return importlib.import_module(module).main(tool_args)
        return train_main(tool_args)
    hooks = None
    real_save = torch.save
    saves = []

    if args.worker == "fill-disk":

        def on_step(trainer):
            if trainer.state.epoch + 1 == args.at_epoch and not saves:
                saves.append(1)
                fill(args.ballast, args.free_kb)

        hooks = TrainHooks(on_step=on_step)
    elif args.worker == "stop-at":
        from tests.train_hooks import stop_at

        hooks = stop_at(args.at)
    else:  # enospc, kill-in-save

        def save(obj, f, *a, **k):
            saves.append(1)
            if len(saves) != args.at:
                return real_save(obj, f, *a, **k)
            if args.worker == "enospc":
                raise OSError(errno.ENOSPC, "No space left on device")
            buffer = io.BytesIO()
            real_save(obj, buffer, *a, **k)
            data = buffer.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        torch.save = save
    assert checkpoint.save_atomic  # the module that calls torch.save is imported
    return train_main(tool_args, hooks=hooks)


# Faults inside a training run (torch.save, the trainer's hooks), and in the files any tool
# writes (patch_writes).
TRAIN_FAULTS = ("fill-disk", "enospc", "kill-in-save", "stop-at")
WRITE_FAULTS = ("erofs", "full-disk", "kill-in-write")


class DiesMidWrite:
    """A file whose first write writes half its bytes, flushes, and SIGKILLs the process."""

    def __init__(self, handle):
        self.handle = handle

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.close()

    def write(self, data) -> int:
        data = bytes(data)
        self.handle.write(data[: len(data) // 2])
        self.handle.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        return 0


class OnAFullDisk(DiesMidWrite):
    """A file on a disk with no room left."""

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def write_fault(args: argparse.Namespace) -> Callable[[Path], type | None]:
    """For a file about to be opened for writing: the class to wrap its handle in (None: none);
    raises EROFS for a file or folder under --under (erofs)."""
    under = str(args.under.resolve()) if args.under else None
    matched = []

    def fault(path: Path) -> type | None:
        inside = under is not None and str(path.resolve()).startswith(under)
        if args.worker == "erofs" and inside:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        if args.worker == "full-disk":
            return OnAFullDisk if inside else None
        if args.worker == "kill-in-write" and fnmatch.fnmatch(path.name, args.file):
            matched.append(path)
            return DiesMidWrite if len(matched) == args.at else None
        return None

    return fault


def patch_writes(fault: Callable[[Path], type | None]) -> None:
    """Every file audioclf writes (fileio's atomic writes, the output locks, prepare's feature
    files, folders) meets `fault` first."""
    import pathlib

    import audioclf.fileio
    import audioclf.outputs
    import audioclf.precompute.files

    real_mkdir, real_open = pathlib.Path.mkdir, builtins.open

    def mkdir(self, *a, **k):
        if not self.exists():
            fault(self)
        return real_mkdir(self, *a, **k)

    def open_(path, mode="r", *a, **k):
        wrapper = fault(Path(path)) if any(c in mode for c in "wxa+") else None
        handle = real_open(path, mode, *a, **k)
        return handle if wrapper is None else wrapper(handle)

    pathlib.Path.mkdir = mkdir
    for module in (audioclf.fileio, audioclf.outputs, audioclf.precompute.files):
        module.open = open_


# ---------------------------------------------------------------------------------------------
# Main


def select(spec: str) -> list[tuple[int, str, Callable]]:
    numbered = [(i + 1, name, fn) for i, (name, fn) in enumerate(CASES)]
    if not spec:
        return numbered
    chosen = []
    for token in (t.strip() for t in spec.split(",") if t.strip()):
        hits = [c for c in numbered if token == str(c[0]) or c[1].startswith(token)]
        if not hits:
            names = ", ".join(f"{n} {name}" for n, name, _ in numbered)
            raise SystemExit(f"faults.py: no case {token!r}; the cases are: {names}")
        chosen += [h for h in hits if h not in chosen]
    return sorted(chosen)


def print_table(rows: list[Row], work: Work) -> None:
    header = ("case", "exit", "message the user saw", "ckpt intact", "data lost")
    table = [
        (r.case, r.code, shorten(work.short(r.message)) or "-", r.intact, r.lost) for r in rows
    ]
    widths = [max(len(str(line[i])) for line in [header, *table]) for i in range(5)]
    for line in [header, tuple("-" * w for w in widths), *table]:
        print(" | ".join(str(v).ljust(w) for v, w in zip(line, widths)).rstrip())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        return worker_main(argv)
    parser = argparse.ArgumentParser(
        prog="benchmarks/faults.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="cases: " + ", ".join(f"{i + 1} {name}" for i, (name, _) in enumerate(CASES)),
    )
    parser.add_argument(
        "--cases", default="", help="comma-separated case numbers or names (prefixes); default: all"
    )
    parser.add_argument(
        "--keep",
        type=Path,
        metavar="DIR",
        help="work in DIR and keep it (default: a temporary folder, removed)",
    )
    parser.add_argument(
        "--no-mount",
        action="store_true",
        help="do not mount tmpfs folders: patch ENOSPC / EROFS inside the run",
    )
    args = parser.parse_args(argv)
    cases = select(args.cases)

    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        if any(args.keep.iterdir()):
            raise SystemExit(f"faults.py: --keep {args.keep} is not empty; choose a new folder")
        root = args.keep.resolve()
    else:
        root = Path(tempfile.mkdtemp(prefix="audioclf-faults-"))
    work = Work(root, use_mounts=not args.no_mount and os.geteuid() == 0)
    CONSOLE_LOGS.append(root / "console")
    rows: list[Row] = []
    start = time.time()
    try:
        ensure_demo(work)
        for number, name, fn in cases:
            t0 = time.time()
            print(f"[{time.time() - start:5.0f} s] case {number} {name} ...", flush=True)
            try:
                new = fn(work, root / f"{number:02d}-{name}", bool(args.keep))
            except Exception as exc:  # noqa: BLE001 - a broken case is a failed row, not a crash
                new = [
                    Row(
                        f"{number} {name}",
                        "-",
                        f"faults.py: {type(exc).__name__}: {exc}",
                        problems=[f"the case itself failed: {type(exc).__name__}: {exc}"],
                    )
                ]
            for row in new:
                row.seconds = time.time() - t0
            rows += new
    finally:
        for mount in list(work.mounts):
            unmount(work, mount, bool(args.keep))
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)

    print()
    print_table(rows, work)
    for row in rows:  # a row is as expected when its case's checks held (intact, nothing lost)
        if row.intact == "no" and not any("intact" in p or "load" in p for p in row.problems):
            row.problems.append("checkpoint not intact")
        if row.lost == "yes" and not row.problems:
            row.problems.append("data lost")
    intact = sum(r.intact in ("yes", "n.a.") for r in rows)
    kept = sum(r.lost == "no" for r in rows)
    bad = [r for r in rows if r.problems]
    print(
        f"\n{len(rows)} cases: {intact} checkpoint intact (or n.a.), {kept} nothing lost, "
        f"{len(rows) - len(bad)} as expected; {time.time() - start:.0f} s"
        + (f"; work folder kept in {root}" if args.keep else "")
    )
    for row in bad:
        print(f"NOT AS EXPECTED: {row.case}")
        for problem in row.problems:
            print(f"    - {shorten(work.short(problem), 300)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
