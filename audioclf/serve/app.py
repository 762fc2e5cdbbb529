"""The HTTP face of `audioclf serve` (Starlette, an ASGI app for uvicorn or any ASGI server).

    app = build_app(Service.open("runs/demo_cnn/best.pt", gallery="data/demo/index.xlsx"))

    POST /embed    audio -> {"dim", "clips": [{"name", "embedding": [D floats]}]}  (unit vectors)
    POST /rank     audio -> {"clips": [{"name", "classes": [{"class", "score"}]}]}  (?top=N)
    POST /search   audio -> {"clips": [{"name", "neighbours": [{"rank", "score", "class",
                   "item", "id", "row", "clip"}]}]}  (?k=N; norm_score with a cohort)
    GET /health    the model, its embedding size and rate, what is loaded, the knobs
    GET /metrics   Prometheus text: requests, clips, batch sizes, queue and request times
    GET /          the page: choose, drop or record a clip, see its classes and neighbours
    GET /clips/N   the audio of row N of the collection (the page plays the neighbours)

Audio is the request body (any format soundfile reads) or the file parts of a
multipart/form-data request, several clips at once. Errors are one line of JSON, {"error": ...}:
400 audio that cannot be decoded (naming the part), 404 no gallery / collection loaded, 413 a
body over --max-request-mb, a clip over --max-clip-seconds or more clips than --max-clips, 503
the queue is full (at once, with Retry-After), 421 a Host header that is not one of the server's
names (ServeOptions.answers_to). Nothing from a request is used as a file path:
clips are decoded from memory, and /clips/N serves the collection's own rows by number.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from importlib import resources

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse
from starlette.routing import Route

from audioclf.data.readers import AudioReadError
from audioclf.errors import one_line
from audioclf.serve.batcher import Overloaded
from audioclf.serve.service import LOOPBACK_NAMES, OverLimit, Service

PATHS = ("/", "/embed", "/rank", "/search", "/health", "/metrics")  # metered by path
QUEUED = ("/embed", "/rank", "/search")  # what queues clips for the model: 503 when full
RETRY = {"Retry-After": "1"}


def error(status: int, message: str, **headers: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


def misdirected(host: str | None) -> str:
    """The one line a request for another name gets (421)."""
    given = "no Host header" if host is None else f"the Host {host!r}"
    return (
        f"{given} is not a name of this server ({', '.join(LOOPBACK_NAMES)}, the address it "
        "listens on); start it with --allow-host NAME to answer to NAME too (docs/serving.md)"
    )


class Guard:
    """ASGI middleware: a request for another Host than this server's names is refused with
    421 (ServeOptions.answers_to), one for the model while the queue is full with 503, a body
    over --max-request-mb with 413 (by its Content-Length
    before a byte is read, else as soon as the bytes received pass it), and every answer is
    counted and timed in the service's stats by path."""

    def __init__(self, app, service: Service) -> None:
        self.app, self.service = app, service
        self.max_bytes = service.options.max_request_bytes

    def overloaded(self) -> str:
        """Why a request for the model is refused now ("" when the queue has room): checked
        here, before the router and before a byte of the body, so a refusal costs the event
        loop as little as it can while other requests keep it and the CPUs busy."""
        try:
            self.service.batcher.check_room()
        except Overloaded as exc:
            return one_line(exc)
        return ""

    def too_large(self) -> str:
        return (
            f"the request is over {self.service.options.max_request_mb:g} MB "
            "(--max-request-mb); send fewer or shorter clips"
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:  # answered by the app's HTTPException handler
                raise HTTPException(413, self.too_large())
            return message

        async def recorded_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"0")
        host = headers.get(b"host")
        host = None if host is None else host.decode("latin-1")
        try:
            if not self.service.options.answers_to(host, scope.get("server")):
                await error(421, misdirected(host))(scope, receive, recorded_send)
            elif scope["path"] in QUEUED and (full := self.overloaded()):
                await error(503, full, **RETRY)(scope, receive, recorded_send)
            elif length.isdigit() and int(length) > self.max_bytes:
                await error(413, self.too_large())(scope, receive, recorded_send)
            else:
                await self.app(scope, counted_receive, recorded_send)
        finally:
            path = scope["path"] if scope["path"] in PATHS else "other"
            stats = self.service.stats
            stats.count("audioclf_requests_total", {"path": path, "code": str(status[0])})
            stats.observe("audioclf_request_seconds", time.perf_counter() - start, {"path": path})


async def clips_of(request: Request, service: Service) -> list[tuple[str, str, bytes]]:
    """(name, where, bytes) of each clip: the file parts of a multipart form ("in part 2
    (a.wav)"), else the body ("in the request body"); `where` is what an error names."""
    limit = service.options.max_clips
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        body = await request.body()
        if not body:
            raise AudioReadError("no audio: send a file as the body or as multipart file parts")
        return [("body", "in the request body", body)]
    try:
        form = await request.form(max_files=limit, max_fields=limit)
    except HTTPException as exc:  # Starlette's "Too many files / fields" is ours to name
        if exc.status_code == 400 and "Too many" in str(exc.detail):
            raise OverLimit(f"more than {limit} clips in one request (--max-clips)") from None
        raise
    clips = []
    for number, (field, value) in enumerate(form.multi_items(), start=1):
        if not isinstance(value, UploadFile):
            raise AudioReadError(
                f"part {number} ({field}) is a text field, not a file: send audio as file "
                "parts (curl -F clip=@a.wav) and options in the query (?top=3)"
            )
        name = value.filename or field
        clips.append((name, f"in part {number} ({name})", await value.read()))
    await form.close()
    if not clips:
        raise AudioReadError("no audio: the form holds no file parts")
    return clips


def query_int(request: Request, name: str, default: int, most: int) -> int:
    """?name=N as an int in [1, most]; 400 naming it otherwise."""
    text = request.query_params.get(name)
    if text is None:
        return default
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise HTTPException(400, f"?{name}= must be a whole number from 1 to {most}, got {text!r}")
    return int(text)


async def in_workers(service: Service, fn, *args):
    """fn(*args) in the service's worker threads (off the event loop)."""
    return await asyncio.wrap_future(service.workers.submit(fn, *args))


async def embedded(request: Request) -> tuple[list[str], object]:
    """The request's clips decoded, batched with other requests' and embedded: (names,
    embeddings [n, D])."""
    service: Service = request.app.state.service
    clips = await clips_of(request, service)  # a full server was refused by the Guard
    with service.batcher.reserve(len(clips)) as slot:
        waves = await in_workers(
            service, lambda: [service.decode(data, where) for _, where, data in clips]
        )
        embeddings = await asyncio.wrap_future(slot.submit(waves))
    names = [name for name, _, _ in clips]
    return names, embeddings


async def embed(request: Request):
    names, embeddings = await embedded(request)
    clips = [{"name": n, "embedding": e.tolist()} for n, e in zip(names, embeddings)]
    return JSONResponse({"dim": int(embeddings.shape[1]), "clips": clips})


async def rank(request: Request):
    service: Service = request.app.state.service
    if service.gallery is None:
        return error(404, "no gallery: start the server with --gallery SHEET")
    top = query_int(request, "top", service.options.top, 1000)
    names, embeddings = await embedded(request)
    ranked = await in_workers(service, service.rank, embeddings, top)
    clips = [
        {"name": name, "classes": [{"class": c, "score": s} for c, s in classes]}
        for name, classes in zip(names, ranked)
    ]
    return JSONResponse({"gallery": str(service.gallery.sheet), "clips": clips})


async def search(request: Request):
    service: Service = request.app.state.service
    if service.searcher is None:
        return error(404, "no collection: start the server with --collection PREFIX")
    k = query_int(request, "k", service.options.k, 1000)
    names, embeddings = await embedded(request)
    found = await in_workers(service, service.search, embeddings, names, k)
    clips = [{"name": name, "neighbours": hits} for name, hits in zip(names, found)]
    return JSONResponse({"collection": str(service.searcher.collection.prefix), "clips": clips})


async def health(request: Request):
    return JSONResponse(request.app.state.service.health())


async def metrics(request: Request):
    return PlainTextResponse(
        request.app.state.service.stats.render(), media_type=CONTENT_TYPE_PLAIN_0_0_4
    )


async def page(request: Request):
    return HTMLResponse(request.app.state.page)


async def clip(request: Request):
    try:
        path = request.app.state.service.clip_path(int(request.path_params["row"]))
    except LookupError as exc:
        return error(404, str(exc))
    if not path.is_file():
        return error(404, f"clip {request.path_params['row']}'s file is gone from the server")
    return FileResponse(path)


async def user_error(request: Request, exc: Exception):
    status = {OverLimit: 413, Overloaded: 503}.get(type(exc), 400)
    return error(status, one_line(exc), **(RETRY if status == 503 else {}))


async def http_error(request: Request, exc: HTTPException):
    return error(exc.status_code, str(exc.detail))


async def server_error(request: Request, exc: Exception):
    return error(500, one_line(exc))


def build_app(service: Service) -> Guard:
    """The ASGI app serving `service`; it starts the batcher on startup and, on shutdown
    (after the requests in flight are answered), embeds what is queued and stops it."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:
            await run_in_threadpool(service.close)

    routes = [
        Route("/", page),
        Route("/embed", embed, methods=["POST"]),
        Route("/rank", rank, methods=["POST"]),
        Route("/search", search, methods=["POST"]),
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/clips/{row:int}", clip),
    ]
    handlers = {
        HTTPException: http_error,
        AudioReadError: user_error,
        OverLimit: user_error,
        Overloaded: user_error,
        ValueError: server_error,  # e.g. check_finite: the model gives NaN / inf
    }
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.service = service
    app.state.page = resources.files("audioclf.serve").joinpath("page.html").read_text()
    return Guard(app, service)
