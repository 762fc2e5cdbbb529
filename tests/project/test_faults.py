"""Nothing lost, nothing silent: resume mismatches, full disks, stale temp files, whole batches
of unreadable files, mid-epoch checkpoints on another world size, failures on one rank."""

from __future__ import annotations

import errno
import sys
from pathlib import Path

import pytest
import torch

from audioclf import checkpoint, fileio
from audioclf.checkpoint import CheckpointError, CheckpointSaver
from audioclf.fileio import DiskWriteError
from tests.helpers import (
    broken_copy,
    child_env,
    cli_args,
    fit,
    free_port,
    run_group,
    run_in_group,
    tiny_config,
)
from tests.train_hooks import stop_at


def test_resuming_with_another_architecture_is_refused_with_the_keys(tmp_path, tiny_demo):
    common = ["train.epochs=1", "eval.every=0"]
    fit(tiny_config(tiny_demo, tmp_path, "cnn", *common))
    with pytest.raises(
        CheckpointError,
        match=r"other settings: model\.cnn\.width 8 \(now 16\).*"
        r"checkpoint\.resume_strict=false",
    ):
        fit(
            tiny_config(
                tiny_demo,
                tmp_path,
                "cnn",
                "train.epochs=2",
                "eval.every=0",
                "model.cnn.width=16",
                "checkpoint.resume=auto",
            )
        )
    done = fit(
        tiny_config(
            tiny_demo,
            tmp_path,
            "cnn",
            "train.epochs=2",
            "eval.every=0",
            "model.cnn.width=16",
            "checkpoint.resume=auto",
            "checkpoint.resume_strict=false",
        )
    )
    assert done["history"][-1]["epoch"] == 2
    log = (tmp_path / "t" / "train.log").read_text()
    assert "resume_strict=false" in log and "model.cnn.width 8 (now 16)" in log


def test_a_checkpoint_with_nan_tensors_is_never_written(tmp_path):
    saver = CheckpointSaver(tmp_path, keep_last=1)
    saver.save_epoch({"model": {"w": torch.ones(2)}, "config": {}}, 1, 0.5)
    with pytest.raises(CheckpointError, match=r"refusing to write .*last\.pt: 1 model tensor.*'w'"):
        saver.save_epoch({"model": {"w": torch.tensor([1.0, float("nan")])}, "config": {}}, 2, 0.9)
    assert torch.equal(checkpoint.load(tmp_path / "last.pt")["model"]["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "epoch_0001.pt", "last.pt"]


@pytest.mark.parametrize(
    "failure",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EROFS, "Read-only file system"),
        RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0"),
    ],
)
def test_a_failed_write_names_the_path_and_keeps_the_previous_file(tmp_path, failure):
    path = checkpoint.save_atomic(
        {"model": {"w": torch.ones(1)}, "config": {}}, tmp_path / "last.pt"
    )

    def broken(handle):
        handle.write(b"partial")
        raise failure

    with pytest.raises(DiskWriteError) as info:
        fileio.atomic_write(path, broken)
    message = str(info.value)
    assert f"cannot write {path}" in message and "GiB free on" in message
    assert "the previous file is unchanged" in message and "\n" not in message
    assert checkpoint.load(path)["model"]["w"].item() == 1.0
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temporary file left


def test_a_read_only_folder_reports_the_file_not_the_temporary_one(tmp_path, monkeypatch):
    def read_only(handle):
        raise OSError(errno.EROFS, "Read-only file system")

    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):
        if self.name.endswith(".tmp"):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    with pytest.raises(DiskWriteError) as info:
        fileio.atomic_write(tmp_path / "config.yaml", read_only)
    assert str(info.value).startswith(f"cannot write {tmp_path / 'config.yaml'}: Read-only file")


def test_an_unreadable_file_in_a_worker_is_one_line_in_train_log(tmp_path, tiny_demo):
    sheet = broken_copy(tiny_demo, tmp_path)
    with pytest.raises(Exception, match="cannot read audio file"):
        fit(
            tiny_config(
                sheet,
                tmp_path / "runs",
                "cnn",
                "train.epochs=1",
                "eval.every=0",
                "data.check_files=false",
                "data.num_workers=1",
            )
        )
    log = (tmp_path / "runs" / "t" / "train.log").read_text()
    assert "Original Traceback" not in log and "rank 0 stopped with AudioReadError" in log
    assert all(line.startswith("20") for line in log.splitlines()), log


def test_a_disk_error_mid_run_keeps_the_epoch_row_and_the_last_checkpoint(
    tmp_path, tiny_demo, monkeypatch
):
    real = checkpoint.save_atomic
    calls = []

    def full_disk_on_second_save(obj, path):
        calls.append(path)
        if len(calls) == 2:
            raise DiskWriteError(errno.ENOSPC, f"cannot write {path}: No space left on device")
        return real(obj, path)

    monkeypatch.setattr(checkpoint, "save_atomic", full_disk_on_second_save)
    with pytest.raises(DiskWriteError, match="No space left"):
        fit(tiny_config(tiny_demo, tmp_path, "cnn", "train.epochs=3", "eval.every=0"))
    run = tmp_path / "t"
    rows = (run / "metrics.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 2  # header, epoch 1, and epoch 2 although its checkpoint failed
    assert checkpoint.load(run / "last.pt")["epoch"] == 1  # the previous checkpoint is intact


def test_temporary_files_of_a_killed_write_are_removed_on_resume(tmp_path, tiny_demo):
    fit(tiny_config(tiny_demo, tmp_path, "cnn", "train.epochs=1", "eval.every=0"))
    stale = tmp_path / "t" / ".last.pt.99999999.0123abcd.tmp"
    stale.write_bytes(b"")  # what kill -9 during torch.save leaves
    fit(
        tiny_config(
            tiny_demo, tmp_path, "cnn", "train.epochs=2", "eval.every=0", "checkpoint.resume=auto"
        )
    )
    assert not stale.exists()
    assert "removed 1 temporary file" in (tmp_path / "t" / "train.log").read_text()


def _fit_worker(rank, world, cfg):
    return fit(cfg)


@pytest.mark.slow
def test_whole_batches_of_unreadable_files_are_dropped_on_every_rank_without_a_hang(
    tmp_path, tiny_demo
):
    sheet = broken_copy(tiny_demo, tmp_path)
    cfg = tiny_config(
        sheet,
        tmp_path / "runs",
        "cnn",
        "train.epochs=1",
        "eval.every=0",
        "data.skip_bad_files=true",
        "data.check_files=false",
    )
    r0, r1 = run_in_group(_fit_worker, tmp_path, cfg, timeout=240)
    row = r0["history"][0]
    batches = r0["step"]  # every step's batch was empty on both ranks
    assert row["skipped_batches"] == 2 * batches and row["skipped_files"] == 2 * batches * 8
    csv_text = (tmp_path / "runs" / "t" / "metrics.csv").read_text()
    assert "skipped_files" in csv_text.splitlines()[0]
    assert "unreadable file(s) skipped" in (tmp_path / "runs" / "t" / "train.log").read_text()


@pytest.mark.slow
def test_a_mid_epoch_checkpoint_restarts_its_epoch_on_another_world_size(tmp_path, tiny_demo):
    cfg = tiny_config(tiny_demo, tmp_path, "cnn", "train.epochs=2", "eval.every=0")
    stopped = fit(cfg, hooks=stop_at(3))
    assert stopped["stopped"] and checkpoint.load(tmp_path / "t" / "last.pt")["position"] == 3
    resume = ["checkpoint.resume=auto"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(AssertionError, match=r"restart_epoch=true"):
        run_in_group(
            _fit_worker,
            tmp_path / "a",
            tiny_config(tiny_demo, tmp_path, "cnn", "train.epochs=2", "eval.every=0", *resume),
            timeout=240,
        )
    r0, _ = run_in_group(
        _fit_worker,
        tmp_path / "b",
        tiny_config(
            tiny_demo,
            tmp_path,
            "cnn",
            "train.epochs=2",
            "eval.every=0",
            *resume,
            "checkpoint.restart_epoch=true",
        ),
        timeout=240,
    )
    assert [h["epoch"] for h in r0["history"]] == [1, 2] and r0["world_size"] == 2
    assert "epoch 1 starts again from its first batch" in (tmp_path / "t" / "train.log").read_text()


@pytest.mark.slow
def test_a_failure_on_one_rank_is_one_line_naming_it(tmp_path, tiny_demo):
    cfg = tiny_config(tiny_demo, tmp_path / "runs", "cnn", "train.epochs=2", "eval.every=0")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "tests.train_hooks",
        "--fail-at-step=2",
        "--rank=1",
        "--",
        *cli_args(cfg),
    ]
    returncode, output = run_group(cmd, child_env(), timeout=240)
    assert returncode != 0
    lines = [line for line in output.splitlines() if "python -m audioclf.train: error:" in line]
    assert lines == ["python -m audioclf.train: error: injected failure on rank 1 at step 2"], (
        output
    )
    log = (tmp_path / "runs" / "t" / "train.log").read_text()
    assert "Traceback" not in log
    assert "rank 1 stopped with ValueError: injected failure on rank 1 at step 2" in log
    assert all(line.startswith("20") for line in log.splitlines()), log  # records only


@pytest.mark.slow
def test_a_setup_error_under_torchrun_is_said_once_and_writes_nothing(tmp_path, tiny_demo):
    # 12 classes, 9 for training: a rank gets 4, fewer than batch_size / m = 8 per batch.
    cfg = tiny_config(tiny_demo, tmp_path / "runs", "cnn", "sampler.batch_size=16")
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        "-m",
        "audioclf.train",
        *cli_args(cfg),
    ]
    returncode, output = run_group(cmd, child_env(), timeout=240)
    assert returncode != 0
    errors = [line for line in output.splitlines() if "audioclf.train: error:" in line]
    assert len(errors) == 1 and "classes per batch" in errors[0], output
    assert not (tmp_path / "runs" / "t").exists()
