"""Experiment trackers beside TensorBoard (train.tracker: mlflow or wandb), on rank 0 only.

A tracker gets the flattened config as parameters once, every epoch's metrics.csv row, and at
the end best.pt (and avg.pt) as artefacts. MLflow writes to MLFLOW_TRACKING_URI when set, else
to a local store in <run dir>/mlruns (`mlflow ui --backend-store-uri runs/<name>/mlruns`);
W&B runs offline unless WANDB_MODE / a login says otherwise (`wandb sync` uploads later). A
resumed run continues its tracker run: the id is kept in <run dir>/tracker.json. Both packages
are optional: a missing one is one error line naming the pip command.

A tracker never costs the run: one it cannot reach at start (an HTTP(S) MLFLOW_TRACKING_URI is
probed with a short connect timeout, before MLflow's own client, which retries for minutes) is
one warning and the run goes on without it, unless train.tracker_required=true, which makes it
one error line before anything is written; one that fails mid-run is disabled with one warning;
a resume whose tracker run is gone starts a new one and says so.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import socket
import urllib.parse
from pathlib import Path

from audioclf.config import Config, to_dict
from audioclf.fileio import atomic_write_bytes

log = logging.getLogger("audioclf")

TRACKERS = {"mlflow": "mlflow-skinny", "wandb": "wandb"}  # tracker -> its pip package
ID_FILE = "tracker.json"
CONNECT_SECONDS = 3.0  # the start-up probe of a tracking server


_LOCAL_STORES: set[str] = set()  # the run folders' stores this process pointed MLflow at


def user_tracking_uri() -> str:
    """MLFLOW_TRACKING_URI as the user set it: MLflow's set_tracking_uri also sets the variable,
    so that a later run in this process would otherwise write into an earlier run's store."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    return "" if uri in _LOCAL_STORES else uri


def _set_local_store(mlflow, store: Path) -> None:
    uri = store.resolve().as_uri()
    _LOCAL_STORES.add(uri)
    mlflow.set_tracking_uri(uri)


class TrackerUnreachable(ValueError):
    """The tracker's server did not answer the start-up probe."""


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
        earlier = read_tracker_id(id_file, kind)
        self._module = _import(kind)
        try:
            run_id = self._start(cfg, earlier)
        except Exception as exc:  # noqa: BLE001 - the tracker's own errors are many
            if earlier is None:
                raise
            log.warning(
                "train.tracker=%s: the run %s of %s is gone (%s); starting a new %s run",
                kind, earlier, id_file, _short(exc), kind,
            )  # fmt: skip
            earlier = None
            run_id = self._start(cfg, None)
        atomic_write_bytes(id_file, json.dumps({kind: run_id}).encode() + b"\n")
        log.info("train.tracker=%s: run %s%s", kind, run_id, " (resumed)" if earlier else "")

    def _start(self, cfg: Config, earlier: str | None) -> str:
        if self.kind == "mlflow":
            return self._mlflow_start(cfg, earlier)
        return self._wandb_start(cfg, earlier)

    def _mlflow_start(self, cfg: Config, earlier: str | None) -> str:
        mlflow = self._module
        if not user_tracking_uri():
            # A local store without a database server or SQLAlchemy: MLflow 3 keeps its file
            # store working behind this switch (maintenance mode, no new features).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            store = self.run_dir / "mlruns"
            if earlier is None:  # a store deleted since this process opened it: MLflow keeps
                (store / ".trash").mkdir(parents=True, exist_ok=True)  # it open, as it made it
            _set_local_store(mlflow, store)
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


class SafeTracker:
    """A Tracker whose failures never stop the run: the first one is one warning, and the
    tracker is then left alone for the rest of the run."""

    def __init__(self, tracker: Tracker):
        self.tracker, self.kind = tracker, tracker.kind

    def log_epoch(self, row: dict) -> None:
        self._call("log_epoch", row)

    def finish(self, artefacts: list[Path]) -> None:
        self._call("finish", artefacts)

    def _call(self, method: str, *args) -> None:
        if self.tracker is None:
            return
        try:
            getattr(self.tracker, method)(*args)
        except Exception as exc:  # noqa: BLE001 - whatever the tracker raises
            log.warning(
                "train.tracker=%s failed (%s): training goes on without it (metrics.csv and "
                "TensorBoard have everything)",
                self.kind,
                _short(exc),
            )
            self.tracker = None


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def read_tracker_id(id_file: Path, kind: str) -> str | None:
    """The tracker run id that `id_file` (tracker.json) keeps for `kind`, or None; ValueError
    naming the file when it is damaged."""
    if not id_file.is_file():
        return None
    try:
        ids = json.loads(id_file.read_text())
        if not isinstance(ids, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{id_file} (the id of this run's tracker run) is damaged ({_short(exc)}): delete "
            "it to start a new tracker run, or set train.tracker=none"
        ) from None
    earlier = ids.get(kind)
    return str(earlier) if earlier else None


def probe_tracker(kind: str, timeout: float = CONNECT_SECONDS) -> None:
    """TrackerUnreachable when the tracker's server does not take a connection within
    `timeout` seconds (an HTTP(S) MLFLOW_TRACKING_URI; local stores and W&B, which runs
    offline unless told otherwise, are not probed)."""
    uri = user_tracking_uri() if kind == "mlflow" else ""
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout).close()
    except OSError as exc:
        raise TrackerUnreachable(
            f"train.tracker=mlflow: MLFLOW_TRACKING_URI={uri} does not answer "
            f"({exc.strerror or exc} within {timeout:g} s)"
        ) from None


def check_tracker(cfg: Config, run_dir: Path | None = None) -> None:
    """Before the run writes anything: ValueError naming the pip command when train.tracker's
    package is missing, naming tracker.json in `run_dir` when it is damaged, and, with
    train.tracker_required=true, when the tracker's server does not answer."""
    if cfg.train.tracker == "none":
        return
    _import(cfg.train.tracker)
    if run_dir is not None:
        read_tracker_id(run_dir / ID_FILE, cfg.train.tracker)
    if cfg.train.tracker_required:
        try:
            probe_tracker(cfg.train.tracker)
        except TrackerUnreachable as exc:
            raise TrackerUnreachable(
                f"{exc}: start it, point MLFLOW_TRACKING_URI at one that runs, or set "
                "train.tracker_required=false to train without it"
            ) from None


def open_tracker(cfg: Config, run_dir: Path, primary: bool) -> SafeTracker | None:
    """The run's tracker on rank 0 (train.tracker), else None; a tracker that cannot be reached
    or started is one warning and None, unless train.tracker_required=true."""
    if cfg.train.tracker == "none" or not primary:
        return None
    try:
        probe_tracker(cfg.train.tracker)
        return SafeTracker(Tracker(cfg.train.tracker, run_dir, cfg))
    except Exception as exc:  # noqa: BLE001 - whatever the tracker raises
        if cfg.train.tracker_required or (isinstance(exc, ValueError) and ID_FILE in str(exc)):
            raise
        log.warning(
            "%s: training goes on without the tracker (train.tracker_required=true makes this "
            "an error)",
            exc
            if isinstance(exc, TrackerUnreachable)
            else f"train.tracker={cfg.train.tracker} could not start ({_short(exc)})",
        )
        return None


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
        if not user_tracking_uri():
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            _set_local_store(module, run_dir / "mlruns")
        try:
            probe_tracker(kind)
            client = module.tracking.MlflowClient()
            client.get_run(run_id)  # gone (a deleted store): nothing to attach to
            for path in files:
                client.log_artifact(run_id, str(path), artifact_path="eval")
        except Exception as exc:  # noqa: BLE001 - the report is written: the tracker is extra
            log.warning(
                "the report is in %s, not attached to the training's mlflow run %s (%s)",
                out_dir,
                run_id,
                _short(exc),
            )
            return None
        return kind
    os.environ.setdefault("WANDB_MODE", "offline")
    run = module.init(id=run_id, resume="allow", dir=str(run_dir))
    for path in files:
        run.save(str(path), base_path=str(path.parent.parent), policy="now")
    run.finish()
    return kind
