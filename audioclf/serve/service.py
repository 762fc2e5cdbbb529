"""What `audioclf serve` does with a request, without the HTTP: a loaded model with its
micro-batcher, and the gallery, collection and cohort it answers from.

    service = Service.open("runs/demo_cnn/best.pt", gallery="data/demo/index.xlsx",
                           collection="runs/demo_cnn/embed/all", options=ServeOptions())
    service.start()
    clips = [service.decode(data, "in part 1 (a.wav)")]    # bytes of any soundfile format
    with service.batcher.reserve(len(clips)) as slot:
        embeddings = slot.submit(clips).result()           # as Model.embed gives for the file
    service.rank(embeddings, top=5)                        # [[(class, score), ...] per clip]
    service.search(embeddings, ["a.wav"], k=10)            # [[neighbour dict, ...] per clip]
    service.close()

Embedding, ranking and searching are the API's own (audioclf.api.Model,
audioclf.embedding.gallery, audioclf.search.queries): a served clip gets the numbers
`audioclf.load(MODEL).embed([file])` gives, its ranking `embed --gallery`'s, its neighbours
`search query`'s.
"""

from __future__ import annotations

import io
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from audioclf.api import Model, load
from audioclf.data.index.table import SUPPORTED_FORMATS
from audioclf.data.readers import AudioReadError, AudioTooLong, load_audio
from audioclf.embedding.gallery import Gallery
from audioclf.search.queries import Queries, Searcher
from audioclf.serve.batcher import MicroBatcher
from audioclf.serve.stats import Stats

log = logging.getLogger("audioclf")
WORKER_THREADS = min(4, os.cpu_count() or 1)


class OverLimit(ValueError):
    """A clip over --max-clip-seconds, or a request with more clips than --max-clips (HTTP
    413)."""


@dataclass(frozen=True)
class ServeOptions:
    """The server's knobs (audioclf serve --help says what each trades)."""

    max_batch: int = 32  # clips per model call
    max_wait_ms: float = 5.0  # how long the oldest waiting clip may wait for more
    max_queue: int = 256  # clips admitted and not yet embedded; more: 503 at once
    max_clips: int = 32  # clips in one request
    max_request_mb: float = 16.0  # request body; more: 413
    max_clip_seconds: float = 60.0  # one clip's duration; longer: 413
    top: int = 5  # classes per clip in /rank (?top=N)
    k: int = 10  # neighbours per clip in /search (?k=N)
    # Host names answered besides LOOPBACK_NAMES and the address listened on; others: 421
    allow_host: tuple[str, ...] = ()

    def check(self) -> None:
        """ValueError naming the flag of the first knob out of range."""
        lowest = {"max_batch": 1, "max_queue": 1, "max_clips": 1, "top": 1, "k": 1}
        for name in self.allow_host:
            if not isinstance(name, str) or not HOST_NAME.fullmatch(name):
                raise ValueError(
                    f"--allow-host (allow_host) takes a host name or address as a browser "
                    f"sends it in the Host header (example.org, 10.0.0.5, [fe80::1]), got {name!r}"
                )
        for name, value in asdict(self).items():
            if name == "allow_host":
                continue
            flag = f"--{name.replace('_', '-')}"
            if name in lowest and value < lowest[name]:
                raise ValueError(f"{flag} must be >= {lowest[name]}, got {value}")
            if name not in lowest and not (value >= 0 if name == "max_wait_ms" else value > 0):
                raise ValueError(
                    f"{flag} must be {'>=' if name == 'max_wait_ms' else '>'} 0, got {value}"
                )
        if self.max_clips > self.max_queue:
            raise ValueError(
                f"--max-clips {self.max_clips} exceeds --max-queue {self.max_queue}: such a "
                "request could never be admitted; raise --max-queue or lower --max-clips"
            )

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mb * 1024 * 1024)

    def answers_to(self, host: str | None, server: tuple | None) -> bool:
        """Whether a request with this Host header (None: none sent), come to the `server`
        address (ASGI's scope["server"]: the address it was listened for on), is for this
        server: a loopback name, that address, or an --allow-host name, with any port. A page
        of another site whose name resolves to this machine (DNS rebinding) sends its own name."""
        if host is None:
            return False
        allowed = {*LOOPBACK_NAMES, *(host_name(name) for name in self.allow_host)}
        if server:
            address = str(server[0]).lower()
            allowed.add(f"[{address}]" if ":" in address else address)
        return host_name(host) in allowed


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
# A Host header's name: letters, digits, dots and dashes, or an IPv6 address in brackets, and an
# optional :port
HOST_NAME = re.compile(r"([a-z0-9.-]+|\[[0-9a-f:.]+\])(:\d+)?", re.IGNORECASE)


def host_name(host: str) -> str:
    """A Host header's name in lower case, without its port: "[::1]:8000" -> "[::1]"."""
    host = host.strip().lower()
    name, colon, port = host.rpartition(":")
    if colon and port.isdigit() and not name.endswith(":"):  # not a bare IPv6 address
        return name
    return host


def check_gallery(sheet: Path) -> None:
    """ValueError naming --gallery (Service.open's gallery=) when `sheet` is no index sheet
    file: the sheet reader's own message names data.index, a training key."""
    if sheet.suffix.lower() not in SUPPORTED_FORMATS.split(", "):
        problem = f"is not an index sheet ({SUPPORTED_FORMATS})"
    elif not sheet.is_file():
        problem = "does not exist"
    else:
        return
    raise ValueError(
        f"--gallery {sheet} {problem}: give --gallery (gallery= in Python) the index sheet of "
        "labelled clips /rank ranks against, e.g. data/demo/index.xlsx"
    )


class Service:
    """A model behind the micro-batcher, with what it ranks and searches against."""

    def __init__(self, model: Model, options: ServeOptions, stats: Stats | None = None):
        options.check()
        self.model, self.options = model, options
        self.stats = stats or Stats()
        self.batcher = MicroBatcher(
            model.embed_prepared,
            max_batch=options.max_batch,
            max_wait_ms=options.max_wait_ms,
            max_queue=options.max_queue,
            stats=self.stats,
        )
        # Decoding, ranking and searching run here, off the event loop: a few threads, not one
        # per waiting request (each thread that allocates keeps a malloc arena of its own)
        self.workers = ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="audioclf-serve")
        self.gallery: Gallery | None = None
        self.searcher: Searcher | None = None
        silence = np.zeros(model.sample_rate, np.float32)  # also warms the model up
        self.dim = int(model.embed_waveforms([silence], model.sample_rate).shape[1])

    @classmethod
    def open(
        cls,
        model: str | Path,
        *,
        gallery: str | Path | None = None,
        collection: str | Path | None = None,
        cohort: str | Path | None = None,
        score_norm: str | None = None,
        cohort_top: int | None = None,
        device: str = "auto",
        trust: bool = False,
        options: ServeOptions | None = None,
    ) -> Service:
        """The model (any artefact audioclf.load takes) with the gallery sheet and the
        collection PREFIX (with its cohort PREFIX) loaded; ValueError naming a file that does
        not fit, before the server listens."""
        options = options or ServeOptions()
        options.check()
        if gallery is not None:
            check_gallery(Path(gallery))
        if cohort is not None and collection is None:
            raise ValueError("--cohort normalises --collection's scores: give --collection too")
        service = cls(load(model, device=device, trust=trust), options)
        loaded = service.model.loaded
        if gallery is not None:
            service.gallery = Gallery.open(loaded, gallery)
        if collection is not None:
            service.searcher = searcher = Searcher.open(
                collection,
                model=loaded,
                device=loaded.device,
                cohort=cohort,
                score_norm=score_norm,
                cohort_top=cohort_top,
                flag="--collection",
            )
            if searcher.warning:
                log.warning("%s", searcher.warning)
            if searcher.index.dim != service.dim:
                raise ValueError(
                    f"--collection {collection} holds {searcher.index.dim}-d embeddings but the "
                    f"model makes {service.dim}-d ones; serve the model that embedded it"
                )
        return service

    def start(self) -> None:
        self.batcher.start()

    def close(self) -> None:
        """Embed the clips already queued, then stop the batcher and the workers."""
        self.batcher.close()
        self.workers.shutdown(wait=True)

    def decode(self, data: bytes, name: str) -> torch.Tensor:
        """An uploaded file's bytes as the model takes them (read as a file of that format is
        read for Model.embed); `name` says where they came from ("in part 2 (a.wav)"):
        AudioReadError naming it when they are no audio, OverLimit past --max-clip-seconds."""
        limit = self.options.max_clip_seconds
        if not data:
            raise AudioReadError(f"no audio {name}: send the bytes of an audio file")
        try:  # the limit by the header when it tells, else by what is read (a pipe's FLAC)
            wave = load_audio(
                io.BytesIO(data), self.model.sample_rate, name=name, max_seconds=limit
            )
        except AudioTooLong as exc:
            raise OverLimit(
                f"{exc}; this server takes clips of at most {limit:g} s (--max-clip-seconds)"
            ) from None
        return self.model.prepare_waveform(wave, self.model.sample_rate)

    def rank(self, embeddings: np.ndarray, top: int) -> list[list[tuple[str, float]]]:
        if self.gallery is None:
            raise LookupError("no gallery: start the server with --gallery SHEET")
        return self.gallery.rank(embeddings, top)

    def search(self, embeddings: np.ndarray, names: list[str], k: int) -> list[list[dict]]:
        """Each clip's k nearest collection rows, best first: rank, score (norm_score), class,
        item, id, and the row with its audio's URL."""
        if self.searcher is None:
            raise LookupError("no collection: start the server with --collection PREFIX")
        queries = Queries(embeddings, pd.DataFrame({"query": names}), f"{len(names)} clip(s)")
        hits = self.searcher.neighbours(queries, k)
        rows = self.searcher.collection.rows.iloc[hits.row][["class", "item", "id"]]
        found: list[list[dict]] = [[] for _ in names]
        for at, (query, row, about) in enumerate(
            zip(hits.query, hits.row, rows.to_dict("records"))
        ):
            hit = {"rank": int(hits.rank[at]), "score": float(hits.score[at]), **about}
            if hits.norm_score is not None:
                hit["norm_score"] = float(hits.norm_score[at])
            found[query].append({**hit, "row": int(row), "clip": f"/clips/{row}"})
        return found

    def clip_path(self, row: int) -> Path:
        """The audio file of a collection row (the rows of the server's own collection only)."""
        if self.searcher is None or not 0 <= row < self.searcher.collection.size:
            raise LookupError(f"no clip {row} in the collection")
        return Path(str(self.searcher.collection.rows["path"].iloc[row]))

    def describe(self) -> str:
        """One line: the model, and the gallery and collection loaded."""
        loaded = self.model.loaded
        parts = [f"model {loaded.path} ({loaded.description}) on {loaded.device}"]
        if self.gallery is not None:
            cached = ", cached" if self.gallery.cached else ""
            parts.append(
                f"gallery {self.gallery.sheet} ({len(self.gallery.classes)} clips, "
                f"{len(np.unique(self.gallery.classes))} classes{cached})"
            )
        if self.searcher is not None:
            norm = self.searcher.norm
            parts.append(
                f"collection {self.searcher.index.describe()}"
                + ("" if norm is None else f", norm_score: {norm.describe()}")
            )
        return "; ".join(parts)

    def answered(self) -> int:
        """Requests answered so far (any status)."""
        return int(self.stats.total("audioclf_requests_total"))

    def health(self) -> dict[str, Any]:
        """What GET /health answers: the model, its embedding size and rate, what is loaded."""
        loaded = self.model.loaded
        gallery = self.gallery
        searcher = self.searcher
        return {
            "status": "ok",
            "model": {
                "path": str(loaded.path),
                "description": loaded.description,
                "embedding_dim": self.dim,
                "sample_rate": self.model.sample_rate,
                "device": str(loaded.device),
            },
            "gallery": None
            if gallery is None
            else {
                "sheet": str(gallery.sheet),
                "clips": len(gallery.classes),
                "classes": len(np.unique(gallery.classes)),
            },
            "collection": None
            if searcher is None
            else {
                "prefix": str(searcher.collection.prefix),
                "clips": searcher.collection.size,
                "index": searcher.index.method,
                "score_norm": None if searcher.norm is None else searcher.norm.record(),
            },
            "options": asdict(self.options),
        }
