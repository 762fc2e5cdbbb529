"""A full disk names the file, its folder's free space and the fix, for every writer: the
output lock's own line (which cannot be flushed) and its close must not replace the message.
On a real full file system: a tmpfs mounted for the test (root only; skipped elsewhere)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from audioclf.fileio import DiskWriteError
from audioclf.outputs import FolderLock
from tests.helpers import cli_args, make_checkpoint, tiny_config


@pytest.fixture
def full_disk(tmp_path):
    """A folder on a 256 KiB tmpfs with no byte left."""
    folder = tmp_path / "full"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:  # full
            pass
        finally:
            os.close(fd)
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


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
