"""Write an evaluation report: report.json, report.md and PNG plots, all written atomically.

``write_report`` (writer.py) takes the metric dicts from ``audioclf.metrics`` plus the
embeddings they were computed on, and writes into one directory:

- ``report.json``: scalar metrics, counts and per-class P@1 as plain JSON (NaN -> null);
- ``report.md``: the same as readable Markdown, per-class table worst first, image links
  (markdown.py);
- ``per_class_p1.png``, ``projection.png`` (PCA or t-SNE, coloured by class), and, when their
  inputs are given, ``det.png`` (DET curve) and ``confusion.png`` (kNN confusion matrix)
  (plots.py);
- ``embeddings.tsv`` + ``metadata.tsv`` (class and the given metadata columns, header row): the
  files https://projector.tensorflow.org loads, at most MAX_TSV_POINTS points;
- ``embeddings.html``: a self-contained interactive 2-D PCA scatter (hover: class, item, id;
  click a class to hide it), at most MAX_HTML_POINTS points (embedding_files.py; the page's
  template is the package-data file embeddings.html).

Both embedding files take a class-stratified sample when the set is larger (every class while
it lasts); report.md and report.json say how many points of how many each holds.

Each file goes to a temporary name in the same directory and is ``os.replace``d into place, so
a crash never leaves a half-written report file.
"""

from audioclf.report.embedding_files import EMBEDDING_FILES, MAX_HTML_POINTS, MAX_TSV_POINTS
from audioclf.report.plots import MAX_LABELLED_CLASSES, MAX_PROJECTION_POINTS
from audioclf.report.writer import PLOT_FILES, PROJECTIONS, REPORT_FILES, write_report

__all__ = [
    "EMBEDDING_FILES",
    "MAX_HTML_POINTS",
    "MAX_LABELLED_CLASSES",
    "MAX_PROJECTION_POINTS",
    "MAX_TSV_POINTS",
    "PLOT_FILES",
    "PROJECTIONS",
    "REPORT_FILES",
    "write_report",
]
