"""Precomputed log-mel features: the library under `python -m audioclf.prepare`.

names   the file-system-safe feature paths DIR/features/<class>/<id>.npy
files   one audio file → one .npy (atomic, resumable), in a pool of worker processes
run     one (sharded) run: the output folder, shard records, the output index
"""

from audioclf.precompute.names import feature_paths
from audioclf.precompute.run import Shard, Summary, feature_settings, prepare, train_command

__all__ = [
    "Shard",
    "Summary",
    "feature_paths",
    "feature_settings",
    "prepare",
    "train_command",
]
