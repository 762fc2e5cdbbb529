"""Experiment trackers beside TensorBoard (train.tracker: mlflow or wandb), on rank 0 only.

A tracker gets the flattened config as parameters once, every epoch's metrics.csv row, and at
the end best.pt (and avg.pt) as artefacts. MLflow writes to MLFLOW_TRACKING_URI when set, else
to a local store in <run dir>/mlruns (`mlflow ui --backend-store-uri runs/<name>/mlruns`);
W&B runs offline unless WANDB_MODE / a login says otherwise (`wandb sync` uploads later). A
resumed run continues its tracker run: the id is kept in <run dir>/tracker.json. Both packages
are optional: a missing one is one error line naming the pip command.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from pathlib import Path

from audioclf.config import Config, to_dict
from audioclf.fileio import atomic_write_bytes

log = logging.getLogger("audioclf")

TRACKERS = {"mlflow": "mlflow-skinny", "wandb": "wandb"}  # tracker -> its pip package
ID_FILE = "tracker.json"


def flat_config(cfg: Config) -> dict[str, object]:
    """The config as dotted keys (the trackers' parameters)."""
    out: dict[str, object] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                out[f"{prefix}{key}"] = value

    walk(to_dict(cfg), "")
    return out


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        raise ValueError(
            f"train.tracker={name} needs the {name} package: pip install {TRACKERS[name]} "
            "(or train.tracker=none)"
        ) from None


class Tracker:
    """One run in an experiment tracker; `log_epoch` per metrics row, `finish` at the end."""

    def __init__(self, kind: str, run_dir: Path, cfg: Config):
        self.kind, self.run_dir = kind, run_dir
        id_file = run_dir / ID_FILE
        earlier = json.loads(id_file.read_text()).get(kind) if id_file.is_file() else None
        self._module = _import(kind)
        run_id = (
            self._mlflow_start(cfg, earlier)
            if kind == "mlflow"
            else self._wandb_start(cfg, earlier)
        )
        atomic_write_bytes(id_file, json.dumps({kind: run_id}).encode() + b"\n")
        log.info("train.tracker=%s: run %s%s", kind, run_id, " (resumed)" if earlier else "")

    def _mlflow_start(self, cfg: Config, earlier: str | None) -> str:
        mlflow = self._module
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # A local store without a database server or SQLAlchemy: MLflow 3 keeps its file
            # store working behind this switch (maintenance mode, no new features).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((self.run_dir / "mlruns").resolve().as_uri())
        if earlier is None:
            mlflow.set_experiment(cfg.train.name)
        run = mlflow.start_run(run_id=earlier, run_name=None if earlier else cfg.train.name)
        if earlier is None:
            params = flat_config(cfg)
            keys = list(params)
            for start in range(0, len(keys), 100):  # MLflow takes at most 100 per call
                mlflow.log_params({k: str(params[k])[:500] for k in keys[start : start + 100]})
        return run.info.run_id

    def _wandb_start(self, cfg: Config, earlier: str | None) -> str:
        wandb = self._module
        os.environ.setdefault("WANDB_MODE", "offline")
        run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "audioclf"),
            name=cfg.train.name,
            id=earlier,
            resume="allow" if earlier else None,
            dir=str(self.run_dir),
            config=flat_config(cfg),
        )
        self._run = run
        return run.id

    def log_epoch(self, row: dict) -> None:
        """The numbers of one metrics.csv row, at its epoch."""
        numbers = {
            k: float(v) for k, v in row.items() if k != "epoch" and isinstance(v, (int, float))
        }
        if self.kind == "mlflow":
            self._module.log_metrics(numbers, step=int(row["epoch"]))
        else:
            self._run.log(numbers, step=int(row["epoch"]))

    def finish(self, artefacts: list[Path]) -> None:
        """Attach the files that exist of `artefacts` (best.pt, avg.pt) and end the run (a run
        that failed: no artefacts)."""
        for path in (p for p in artefacts if p.is_file()):
            if self.kind == "mlflow":
                self._module.log_artifact(str(path))
            else:
                self._run.save(str(path), base_path=str(path.parent), policy="now")
        if self.kind == "mlflow":
            self._module.end_run()
        else:
            self._run.finish()


def check_tracker(cfg: Config) -> None:
    """ValueError naming the pip command when train.tracker's package is missing (before the
    run writes anything)."""
    if cfg.train.tracker != "none":
        _import(cfg.train.tracker)


def open_tracker(cfg: Config, run_dir: Path, primary: bool) -> Tracker | None:
    """The run's tracker on rank 0 (train.tracker), else None."""
    if cfg.train.tracker == "none" or not primary:
        return None
    return Tracker(cfg.train.tracker, run_dir, cfg)


def attach_report(run_dir: Path, out_dir: Path) -> str | None:
    """Add evaluate's report.json and report.md in `out_dir` as artefacts (under eval/) to the
    tracker run of the training run in `run_dir`, when it kept one (tracker.json); returns
    "mlflow" / "wandb", or None."""
    id_file = run_dir / ID_FILE
    files = [out_dir / name for name in ("report.json", "report.md") if (out_dir / name).is_file()]
    if not id_file.is_file() or not files:
        return None
    try:
        (kind, run_id), *_ = json.loads(id_file.read_text()).items()
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(
            f"{id_file} (the training's tracker run) is unreadable ({exc}); the report is in "
            f"{out_dir}, not attached: restore tracker.json, or delete it to stop attaching"
        ) from None
    module = _import(kind)
    if kind == "mlflow":
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            module.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        client = module.tracking.MlflowClient()
        for path in files:
            client.log_artifact(run_id, str(path), artifact_path="eval")
        return kind
    os.environ.setdefault("WANDB_MODE", "offline")
    run = module.init(id=run_id, resume="allow", dir=str(run_dir))
    for path in files:
        run.save(str(path), base_path=str(path.parent.parent), policy="now")
    run.finish()
    return kind
