"""Cases 20-23 of the fault matrix, the outputs users keep (issue 28): one writer per output, kill
-9 in the middle of a write, full and read-only disks, every artefact cut in half and met by
its reader."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.faults.harness import (
    Result,
    Row,
    Work,
    audioclf_tracebacks,
    checkpoint_intact,
    console_lines,
    copy_run,
    ensure_base,
    ensure_demo,
    env,
    error_lines,
    fill,
    first_error_line,
    leftovers,
    mount_tmpfs,
    read,
    remount_read_only,
    run,
    tool,
    unmount,
    worker,
)

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


# (name, case) in the matrix's order: cases 20-23
CASES: list[tuple[str, Callable[[Work, Path, bool], list[Row]]]] = [
    ("artefacts", case_artefacts),
    ("artefacts-kill", case_artefacts_kill),
    ("artefacts-disk", case_artefacts_disk),
    ("artefacts-damage", case_artefacts_damage),
]
