"""The page of `audioclf serve`, seen working in a real browser: Playwright drives headless
Chromium (Debian's `chromium`, offline through executable_path) to a server on the loopback; a
file is chosen in its file input as a person would, the ranked classes and nearest clips
appear, a neighbour plays from the server, and no request leaves this machine. The screenshot
docs/serving.md shows is this test's (`--screenshots docs/`)."""

from __future__ import annotations

import pytest

import audioclf
from audioclf.embedding.index import EmbedSheetOptions, embed_sheet
from audioclf.serve.app import build_app
from audioclf.serve.service import ServeOptions, Service
from tests.helpers import make_checkpoint, offline_page, serving

pytestmark = pytest.mark.slow

ROWS = "(rows) => rows.map((tr) => [...tr.children].map((td) => td.textContent))"


def test_the_page_works_offline_and_shows_a_clips_classes_and_neighbours(
    browser, tiny_demo, tmp_path, screenshots
):
    model_path = make_checkpoint(tmp_path / "model.pt")
    model = audioclf.load(model_path, device="cpu")
    embed_sheet(
        model.loaded, tiny_demo, tmp_path / "all", EmbedSheetOptions(num_workers=0), progress=False
    )
    service = Service.open(
        model_path, gallery=tiny_demo, collection=tmp_path / "all", options=ServeOptions(k=4)
    )
    clip = sorted(tiny_demo.parent.rglob("*.wav"))[40]
    expected = model.rank([clip], tiny_demo, top=5)
    page, elsewhere = offline_page(browser)
    with serving(build_app(service)) as url:
        page.goto(url + "/")
        page.locator("#model").filter(has_text="12 classes").wait_for()
        page.set_input_files("#file", clip)
        page.wait_for_function("['done', 'error'].includes(document.body.dataset.state)")
        status = page.locator("#status").text_content()
        classes = page.locator("#classes tr").evaluate_all(ROWS)
        neighbours = page.locator("#neighbours tr").evaluate_all(ROWS)
        player = page.locator("#neighbours audio").first
        with page.expect_response(lambda r: "/clips/" in r.url) as played:
            player.evaluate("(audio) => audio.play().catch(() => {})")
        heard = played.value
        page.screenshot(path=screenshots / "serving-page.png", full_page=True)
    assert status.startswith(f"{clip.name}: answered in"), status
    assert [row[1] for row in classes] == [expected.names[o] for o in expected.order[0]]
    assert len(neighbours) == 4 and [row[0] for row in neighbours] == ["1", "2", "3", "4"]
    assert heard.ok and heard.url.startswith(url)  # the neighbour plays from this server
    assert elsewhere == []  # nothing asked of another host
