"""End-to-end training on CPU: real 2-process gloo groups, torchrun, resume, signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from audioclf import checkpoint
from audioclf.config import Config
from tests.helpers import (
    ROOT,
    as_a_terminal_starts_it,
    child_env,
    cli_args,
    free_port,
    run_group,
    run_in_group,
    tiny_config,
    wait_for_text,
)
from tests.train_hooks import digest_hooks, stop_at


def _fit_worker(rank, world, cfg: Config):
    from audioclf.training.trainer import fit

    return fit(cfg, hooks=digest_hooks())


def untrained_metrics(cfg: Config) -> dict:
    """Validation metrics of the freshly initialised network, built as the trainer builds it."""
    from audioclf.inference import embed_dataset
    from audioclf.metrics import retrieval_summary
    from audioclf.models import build_net
    from audioclf.training.trainer import seed_everything
    from tests.helpers import run_datasets

    seed_everything(cfg.train.seed, False)
    train, _, val_set = run_datasets(cfg)
    net = build_net(cfg, len(train.classes))
    emb, labels, _ = embed_dataset(net, val_set, batch_size=cfg.eval.batch_size)
    return retrieval_summary(emb, labels)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["cnn", "conformer"])
def test_ddp_training_learns_and_ranks_stay_identical(tmp_path, tiny_demo, model):
    epochs, lr = {"cnn": (6, 0.003), "conformer": (24, 0.007)}[model]
    # Closed-set validation (held-out items of the training classes): on 12 tiny classes an
    # open-set split holds out only 3 classes, which random features already separate.
    cfg = tiny_config(
        tiny_demo,
        tmp_path / "runs",
        model,
        f"train.epochs={epochs}",
        "data.holdout=items",
        "train.consistency_every_steps=2",
        "eval.distributed=true",
        "loss.miner=all",
        f"optim.lr={lr}",
    )
    before = untrained_metrics(cfg)
    r0, r1 = run_in_group(_fit_worker, tmp_path, cfg, timeout=300)
    # Bit-identical parameters on both ranks (and the per-step consistency check never fired).
    assert r0["parameters_sha256"] == r1["parameters_sha256"]
    assert r0["world_size"] == 2 and r0["step"] == r1["step"] > 0
    best = max(h["map_at_r"] for h in r0["history"])  # the epoch best.pt keeps
    assert best > before["map_at_r"] + 0.1, (before, r0["history"])
    run_dir = Path(r0["run_dir"])
    for name in ("config.yaml", "train.log", "metrics.csv", "last.pt", "best.pt"):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "tensorboard").iterdir())
    rows = (run_dir / "metrics.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + epochs
    ckpt = checkpoint.load(run_dir / "last.pt")
    assert not any(k.startswith("module.") for k in ckpt["model"])
    assert len(ckpt["rng"]) == 2 and ckpt["world_size"] == 2
    assert {"optimizer", "lr_schedule", "scaler", "sampler", "versions", "config"} <= set(ckpt)


def _fit_single(cfg: Config, hooks=None) -> dict:
    from audioclf.training.trainer import fit

    return fit(cfg, hooks=hooks or digest_hooks())


def test_resume_after_two_epochs_is_bit_exact(tmp_path, tiny_demo):
    common = [
        "optim.scheduler=step",
        "optim.step_size=1",
        "optim.gamma=0.7",
        "optim.warmup_steps=3",
        "eval.every=2",
    ]
    straight = _fit_single(tiny_config(tiny_demo, tmp_path / "a", "cnn", "train.epochs=4", *common))
    first = _fit_single(tiny_config(tiny_demo, tmp_path / "b", "cnn", "train.epochs=2", *common))
    resumed = _fit_single(
        tiny_config(
            tiny_demo, tmp_path / "b", "cnn", "train.epochs=4", "checkpoint.resume=auto", *common
        )
    )
    assert first["step"] < resumed["step"] == straight["step"]
    assert resumed["parameters_sha256"] == straight["parameters_sha256"]
    assert [h["train_loss"] for h in resumed["history"]] == [
        h["train_loss"] for h in straight["history"]
    ]


def test_mid_epoch_stop_and_resume_continues_the_same_batches(tmp_path, tiny_demo):
    straight = _fit_single(tiny_config(tiny_demo, tmp_path / "a", "cnn", "train.epochs=2"))
    stopped = _fit_single(
        tiny_config(tiny_demo, tmp_path / "b", "cnn", "train.epochs=2"), hooks=stop_at(3)
    )
    assert stopped["stopped"] and stopped["step"] == 3
    ckpt = checkpoint.load(tmp_path / "b" / "t" / "last.pt")
    assert (ckpt["epoch"], ckpt["position"], ckpt["step"]) == (0, 3, 3)
    assert ckpt["sampler"]["position"] == 3
    assert "ema" not in ckpt and "averaged" not in ckpt  # EMA and averaging are off by default
    resumed = _fit_single(
        tiny_config(tiny_demo, tmp_path / "b", "cnn", "train.epochs=2", "checkpoint.resume=auto")
    )
    assert resumed["step"] == straight["step"]
    assert resumed["parameters_sha256"] == straight["parameters_sha256"]
    assert resumed["average"] is None and not (tmp_path / "b" / "t" / checkpoint.AVG).exists()


@pytest.mark.slow
def test_sigterm_finishes_the_step_and_leaves_a_loadable_checkpoint(tmp_path, tiny_demo):
    cfg = tiny_config(tiny_demo, tmp_path / "runs", "cnn", "train.epochs=100", "eval.every=0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "audioclf.train", *cli_args(cfg)],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    log = tmp_path / "runs" / "t" / "train.log"
    try:
        assert wait_for_text(log, "epoch 1/100")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, out.decode()[-3000:]
    ckpt = checkpoint.load(tmp_path / "runs" / "t" / "last.pt")
    assert ckpt["step"] > 0 and ckpt["epoch"] < 100
    assert "stopped on request" in log.read_text()


def _start_training(cfg: Config) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "audioclf.train", *cli_args(cfg)],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_a_second_run_into_a_live_run_folder_stops_before_writing(tmp_path, tiny_demo):
    cfg = tiny_config(tiny_demo, tmp_path / "runs", "cnn", "train.epochs=100", "eval.every=0")
    first = _start_training(cfg)
    run_dir = tmp_path / "runs" / "t"
    try:
        assert wait_for_text(run_dir / "train.log", "epoch 1/100")
        for extra in ([], ["checkpoint.resume=auto"]):
            second = subprocess.run(
                [sys.executable, "-m", "audioclf.train", *cli_args(cfg), *extra],
                cwd=ROOT,
                env=child_env(),
                capture_output=True,
                text=True,
                timeout=120,
            )
            lines = second.stderr.strip().splitlines()
            assert second.returncode == 2, second.stderr[-2000:]
            assert lines[-1].startswith("python -m audioclf.train: error: run folder ")
            assert f"in use by another run (pid {first.pid} on " in lines[-1]
            assert "another train.name" in lines[-1] and "./run.sh stop t" in lines[-1]
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0, err[-3000:]
    assert checkpoint.load(run_dir / "last.pt")["step"] > 0
    assert (run_dir / "train.log").read_text().count("run directory ") == 1


@pytest.mark.slow
def test_ctrl_c_is_a_clean_stop_with_status_130(tmp_path, tiny_demo):
    cfg = tiny_config(tiny_demo, tmp_path / "runs", "cnn", "train.epochs=100", "eval.every=0")
    proc = _start_training(cfg)
    run_dir = tmp_path / "runs" / "t"
    try:
        assert wait_for_text(run_dir / "train.log", "epoch 1/100")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    ckpt = checkpoint.load(run_dir / "last.pt")
    log = (run_dir / "train.log").read_text()
    # Mid-epoch, the epoch in progress (ckpt["epoch"] counts completed ones); a stop that lands
    # in an epoch's last step or its end (a loaded machine) stops after that epoch, saved whole.
    epoch = ckpt["epoch"] + (1 if ckpt["position"] > 0 else 0)
    assert (
        f"stopped on request at epoch {epoch}, step {ckpt['step']}; last.pt "
        "saved; resume with checkpoint.resume=auto" in log
    )
    assert not (run_dir / "best.pt").exists()  # no partial epoch stands in for the best


@pytest.mark.slow
def test_nproc_starts_the_ranks_and_one_ctrl_c_is_one_line_and_130(tmp_path, tiny_demo):
    # `audioclf train --nproc-per-node 2`: the ranks through torch's elastic launcher, each in
    # a session of its own; a Ctrl-C reaches the launcher, which passes it on once: the ranks
    # save last.pt, and the launcher says so in one line (bare torchrun ends in a traceback).
    cfg = tiny_config(tiny_demo, tmp_path / "runs", "cnn", "train.epochs=100", "eval.every=0")
    run_dir = tmp_path / "runs" / "t"
    proc = subprocess.Popen(
        [sys.executable, "-m", "audioclf.train", "--nproc", "2", *cli_args(cfg)],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=as_a_terminal_starts_it,
        start_new_session=True,  # a foreground job's group, as a terminal makes it
    )
    try:
        assert wait_for_text(run_dir / "train.log", "epoch 1/100")
        assert "rank 0 of 2, ddp" in (run_dir / "train.log").read_text()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "SignalException" not in err
    assert err.strip().splitlines()[-1] == (
        f"python -m audioclf.train: stopped by SIGINT; {run_dir / 'last.pt'} is the last "
        "checkpoint saved; resume with checkpoint.resume=auto"
    )
    assert checkpoint.load(run_dir / "last.pt")["step"] > 0


@pytest.mark.slow
def test_torchrun_restarts_a_crashed_group_and_resumes(tmp_path, tiny_demo):
    cfg = tiny_config(
        tiny_demo,
        tmp_path / "runs",
        "cnn",
        "train.epochs=2",
        "eval.every=0",
        "checkpoint.every_steps=2",
        "checkpoint.resume=auto",
    )
    # The c10d rendezvous of the README's multi-node command, on one node.
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--max-restarts=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}",
        "--rdzv_id=restart-test",
        "-m",
        "tests.train_hooks",
        "--crash-at-step=3",
        "--",
        *cli_args(cfg),
    ]
    returncode, output = run_group(cmd, child_env(), timeout=300)
    assert returncode == 0, output[-4000:]
    log = (tmp_path / "runs" / "t" / "train.log").read_text()
    assert "test fault injection: crashing at step 3" in log
    assert "resumed from" in log and "at epoch 0, batch 2, step 2" in log
    assert len((tmp_path / "runs" / "t" / "metrics.csv").read_text().strip().splitlines()) == 3


@pytest.mark.slow
def test_legacy_local_rank_launch(tmp_path, tiny_demo):
    cfg = tiny_config(
        tiny_demo,
        tmp_path / "runs",
        "cnn",
        "train.epochs=1",
        "eval.every=0",
        "train.limit_batches=2",
    )
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            child_env(),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE="2",
        )
        env.pop("LOCAL_RANK", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "audioclf.train", f"--local_rank={rank}", *cli_args(cfg)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    log = (tmp_path / "runs" / "t" / "train.log").read_text()
    assert "rank 0 of 2" in log


@pytest.mark.slow
def test_dataloader_workers_do_not_change_the_run(tmp_path, tiny_demo):
    # Crops are seeded per (epoch, batch, slot), not by worker RNG: 0 or 2 workers, same run.
    runs = [
        _fit_single(
            tiny_config(
                tiny_demo,
                tmp_path / str(w),
                "cnn",
                "train.epochs=2",
                f"data.num_workers={w}",
                "eval.every=0",
            )
        )
        for w in (0, 2)
    ]
    assert runs[0]["parameters_sha256"] == runs[1]["parameters_sha256"]


def test_training_on_precomputed_npy_features(tmp_path):
    from audioclf.data.demo import generate_demo

    generate_demo(tmp_path / "demo", classes=8, items=3, ids=3, features=True)
    cfg = tiny_config(
        tmp_path / "demo" / "index_features.xlsx",
        tmp_path / "runs",
        "cnn",
        "features.kind=npy",
        "features.n_mels=64",
        "train.epochs=1",
    )
    result = _fit_single(cfg)
    assert result["step"] > 0 and set(result["metrics"]) == {
        "precision_at_1",
        "map_at_r",
        "r_precision",
    }


def test_fp16_run_keeps_grad_scaler_state_in_checkpoints(tmp_path, tiny_demo):
    cfg = tiny_config(
        tiny_demo, tmp_path / "runs", "cnn", "train.epochs=1", "eval.every=0", "train.opt_level=O1"
    )  # the apex alias for fp16 autocast + loss scaling
    first = _fit_single(cfg)
    ckpt = checkpoint.load(tmp_path / "runs" / "t" / "last.pt")
    assert ckpt["config"]["train"]["opt_level"] == "O1"
    assert ckpt["scaler"]["scale"] > 0 and "_growth_tracker" in ckpt["scaler"]
    resumed = _fit_single(
        tiny_config(
            tiny_demo,
            tmp_path / "runs",
            "cnn",
            "train.epochs=2",
            "eval.every=0",
            "train.opt_level=O1",
            "checkpoint.resume=auto",
        )
    )
    assert resumed["step"] == 2 * first["step"]


def test_fresh_start_refuses_to_overwrite_a_run(tmp_path, tiny_demo):
    cfg = tiny_config(tiny_demo, tmp_path / "runs", "cnn", "train.epochs=1", "eval.every=0")
    first = _fit_single(cfg)
    with pytest.raises(
        ValueError, match=r"already holds a run \(last.pt\).*checkpoint.resume=auto"
    ):
        _fit_single(cfg)
    done = _fit_single(
        tiny_config(
            tiny_demo,
            tmp_path / "runs",
            "cnn",
            "train.epochs=1",
            "eval.every=0",
            "checkpoint.resume=auto",
        )
    )
    assert done["step"] == first["step"] and done["history"] == first["history"]


def test_validation_is_cross_item_and_matches_the_offline_evaluation(tmp_path, tiny_demo):
    # Open-set validation: 3 held-out classes of 3 items x 4 clips. A clip may not retrieve clips
    # of its own item, in training as offline.
    from audioclf.evaluation.run import compute_metrics, embed_index
    from audioclf.evaluation.select import select_data
    from audioclf.inference import LoadedEmbedder
    from audioclf.metrics import retrieval_summary

    result = _fit_single(tiny_config(tiny_demo, tmp_path / "runs", "cnn", "train.epochs=1"))
    model = LoadedEmbedder.from_checkpoint(Path(result["run_dir"]) / "last.pt", torch.device("cpu"))
    data = select_data(model.cfg, split="val", gallery="none")
    emb, rows = embed_index(
        model, data.evaluated, batch_size=16, num_workers=0, progress=False, description="val"
    )
    labels = data.evaluated.labels()
    cross = retrieval_summary(emb, labels, rows["item"].to_numpy(dtype=str))
    assert cross["cross_item"] == 1.0
    for key in ("precision_at_1", "map_at_r", "r_precision"):
        assert result["metrics"][key] == pytest.approx(cross[key], abs=1e-6)
    offline = compute_metrics(
        emb, rows["cls"].to_numpy(dtype=object), items=rows["item"].to_numpy(dtype=object)
    ).results
    assert offline["map_at_r"] == pytest.approx(cross["map_at_r"], abs=1e-6)
    assert offline["loo_map_at_r"] == pytest.approx(retrieval_summary(emb, labels)["map_at_r"])


@pytest.mark.parametrize(
    "device, visible, started",
    [("auto", 1, False), ("cuda", 2, True), ("cuda", 0, False), ("cpu", 0, True)],
)
def test_nproc_is_checked_against_the_visible_gpus_before_any_rank_starts(
    device, visible, started, monkeypatch, capsys
):
    # A rank past the visible GPUs died in set_device ("invalid device ordinal") and the
    # launcher could only name exit codes. The device count is monkeypatched: no GPU here.
    import audioclf.distributed.launch as launch
    import audioclf.train as train
    import audioclf.training.rundir as rundir

    launched = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    # train imports the launcher when it launches (a Ctrl-C while torch loads is one line)
    monkeypatch.setattr(launch, "launch_ranks", lambda *args, **kw: launched.append(args))
    monkeypatch.setattr(rundir, "check_before_ranks", lambda cfg: None)  # no sheet here
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(visible))))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    status = train.main(["--nproc-per-node", "2", f"train.device={device}"])
    lines = capsys.readouterr().err.splitlines()
    assert (status, len(launched)) == ((0, 1) if started else (2, 0)), lines
    if not started:
        fix = "use --nproc-per-node 1 or fewer" if visible else "use train.device=cpu"
        assert lines == [
            "python -m audioclf.train: error: --nproc-per-node 2 starts a rank per GPU, but "
            f"{visible} GPU(s) are visible (CUDA_VISIBLE_DEVICES={','.join(map(str, range(visible)))}): {fix}"
        ]
