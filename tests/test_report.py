"""``daskgen report``: the HTML page and the PNG are generated and hold the expected panels."""

from __future__ import annotations

import base64
import re

import pytest

from daskgen.analysis import report
from daskgen.errors import ExportError, OutputExistsError, StoreError
from tests.conftest import run_cli
from tests.test_analysis import build_store

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def truth(tmp_path):
    return build_store(tmp_path)


def test_html_has_every_panel_as_an_embedded_image(truth, tmp_path):
    out = report.write_report(truth.path, tmp_path / "r.html")
    page = out.read_text()
    for title in report.PANELS:
        assert f"<h2>{title}</h2>" in page
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)"', page)
    assert [alt for alt, _ in images] == list(report.PANELS[:4])
    assert all(base64.b64decode(data).startswith(PNG_MAGIC) for _, data in images)
    assert "Response length statistics" in page and "<th>stop</th>" in page
    assert "engine crashed on this prompt" in page, "first errors are listed"
    assert "SIMULATED" in page and "<th>n_samples</th><td>3</td>" in page


def test_png_report_is_one_readable_figure(truth, tmp_path):
    import matplotlib.image

    out = report.write_report(truth.path, tmp_path / "r.png")
    assert out.read_bytes().startswith(PNG_MAGIC)
    height, width = matplotlib.image.imread(out).shape[:2]
    assert width >= 1500 and height >= 1000


def test_collect_gives_the_numbers_the_panels_show(truth):
    data = report.collect(truth.path)
    assert data.counts == {"done": 7, "pending": 2, "failed": 1}
    assert int(data.histogram.sum()) == 20 and data.rate["prompts"].sum() == 7
    assert dict(report.settings_rows(data))["model"] == "sim"


def test_report_of_a_store_with_nothing_done(tmp_path):
    truth = build_store(tmp_path, done={})
    page = report.write_report(truth.path, tmp_path / "empty.html").read_text()
    assert page.count("data:image/png;base64,") == 4


def test_report_errors(truth, tmp_path):
    with pytest.raises(ExportError, match=r"must end in \.html or \.png"):
        report.write_report(truth.path, tmp_path / "r.pdf")
    with pytest.raises(StoreError, match="is not a daskgen store"):
        report.write_report(tmp_path, tmp_path / "r.html")
    (tmp_path / "r.html").write_text("old")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        report.write_report(truth.path, tmp_path / "r.html")
    report.write_report(truth.path, tmp_path / "r.html", overwrite=True)
    assert "<h2>Settings</h2>" in (tmp_path / "r.html").read_text()


def test_cli_report_default_path(truth):
    res = run_cli("report", truth.path)
    out = truth.path.with_suffix(".report.html")
    assert res.returncode == 0 and f"report written to {out}" in res.stdout, res.stderr
    assert out.read_text().count("data:image/png;base64,") == 4


@pytest.mark.timeout(180)
def test_a_real_run_gets_engine_throughput_and_worker_balance_panels(tmp_path):
    """A run on a two-worker LocalCluster keeps its engine record; the report draws it from the store."""
    from daskgen.analysis.accessor import open_store
    from daskgen.analysis.report_engines import ENGINE_PANELS, balance, latest_record, rates
    from tests.conftest import simulated_run, write_prompts

    store = tmp_path / "out.zarr"
    args = [*simulated_run(max_new_tokens=32), "--n-workers", "2"]  # the later --n-workers wins
    res = run_cli("run", "--prompts", write_prompts(tmp_path / "p.jsonl", 40), "--store", store, *args)
    assert res.returncode == 0, res.stdout + res.stderr
    ds = open_store(store)
    number, record = latest_record(ds.daskgen.attrs)
    stored_tokens = int(ds.response_length.values.sum())
    assert number == 1 and record["engine_tokens"] == record["committed_tokens"] == stored_tokens
    names, tokens, _ratio = balance(record)
    assert len(names) == 2 and tokens.sum() == stored_tokens
    assert sum(w["samples"] for w in record["workers"].values()) == 40 * 2
    r = rates(record)
    assert r["gap"][-1] == 0 and len(r["time"]) == len(record["series"]["seconds"]) >= 2
    page = report.write_report(store, tmp_path / "r.html").read_text()
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,', page)
    assert images == [*report.PANELS[:4], *ENGINE_PANELS]
    png = report.write_report(store, tmp_path / "r.png")
    assert png.read_bytes().startswith(PNG_MAGIC)
