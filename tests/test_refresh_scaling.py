"""The refresh scaling model of ``benchmarks/refresh_scaling.py``: its formula, and the records it reads.

Full versions are read by every worker, delta versions once per node, so a delta's shared reads do not grow
with the workers on a node; a full version's pause grows with the workers reading the shared file system at
once, a delta version's does not; the cost table a refresh record holds is read back as written.
"""

from __future__ import annotations

import pytest

from tests.conftest import REPO

MB = 1_000_000


@pytest.fixture
def scaling(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import refresh_scaling

    return refresh_scaling


def measured(scaling, **changes):
    values = dict(name="m", workers=2, weights=100 * MB, files=101 * MB, delta=2 * MB, t_mem=0.5,
                  read_rate=10_000 * MB, t_check=0.25, overhead=1.0, t_rebuild=3.0, rows=[])  # fmt: skip
    return scaling.Measured(**{**values, **changes})


def test_shared_reads_full_per_worker_delta_once_per_node(scaling):
    reads = scaling.shared_reads
    assert reads("full", 256, 8, 100 * MB, 101 * MB, 2 * MB, False) == 256 * 100 * MB
    assert reads("delta", 256, 8, 100 * MB, 101 * MB, 2 * MB, False) == 32 * 2 * MB
    assert reads("delta", 256, 8, 100 * MB, 101 * MB, 2 * MB, True) == 32 * (101 + 2) * MB  # the full base too
    # eight nodes: one worker or eight on each
    assert reads("delta", 8, 1, 100 * MB, 101 * MB, 2 * MB, False) == reads(
        "delta", 64, 8, 100 * MB, 101 * MB, 2 * MB, False
    )
    assert reads("full", 64, 8, 100 * MB, 101 * MB, 2 * MB, False) == 8 * reads(
        "full", 8, 1, 100 * MB, 101 * MB, 2 * MB, False
    )
    assert reads("delta", 17, 8, 100 * MB, 101 * MB, 2 * MB, False) == 3 * 2 * MB  # a partly filled node reads too


def test_a_full_versions_pause_grows_with_the_workers_a_deltas_does_not(scaling):
    m, bandwidth, link = measured(scaling), 2_000 * MB, 12_500 * MB
    assert scaling.pause(m, "full", 256, 8, bandwidth, link) == pytest.approx(0.5 + 0.25 + 256 * 100 / 2_000)
    assert scaling.pause(m, "full", 2, 8, bandwidth, link) == pytest.approx(0.75 + 2 * 100 / 2_000)
    assert scaling.pause(m, "full", 16, 8, 10**12, link) == pytest.approx(0.75 + 8 * 100 / 12_500)  # the node link
    delta = [scaling.pause(m, "delta", n, 8, bandwidth, link) for n in (16, 256)]
    assert delta[0] == delta[1] == pytest.approx(0.75 + 100 / 10_000)
    full_refresh = scaling.refresh_time(m, "full", 256, 8, bandwidth, link)
    assert full_refresh == pytest.approx(1.0 + 0.75 + 12.8)
    # a delta is fetched (32 nodes × 2 MB over B) and rebuilt before the pause
    assert scaling.refresh_time(m, "delta", 256, 8, bandwidth, link) == pytest.approx(1.0 + 64 / 2_000 + 3.0 + delta[1])


def test_an_engine_that_stages_reads_and_hashes_outside_its_pause(scaling):
    m, bandwidth, link = measured(scaling, staged=True, t_hash=0.4), 2_000 * MB, 12_500 * MB
    assert scaling.pause(m, "full", 256, 8, bandwidth, link) == scaling.pause(m, "delta", 2, 8, bandwidth, link)
    assert scaling.pause(m, "full", 256, 8, bandwidth, link) == pytest.approx(0.5 + 0.25)  # load and check only
    assert scaling.stage_time(m, "full", 256, 8, bandwidth, link) == pytest.approx(256 * 100 / 2_000 + 0.4)
    assert scaling.stage_time(m, "delta", 256, 8, bandwidth, link) == pytest.approx(100 / 10_000 + 0.4)
    assert scaling.refresh_time(m, "full", 256, 8, bandwidth, link) == pytest.approx(1.0 + 12.8 + 0.4 + 0.75)
    unstaged = measured(scaling)
    assert scaling.stage_time(unstaged, "full", 256, 8, bandwidth, link) == 0.0


def test_a_records_cost_table_is_read_back(scaling, tmp_path):
    import refresh_costs
    from common.records import markdown_table

    row = dict.fromkeys(refresh_costs.COST_HEADER, 0.0)
    full = {**row, "publish": "full", "policy": "continue", "version": 1, "kind": "full", "version bytes": 100 * MB,
            "loaded on every worker (s)": 2.0, "shared-storage bytes read, all workers": 200 * MB,
            "fetch s, slowest worker": 0.0, "pause s, slowest worker": 0.75, "check s, slowest worker": 0.25,
            "engine load from memory (s)": 0.5}  # fmt: skip
    deltas = [
        {**full, "version": v, "kind": "delta", "version bytes": size, "shared-storage bytes read, all workers": read,
         "fetch s, slowest worker": fetch}
        for v, size, read, fetch in ((2, 2 * MB, 103 * MB, 1.0), (3, 3 * MB, 3 * MB, 0.5))
    ]  # fmt: skip
    table = markdown_table(refresh_costs.COST_HEADER, [list(r.values()) for r in (full, *deltas)])
    record = tmp_path / "r.md"
    record.write_text(
        "Engine `transformers` ({}); model /x/tiny; 2 workers\n\n"
        "### What each refresh cost (2 workers, one node). Weights per version: 100,000,000 bytes, every file of "
        f"its folder 101,000,000 bytes; page-cache read rate of them: 10,000,000,000 bytes/s.\n\n{table}\n"
    )
    m = scaling.read_measured(record)
    assert (m.workers, m.weights, m.files, m.read_rate, m.t_mem) == (2, 100 * MB, 101 * MB, 10_000 * MB, 0.5)
    assert m.staged and m.t_hash == 0.0  # stage times of 0 s: less than a read of the weights
    assert m.delta == 2.5 * MB and m.t_rebuild == 0.5  # the later delta's fetch (it did not read the full base)
    assert m.t_check == 0.25 and m.overhead == pytest.approx(0.75)  # median of 1.25, 0.25, 0.75
    checked = scaling.check_rows(m)
    assert [r[4] for r in checked] == [200 * MB, 103 * MB, 3 * MB]  # the model's reads: the measured ones


def test_a_steady_interval_without_commits_gives_no_shares_instead_of_dividing_by_zero(monkeypatch):
    """On a loaded machine a steady interval can end before any partition commits: the record leaves the shares
    of the steady rate out ("-") and the run still writes its record."""
    import argparse

    import numpy as np

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import refresh

    run = {"bounds": [0.0, 3.0, 6.0], "committed_at": np.array([4.0, 5.0]), "tokens": np.array([10, 20])}
    rows, rate = refresh.throughput_rows(run, argparse.Namespace(interval=3.0, steady=1))
    assert rate == 0 and rows == [["steady 1", 0.0, None, None], ["after publish 1", 10.0, -30.0, None]]
    run["committed_at"] = np.array([1.0, 4.0])
    rows, rate = refresh.throughput_rows(run, argparse.Namespace(interval=3.0, steady=1))
    assert rate == pytest.approx(10 / 3) and rows[1][3] == pytest.approx(-10 / (10 / 3))
