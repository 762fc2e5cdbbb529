"""The evaluation's scatter page (eval/embeddings.html), opened in a real browser: Playwright
drives headless Chromium (Debian's `chromium`, offline) over the page `python -m
audioclf.evaluate` wrote; every validation clip is a point, hovering one shows its class, item
and id, a class hides from the legend, and nothing is fetched from anywhere."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from audioclf.evaluate import main as evaluate_main
from tests.helpers import offline_page, tiny_config

pytestmark = pytest.mark.slow  # trains one short epoch, evaluates, starts a browser


def test_every_validation_clip_is_a_point_whose_hover_names_it(
    browser, tiny_demo, tmp_path, screenshots
):
    from audioclf.training.trainer import fit

    cfg = tiny_config(
        tiny_demo, tmp_path / "runs", "cnn", "train.epochs=1", "train.limit_batches=2"
    )
    checkpoint = Path(fit(cfg)["run_dir"]) / "best.pt"
    out = tmp_path / "eval"
    assert evaluate_main(["--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    metadata = pd.read_csv(out / "metadata.tsv", sep="\t", dtype=str)

    page, elsewhere = offline_page(browser)
    page.goto((out / "embeddings.html").as_uri())
    points = page.locator("#plot circle")
    assert points.count() == report["evaluation"]["n_samples"] == len(metadata)
    for number in (0, points.count() // 2, points.count() - 1):
        point = points.nth(number)
        point.hover(force=True)
        tip = page.locator("#tip").text_content()
        row = metadata[metadata["id"] == tip.split("id: ")[1].split()[0]].iloc[0]
        assert f"class: {row['class']}" in tip and f"item: {row['item']}" in tip, tip
        assert point.get_attribute("data-k") is not None
    page.screenshot(path=screenshots / "embeddings-page.png", full_page=True)
    legend = page.locator("#legend div").first
    hidden = points.and_(page.locator(f"circle[data-k='{legend.get_attribute('data-k')}']"))
    legend.click()
    assert hidden.count() > 0 and all(not hidden.nth(i).is_visible() for i in range(hidden.count()))
    assert elsewhere == []  # a self-contained page
