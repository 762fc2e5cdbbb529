"""`--adapt` / `adapt=` / `Model.adapt`: AdaBN of a loaded checkpoint on unlabelled audio of a
new source.

    adapted = adapt(model, ["new_source/"])   # files, folders searched recursively
    adapted.adaptation   # {"method": "adabn", "clips", "batchnorm_layers", "source", "statistics"}

The files are found and read as embedding finds and reads them (audioclf.inference.extract's
find_files and read_clips: the model's sample rate and evaluation clip) and passed to
audioclf.models.adapt.adapt_batchnorm, which changes a copy of the network; `model` is left as it
is. The adapted model's description ends with what was done, so every output that names the
model says it (embed's first line, evaluate's report, a search collection's model record), and
its `adaptation` keys the caches and part files that depend on the embeddings ("statistics":
a digest of the adapted running statistics). Exports cannot be adapted (their statistics are
fixed): adapt the checkpoint they were exported from, or export with `export --adapt`. The
network is measured under the exact arithmetic of embedding (precision.exact_arithmetic: IEEE
fp32, no cuDNN autotuning, compiled modules eager), so the statistics do not depend on the TF32
a training in the same process left on.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import hashlib
from collections.abc import Sequence
from pathlib import Path

from torch import nn

from audioclf import distributed
from audioclf.inference.artefacts import LoadedEmbedder, describe_adaptation
from audioclf.inference.extract import find_files, read_clips
from audioclf.models.adapt import adapt_batchnorm, batchnorm_layers
from audioclf.precision import exact_arithmetic


def adapt(
    model: LoadedEmbedder, sources: Sequence[str | Path], *, flag: str = "--adapt"
) -> LoadedEmbedder:
    """A copy of `model` (a checkpoint) whose BatchNorm statistics are those of the audio in
    `sources` (AdaBN), its `adaptation` the record of what was done. ValueError for an export,
    for no sources or an empty path among them (`flag`: how the caller's user passed them), for
    no audio found, and naming a file that cannot be read."""
    check_sources(sources, flag)
    if model.network is None:
        raise ValueError(
            f"--adapt needs an audioclf checkpoint, not {model.description} ({model.path}): "
            "adapt the checkpoint it was exported from (an export's statistics are fixed)"
        )
    sources = [Path(s) for s in sources]
    files = find_files(sources, model.features)
    adapted = _copy(model)
    clips = read_clips(adapted, files)  # on the host; moved a batch at a time
    with exact_arithmetic():
        measured = adapt_batchnorm(adapted.network, clips)
    record = {
        **measured,
        "source": [str(s) for s in sources],
        "statistics": statistics_digest(adapted.network),
    }
    return _described(adapted, model, record)


def check_sources(sources: Sequence[str | Path], flag: str = "--adapt") -> None:
    """ValueError for no sources, or an empty path among them (Path("") is the working
    folder: adapting on whatever audio lies there would be silent)."""
    fix = "pass the files or folders of unlabelled audio of the new source"
    if not sources:
        raise ValueError(f"{flag} got no files or folders; {fix}")
    if any(not str(source).strip() for source in sources):
        raise ValueError(f"{flag} got an empty path (''); {fix}")


def adapt_across_ranks(model: LoadedEmbedder, sources: Sequence[str | Path]) -> LoadedEmbedder:
    """adapt() under a process group (embed --index under torchrun): rank 0 reads the clips
    and measures, every rank takes its statistics, so all embed with one network and the new
    source is read once (its errors are raised on every rank). The other ranks wait for rank 0
    up to adaptation_timeout() of the files found, not the process group's timeout (30 minutes:
    a large source takes longer). Without a group: adapt()."""
    if not distributed.is_initialized():
        return adapt(model, sources)
    files = find_files([Path(s) for s in sources], model.features)  # a listing: every rank

    def measure() -> tuple[dict, list[tuple]]:
        adapted = adapt(model, sources)
        layers = batchnorm_layers(adapted.network)
        return adapted.adaptation, [(b.running_mean.cpu(), b.running_var.cpu()) for b in layers]

    record, statistics = distributed.primary_only(measure, timeout=adaptation_timeout(len(files)))
    adapted = _copy(model)
    for layer, (mean, var) in zip(batchnorm_layers(adapted.network), statistics, strict=True):
        layer.running_mean.copy_(mean)
        layer.running_var.copy_(var)
    return _described(adapted, model, record)


def adaptation_timeout(files: int) -> datetime.timedelta:
    """How long the other ranks wait for rank 0 to read and measure `files` clips: 30 minutes,
    plus half a second a clip (reading, resampling, a partial forward per BatchNorm layer)."""
    return datetime.timedelta(minutes=30, seconds=0.5 * files)


def _copy(model: LoadedEmbedder) -> LoadedEmbedder:
    network = copy.deepcopy(model.network)
    return dataclasses.replace(model, embed_fn=network.embed, network=network)


def _described(adapted: LoadedEmbedder, model: LoadedEmbedder, record: dict) -> LoadedEmbedder:
    # adapted again: the new statistics replace the old
    base = model.description.removesuffix(describe_adaptation(model.adaptation))
    return dataclasses.replace(
        adapted, adaptation=record, description=base + describe_adaptation(record)
    )


def statistics_digest(network: nn.Module) -> str:
    """A short key of every BatchNorm's running statistics: which adaptation made embeddings."""
    hashed = hashlib.blake2b(digest_size=8)
    for layer in batchnorm_layers(network):
        hashed.update(layer.running_mean.detach().cpu().numpy().tobytes())
        hashed.update(layer.running_var.detach().cpu().numpy().tobytes())
    return hashed.hexdigest()
