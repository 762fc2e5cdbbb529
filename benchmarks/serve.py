"""Benchmark: `audioclf serve` on the loopback, against the model called in-process.

Run from the repository root:

    ./run.sh demo --stage 1 --stop-stage 2                   # data/demo and runs/demo_cnn/best.pt
    .venv/bin/python benchmarks/serve.py                     # about 5 minutes on 2 cores
    .venv/bin/python benchmarks/serve.py --screenshot docs/serving-page.png
    .venv/bin/python benchmarks/serve.py --quick             # a tiny model (tests/ runs this)

(Not under `nice`: a server's latency is mostly waits for a CPU, which nice lengthens.)

What runs, in one run so that every ratio compares figures taken on the same machine:

- the server (`python -m audioclf.serve MODEL --threads 1`, a subprocess on 127.0.0.1 at a free
  port) with batching (--max-batch 32 --max-wait-ms 5) and with --max-batch 1, for the
  checkpoint; the batched server also for its TorchScript and ONNX exports (written into a
  temporary folder; --quick skips these two servers and the page's round trip);
- a closed-loop load generator (asyncio, one keep-alive connection per client) posting one clip
  per request to /embed at concurrency 1, 8, 32 and 64; each level is bounded by --requests and
  --seconds after a warm-up of 2 requests per client; requests/s, clips/s and the p50 / p95 /
  p99 latency seen by the client;
- the in-process ceiling of each backend: audioclf.load(MODEL).embed(the same files,
  batch_size=32) in this process (--threads 1 too), run just after that backend's server levels;
- the peak again (concurrency 32), then an open-loop generator offering 80 % of it (evenly
  spaced requests; a latency counts from when its request was due);
- overload: twice that peak offered (open loop) to a server whose queue holds 16 clips, on
  the machine as it is and again beside one busy-looping process per CPU (other jobs sharing
  the CPUs); the time to each 503 (from when the request was due, and from when it was sent),
  and whether the server answers /health after;
- memory: --memory-requests requests at concurrency 32; the server's resident memory after the
  first tenth and at the end;
- the page, when chromium is installed: headless Chromium (Playwright, tests/helpers.py)
  opens the page of the batched server, loaded with the sheet as gallery and as collection, and
  chooses the longest clip (about 2 s) --page-uploads times; the page's own upload-to-results
  time is reported (--screenshot PATH: the page after the last as PNG);
- the model alone: Model.embed_prepared's ms per clip at batch 1 and 32, what batching can give
  on this machine before any HTTP.

Clips: --files wav files of the --sheet's folder (the demo's: 1-2 s at 16 kHz), sent as the
bytes on disk. Targets (issue 37), each a PASS / FAIL line with its figure: batched >= 3 x
--max-batch 1 at concurrency 32; batched >= 0.6 x the in-process ceiling (clips/s, concurrency
32); p99 <= 3 x p50 at 80 % of the peak; 503s within 50 ms (p99), no other error, and the
server alive, in both overload runs; resident memory growth <= 10 MB after the first tenth of the memory run; the
page's round trip (median) < 1 s. The machines this ran on are shared with other jobs: figures
move by tens of percent between runs, the ratios less. Exit status: 0 all PASS (and always with
--quick, whose figures mean nothing), 1 a target missed, 2 no model or sheet.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soundfile
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONCURRENCY = (1, 8, 32, 64)
BATCHED = ("--max-batch", "32", "--max-wait-ms", "5")
UNBATCHED = ("--max-batch", "1", "--max-wait-ms", "0")
OVERLOAD_QUEUE, OVERLOAD_RATE = 16, 2.0  # clips the queue holds; offered load / the peak
OPEN_LOOP_CONNECTIONS = 128
TARGET_SPEEDUP, TARGET_CEILING, TARGET_TAIL = 3.0, 0.6, 3.0
TARGET_503_MS, TARGET_MEMORY_MB, TARGET_PAGE_MS = 50.0, 10.0, 1000.0


@dataclass
class Level:
    """One closed- or open-loop run against a server."""

    label: str
    concurrency: int | str
    latencies: list[float] = field(default_factory=list)  # seconds, answered 200
    rejected: list[float] = field(default_factory=list)  # seconds, answered 503
    rejected_sent: list[float] = field(default_factory=list)  # the same, from the send on
    errors: int = 0
    seconds: float = 0.0
    offered: float = 0.0  # requests/s an open loop offered

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.seconds if self.seconds else 0.0

    def ms(self, q: float) -> float:
        return 1000 * float(np.quantile(self.latencies, q)) if self.latencies else float("nan")

    def row(self) -> str:
        """One table row (one clip a request: requests/s = clips/s; - where not measured)."""

        def cell(value: float) -> str:
            return "-" if np.isnan(value) else f"{value:.1f}"

        requests = float("nan") if self.concurrency == "-" else self.rate
        times = " ".join(f"{cell(self.ms(q)):>7}" for q in (0.5, 0.95, 0.99))
        return (
            f"{self.label:<34} {self.concurrency!s:>4} {len(self.latencies):>8} "
            f"{cell(requests):>8} {cell(self.rate):>8} {times} "
            f"{self.errors + len(self.rejected):>6}"
        )


HEADER = (
    f"{'backend / server':<34} {'conc':>4} {'requests':>8} {'req/s':>8} {'clips/s':>8} "
    f"{'p50 ms':>7} {'p95 ms':>7} {'p99 ms':>7} {'errors':>6}"
)


# ---------------------------------------------------------------------------------------------
# The server, and a minimal HTTP/1.1 client on asyncio streams


class Server:
    """`python -m audioclf.serve MODEL ARGS` on 127.0.0.1 at a free port, stopped by SIGTERM."""

    threads = 1  # --threads of every server (the benchmark's --threads)

    def __init__(self, model: Path, *args: str):
        command = [sys.executable, "-m", "audioclf.serve", str(model), "--port", "0",
                   "--threads", str(self.threads), *args]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        lines = []
        while not (lines and "listening on http://" in lines[-1]):
            lines.append(self.proc.stdout.readline())
            if not lines[-1]:
                self.proc.wait()
                raise RuntimeError("the server did not start:\n" + "".join(lines))
        found = re.search(r"http://([\d.]+):(\d+)", lines[-1])
        self.host, self.port = found.group(1), int(found.group(2))

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()
        return self.proc.returncode

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Connection:
    """One keep-alive HTTP/1.1 connection posting bodies to a path."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str):
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        return cls(*await asyncio.open_connection(host, port), f"{host}:{port}")

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: audio/wav\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        await self.writer.drain()
        status = int((await self.reader.readline()).split()[1])
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


async def _client(
    server: Server, bodies: list[bytes], start: int, level: Level, budget: dict, stop: float
) -> None:
    conn = await Connection.open(server.host, server.port)
    try:
        at = start
        while budget["left"] > 0 and time.perf_counter() < stop:
            budget["left"] -= 1
            began = time.perf_counter()
            status, _ = await conn.request("POST", "/embed", bodies[at % len(bodies)])
            took = time.perf_counter() - began
            if not budget.get("timed", True):
                pass
            elif status in (200, 503):
                (level.latencies if status == 200 else level.rejected).append(took)
            else:
                level.errors += 1
            at += 1
    finally:
        conn.close()


async def closed_loop(
    server: Server, bodies: list[bytes], label: str, clients: int, requests: int, seconds: float
) -> Level:
    """`clients` clients, each posting one clip after another (after a warm-up of 2 each)."""
    level = Level(label, clients)
    warm = {"left": 2 * clients, "timed": False}
    far = time.perf_counter() + 600
    await asyncio.gather(*(_client(server, bodies, i, level, warm, far) for i in range(clients)))
    budget, began = {"left": requests}, time.perf_counter()
    stop = began + seconds
    await asyncio.gather(*(_client(server, bodies, i, level, budget, stop) for i in range(clients)))
    level.seconds = time.perf_counter() - began
    return level


async def open_loop(
    server: Server, bodies: list[bytes], label: str, rate: float, requests: int, seconds: float
) -> Level:
    """Requests sent at `rate` per second, evenly spaced, each on a pooled connection; a
    request's latency runs from when it was due (a wait for a free connection included)."""
    level = Level(label, "open", offered=rate)
    pool: asyncio.Queue = asyncio.Queue()
    for _ in range(OPEN_LOOP_CONNECTIONS):
        pool.put_nowait(await Connection.open(server.host, server.port))

    async def one(i: int, due: float) -> None:
        conn = await pool.get()
        sent = time.perf_counter()
        status, _ = await conn.request("POST", "/embed", bodies[i % len(bodies)])
        took = time.perf_counter() - due
        if status in (200, 503):
            (level.latencies if status == 200 else level.rejected).append(took)
        else:
            level.errors += 1
        if status == 503:
            level.rejected_sent.append(time.perf_counter() - sent)
        pool.put_nowait(conn)

    count = min(requests, int(rate * seconds))
    began, tasks = time.perf_counter(), []
    for i in range(count):
        due = began + i / rate
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        tasks.append(asyncio.create_task(one(i, due)))
    await asyncio.gather(*tasks)
    level.seconds = time.perf_counter() - began
    while not pool.empty():
        pool.get_nowait().close()
    return level


# ---------------------------------------------------------------------------------------------
# The measurements


def run_levels(server: Server, bodies: list[bytes], label: str, args) -> list[Level]:
    levels = []
    for clients in args.concurrency:
        level = asyncio.run(
            closed_loop(server, bodies, label, clients, args.requests, args.seconds)
        )
        print(level.row(), flush=True)
        levels.append(level)
    return levels


def ceiling(model: Path, files: list[Path], backend: str) -> Level:
    """audioclf.load(model).embed(files) in this process, after one untimed call."""
    import audioclf

    loaded = audioclf.load(model, device="cpu")
    loaded.embed(files[:32], batch_size=32)
    began = time.perf_counter()
    _, emb = loaded.embed(files, batch_size=32)
    level = Level(f"{backend} in-process Model.embed", "-", seconds=time.perf_counter() - began)
    level.latencies = [float("nan")] * len(emb)  # throughput only
    print(level.row(), flush=True)
    return level


def model_alone(model: Path, files: list[Path]) -> str:
    """The model's own ms per clip at batch 1 and 32 (Model.embed_prepared on the same clips,
    best of 3): how much batching can give on this machine before any HTTP."""
    import audioclf

    loaded = audioclf.load(model, device="cpu")
    clips = [loaded.prepare_waveform(soundfile.read(str(f), dtype="float32")[0],
                                     soundfile.info(str(f)).samplerate) for f in files[:32]]  # fmt: skip
    costs = {}
    for size in (1, 32):
        loaded.embed_prepared(clips[:size])
        best = float("inf")
        for _ in range(3):
            began = time.perf_counter()
            for start in range(0, len(clips), size):
                loaded.embed_prepared(clips[start : start + size])
            best = min(best, (time.perf_counter() - began) / len(clips))
        costs[size] = 1000 * best
    return (
        f"the model alone (Model.embed_prepared, {torch.get_num_threads()} thread(s)): "
        f"{costs[1]:.2f} ms/clip at batch 1, {costs[32]:.2f} at batch 32: batching itself "
        f"gives {costs[1] / costs[32]:.2f}x here"
    )


@contextlib.contextmanager
def cpu_bound_jobs(count: int):
    """`count` busy-looping processes (one per CPU): other jobs sharing the machine's CPUs."""
    loop = [sys.executable, "-c", "while True: pass"]
    jobs = [subprocess.Popen(loop, start_new_session=True) for _ in range(count)]
    try:
        yield
    finally:
        for job in jobs:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def overload(model: Path, bodies: list[bytes], peak: float, args, busy: int = 0):
    """Twice the peak rate offered (open loop) to a server whose queue holds 16 clips, beside
    `busy` CPU-bound jobs: (the run, whether the server answers /health after)."""
    flags = (*BATCHED, "--max-queue", str(OVERLOAD_QUEUE), "--max-clips", "1")
    label = f"overload: {OVERLOAD_RATE:g} x the peak, queue {OVERLOAD_QUEUE}"
    if busy:
        label += f", beside {busy} busy CPU job(s)"
    with Server(model, *flags) as server:
        with cpu_bound_jobs(busy):
            level = asyncio.run(
                open_loop(server, bodies, label, OVERLOAD_RATE * peak, args.requests, args.seconds)
            )
        alive = asyncio.run(_health(server)) == 200 and server.alive()
    return level, alive


async def _health(server: Server) -> int:
    conn = await Connection.open(server.host, server.port)
    try:
        return (await conn.request("GET", "/health"))[0]
    finally:
        conn.close()


def memory(server: Server, bodies: list[bytes], requests: int) -> list[float]:
    """The server's resident MB after each tenth of `requests` (at concurrency 32)."""
    tenth, samples = max(requests // 10, 1), []
    for _ in range(10):
        asyncio.run(closed_loop(server, bodies, "memory", 32, tenth, 600))
        samples.append(server.rss_mb())
    return samples


def page_round_trip(server: Server, clip: Path, args, tmp: Path) -> list[float] | None:
    """The page's upload-to-results milliseconds for `clip`, --page-uploads times (None without
    Playwright and chromium); the server has a gallery and a collection."""
    from tests.helpers import browser_missing, chromium, offline_page

    if browser_missing() is not None:
        return None
    times = []
    with chromium() as browser:
        page, elsewhere = offline_page(browser)
        page.goto(f"http://{server.host}:{server.port}/")
        page.locator("#model").filter(has_text="classes").wait_for()
        for _ in range(args.page_uploads):
            page.evaluate("document.body.dataset.state = ''")
            page.set_input_files("#file", clip)
            page.wait_for_function("['done', 'error'].includes(document.body.dataset.state)")
            if page.evaluate("document.body.dataset.state") != "done":
                raise RuntimeError(f"the page says: {page.locator('#status').text_content()}")
            times.append(float(page.evaluate("document.body.dataset.ms")))
        if elsewhere:
            raise RuntimeError(f"the page asked another host: {elsewhere[0]}")
        if args.screenshot:
            page.screenshot(path=args.screenshot, full_page=True)
    return times


def measure(args, models: dict[str, Path], files: list[Path], bodies: list[bytes], tmp: Path):
    """Every measurement, in order; returns what report_targets takes."""
    import audioclf
    from audioclf.embedding.index import embed_sheet

    model = models["checkpoint"]
    embed_sheet(audioclf.load(model, device="cpu").loaded, args.sheet, tmp / "all", progress=False)
    page_flags = ("--gallery", str(args.sheet), "--collection", str(tmp / "all"), "--k", "5")
    levels, ceilings = [], {}
    with Server(model, *BATCHED, *page_flags) as server:  # also the page's
        levels += run_levels(server, bodies, "checkpoint batched (32, 5 ms)", args)
        ceilings["checkpoint"] = ceiling(model, files, "checkpoint")  # the server idle
        probe = asyncio.run(
            closed_loop(server, bodies, "the peak, again", 32, args.requests, args.seconds)
        )
        print(probe.row(), flush=True)
        tail = asyncio.run(
            open_loop(server, bodies, "80 % of the peak", 0.8 * probe.rate, args.requests,
                      args.seconds)
        )  # fmt: skip
        print(tail.row(), flush=True)
        mem = memory(server, bodies, args.memory_requests)
        longest = max(files, key=lambda f: soundfile.info(str(f)).duration)
        # --quick leaves the browser out: tests/serve/test_serve_page.py drives the page itself
        page = None if args.quick else page_round_trip(server, longest, args, tmp)
    overloads = [overload(model, bodies, probe.rate, args, busy) for busy in (0, os.cpu_count())]
    for over, _ in overloads:
        print(over.row(), flush=True)
    with Server(model, *UNBATCHED) as server:
        levels += run_levels(server, bodies, "checkpoint max-batch 1", args)
    for backend in ("torchscript", "onnx"):
        if not args.quick:  # the same server with another MODEL: --quick spares the starts
            with Server(models[backend], *BATCHED) as server:
                levels += run_levels(server, bodies, f"{backend} batched (32, 5 ms)", args)
        ceilings[backend] = ceiling(models[backend], files, backend)
    print(model_alone(model, files), flush=True)
    return levels, ceilings, tail, overloads, mem, page


# ---------------------------------------------------------------------------------------------
# Inputs and the report


def quick_inputs(tmp: Path) -> tuple[Path, Path]:
    """A tiny untrained model and a tiny generated demo set (what --quick measures)."""
    from audioclf.data.demo import generate_demo
    from tests.helpers import make_checkpoint

    sheet = generate_demo(tmp / "demo", classes=4, items=2, ids=3, seed=0)
    return make_checkpoint(tmp / "model.pt"), sheet


def exports(model: Path, tmp: Path) -> dict[str, Path]:
    from audioclf.inference.exporting import export_model

    out = {"checkpoint": model}
    for fmt, name in (("torchscript", "model.ts"), ("onnx", "model.onnx")):
        export_model(model, fmt, tmp / name)
        out[fmt] = tmp / name
    return out


def verdict(ok: bool, text: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'} {text}", flush=True)
    return ok


def refusal_verdict(over: Level, alive: bool) -> bool:
    rejected = np.array(over.rejected or [np.nan]) * 1000
    p50_503, p99_503 = np.quantile(rejected, 0.5), np.quantile(rejected, 0.99)
    sent = np.array(over.rejected_sent or [np.nan]) * 1000
    return verdict(
        bool(over.rejected) and p99_503 <= TARGET_503_MS and alive and not over.errors,
        f"{over.label}: answered with 503 within {TARGET_503_MS:g} ms (p99): "
        f"{len(over.rejected)} of {len(over.rejected) + len(over.latencies)} requests answered "
        f"503, p50 {p50_503:.1f} ms, p99 {p99_503:.1f} ms, max {np.max(rejected):.1f} ms (from "
        f"when each was due; from when it was sent: p50 {np.quantile(sent, 0.5):.1f}, p99 "
        f"{np.quantile(sent, 0.99):.1f}); {over.errors} other errors; the server alive after: "
        f"{alive}",
    )


def report_targets(levels, ceilings, tail, overloads, mem, page) -> bool:
    clients = min(32, max(level.concurrency for level in levels))  # 8 with --quick

    def at(label: str) -> Level:
        return next(lv for lv in levels if lv.label == label and lv.concurrency == clients)

    batched, single = at("checkpoint batched (32, 5 ms)"), at("checkpoint max-batch 1")
    ok = [
        verdict(
            batched.rate >= TARGET_SPEEDUP * single.rate,
            f"batched >= {TARGET_SPEEDUP:g}x max-batch 1 at concurrency {clients}: "
            f"{batched.rate / single.rate:.2f}x ({batched.rate:.1f} vs {single.rate:.1f} req/s)",
        ),
        verdict(
            batched.rate >= TARGET_CEILING * ceilings["checkpoint"].rate,
            f"batched >= {TARGET_CEILING:g}x the in-process ceiling at concurrency {clients}: "
            f"{batched.rate / ceilings['checkpoint'].rate:.2f}x ({batched.rate:.1f} vs "
            f"{ceilings['checkpoint'].rate:.1f} clips/s)",
        ),
        verdict(
            tail.ms(0.99) <= TARGET_TAIL * tail.ms(0.5) and tail.rate >= 0.95 * tail.offered,
            f"p99 <= {TARGET_TAIL:g}x p50 at 80 % of the peak: p99 {tail.ms(0.99):.1f} ms, p50 "
            f"{tail.ms(0.5):.1f} ms ({tail.ms(0.99) / tail.ms(0.5):.2f}x); {tail.offered:.1f} "
            f"req/s offered, {tail.rate:.1f} served"
            + ("" if tail.rate >= 0.95 * tail.offered else " (it did not keep up: not 80 %)"),
        ),
    ]
    ok += [refusal_verdict(over, alive) for over, alive in overloads]
    ok.append(
        verdict(
            mem[-1] - mem[0] <= TARGET_MEMORY_MB,
            f"memory growth <= {TARGET_MEMORY_MB:g} MB after the first tenth of the run: "
            f"{mem[-1] - mem[0]:+.1f} MB (resident MB after each tenth: "
            f"{', '.join(f'{m:.0f}' for m in mem)})",
        )
    )
    if page is None:
        print(
            "SKIP the page's round trip: not measured (--quick, or no chromium on PATH: "
            "apt-get install chromium)"
        )
    else:
        median = float(np.median(page))
        ok.append(
            verdict(
                median < TARGET_PAGE_MS,
                f"the page's upload-to-results round trip < {TARGET_PAGE_MS:g} ms: median "
                f"{median:.0f} ms, max {max(page):.0f} ms over {len(page)} uploads",
            )
        )
    return all(ok)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "runs/demo_cnn/best.pt")
    parser.add_argument(
        "--sheet",
        type=Path,
        default=ROOT / "data/demo/index.xlsx",
        help="its folder's wav files are the clips; the page's gallery and collection",
    )
    parser.add_argument("--files", type=int, default=256, help="clips sent (cycled)")
    parser.add_argument("--requests", type=int, default=1500, help="most requests a level")
    parser.add_argument("--seconds", type=float, default=6.0, help="most seconds a level")
    parser.add_argument("--memory-requests", type=int, default=10_000)
    parser.add_argument("--page-uploads", type=int, default=5)
    parser.add_argument("--screenshot", type=Path, help="write the page's last result as PNG")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads of the servers and the ceiling"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a tiny model, seconds per level (the test's)"
    )
    args = parser.parse_args(argv)
    Server.threads = args.threads
    torch.set_num_threads(args.threads)  # the in-process ceiling's
    args.concurrency = CONCURRENCY
    if args.quick:
        args.files, args.requests, args.seconds, args.concurrency = 16, 40, 2.0, (1, 8)
        args.memory_requests, args.page_uploads = 100, 2
    return args


def pick_files(sheet: Path, count: int) -> list[Path]:
    """`count` wav files of the sheet's folder, evenly spread over them in name order."""
    files = sorted(sheet.parent.rglob("*.wav"))
    picks = np.linspace(0, len(files) - 1, min(count, len(files))).round().astype(int)
    return [files[i] for i in picks]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as tmp_name:
        tmp = Path(tmp_name)
        if args.quick:
            args.model, args.sheet = quick_inputs(tmp)
        for path in (args.model, args.sheet):
            if not path.is_file():
                print(
                    f"serve.py: {path} does not exist: make data/demo and runs/demo_cnn with "
                    "./run.sh demo --stage 1 --stop-stage 2 (or give --model / --sheet)",
                    file=sys.stderr,
                )
                return 2
        files = pick_files(args.sheet, args.files)
        bodies = [f.read_bytes() for f in files]
        seconds = [soundfile.info(str(f)).duration for f in files]
        quick = "; --quick: a tiny untrained model, figures mean nothing" if args.quick else ""
        print(
            f"serve benchmark: model {args.model}; {len(files)} clips of {min(seconds):.1f}-"
            f"{max(seconds):.1f} s from {args.sheet.parent}; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, shared with other "
            f"jobs: figures are noisy{quick}",
            flush=True,
        )
        models = exports(args.model, tmp)
        print(HEADER, flush=True)
        results = measure(args, models, files, bodies, tmp)
        passed = report_targets(*results)
    print(f"took {time.perf_counter() - started:.0f} s")
    return 0 if passed or args.quick else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
