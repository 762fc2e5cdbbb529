"""The export sidecar <artefact>.json: what `export` writes next to an artefact so that it runs
without audioclf's training config, and what `load_embedder` reads back."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from audioclf.config import Config, config_from_dict


def sidecar_path(artefact: str | Path) -> Path:
    """<artefact>.json"""
    artefact = Path(artefact)
    return artefact.with_name(artefact.name + ".json")


@dataclass
class ExportSidecar:
    """Everything needed to run an exported model without audioclf's training config."""

    format: str  # torchscript | onnx | state_dict
    file: str  # the artefact's file name
    input_kind: str  # "waveform" or "log_mel"
    inputs: dict[str, str]  # input name -> what it holds
    outputs: dict[str, str]  # output name -> what it holds
    output_names: list[str]
    embedding_dim: int
    sample_rate: int
    features: dict[str, Any]  # the FeaturesConfig the model was trained with
    model: dict[str, Any]  # the ModelConfig
    classes: list[str]  # names of the classifier head's outputs ([] without a head)
    data_columns: dict[str, Any]  # index sheet column settings (for reading a gallery)
    checkpoint: dict[str, Any]  # source checkpoint path, epoch, step
    parity: dict[str, Any]  # max_abs_diff, tolerance, input_shapes
    versions: dict[str, str]
    opset: int | None = None  # ONNX only
    clips: dict[str, Any] = dataclasses.field(default_factory=dict)  # how evaluation reads files
    adaptation: dict[str, Any] | None = None  # export --adapt: what the statistics were adapted on

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        for optional in ("opset", "adaptation"):
            if fields[optional] is None:
                del fields[optional]
        return json.dumps(fields, indent=2) + "\n"

    @classmethod
    def read(cls, path: str | Path) -> ExportSidecar:
        """Parse a sidecar; ValueError / KeyError / TypeError when it is not one."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def sidecar_config(meta: ExportSidecar) -> Config:
    """A Config holding what a sidecar records (features, clips, the sheet's columns); older
    sidecars' features sections are read as their release wrote them. Raises ConfigError."""
    return config_from_dict(
        {"features": meta.features, "clips": meta.clips, "data": meta.data_columns}
    )
