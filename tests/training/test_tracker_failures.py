"""A tracker that fails mid-run is disabled with one warning; the run never stops for it."""

from __future__ import annotations

from pathlib import Path

from audioclf.training.trackers import SafeTracker


class _Failing:
    """A tracker whose server went away after the start."""

    kind = "mlflow"

    def __init__(self):
        self.calls = 0

    def log_epoch(self, row: dict) -> None:
        self.calls += 1
        raise ConnectionError("API request to http://127.0.0.1:9/api failed: refused")

    def finish(self, artefacts: list[Path]) -> None:
        self.calls += 1
        raise ConnectionError("refused")


def test_a_tracker_failing_mid_run_is_one_warning_then_left_alone(notes):
    failing = _Failing()
    tracker = SafeTracker(failing)
    for epoch in (1, 2):
        tracker.log_epoch({"epoch": epoch, "train_loss": 0.5})
    tracker.finish([])
    assert failing.calls == 1
    warnings = [n for n in notes if "train.tracker=mlflow failed" in n]
    assert warnings == [
        "train.tracker=mlflow failed (API request to http://127.0.0.1:9/api failed: refused): "
        "training goes on without it (metrics.csv and TensorBoard have everything)"
    ]
