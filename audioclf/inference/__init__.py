"""Using a model outside the training loop: the library under evaluate, export and embed.

    net, cfg, ckpt = load_trained("runs/demo/best.pt")        # EmbeddingNet in eval mode
    emb = embed_files(net, cfg, ["a.wav", "b.wav"], batch_size=16, device="cpu")  # [2, D]
    model = load_embedder("model.onnx", torch.device("cpu"))  # any artefact → one embed function

Modules:
    checkpoints         load_trained, init_weights (fine-tuning; the trainer calls it)
    extract             extract_embeddings (training's validation runs it too), embed_files
    formats             TorchScript / ONNX artefacts: each format's writer and loader
    sidecar             the export sidecar <artefact>.json
    artefacts           load_embedder: checkpoint, state_dict, TorchScript, ONNX → LoadedEmbedder
    exporting           export_model: the exported module, the parity check, the sidecar
    evaluation          evaluate's data selection, embedding, report folder and printed summary
    evaluation_metrics  every metric of one evaluated set (retrieval, classification, ...)
    gallery             embed's class ranking of files against a gallery sheet (cached)
    index_embedding     embed --index: every row of a sheet into resumable part files
    index_parts         the files of an --index run: PREFIX.* names, the part files, their manifest

Nothing here imports the trainer or a CLI module; the names below are what training, tests and
benchmarks import from `audioclf.inference`.
"""

from audioclf.inference.artefacts import ArtefactError, LoadedEmbedder, load_embedder
from audioclf.inference.checkpoints import (
    checkpoint_config,
    describe_checkpoint,
    init_weights,
    load_trained,
)
from audioclf.inference.extract import (
    LOG_MEL,
    WAVEFORM,
    embed_files,
    extract_embeddings,
    file_dataset,
)

__all__ = [
    "LOG_MEL",
    "WAVEFORM",
    "ArtefactError",
    "LoadedEmbedder",
    "checkpoint_config",
    "describe_checkpoint",
    "embed_files",
    "extract_embeddings",
    "file_dataset",
    "init_weights",
    "load_embedder",
    "load_trained",
]
