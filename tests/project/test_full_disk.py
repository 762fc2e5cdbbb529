"""A full disk names the file, its folder's free space and the fix, for every writer: the
output lock's own line (which cannot be flushed) and its close must not replace the message.
On a real full file system: a tmpfs mounted for the test (root only; skipped elsewhere)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from audioclf.fileio import DiskWriteError
from audioclf.outputs import FolderLock
from tests.helpers import cli_args, make_checkpoint, tiny_config


@pytest.fixture
def full_disk(small_tmpfs):
    """A folder on a 256 KiB tmpfs with no byte left."""
    fd = os.open(small_tmpfs / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:  # full
        pass
    finally:
        os.close(fd)
    return small_tmpfs


def _says_full(err: str, folder: Path) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert f"cannot write {folder}/" in lines[0], err
    assert "No space left on device" in lines[0] and "free on " in lines[0], err
    assert "Free some space there, or write to another folder" in lines[0], err
    assert "[Errno 28]" not in lines[0], err


def test_a_lock_on_a_full_disk_names_its_file_and_the_fix(full_disk):
    lock = FolderLock(full_disk / "out" / "x.lock", what="--out x", by="another", fix="wait")
    with pytest.raises(DiskWriteError) as caught:
        lock.acquire()
    message = str(caught.value)
    assert message.startswith(f"cannot write {full_disk / 'out' / 'x.lock'}: No space left")
    assert "nothing was written. Free some space there, or write to another folder" in message
    assert not (full_disk / "out" / "x.lock").exists()


@pytest.mark.parametrize("tool", ["train", "export", "embed", "evaluate"])
def test_every_writer_on_a_full_disk_names_its_folder(tool, full_disk, tiny_demo, tmp_path, capsys):
    model = make_checkpoint(tmp_path / "best.pt")
    if tool == "train":
        from audioclf.train import main

        argv = cli_args(tiny_config(tiny_demo, full_disk / "runs", "cnn"))
        folder = full_disk / "runs" / "t"
    elif tool == "export":
        from audioclf.export import main

        argv = ["--checkpoint", model, "--format", "torchscript", "--out", full_disk / "x/m.pt"]
        folder = full_disk / "x"
    elif tool == "embed":
        from audioclf.embed import main

        argv = ["--model", model, "--index", tiny_demo, "--save", full_disk / "emb" / "all"]
        folder = full_disk / "emb"
    else:
        from audioclf.evaluate import main

        argv = ["--checkpoint", model, "--index", tiny_demo, "--out", full_disk / "ev"]
        folder = full_disk / "ev"
    code = main([str(a) for a in [*argv, *(["--quiet"] if tool in ("embed", "evaluate") else [])]])
    _, err = capsys.readouterr()
    assert code == 2, err
    _says_full(err, folder)


@pytest.fixture
def small_tmpfs(tmp_path):
    """An empty 256 KiB tmpfs (root only; skipped elsewhere)."""
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _pack_args(tmp_path: Path, out: Path) -> list[str]:
    """prepare --pack of 20 .npy sources, 320 kB of fp16 frames: more than a small tmpfs holds."""
    rows = []
    for number in range(20):
        path = tmp_path / f"c{number % 4}_{number}.npy"
        np.save(path, np.ones((500, 16), np.float32))
        rows.append({"a_cls": f"c{number % 4}", "a_item": f"i{number}", "a_id": path.stem,
                     "path": str(path)})  # fmt: skip
    sheet = tmp_path / "sources.csv"
    pd.DataFrame(rows).to_csv(sheet, index=False)
    return ["--index", str(sheet), "--out", str(out), "--pack", "--quiet", "--workers", "1",
            "features.kind=npy", "features.n_mels=16"]  # fmt: skip


def test_prepare_pack_on_a_full_disk_names_the_file(small_tmpfs, tmp_path, capsys):
    from audioclf.prepare import main  # noqa: PLC0415

    assert main(_pack_args(tmp_path, small_tmpfs / "pack")) == 2
    _, err = capsys.readouterr()
    _says_full(err, small_tmpfs / "pack")


def test_a_read_only_folder_says_read_only_not_free_some_space(small_tmpfs, tmp_path, capsys):
    from audioclf.prepare import main  # noqa: PLC0415

    (small_tmpfs / "pack").mkdir()
    remounted = subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], capture_output=True)
    if remounted.returncode != 0:
        pytest.skip(f"cannot remount read-only: {remounted.stderr.decode().strip()}")
    assert main(_pack_args(tmp_path, small_tmpfs / "pack")) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"cannot write {small_tmpfs / 'pack'}/" in lines[0] and "Read-only" in lines[0]
    assert "is on a read-only file system: remount it writable, or write to another" in lines[0]
    assert "Free some space" not in lines[0]
