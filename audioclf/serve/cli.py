"""`audioclf serve MODEL` (= python -m audioclf.serve): a trained model behind an HTTP server on
this machine, with a page to try it in a browser.

    audioclf serve runs/demo_cnn/best.pt --gallery data/demo/index.xlsx \\
        --collection runs/demo_cnn/embed/all
    curl -F clip=@a.wav http://127.0.0.1:8000/rank       # or open http://127.0.0.1:8000/

MODEL is any artefact audioclf.load takes: a checkpoint, a state-dict export, or a TorchScript /
ONNX export beside its sidecar. POST /embed, /rank (the --gallery sheet's classes, as embed
--gallery ranks them) and /search (the nearest clips of the --collection PREFIX of embed --index,
with norm_score against a --cohort PREFIX); GET /health, /metrics (Prometheus) and / (the page).
Clips from concurrent requests are embedded together: a batch of up to --max-batch clips starts
when that many wait or --max-wait-ms after the oldest came. Limits: --max-request-mb (413),
--max-clip-seconds (413), --max-clips per request (413), --max-queue clips waiting (503 at once).
It listens on 127.0.0.1 only unless --host says otherwise (docs/serving.md: a reverse proxy for
other machines), and answers only requests for its own names (the Host header: 127.0.0.1,
localhost, [::1], the address it listens on, --allow-host NAME; others get 421). SIGTERM or
Ctrl-C: no new connections, the requests in flight answered, exit 0.
Needs the [serve] extra: pip install "audioclf[serve]" (starlette, uvicorn, python-multipart,
prometheus_client).
"""

from __future__ import annotations

import argparse
from dataclasses import fields

import torch

from audioclf.errors import UsageError, add_trust_flag, run_cli
from audioclf.metrics import SCORE_NORMS

PROG = "audioclf serve"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
ALLOW = (
    "answer requests whose Host header names NAME too (repeatable); always answered: "
    "127.0.0.1, localhost, [::1] and the address it listens on; others get 421"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from audioclf.serve.service import ServeOptions  # noqa: PLC0415 - the flags' defaults, cheap

    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", metavar="MODEL", help="checkpoint or export (with its sidecar)")
    parser.add_argument("--gallery", metavar="SHEET", help="rank this sheet's classes (/rank)")
    parser.add_argument("--collection", metavar="PREFIX", help="embed --index PREFIX (/search)")
    parser.add_argument("--cohort", metavar="PREFIX", help="normalise /search scores against it")
    parser.add_argument("--score-norm", choices=SCORE_NORMS, help="with --cohort (default asnorm)")
    parser.add_argument("--cohort-top", type=int, help="asnorm: top N kept a side (default 300)")
    parser.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine)")
    parser.add_argument("--port", type=int, default=8000, help="default 8000; 0: a free one")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    parser.add_argument(
        "--threads", type=int, help="torch's CPU threads for the model (default: torch's)"
    )
    add_trust_flag(parser)
    for field in fields(ServeOptions):
        flag = "--" + field.name.replace("_", "-")
        if field.type.startswith("tuple"):  # allow_host: repeatable
            parser.add_argument(flag, action="append", default=[], metavar="NAME", help=ALLOW)
            continue
        kind = float if field.type == "float" else int
        parser.add_argument(flag, type=kind, default=field.default, help=f"default {field.default}")
    parser.add_argument("--log-level", default="warning", help="uvicorn's (default warning)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    try:
        from audioclf.serve.app import build_app  # noqa: PLC0415 - the optional [serve] extra
        from audioclf.serve.server import (  # noqa: PLC0415 - the same
            bound_malloc_arenas,
            listen,
            run,
        )
    except ImportError as exc:
        raise UsageError(
            f"audioclf serve needs the [serve] extra ({exc.name} is missing): "
            'pip install "audioclf[serve]"'
        ) from None
    from audioclf.serve.service import ServeOptions, Service  # noqa: PLC0415 - after the check

    given = {f.name: getattr(args, f.name) for f in fields(ServeOptions)}
    options = ServeOptions(**{**given, "allow_host": tuple(args.allow_host)})
    options.check()
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    bound_malloc_arenas()  # before the model and the threads allocate
    sock = listen(args.host, args.port)  # before the model loads: a taken port fails at once
    service = Service.open(
        args.model,
        gallery=args.gallery,
        collection=args.collection,
        cohort=args.cohort,
        score_norm=args.score_norm,
        cohort_top=args.cohort_top,
        device=args.device,
        trust=args.trust_checkpoint,
        options=options,
    )
    host, port = sock.getsockname()[:2]
    print(f"{PROG}: {service.describe()}", flush=True)
    if args.host not in LOOPBACK:
        print(
            f"{PROG}: listening on {args.host}: other machines can reach it; put it behind a "
            "reverse proxy with TLS and access control (docs/serving.md)",
            flush=True,
        )
    url = f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"
    print(f"{PROG}: listening on {url} (the page: open it in a browser; Ctrl-C stops)", flush=True)
    run(build_app(service), sock, log_level=args.log_level)
    print(f"{PROG}: stopped after {service.answered()} request(s)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_cli(PROG, lambda: run(args))
