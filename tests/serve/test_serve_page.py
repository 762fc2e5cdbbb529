"""The page of `audioclf serve`, seen working in a real browser: headless Chromium (Debian's
`chromium`) opens it from a server on the loopback, a file is chosen in its file input as a
person would, and the ranked classes and nearest clips appear on the page."""

from __future__ import annotations

import json
import re

import pytest

import audioclf
from audioclf.embedding.index import embed_sheet
from audioclf.serve.app import build_app
from audioclf.serve.service import ServeOptions, Service
from tests.helpers import Chromium, chromium_binary, http_request, make_checkpoint, serving

pytestmark = pytest.mark.slow

ROWS = """JSON.stringify([...document.querySelectorAll('#SECTION tr')].map(
    (tr) => [...tr.children].map((td) => td.textContent)))"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no chromium on PATH: apt-get install chromium")
    with Chromium(binary, tmp_path_factory.mktemp("profile")) as chromium:
        yield chromium


def test_the_page_works_offline_and_shows_a_clips_classes_and_neighbours(
    browser, tiny_demo, tmp_path
):
    model_path = make_checkpoint(tmp_path / "model.pt")
    model = audioclf.load(model_path, device="cpu")
    embed_sheet(model.loaded, tiny_demo, tmp_path / "all", num_workers=0, progress=False)
    service = Service.open(
        model_path, gallery=tiny_demo, collection=tmp_path / "all", options=ServeOptions(k=4)
    )
    clip = sorted(tiny_demo.parent.rglob("*.wav"))[40]
    expected = model.rank([clip], tiny_demo, top=5)
    with serving(build_app(service)) as url:
        page = http_request("GET", url + "/")[2].decode()
        # nothing fetched from elsewhere: no src / href / fetch to another host
        assert not re.findall(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", page)
        assert not re.findall(r"""fetch\(\s*["'`](?:https?:)?//""", page)
        browser.open(url + "/")
        browser.wait_for("document.getElementById('model').textContent.includes('12 classes')")
        browser.set_files("#file", [clip])
        browser.wait_for("['done', 'error'].includes(document.body.dataset.state)")
        status = browser.evaluate("document.getElementById('status').textContent")
        classes = browser.evaluate(ROWS.replace("SECTION", "classes"))
        neighbours = browser.evaluate(ROWS.replace("SECTION", "neighbours"))
        sources = browser.evaluate(
            "[...document.querySelectorAll('#neighbours audio')].map((a) => a.src)"
        )
        played = http_request("GET", sources[0])
    assert status.startswith(f"{clip.name}: answered in"), status
    shown = [row[1] for row in json.loads(classes)]
    assert shown == [expected.names[o] for o in expected.order[0]]
    rows = json.loads(neighbours)
    assert len(rows) == 4 and [row[0] for row in rows] == ["1", "2", "3", "4"]
    assert played[0] == 200 and played[2][:4] == b"RIFF"  # the neighbour plays from the server
