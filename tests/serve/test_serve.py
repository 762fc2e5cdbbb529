"""audioclf serve: real HTTP on the loopback (uvicorn in a thread, 127.0.0.1, a free port), real
concurrency (threads of clients), the batcher on its own, and the command as a user runs it."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from socket import IPPROTO_TCP, TCP_NODELAY
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import soundfile
import torch
from prometheus_client.parser import text_string_to_metric_families

import audioclf
from audioclf.embedding.index import EmbedSheetOptions, embed_sheet
from audioclf.serve.app import Guard, build_app
from audioclf.serve.batcher import MicroBatcher, Overloaded
from audioclf.serve.cli import main as serve_main
from audioclf.serve.cli import parse_args
from audioclf.serve.server import listen
from audioclf.serve.service import ServeOptions, Service
from audioclf.serve.stats import Stats
from tests.helpers import (
    ROOT,
    child_env,
    doc_commands,
    http_request,
    make_checkpoint,
    multipart,
    serving,
    write_unknown_length_audio,
)


@pytest.fixture(scope="module")
def served(tiny_demo, tmp_path_factory) -> dict:
    """A tiny model with the tiny demo sheet as gallery, its collection (and cohort), served
    with a batch wait long enough for concurrent requests to share batches."""
    tmp = tmp_path_factory.mktemp("serve")
    model_path = make_checkpoint(tmp / "model.pt")
    model = audioclf.load(model_path, device="cpu")
    prefix = tmp / "collection"
    embed_sheet(model.loaded, tiny_demo, prefix, EmbedSheetOptions(num_workers=0), progress=False)
    options = ServeOptions(max_batch=8, max_wait_ms=30)
    service = Service.open(
        model_path, gallery=tiny_demo, collection=prefix, cohort=prefix, options=options
    )
    files = sorted(tiny_demo.parent.rglob("*.wav"))
    with serving(build_app(service)) as url:
        yield {
            "url": url,
            "model": model,
            "files": files,
            "sheet": tiny_demo,
            "prefix": prefix,
            "service": service,
            "model_path": model_path,
        }


def post(url: str, files: list[Path], query: str = "") -> tuple[int, dict]:
    body, headers = multipart([("clip", f.name, f.read_bytes()) for f in files])
    status, _, answer = http_request("POST", url + query, body, headers)
    return status, json.loads(answer)


def metric(url: str, series: str, missing: float | None = None) -> float:
    """A series' value in /metrics; `missing` when it is not there yet (None: fail)."""
    text = http_request("GET", url + "/metrics")[2].decode()
    found = re.search(rf"^{re.escape(series)} (\S+)$", text, flags=re.M)
    if found is None and missing is not None:
        return missing
    assert found, f"{series} not in /metrics:\n{text}"
    return float(found.group(1))


# ---------------------------------------------------------------------------------------------
# The endpoints


def test_concurrent_requests_get_the_numbers_of_model_embed_on_the_same_files(served):
    url, files = served["url"], served["files"][:24]
    batches_before = metric(url, "audioclf_batch_size_count")
    clips_before = metric(url, "audioclf_clips_total")
    with ThreadPoolExecutor(12) as pool:  # one file a request, 12 at a time
        answers = list(pool.map(lambda f: post(url + "/embed", [f]), files))
    assert all(status == 200 for status, _ in answers), answers[0]
    served_rows = np.array([answer["clips"][0]["embedding"] for _, answer in answers])
    _, expected = served["model"].embed(files)
    np.testing.assert_allclose(served_rows, expected, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(served_rows, axis=1), 1, atol=1e-5)
    # the requests shared batches: fewer model calls than clips
    batches = metric(url, "audioclf_batch_size_count") - batches_before
    assert metric(url, "audioclf_clips_total") - clips_before == 24 and batches < 24


def test_several_files_in_one_request_keep_their_order_and_names(served):
    files = served["files"][30:33]
    status, answer = post(served["url"] + "/embed", files)
    assert status == 200 and answer["dim"] == 16
    assert [clip["name"] for clip in answer["clips"]] == [f.name for f in files]
    _, expected = served["model"].embed(files)
    np.testing.assert_allclose([c["embedding"] for c in answer["clips"]], expected, atol=2e-5)


def test_a_raw_body_is_one_clip(served):
    path = served["files"][5]
    status, _, answer = http_request("POST", served["url"] + "/embed", path.read_bytes())
    _, expected = served["model"].embed([path])
    assert status == 200
    np.testing.assert_allclose(json.loads(answer)["clips"][0]["embedding"], expected[0], atol=2e-5)


def test_rank_ranks_the_gallery_as_model_rank_does(served):
    files = served["files"][::20]
    status, answer = post(served["url"] + "/rank", files, "?top=3")
    expected = served["model"].rank(files, served["sheet"], top=3)
    assert status == 200 and len(answer["clips"]) == len(files)
    for clip, order, scores in zip(answer["clips"], expected.order, expected.scores):
        assert [c["class"] for c in clip["classes"]] == [expected.names[o] for o in order]
        np.testing.assert_allclose([c["score"] for c in clip["classes"]], scores[order], atol=2e-5)


def test_search_finds_what_model_search_finds_with_normalised_scores(served):
    files = served["files"][7:9]
    status, answer = post(served["url"] + "/search", files, "?k=4")
    prefix = served["prefix"]
    table = served["model"].search(files, prefix, k=4, cohort=prefix)
    assert status == 200
    hits = [hit for clip in answer["clips"] for hit in clip["neighbours"]]
    assert [h["id"] for h in hits] == table["id"].tolist()
    np.testing.assert_allclose([h["score"] for h in hits], table["score"], atol=2e-5)
    np.testing.assert_allclose([h["norm_score"] for h in hits], table["norm_score"], atol=1e-4)
    rows = pd.read_parquet(prefix.with_suffix(".parquet"))
    first = hits[0]
    assert (
        rows["id"].iloc[first["row"]] == first["id"] and first["clip"] == f"/clips/{first['row']}"
    )
    status, _, audio = http_request("GET", served["url"] + first["clip"])
    assert status == 200 and audio == Path(rows["path"].iloc[first["row"]]).read_bytes()


def test_health_names_the_model_and_what_is_loaded(served):
    status, _, body = http_request("GET", served["url"] + "/health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok"
    assert health["model"]["embedding_dim"] == 16 and health["model"]["sample_rate"] == 8000
    assert health["model"]["path"] == str(served["model_path"])
    assert health["gallery"] == {"sheet": str(served["sheet"]), "clips": 144, "classes": 12}
    assert health["collection"]["clips"] == 144 and health["collection"]["index"] == "exact"
    assert health["collection"]["score_norm"]["method"] == "asnorm"
    assert health["options"]["max_batch"] == 8


def test_metrics_are_prometheus_text(served):
    url = served["url"]
    # a labelled series appears with its first request: none yet when this test runs first
    before = metric(url, 'audioclf_requests_total{code="200",path="/embed"}', missing=0.0)
    post(url + "/embed", served["files"][:1])
    assert metric(url, 'audioclf_requests_total{code="200",path="/embed"}') == before + 1
    status, headers, body = http_request("GET", url + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    sample = re.compile(r'^[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? [-+0-9.eEinfa]+$')
    for line in body.decode().splitlines():
        assert line.startswith(("# HELP ", "# TYPE ")) or sample.match(line), line
    for name in ("queue_seconds", "batch_size", "request_seconds"):
        assert f"# TYPE audioclf_{name} summary" in body.decode()
    assert 0 < metric(url, 'audioclf_request_seconds{path="/embed",quantile="0.99"}') < 60
    families = {f.name: f.type for f in text_string_to_metric_families(body.decode())}
    assert families == {  # the reference parser reads every family (counters without _total)
        "audioclf_requests": "counter",
        "audioclf_request_seconds": "summary",
        "audioclf_clips": "counter",
        "audioclf_rejected_requests": "counter",
        "audioclf_queue_clips": "gauge",
        "audioclf_queue_seconds": "summary",
        "audioclf_batch_size": "summary",
        "audioclf_batch_seconds": "summary",
    }


# ---------------------------------------------------------------------------------------------
# Safe by default


def test_undecodable_audio_is_400_naming_the_part(served):
    good = served["files"][0]
    body, headers = multipart([("a", good.name, good.read_bytes()), ("b", "notes.txt", b"hello")])
    status, _, answer = http_request("POST", served["url"] + "/embed", body, headers)
    assert status == 400
    assert json.loads(answer) == {
        "error": "cannot read audio in part 2 (notes.txt): Format not recognised."
    }
    status, _, answer = http_request("POST", served["url"] + "/rank", b"")
    assert status == 400 and "no audio" in json.loads(answer)["error"]


def test_nothing_from_a_request_is_used_as_a_path(served):
    path = served["files"][0]  # an audio file the server could read, named in several ways
    for name in (str(path), "../" * 8 + str(path).lstrip("/")):
        body, headers = multipart([("clip", name, str(path).encode())])
        status, _, answer = http_request("POST", served["url"] + "/embed", body, headers)
        assert status == 400 and "Format not recognised" in json.loads(answer)["error"]
    status, _, answer = http_request("POST", served["url"] + "/embed", str(path).encode())
    assert status == 400
    for row in ("-1", "144", "..%2F..%2Fetc%2Fpasswd", "0.5"):
        assert http_request("GET", served["url"] + f"/clips/{row}")[0] == 404


def test_a_request_for_another_host_name_is_refused_with_one_line(served):
    # DNS rebinding: a page of another site whose name resolves to 127.0.0.1 asked /health and
    # /clips/0 with its own Host, and got the model's path and the collection's audio (issue 42)
    url = served["url"]
    port = url.rsplit(":", 1)[1]
    for path in ("/health", "/clips/0"):
        for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1.attacker.example"):
            status, _, body = http_request("GET", url + path, headers={"Host": host})
            message = json.loads(body)["error"]
            assert status == 421 and f"the Host {host!r} is not a name of this server" in message
            assert "--allow-host NAME" in message and "\n" not in message
        for host in ("127.0.0.1", f"127.0.0.1:{port}", "localhost", f"LocalHost:{port}", "[::1]"):
            assert http_request("GET", url + path, headers={"Host": host})[0] == 200, host
    status, answer = post(url + "/embed", served["files"][:1])  # http.client's own Host
    assert status == 200 and answer["clips"]


def test_allowed_host_names_are_the_loopback_the_address_listened_on_and_allow_host():
    options = ServeOptions(allow_host=("audio.example.org", "10.0.0.9:8443"))
    options.check()
    listened = ("192.168.1.20", 8000)
    for host in ("localhost:8000", "[::1]:8000", "192.168.1.20", "192.168.1.20:8000",
                 "Audio.Example.org", "audio.example.org:443", "10.0.0.9"):  # fmt: skip
        assert options.answers_to(host, listened), host
    for host in (None, "", "example.org", "192.168.1.21:8000", "audio.example.org.evil", "::1"):
        assert not options.answers_to(host, listened), host
    assert ServeOptions().answers_to("[fe80::1]:8000", ("fe80::1", 8000, 0, 0))
    assert parse_args(["m.pt", "--allow-host", "a.org", "--allow-host", "b.org"]).allow_host == [
        "a.org",
        "b.org",
    ]
    with pytest.raises(ValueError, match=re.escape("--allow-host (allow_host) takes a host")):
        ServeOptions(allow_host=("http://a.org/",)).check()


def test_a_missing_gallery_sheet_names_the_flag(served, tmp_path, capsys):
    # its one line said "set data.index to your sheet" (a training key), not --gallery
    missing = tmp_path / "missing.xlsx"
    assert serve_main([str(served["model_path"]), "--gallery", str(missing), "--port", "0"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"audioclf serve: error: --gallery {missing} does not exist")
    assert "data.index" not in error and "\n" not in error
    for sheet, problem in ((missing, "does not exist"), (tmp_path / "a.txt", "is not an index")):
        with pytest.raises(ValueError, match=re.escape(f"--gallery {sheet} {problem}")) as raised:
            Service.open(served["model_path"], gallery=sheet)
        assert "gallery= in Python" in str(raised.value)


def test_rank_and_search_say_what_the_server_was_not_given(tmp_path, served):
    service = Service(served["model"], ServeOptions())
    with serving(build_app(service)) as url:
        for path, flag in (("/rank", "--gallery SHEET"), ("/search", "--collection PREFIX")):
            status, answer = post(url + path, served["files"][:1])
            assert status == 404 and flag in answer["error"]
        assert json.loads(http_request("GET", url + "/health")[2])["gallery"] is None


def test_limits_answer_413_before_the_model(served, tmp_path):
    options = ServeOptions(max_request_mb=0.05, max_clip_seconds=1.5, max_clips=2)
    service = Service(served["model"], options)
    long_clip = tmp_path / "long.wav"
    soundfile.write(long_clip, np.zeros(16000 * 2, np.float32), 16000)  # 2 s, 64 kB as float
    soundfile.write(tmp_path / "short.wav", np.zeros(16000, np.int16), 16000)  # 1 s, 32 kB
    short = (tmp_path / "short.wav").read_bytes()
    with serving(build_app(service)) as url:
        status, _, body = http_request("POST", url + "/embed", long_clip.read_bytes())
        assert status == 413 and "--max-request-mb" in json.loads(body)["error"]
        chunks = iter([short, short])  # no Content-Length: refused as the bytes pass the limit
        status, _, body = http_request("POST", url + "/embed", chunks)
        assert status == 413 and "--max-request-mb" in json.loads(body)["error"]
        soundfile.write(long_clip, np.zeros(16000 * 2, np.int16), 16000, format="FLAC")
        status, answer = post(url + "/embed", [long_clip])
        assert status == 413 and answer["error"].startswith(
            "the audio in part 1 (long.wav) is 2.0 s"
        )
        body, headers = multipart([("c", f"{i}.wav", short[:2000]) for i in range(3)])
        status, _, body = http_request("POST", url + "/embed", body, headers)
        assert status == 413 and "more than 2 clips" in json.loads(body)["error"]
        status, _, body = http_request("POST", url + "/rank?top=0", short)
        assert status in (400, 404)
    assert service.stats.total("audioclf_clips_total") == 0  # none reached the model


@pytest.mark.parametrize("suffix", [".flac", ".wav"])
def test_audio_of_unknown_length_is_embedded_and_limited_by_its_real_length(
    served, tmp_path, suffix
):
    wave = np.random.default_rng(3).uniform(-0.3, 0.3, 2 * 16000).astype(np.float32)
    soundfile.write(tmp_path / f"known{suffix}", wave, 16000)
    piped = write_unknown_length_audio(tmp_path / f"piped{suffix}", wave, 16000)
    _, expected = served["model"].embed([tmp_path / f"known{suffix}"])
    _, embedded = served["model"].embed([piped])  # Model.embed reads it whole
    np.testing.assert_allclose(embedded, expected, atol=1e-6)
    status, answer = post(served["url"] + "/embed", [piped])
    assert status == 200, answer
    np.testing.assert_allclose(answer["clips"][0]["embedding"], expected[0], atol=2e-5)
    service = Service(served["model"], ServeOptions(max_clip_seconds=1.5))
    with serving(build_app(service)) as url:
        status, answer = post(url + "/embed", [piped])
    assert status == 413 and re.fullmatch(
        rf"the audio in part 1 \(piped{suffix}\) is (more than 1.5 s|2.0 s) long; this server "
        r"takes clips of at most 1.5 s \(--max-clip-seconds\)",
        answer["error"],
    ), answer


def test_a_collection_embedded_adapted_served_with_the_unadapted_model_is_a_warning(
    served, tmp_path, caplog
):
    adapted = audioclf.load(served["model_path"], device="cpu")
    adapted.adapt(served["files"][:4])
    prefix = tmp_path / "adapted"
    embed_sheet(
        adapted.loaded, served["sheet"], prefix, EmbedSheetOptions(num_workers=0), progress=False
    )
    with caplog.at_level("WARNING", logger="audioclf"):
        Service.open(served["model_path"], collection=prefix).close()
    warned = [
        r.getMessage() for r in caplog.records if "BatchNorm statistics differ" in r.getMessage()
    ]
    assert len(warned) == 1 and f"{prefix} was embedded by" in warned[0], caplog.text


def test_a_full_queue_answers_503_at_once_and_the_admitted_requests_still_complete(
    served, monkeypatch
):
    model = audioclf.load(served["model_path"], device="cpu")
    armed, gate, entered = threading.Event(), threading.Event(), threading.Event()
    embed = model.embed_prepared

    def held(clips):  # once armed, the model is "busy" until the test opens the gate
        if armed.is_set():
            entered.set()
            assert gate.wait(60)
        return embed(clips)

    monkeypatch.setattr(model, "embed_prepared", held)
    service = Service(model, ServeOptions(max_queue=2, max_clips=2, max_wait_ms=0))
    armed.set()  # after the service's warm-up call
    clip = served["files"][0]
    with serving(build_app(service)) as url, ThreadPoolExecutor(2) as pool:
        admitted = [pool.submit(post, url + "/embed", [clip]) for _ in range(2)]
        assert entered.wait(60)
        deadline = time.monotonic() + 60
        while metric(url, "audioclf_queue_clips") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        status, headers, body = http_request("POST", url + "/embed", clip.read_bytes())
        assert not gate.is_set()  # refused while the queue was still full: it did not wait
        assert status == 503 and headers["retry-after"] == "1"
        assert "queue is full (2 of 2 clips waiting)" in json.loads(body)["error"]
        gate.set()
        assert [f.result(60)[0] for f in admitted] == [200, 200]
        assert metric(url, "audioclf_rejected_requests_total") == 1


def test_a_full_queue_is_refused_before_the_router_and_the_body():
    # beside CPU-bound jobs a 503 took 174-192 ms (issue 42): the refusal went through
    # Starlette's router and handler; the Guard now answers it from the batcher's count
    stats = Stats()
    batcher = MicroBatcher(
        recording_embed([]), max_batch=1, max_wait_ms=0, max_queue=1, stats=stats
    )
    service = SimpleNamespace(options=ServeOptions(max_queue=1, max_clips=1), stats=stats)
    service.batcher = batcher
    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def receive():
        reached.append("body read")
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/embed", "server": ("127.0.0.1", 80),
             "headers": [(b"host", b"127.0.0.1"), (b"content-length", b"100")]}  # fmt: skip
    with batcher.reserve(1):  # the queue is full
        asyncio.run(Guard(app, service)(scope, receive, send))
    assert reached == [] and sent[0]["status"] == 503
    assert (b"retry-after", b"1") in sent[0]["headers"]
    assert b"the queue is full (1 of 1 clips waiting)" in sent[1]["body"]
    assert service.stats.total("audioclf_rejected_requests_total") == 1
    asyncio.run(Guard(app, service)(scope, receive, send))  # room again: on to the app
    assert reached == ["/embed"]


@pytest.mark.slow  # a child process
def test_the_command_bounds_malloc_arenas_so_threads_do_not_grow_memory():
    # each thread that allocated kept a glibc arena (and its high-water mark): +28-64 MB over
    # 10k requests at the default settings (issue 42); the command sets two at start
    script = """if True:
        import ctypes, re, sys, tempfile, threading
        from audioclf.serve.server import bound_malloc_arenas
        print(bound_malloc_arenas() if sys.argv[1] == "bound" else "-")
        start = threading.Barrier(16)
        def churn():
            start.wait()
            for _ in range(2000):
                del [bytearray(1000) for _ in range(50)][:]
        threads = [threading.Thread(target=churn) for _ in range(16)]
        for thread in threads: thread.start()
        for thread in threads: thread.join()
        libc = ctypes.CDLL(None)
        libc.fopen.restype = ctypes.c_void_p
        path = tempfile.mktemp()
        out = ctypes.c_void_p(libc.fopen(path.encode(), b"w"))
        libc.malloc_info(0, out)
        libc.fclose(out)
        print(len(re.findall("<heap nr=", open(path).read())))
    """
    env = {k: v for k, v in child_env().items() if k != "MALLOC_ARENA_MAX"}
    arenas = {}
    for mode in ("free", "bound"):
        out = subprocess.run([sys.executable, "-c", script, mode], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
        arenas[mode] = out.stdout.split()
    if arenas["bound"][0] == "False":
        pytest.skip("not glibc: no malloc arenas to bound")
    assert int(arenas["free"][1]) > 2 >= int(arenas["bound"][1]), arenas
    assert "bound_malloc_arenas()" in (ROOT / "audioclf/serve/cli.py").read_text()


# ---------------------------------------------------------------------------------------------
# The micro-batcher on its own


def recording_embed(calls: list, gate: threading.Event | None = None):
    def embed(clips):
        if gate is not None:
            assert gate.wait(60)
        calls.append([int(c.shape[0]) for c in clips])
        if any(torch.isnan(c).any() for c in clips):
            raise ValueError("a NaN clip")
        return np.stack([np.full(3, c.shape[0], np.float32) for c in clips])

    return embed


def test_batches_hold_the_oldest_clip_and_those_nearest_it_in_length():
    calls, gate = [], threading.Event()
    batcher = MicroBatcher(recording_embed(calls, gate), max_batch=3, max_wait_ms=0, max_queue=64)
    batcher.start()
    lengths = [50, 100, 5000, 110, 5100, 120, 5200]  # 50 is taken alone while the rest queue
    futures = []
    for length in lengths:
        with batcher.reserve(1) as slot:
            futures.append(slot.submit([torch.zeros(length)]))
        time.sleep(0.05 if length == 50 else 0)
    gate.set()
    results = [f.result(60) for f in futures]
    batcher.close()
    assert [r[0, 0] for r in results] == lengths  # each request got its own row
    assert calls == [[50], [100, 110, 120], [5000, 5100, 5200]]


def test_a_full_batch_starts_without_waiting_and_close_embeds_what_is_queued():
    calls = []
    batcher = MicroBatcher(recording_embed(calls), max_batch=2, max_wait_ms=600_000, max_queue=8)
    batcher.start()
    with batcher.reserve(2) as slot:
        both = slot.submit([torch.zeros(10), torch.zeros(20)])
    assert both.result(60).shape == (2, 3)  # max_batch reached: no 10-minute wait
    with batcher.reserve(1) as slot:
        last = slot.submit([torch.zeros(30)])
    batcher.close()  # the queued clip is embedded before the worker ends
    assert last.result(0)[0, 0] == 30 and calls == [[10, 20], [30]]
    with pytest.raises(Overloaded, match="shutting down"):
        batcher.reserve(1)


def test_a_failing_clip_fails_its_own_request_only():
    calls, gate = [], threading.Event()
    batcher = MicroBatcher(recording_embed(calls, gate), max_batch=8, max_wait_ms=0, max_queue=8)
    batcher.start()
    with batcher.reserve(1) as slot:
        first = slot.submit([torch.zeros(5)])
    time.sleep(0.05)  # the first batch holds the worker at the gate while the next two queue
    with batcher.reserve(1) as slot:
        bad = slot.submit([torch.full((7,), float("nan"))])
    with batcher.reserve(1) as slot:
        good = slot.submit([torch.zeros(9)])
    gate.set()
    assert first.result(60)[0, 0] == 5 and good.result(60)[0, 0] == 9
    with pytest.raises(ValueError, match="a NaN clip"):
        bad.result(60)
    batcher.close()
    assert calls[1] == [7, 9]  # they were batched together, then run apart


def test_a_reservation_not_submitted_gives_its_room_back():
    batcher = MicroBatcher(recording_embed([]), max_batch=2, max_wait_ms=0, max_queue=2)
    with batcher.reserve(2):
        with pytest.raises(Overloaded, match="queue is full"):
            batcher.reserve(1)
    batcher.reserve(2)  # the room came back when the block ended (decoding failed, say)


# ---------------------------------------------------------------------------------------------
# The command


def test_options_are_checked_with_the_flag_named():
    for options, message in (
        (ServeOptions(max_batch=0), "--max-batch must be >= 1, got 0"),
        (ServeOptions(max_wait_ms=-1), "--max-wait-ms must be >= 0"),
        (ServeOptions(max_request_mb=0), "--max-request-mb must be > 0"),
        (ServeOptions(max_clips=300), "--max-clips 300 exceeds --max-queue 256"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            options.check()


def test_the_command_binds_the_loopback_by_default_and_names_a_taken_port(capsys, tmp_path):
    args = parse_args(["model.pt"])
    assert (args.host, args.port, args.max_batch) == ("127.0.0.1", 8000, 32)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serve_main([str(tmp_path / "model.pt"), "--port", str(port)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"audioclf serve: error: cannot listen on 127.0.0.1:{port}")
    assert "choose another --port" in error and "\n" not in error
    assert serve_main([str(tmp_path / "absent.pt"), "--port", "0"]) == 2
    assert "absent.pt does not exist" in capsys.readouterr().err


def start_server(command: list[str], cwd: Path) -> tuple[subprocess.Popen, str, list[str]]:
    """A `python -m audioclf.serve ...` process on a free port: (process, URL, its lines)."""
    proc = subprocess.Popen(
        [*command, "--port", "0"],
        cwd=cwd,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines = []
    while not (lines and "listening on http://" in lines[-1]):
        lines.append(proc.stdout.readline())
        if not lines[-1]:
            proc.wait()
            raise AssertionError("the server did not start:\n" + "".join(lines))
    return proc, re.search(r"http://[\d.]+:\d+", lines[-1]).group(0), lines


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_stop_answers_the_requests_in_flight_and_exits_0(served, stop):
    command = [sys.executable, "-m", "audioclf.serve", str(served["model_path"])]
    command += ["--max-wait-ms", "1500", "--max-batch", "64"]
    proc, url, lines = start_server(command, ROOT)
    try:
        with ThreadPoolExecutor(3) as pool:
            in_flight = [pool.submit(post, url + "/embed", [f]) for f in served["files"][:3]]
            deadline = time.monotonic() + 60
            while metric(url, "audioclf_queue_clips") < 3 and time.monotonic() < deadline:
                time.sleep(0.01)  # all three wait in the batcher (1.5 s)
            proc.send_signal(stop)
            answers = [f.result(60) for f in in_flight]
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [status for status, _ in answers] == [200, 200, 200]
    assert proc.returncode == 0, "".join(lines) + out
    assert "stopped after" in out


def test_accepted_connections_send_at_once():
    """TCP_NODELAY on every accepted socket (asyncio sets it for IPPROTO_TCP sockets only):
    without it each answer on a kept-alive connection waited ~40 ms for a delayed ACK."""

    async def accepted_nodelay() -> int:
        sock, seen = listen("127.0.0.1", 0), []

        async def handle(reader, writer):
            seen.append(writer.get_extra_info("socket").getsockopt(IPPROTO_TCP, TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        await reader.read()
        writer.close()
        server.close()
        return seen[0]

    assert asyncio.run(accepted_nodelay()) == 1


# ---------------------------------------------------------------------------------------------
# docs/serving.md's commands and benchmarks/serve.py, as a user runs them


@pytest.mark.slow
def test_the_serving_docs_run_as_written(served, tmp_path):
    if shutil.which("curl") is None:
        pytest.skip("no curl on PATH")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "demo").symlink_to(served["sheet"].parent)
    (tmp_path / "runs" / "demo_cnn").mkdir(parents=True)
    shutil.copy(served["model_path"], tmp_path / "runs" / "demo_cnn" / "best.pt")
    commands = doc_commands("docs/serving.md")
    embed, serve, curls = commands[0], commands[1], commands[2:]
    assert embed.startswith("python -m audioclf.embed") and serve.startswith(
        "python -m audioclf.serve"
    )
    python = [sys.executable if word == "python" else word for word in shlex.split(embed)]
    subprocess.run(python, cwd=tmp_path, env=child_env(), check=True, capture_output=True)
    python = [sys.executable if word == "python" else word for word in shlex.split(serve)]
    proc, url, lines = start_server(python, tmp_path)
    try:
        answers = []
        for command in curls:
            assert "http://127.0.0.1:8000/" in command
            done = subprocess.run(
                ["bash", "-c", command.replace("http://127.0.0.1:8000", url)],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, f"{command}: {done.stderr}"
            answers.append(done.stdout)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, "".join(lines) + out
    *replies, metrics_text = answers
    for command, reply in zip(curls, replies):
        assert "error" not in json.loads(reply), f"{command}: {reply}"
    assert 'audioclf_requests_total{code="200",path="/rank"} 1.0' in metrics_text
    assert json.loads(replies[3])["clips"][0]["neighbours"][0]["norm_score"] > 0  # --cohort


@pytest.mark.slow
def test_the_benchmark_runs_in_its_quick_mode():
    done = subprocess.run(
        [sys.executable, "benchmarks/serve.py", "--quick"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    table = re.compile(r"^(.{34}) +(\S+) +(\d+) +(\S+) +([\d.]+) +(\S+) +(\S+) +(\S+) +(\d+)$")
    rows = {(m.group(1).strip(), m.group(2)) for line in lines if (m := table.match(line))}
    for server in ("checkpoint batched (32, 5 ms)", "checkpoint max-batch 1"):
        assert {(server, "1"), (server, "8")} <= rows, rows
    for backend in ("checkpoint", "torchscript", "onnx"):
        assert (f"{backend} in-process Model.embed", "-") in rows
    verdicts = [line for line in lines if line.startswith(("PASS ", "FAIL ", "SKIP "))]
    for target in (
        "max-batch 1",
        "in-process ceiling",
        "80 % of the peak",
        "503",
        "memory",
        "round trip",
    ):
        assert any(target in line for line in verdicts), (target, verdicts)
