"""Using a model outside the training loop: the library under evaluate, export and embed.

    net, cfg, ckpt = load_trained("runs/demo/best.pt")        # EmbeddingNet in eval mode
    model = load_embedder("model.onnx", torch.device("cpu"))  # any artefact → one embed function
    files, emb, skipped = embed_paths(model, ["a.wav", "b.wav"], batch_size=16)  # [2, D]

Modules:
    checkpoints         load_trained, init_weights (fine-tuning; the trainer calls it)
    extract             the one embedding path: embed_dataset (training's validation runs it
                        too), embed_paths (files, segments, skipping unreadable ones),
                        embed_waves (in-memory audio), find_files (the files a user names)
    formats             TorchScript / ONNX artefacts: each format's writer and loader
    sidecar             the export sidecar <artefact>.json
    artefacts           load_embedder: checkpoint, state_dict, TorchScript, ONNX → LoadedEmbedder;
                        resolve_device: the --device / device= choice
    exporting           export_model: the exported module, the parity check, the sidecar

Evaluation (audioclf.evaluation) and embedding a collection (audioclf.embedding) build on it.
Nothing here imports the trainer, search or a CLI module; the names below are what training, tests and
benchmarks import from `audioclf.inference`.
"""

from audioclf.inference.artefacts import LoadedEmbedder, load_embedder, resolve_device
from audioclf.inference.checkpoints import (
    describe_checkpoint,
    init_weights,
    load_trained,
)
from audioclf.inference.extract import embed_dataset, embed_paths, embed_waves, find_files

__all__ = [
    "LoadedEmbedder",
    "describe_checkpoint",
    "embed_dataset",
    "embed_paths",
    "embed_waves",
    "find_files",
    "init_weights",
    "load_embedder",
    "load_trained",
    "resolve_device",
]
