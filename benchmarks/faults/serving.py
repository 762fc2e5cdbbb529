"""Cases S1-S3 of the fault matrix, what a server's threads and a browser do to `audioclf serve`
(issue 42): four threads searching one collection and entering exact arithmetic at once, a
page of another site that renamed itself to 127.0.0.1 (DNS rebinding), and a --gallery sheet
that is not there."""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Callable
from pathlib import Path

from benchmarks.faults.harness import (
    Row,
    Work,
    console_lines,
    ensure_base,
    first_error_line,
    run,
    start,
    tool,
    wait_for,
)
from benchmarks.faults.outputs import ensure_embedded

THREADS, ROUNDS = 4, 10


# ---------------------------------------------------------------------------------------------
# Threads: one collection searched by four, the precision flags entered and left by four


def case_search_threads(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    import numpy as np

    from audioclf.metrics import ExactSearch
    from audioclf.precision import EXACT, BackendFlags, exact_arithmetic
    from tests.helpers import answers_in_threads

    rng = np.random.default_rng(0)
    index = ExactSearch(rng.normal(size=(20_000, 64)).astype(np.float32))
    queries = [rng.normal(size=(8, 64)).astype(np.float32) for _ in range(10)]
    serial = [index.search(q, 10)[1] for q in queries]
    row = Row(f"S1a /search as serve's pool runs it: {THREADS} threads, 20k rows (ExactSearch)")
    answers = answers_in_threads(lambda q: index.search(q, 10)[1], queries, THREADS, ROUNDS)
    wrong = [sum(not np.array_equal(a, s) for a, s in zip(t, serial * ROUNDS)) for t in answers]
    row.code = "-"
    row.message = f"answers per thread not the serial one: {wrong} of {len(queries) * ROUNDS}"
    row.expect(not any(wrong), "a thread got another query's neighbours")

    def flags_inside(size: int) -> BackendFlags:
        with exact_arithmetic():
            np.ones((size, 8)).sum()  # a little work inside
            return BackendFlags.current()

    flags = Row(f"S1b exact_arithmetic entered and left by {THREADS} threads, TF32 on outside")
    saved, on = BackendFlags.current(), BackendFlags(True, True, True)
    try:
        on.apply()
        seen = answers_in_threads(flags_inside, [1000, 20_000, 5000, 100], THREADS, ROUNDS)
        after = BackendFlags.current()
    finally:
        saved.apply()
    off = sum(f != EXACT for thread in seen for f in thread)
    flags.message = f"inside: {off} of {THREADS * 4 * ROUNDS} not exact; after: {after}"
    flags.expect(not off, "a leaving thread turned TF32 back on under another")
    flags.expect(after == on, "the flags found before were not put back")
    return [row, flags]


# ---------------------------------------------------------------------------------------------
# The server: a request for another name, a --gallery that is not there


def case_dns_rebinding(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    from tests.helpers import free_port, http_request

    model, prefix = ensure_base(work) / "best.pt", ensure_embedded(work)
    port = free_port()
    job = start(tool("serve", model, "--collection", prefix, "--port", port), case_dir / "jobs")
    rows = []
    try:
        if not wait_for(job.out, "listening on http://", 120):
            row = Row("S2 the server did not start")
            row.message = first_error_line(job.console())
            return [row]
        url = f"http://127.0.0.1:{port}"
        for letter, path in (("a", "/health"), ("b", "/clips/0")):
            row = Row(f"S2{letter} GET {path} with Host: attacker.example (DNS rebinding)")
            status, _, body = http_request("GET", url + path, headers={"Host": "attacker.example"})
            answer = json.loads(body) if body.startswith(b"{") else {}
            row.code, row.message = str(status), answer.get("error", body[:80].decode("latin-1"))
            row.expect(status == 421, f"answered {status}, expected 421")
            row.expect("--allow-host" in row.message, "the answer does not name --allow-host")
            own = http_request("GET", url + path, headers={"Host": f"localhost:{port}"})[0]
            row.expect(own == 200, f"the same with Host: localhost answered {own}, expected 200")
            rows.append(row)
    finally:
        job.signal(signal.SIGTERM)
        job.finish(60)
    return rows


def case_missing_gallery(work: Work, case_dir: Path, keep: bool) -> list[Row]:
    model = ensure_base(work) / "best.pt"
    missing = case_dir / "missing.xlsx"
    result = run(tool("serve", model, "--gallery", missing, "--port", 0))
    lines = console_lines(result.err)
    row = Row("S3 serve MODEL --gallery missing.xlsx")
    row.code, row.message = str(result.code), first_error_line(result.console)
    row.expect(result.code == 2, f"exit {result.code}, expected 2")
    row.expect(len(lines) == 1, f"stderr is {len(lines)} lines, expected 1")
    row.expect(bool(re.search(r"--gallery \S*missing\.xlsx does not exist", row.message)),
               "the line does not name --gallery and the sheet")  # fmt: skip
    row.expect("data.index" not in result.console, "the line names data.index (a training key)")
    return [row]


# (name, case) in the matrix's order: cases S1-S3
CASES: list[tuple[str, Callable[[Work, Path, bool], list[Row]]]] = [
    ("search-threads", case_search_threads),
    ("dns-rebinding", case_dns_rebinding),
    ("serve-missing-gallery", case_missing_gallery),
]
