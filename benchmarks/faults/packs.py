"""Fault-matrix rows of issue 42's packs, adaptation inputs, audio of unknown length and run.sh's
arguments: a feature pack whose pack.json, rows.npy or sources changed since packing (training
and prepare --pack name the file and the fix), a pack of an older format, prepare --pack onto a
full disk and into a read-only folder; Model.adapt('') and adapt([]); a collection embedded with
--adapt queried with the unadapted model, straight from embed and after search build --model (one
warning line); a FLAC whose header leaves its length unknown, embedded by the CLI and refused by
the server's length limit by its real length; ./run.sh demo with a bad --stage / --stop-stage."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.faults.harness import (
    ROOT,
    Row,
    Work,
    audioclf_tracebacks,
    console_lines,
    ensure_base,
    ensure_demo,
    error_lines,
    fill,
    first_error_line,
    mount_tmpfs,
    python_train,
    remount_read_only,
    run,
    tool,
    train_args,
    unmount,
)
from benchmarks.faults.outputs import expect_disk_refusal, one_line_for_damage

PACK_FIX = "prepare --pack"


def pack_of_demo(work: Work, case_dir: Path, name: str) -> tuple[list[str], Path]:
    """(the prepare --pack command of the demo with the tiny config, its --out folder), run."""
    from audioclf.config import save_config
    from tests.helpers import tiny_config

    config = case_dir / "tiny.yaml"
    case_dir.mkdir(parents=True, exist_ok=True)
    save_config(tiny_config(ensure_demo(work), case_dir / "runs", "cnn"), config)
    out = case_dir / name
    cmd = tool("prepare", "--index", work.index, "--out", out, "--pack", "--config", config,
               "--workers", 1, "--quiet")  # fmt: skip
    return cmd, out


def train_on(work: Work, pack: Path, runs: Path) -> list[str]:
    return python_train(
        train_args(work, runs, "features.kind=npy", "train.epochs=1", index=pack / "index.parquet")
    )


# ---------------------------------------------------------------------------------------------
# Packs that cannot lie


def case_pack_lies(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    cmd, clean = pack_of_demo(work, case_dir, "clean")
    made = run(cmd, timeout=300)
    if made.code != 0:
        raise RuntimeError("prepare --pack of the demo failed:\n" + made.err[-3000:])
    rows = []
    for letter, what, damage, names in (
        ("a", "pack.json's dtype edited to float32", _edit_dtype, "pack.json"),
        ("b", "rows.npy cut short", _cut_rows, "rows.npy"),
        ("c", "pack.json of format version 1 (an older audioclf)", _older, "older audioclf"),
    ):
        pack = case_dir / f"pack_{letter}"
        shutil.copytree(clean, pack)
        damage(pack)
        shown = pack / names if names.endswith((".json", ".npy")) else names
        rows.append(one_line_for_damage(f"packs-{letter} {what}, then training",
                                        train_on(work, pack, case_dir / f"runs_{letter}"),
                                        shown, PACK_FIX))  # fmt: skip
    rows.append(source_changed_row(work, case_dir))
    return rows


def _edit_dtype(pack: Path) -> None:
    manifest = pack / "pack.json"
    manifest.write_text(json.dumps(json.loads(manifest.read_text()) | {"dtype": "float32"}))


def _cut_rows(pack: Path) -> None:
    data = (pack / "rows.npy").read_bytes()
    (pack / "rows.npy").write_bytes(data[: len(data) - 64])


def _older(pack: Path) -> None:
    manifest = pack / "pack.json"
    old = json.loads(manifest.read_text()) | {"version": 1}
    manifest.write_text(json.dumps({k: v for k, v in old.items() if "checksum" not in k}))


def source_changed_row(work: Work, case_dir: Path) -> Row:
    """A sheet of .npy sources packed, one source rewritten, the same prepare --pack again."""
    import numpy as np
    import pandas as pd

    sources = case_dir / "sources"
    sources.mkdir(parents=True, exist_ok=True)
    rows = []
    for number in range(12):
        path = sources / f"s{number}.npy"
        np.save(path, np.full((120, 16), number, np.float32))
        rows.append({"a_cls": f"c{number % 3}", "a_item": f"i{number}", "a_id": path.stem,
                     "path": str(path)})  # fmt: skip
    sheet = sources / "sheet.csv"
    pd.DataFrame(rows).to_csv(sheet, index=False)
    cmd = tool("prepare", "--index", sheet, "--out", case_dir / "npy_pack", "--pack", "--quiet",
               "--workers", 1, "features.kind=npy", "features.n_mels=16")  # fmt: skip
    row = Row("packs-d a source .npy rewritten, then the same prepare --pack")
    first = run(cmd)
    if not row.expect(first.code == 0, f"the first prepare --pack exited {first.code}"):
        return row
    np.save(sources / "s4.npy", np.zeros((120, 16), np.float32))
    again = one_line_for_damage(row.case, cmd, sources / "s4.npy", PACK_FIX)
    again.expect("nothing to do" not in again.message, "the rerun kept the old frames")
    return again


def case_pack_disk(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    rows = []
    for letter, fault in (("e", "full disk"), ("f", "read-only folder")):
        row = Row(f"packs-{letter} prepare --pack: {fault}")
        folder = case_dir / letter
        mounted = mount_tmpfs(work, folder, "1m")
        try:
            cmd, _ = pack_of_demo(work, case_dir / f"config_{letter}", "unused")
            cmd[cmd.index("--out") + 1] = str(folder / "pack")
            if not mounted:
                row.case += " [no tmpfs: not run]"
                rows.append(row)
                continue
            if fault == "full disk":
                fill(folder / "ballast.bin", 64)  # the lock fits, the frames do not
            else:
                (folder / "pack").mkdir()
                if not remount_read_only(folder):
                    row.case += " [remount failed: not run]"
                    rows.append(row)
                    continue
            expect_disk_refusal(row, run(cmd), folder, fault)
            row.expect(fault == "full disk" or "read-only file system: remount it writable"
                       in row.message, "the fix is not to make it writable")  # fmt: skip
            row.expect("Free some space" not in row.message or fault == "full disk",
                       "a read-only folder is told to free some space")  # fmt: skip
        finally:
            unmount(work, folder, keep)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Adaptation inputs and the one record of an adapted collection


ADAPT = (
    "import sys, audioclf\n"
    "model = audioclf.load(sys.argv[1], device='cpu')\n"
    "try:\n"
    "    model.adapt(eval(sys.argv[2]))\n"
    "except ValueError as exc:\n"
    "    sys.exit(f'Model.adapt: error: {exc}')\n"
    "print('adapted on', model.adaptation['source'])\n"
)


def case_adapt_inputs(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    model = ensure_base(work) / "best.pt"
    rows = []
    for letter, given in (("a", "''"), ("b", "[]")):
        row = Row(f"adapt-{letter} Model.adapt({given})")
        result = run([sys.executable, "-c", ADAPT, str(model), given])
        row.code, row.message = str(result.code), first_error_line(result.console)
        lines = error_lines(result.console)
        row.expect(result.code == 1 and len(lines) == 1, f"exit {result.code}, {len(lines)} lines")
        row.expect("  " not in row.message and "pass the files or folders" in row.message,
                   "a blank in the message, or no fix")  # fmt: skip
        rows.append(row)
    return rows + adapted_collection_rows(work, case_dir, model)


def adapted_collection_rows(work: Work, case_dir: Path, model: Path) -> list[Row]:
    """The demo embedded with --adapt, queried with the unadapted model: straight from embed,
    and after search build --model with that model."""
    prefix = case_dir / "adapted" / "emb"
    clips = work.index.parent / "wav" / "c01"
    made = run(tool("embed", "--model", model, "--index", work.index, "--save", prefix,
                    "--adapt", clips, "--quiet"))  # fmt: skip
    if made.code != 0:
        raise RuntimeError("embed --adapt of the demo failed:\n" + made.err[-3000:])
    query = tool("search", "query", prefix, work.index.parent / "wav" / "c02", "--model", model,
                 "--k", 1, "--quiet", "--device", "cpu")  # fmt: skip
    build = tool("search", "build", prefix, "--model", model, "--quiet")
    rows = []
    for letter, name, before in (("c", "straight from embed --adapt", None),
                                 ("d", "after search build --model M", build)):  # fmt: skip
        row = Row(f"adapt-{letter} an --adapt collection queried unadapted, {name}")
        first = run(before) if before else None
        result = run(query)
        said = [line for line in console_lines(result.err) if "warning:" in line]
        row.code, row.message = str(result.code), (said or [first_error_line(result.console)])[0]
        row.expect(result.code == 0, f"exit {result.code}, expected 0")
        row.expect(len(said) == 1 and "BatchNorm statistics differ" in said[0],
                   f"{len(said)} adaptation warning lines, expected 1")  # fmt: skip
        if first is not None:
            row.expect(first.code == 0 and "BatchNorm statistics differ" in first.err,
                       "search build --model M does not warn that M is unadapted")  # fmt: skip
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Audio of unknown length; run.sh's arguments


SERVE_DECODE = (
    "import sys, audioclf\n"
    "from audioclf.serve.service import OverLimit, ServeOptions, Service\n"
    "service = Service(audioclf.load(sys.argv[1], device='cpu'), ServeOptions(max_clip_seconds=0.5))\n"
    "try:\n"
    "    service.decode(open(sys.argv[2], 'rb').read(), 'in part 1 (piped.flac)')\n"
    "except OverLimit as exc:\n"
    "    print(f'413: {exc}')\n"
    "finally:\n"
    "    service.close()\n"
)


def case_unknown_length(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    import soundfile

    from tests.helpers import write_unknown_length_audio

    model = ensure_base(work) / "best.pt"
    case_dir.mkdir(parents=True, exist_ok=True)
    source = sorted((work.index.parent / "wav").rglob("*.wav"))[0]
    wave, rate = soundfile.read(str(source), dtype="float32")
    piped = write_unknown_length_audio(case_dir / "piped.flac", wave, rate)
    embed = Row("unknown-a a pipe's FLAC (length unknown): embed --gallery")
    result = run(tool("embed", "--model", model, "--gallery", work.index, "--top", 1, piped))
    embed.code, embed.message = str(result.code), first_error_line(result.console)
    ranked = [line for line in console_lines(result.out) if "piped" in line]
    embed.message = embed.message or (ranked or [""])[0]
    embed.expect(result.code == 0, f"exit {result.code}, expected 0")
    serve = Row("unknown-b the same FLAC to serve's decode, --max-clip-seconds 0.5")
    result = run([sys.executable, "-c", SERVE_DECODE, str(model), str(piped)])
    said = [line for line in console_lines(result.out) if line.startswith("413: ")]
    serve.code, serve.message = str(result.code), (said or [first_error_line(result.console)])[0]
    serve.expect(result.code == 0 and not audioclf_tracebacks(result.console), "it failed")
    serve.expect(bool(said) and "is more than 0.5 s long" in said[0], "no 413 by its real length")
    return [embed, serve]


def case_run_sh_args(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    rows = []
    for letter, args in zip("abcd", (["--stage", "x"], ["--stop-stage", "two"], ["--stage"],
                                     ["--stage", "9"])):  # fmt: skip
        row = Row(f"run-sh-{letter} ./run.sh demo {' '.join(args)}")
        result = run([str(ROOT / "run.sh"), "demo", *args], timeout=60)
        lines = console_lines(result.err)
        row.code, row.message = str(result.code), lines[0] if lines else ""
        row.expect(result.code == 2, f"exit {result.code}, expected 2")
        row.expect(len(lines) == 1 and lines[0].startswith("run.sh: demo: "), f"stderr: {lines}")
        row.expect("== stage" not in result.out, "a stage ran")
        rows.append(row)
    return rows


# (name, case) in the matrix's order
CASES: list[tuple[str, Callable[[Work, Path, bool], list[Row]]]] = [
    ("pack-lies", case_pack_lies),
    ("pack-disk", case_pack_disk),
    ("adapt-inputs", case_adapt_inputs),
    ("unknown-length-audio", case_unknown_length),
    ("run-sh-args", case_run_sh_args),
]
