"""Offline evaluation (`python -m audioclf.evaluate`) as one call, `evaluate(checkpoint, ...)`
(run.py: the job, embedding and scoring; select.py: which rows; report.py: the report folder
under its lock), every metric of one evaluated set (metrics.py, over audioclf.metrics with the search backend
injected), and the report folder (report.py with markdown.py, plots.py, embedding_files.py):

- ``report.json``: scalar metrics, counts and per-class P@1 as plain JSON (NaN -> null);
- ``report.md``: the same as readable Markdown, per-class table worst first, image links;
- ``per_class_p1.png``, ``projection.png`` (PCA or t-SNE, coloured by class), and, when their
  inputs are given, ``det.png`` (DET curve) and ``confusion.png`` (kNN confusion matrix);
- ``embeddings.tsv`` + ``metadata.tsv``: the files https://projector.tensorflow.org loads;
- ``embeddings.html``: a self-contained interactive 2-D PCA scatter (the page's template is
  the package-data file embeddings.html).

Every file goes to a temporary name in the same folder and is renamed into place, so a crash
never leaves a half-written report file.
"""

from audioclf.evaluation.run import Evaluated, EvaluateOptions, evaluate

__all__ = ["Evaluated", "EvaluateOptions", "evaluate"]
