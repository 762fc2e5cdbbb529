"""The fault matrix's harness: the rows it prints, commands run as a user runs them (each in
its own session, its console kept), the checks of what they left behind, and the building blocks
of the cases (the tiny demo and configs, a finished base run, tmpfs mounts, damaged files)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
        err += f"\n[benchmarks.faults: timed out after {timeout:.0f} s, process group killed]"
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
            result.err += (
                f"\n[benchmarks.faults: timed out after {timeout:.0f} s, process group killed]"
            )
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
    """`python -m benchmarks.faults.injection --worker MODE ... -- <train args>` (a hook inside
    the run; see injection.py)."""
    return [
        sys.executable,
        "-m",
        "benchmarks.faults.injection",
        "--worker",
        mode,
        *options,
        "--",
        *args,
    ]


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


def tool(name: str, *args: object) -> list[str]:
    """`python -m audioclf.<name> args...`."""
    return [sys.executable, "-m", f"audioclf.{name}", *map(str, args)]


def fill(ballast: Path, free_kb: int) -> None:
    """Fill the disk of `ballast`'s folder up to `free_kb` KiB free, as another job's output would."""
    free = shutil.disk_usage(ballast.parent).free - free_kb * 1024
    with open(ballast, "wb") as handle:
        while free > 0:
            chunk = min(free, 1 << 20)
            handle.write(b"\0" * chunk)
            free -= chunk
