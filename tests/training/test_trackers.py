"""Experiment trackers (train.tracker): a real local MLflow store read back through MLflow's own
client, W&B offline without a key, a resume that continues the tracker run, and a missing
package as one line before anything is written."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from tests.helpers import fit, free_port, tiny_config

pytestmark = pytest.mark.slow  # trainings, and the trackers' own background processes


def test_mlflow_gets_params_epoch_metrics_and_best_pt_and_a_resume_continues(
    tmp_path, tiny_demo, monkeypatch
):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the tracker sets it

    runs = tmp_path / "runs"
    first = fit(tiny_config(tiny_demo, runs, "cnn", "train.tracker=mlflow", "train.epochs=2"))
    run_dir = tmp_path / "runs" / "t"
    run_id = json.loads((run_dir / "tracker.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    run = client.get_run(run_id)
    assert run.data.params["model.name"] == "cnn" and run.data.params["train.epochs"] == "2"
    losses = client.get_metric_history(run_id, "train_loss")
    assert [m.step for m in losses] == [1, 2]
    assert losses[-1].value == pytest.approx(first["history"][-1]["train_loss"])
    assert "map_at_r" in run.data.metrics and run.info.status == "FINISHED"
    assert "best.pt" in [a.path for a in client.list_artifacts(run_id)]
    fit(
        tiny_config(
            tiny_demo,
            runs,
            "cnn",
            "train.tracker=mlflow",
            "train.epochs=3",
            "checkpoint.resume=auto",
        )
    )
    assert json.loads((run_dir / "tracker.json").read_text())["mlflow"] == run_id
    assert [m.step for m in client.get_metric_history(run_id, "train_loss")] == [1, 2, 3]
    # evaluate adds its report to the training's run
    from audioclf.evaluate import main as evaluate

    assert evaluate(["--checkpoint", str(run_dir / "best.pt"), "--quiet"]) == 0
    reports = sorted(a.path for a in client.list_artifacts(run_id, "eval"))
    assert reports == ["eval/report.json", "eval/report.md"]
    # evaluate adds its report to the training's run
    from audioclf.evaluate import main as evaluate

    assert evaluate(["--checkpoint", str(run_dir / "best.pt"), "--quiet"]) == 0
    assert sorted(a.path for a in client.list_artifacts(run_id, "eval")) == [
        "eval/report.json",
        "eval/report.md",
    ]


def test_wandb_runs_offline_without_a_key(tmp_path, tiny_demo, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    fit(tiny_config(tiny_demo, tmp_path / "runs", "cnn", "train.tracker=wandb", "train.epochs=1"))
    run_dir = tmp_path / "runs" / "t"
    run_id = json.loads((run_dir / "tracker.json").read_text())["wandb"]
    (offline,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}")
    assert (offline / f"run-{run_id}.wandb").stat().st_size > 0  # what `wandb sync` uploads


def test_a_missing_tracker_package_is_one_line_before_anything_is_written(
    tmp_path, tiny_demo, monkeypatch
):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed: import fails
    with pytest.raises(ValueError, match=r"pip install mlflow-skinny \(or train.tracker=none\)"):
        fit(tiny_config(tiny_demo, tmp_path / "runs", "cnn", "train.tracker=mlflow"))
    assert not (tmp_path / "runs" / "t").exists()


def _unreachable_server(monkeypatch) -> str:
    """MLFLOW_TRACKING_URI at a local port nothing listens on. MLflow's own retries are cut
    short here so that a tracker that waits for them fails this test in seconds, not minutes."""
    uri = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    return uri


def test_an_unreachable_tracker_is_one_warning_and_training_goes_on(
    tmp_path, tiny_demo, monkeypatch
):
    uri = _unreachable_server(monkeypatch)
    summary = fit(tiny_config(tiny_demo, tmp_path / "runs", "cnn", "train.tracker=mlflow",
                              "train.epochs=1"))  # fmt: skip
    run_dir = tmp_path / "runs" / "t"
    assert (run_dir / "best.pt").is_file() and summary["history"]
    log = (run_dir / "train.log").read_text()
    assert f"train.tracker=mlflow: MLFLOW_TRACKING_URI={uri} does not answer" in log
    assert "training goes on without the tracker (train.tracker_required=true" in log
    assert not (run_dir / "tracker.json").exists()


def test_a_required_tracker_that_is_down_is_one_error_before_anything_is_written(
    tmp_path, tiny_demo, monkeypatch
):
    uri = _unreachable_server(monkeypatch)
    cfg = tiny_config(
        tiny_demo, tmp_path / "runs", "cnn", "train.tracker=mlflow", "train.tracker_required=true"
    )
    with pytest.raises(ValueError) as caught:
        fit(cfg)
    assert str(caught.value).startswith(f"train.tracker=mlflow: MLFLOW_TRACKING_URI={uri} does")
    assert "train.tracker_required=false to train without it" in str(caught.value)
    assert not (tmp_path / "runs" / "t").exists()


def test_a_resume_or_evaluate_whose_tracker_run_is_gone_goes_on_and_says_so(
    tmp_path, tiny_demo, monkeypatch, capsys
):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runs, run_dir = tmp_path / "runs", tmp_path / "runs" / "t"
    fit(tiny_config(tiny_demo, runs, "cnn", "train.tracker=mlflow", "train.epochs=1"))
    first = json.loads((run_dir / "tracker.json").read_text())["mlflow"]
    shutil.rmtree(run_dir / "mlruns")  # the tracker's store deleted
    fit(tiny_config(tiny_demo, runs, "cnn", "train.tracker=mlflow", "train.epochs=2",
                    "checkpoint.resume=auto"))  # fmt: skip
    second = json.loads((run_dir / "tracker.json").read_text())["mlflow"]
    assert second != first
    assert (
        f"the run {first} of {run_dir / 'tracker.json'} is gone"
        in (run_dir / "train.log").read_text()
    )
    assert "starting a new mlflow run" in (run_dir / "train.log").read_text()
    shutil.rmtree(run_dir / "mlruns")
    from audioclf.evaluate import main as evaluate

    capsys.readouterr()
    assert evaluate(["--checkpoint", str(run_dir / "best.pt"), "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert f"not attached to the training's mlflow run {second} (" in out + err
    assert "Traceback" not in out + err


def test_a_damaged_tracker_json_is_named(tmp_path, tiny_demo, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    runs, run_dir = tmp_path / "runs", tmp_path / "runs" / "t"
    fit(tiny_config(tiny_demo, runs, "cnn", "train.tracker=mlflow", "train.epochs=1"))
    text = (run_dir / "tracker.json").read_text()
    (run_dir / "tracker.json").write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match="tracker.json .* is damaged .*delete it to start a new"):
        fit(tiny_config(tiny_demo, runs, "cnn", "train.tracker=mlflow", "train.epochs=2",
                        "checkpoint.resume=auto"))  # fmt: skip
