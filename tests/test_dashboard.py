"""daskgen's page on the Dask dashboard: the aggregation, the plugin on real clusters, the page in a real browser.

The browser tests open the page in one headless Chromium (Debian's ``chromium`` + ``chromium-driver``,
driven by selenium) while a real run streams on a real cluster, read the numbers the page displays and
the data sources its figures draw (through the page's Bokeh document), compare them with the store,
fail on severe console errors and keep screenshots (``$DASKGEN_TEST_ARTIFACTS``, default
``artifacts/dashboard/``; see ``tests/browser.py``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster

from daskgen.analysis.palette import FINISH_COLORS
from daskgen.dashboard import PLUGIN_NAME, DashboardPlugin, page_link
from daskgen.dashboard.metrics import REASON_LABELS, RUN_TOPIC, WORKER_TOPIC
from daskgen.dashboard.page import (
    COMMITTED_COLOR,
    ENGINE_COLOR,
    GAP_COLOR,
    LENGTHS_SOURCE,
    THROUGHPUT_SOURCE,
    VERSION_COLOR,
    VERSIONS_SOURCE,
    WORKERS_SOURCE,
)
from daskgen.dashboard.state import DashboardState, bin_lengths, load_ratio
from daskgen.engines.base import FinishReason
from daskgen.store.generation_store import GenerationStore
from daskgen.store.layout import DONE
from daskgen.testing.probes import read_events
from tests.browser import (
    artifacts_dir,
    chromium,
    colours,
    figure_boxes,
    number,
    open_page,
    rgb,
    screenshot,
    severe_console_errors,
    wait_for_sources,
    wait_until_shown,
)
from tests.conftest import cli_env, popen_cli, write_prompts

N_PROMPTS, PARTITION, N_SAMPLES = 96, 4, 2
HELD_ROWS = [93, 94]  # two rows of the last partition wait at the probe's gate until the test opens it
N_SAMPLED = N_PROMPTS * N_SAMPLES
SOURCES = (THROUGHPUT_SOURCE, WORKERS_SOURCE, LENGTHS_SOURCE, VERSIONS_SOURCE)


# --------------------------------------------------------------------------- aggregation (no cluster)
def _worker_msg(worker: str, t: float, tokens: int, lengths: dict | None = None, **extra) -> dict:
    base = {"worker": worker, "time": t, "tokens": tokens, "samples": tokens // 10, "partitions": 0, "restarts": 0}
    return {**base, "error": None, "lengths": lengths or {}, "state": "ready", "outstanding": 8, "capacity": 16,
            "window": 4, "running": 2, **extra}  # fmt: skip


def _run_msg(t: float, committed_prompts: int, committed_tokens: int, pending: int, **extra) -> dict:
    return {"run": "s.zarr@1", "store": "s.zarr", "time": t, "started": 1000.0, "total": 100, "done": 100 - pending,
            "failed": 0, "pending": pending, "committed_prompts": committed_prompts,
            "committed_tokens": committed_tokens, "max_new_tokens": 64, "state": "generating", "stop_reason": None,
            "errors": [], **extra}  # fmt: skip


def test_state_rates_gap_balance_lengths_and_record():
    state = DashboardState()
    for i in range(11):  # 10 s: worker a makes 300 tokens/s, worker b 100; the store gets 200 tokens/s
        t = 1000.0 + i
        state.ingest(WORKER_TOPIC, _worker_msg("tcp://a:1", t, 300 * i, {"stop": [5, 5, 63]} if i == 1 else {}))
        state.ingest(WORKER_TOPIC, _worker_msg("tcp://b:1", t, 100 * i, {"length": [64]} if i == 2 else {}))
        state.ingest(RUN_TOPIC, _run_msg(t, 9 * i, 200 * i, pending=100 - 9 * i))
    snap = state.snapshot(now=1010.0)
    rates = snap["throughput"]
    assert rates["engine"][-1] == pytest.approx(400) and rates["committed"][-1] == pytest.approx(200)
    assert snap["progress"]["gap_tokens"] == 4000 - 2000 and rates["gap"][-1] == 2000
    assert [w["tokens_per_s"] for w in snap["workers"]] == pytest.approx([300, 100])
    assert snap["workers"][0]["occupancy"] == 0.5 and snap["load_ratio"] == pytest.approx(3.0)
    assert snap["progress"]["eta_s"] == pytest.approx(10 / 9)  # 10 prompts left at 9 prompts/s
    hist = snap["lengths"]
    assert sum(hist["counts"]["stop"]) == 3 and sum(hist["counts"]["length"]) == 1 and hist["edges"][-1] >= 64
    assert hist["counts"]["length"][-1] == 1  # 64 tokens: the last bar
    record = state.record()
    assert record["engine_tokens"] == 4000 and record["committed_tokens"] == 2000
    assert record["workers"]["tcp://b:1"]["tokens"] == 1000
    assert record["series"]["committed_tokens"][-1] == 2000 and record["series"]["seconds"][-1] == 10.0


def test_a_run_report_waits_for_the_workers_reports_after_it():
    """Engine and committed totals of a point refer to the same moment: a worker's tokens are interpolated
    between its reports before and after the client's report (they tick on different clocks)."""
    state = DashboardState()
    state.ingest(WORKER_TOPIC, _worker_msg("tcp://a:1", 1000.5, 100))
    state.ingest(RUN_TOPIC, _run_msg(1001.0, 1, 120, pending=99))
    assert state.series.points == []  # no worker report after it yet
    state.ingest(WORKER_TOPIC, _worker_msg("tcp://a:1", 1001.5, 300))
    assert state.series.points == [(1001.0, 200.0, 120, 1)]
    assert state.snapshot(now=1001.5)["progress"]["gap_tokens"] == 80
    state.ingest(RUN_TOPIC, _run_msg(1002.0, 2, 300, pending=98, state="finished"))  # the last report: final
    assert state.series.points[-1] == (1002.0, 300.0, 300, 2)


def test_state_errors_tail_share_and_a_new_run():
    state = DashboardState()
    state.ingest(RUN_TOPIC, _run_msg(1000.0, 0, 0, pending=100))
    state.ingest(WORKER_TOPIC, _worker_msg("tcp://a:1", 1001.0, 0, error="EngineError: boom", restarts=1))
    state.ingest(WORKER_TOPIC, _worker_msg("tcp://a:1", 1002.0, 0, error="EngineError: boom", restarts=1))
    state.ingest(RUN_TOPIC, _run_msg(1090.0, 90, 0, pending=10))
    state.ingest(RUN_TOPIC, _run_msg(1100.0, 100, 0, pending=0, errors=[[7, "bad prompt"]]))
    snap = state.snapshot(now=1100.0)
    assert [e["source"] for e in snap["errors"]] == ["row 7", "tcp://a:1"]  # newest first, one per restart
    assert snap["progress"]["tail_share"] == pytest.approx(10 / 100)  # the last 10 prompts took 10 of 100 s
    assert snap["workers"][0]["state"] == "silent"  # nothing for 98 s
    assert load_ratio(snap["workers"]) is None
    state.ingest(RUN_TOPIC, {**_run_msg(1200.0, 0, 0, pending=5), "run": "other@2"})
    assert not state.workers and not state.errors and state.run["run"] == "other@2"
    assert load_ratio([{"state": "ready", "tokens_per_s": 5.0}, {"state": "ready", "tokens_per_s": 0.0}]) == math.inf


# --------------------------------------------------------------------------- real clusters
def _run_args(tmp_path: Path, store: Path, *extra: str) -> list[str]:
    """A run of the simulated engine behind the probe (a labelled test double) that holds :data:`HELD_ROWS`."""
    prompts = write_prompts(tmp_path / "p.jsonl", N_PROMPTS)
    engine = {"inner": "simulated", "events_path": tmp_path / "events.log", "gate_path": tmp_path / "gate",
              "gate_rows": HELD_ROWS, "time_scale": 0.3, "length_mean": 40, "max_batch": 8}  # fmt: skip
    args = ["run", "--prompts", prompts, "--store", store, "--model", "sim"]
    args += ["--engine", "daskgen.testing.probes:ProbeEngine", "--max-new-tokens", "96", "--max-prompt-tokens", "128"]
    args += ["--partition-size", PARTITION, "--n-samples", N_SAMPLES]
    for key, value in engine.items():
        args += ["--engine-arg", f"{key}={value}"]
    return [str(a) for a in [*args, *extra]]


def _state(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/state.json", timeout=10) as answer:
        return json.loads(answer.read())


def _wait_state(url: str, check, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            state = _state(url)
        except urllib.error.HTTPError as exc:  # 404 until the run installed the plugin
            state = {"error": str(exc)}
        if "error" not in state and check(state):
            return state
        assert time.monotonic() < deadline, f"state.json never matched: {json.dumps(state)[:2000]}"
        time.sleep(0.3)


def _finish(proc: subprocess.Popen, gate: Path, timeout: float = 120) -> str:
    gate.touch()
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def _store_truth(store: Path) -> dict:
    """The store's done rows: their count, response tokens and samples."""
    gs = GenerationStore.open(store)
    done = gs.read_status() == DONE
    lengths = gs.array("response_length")[:][done]
    return {"done": int(done.sum()), "tokens": int(lengths.sum()), "samples": int(lengths.size)}


def _store_histogram(store: Path) -> dict:
    """The done rows' ``response_length`` by finish reason, in the dashboard's bars (its own binning rule)."""
    gs = GenerationStore.open(store)
    done = gs.read_status() == DONE
    lengths, reasons = gs.array("response_length")[:][done], gs.array("finish_reason")[:][done]
    counts = {FinishReason(code).name.lower(): np.bincount(lengths[reasons == code]) for code in np.unique(reasons)}
    return bin_lengths(counts, gs.layout.max_new_tokens)


def _store_versions(store: Path) -> dict:
    """The done rows' samples per policy version of their first token, and of those the continued ones."""
    gs = GenerationStore.open(store)
    done = gs.read_status() == DONE
    first, changed = gs.array("policy_version")[:][done], gs.array("version_changed_at")[:][done]
    versions = np.unique(first).tolist()
    return {"version": versions, "samples": [int((first == v).sum()) for v in versions],
            "continued": [int(((first == v) & (changed >= 0)).sum()) for v in versions]}  # fmt: skip


def _store_by_worker(store: Path, events: Path, pids: dict[str, int]) -> dict[str, dict]:
    """Samples and response tokens in the store by the worker that generated them: the store does not say
    which worker wrote a partition, the probe's request log says which worker process ended each request."""
    ended = [e for e in read_events(events) if e.kind == "end"]
    assert len({e.request_id for e in ended}) == len(ended), "a request ended twice: the counts would not be exact"
    lengths = GenerationStore.open(store).array("response_length")[:]
    worker_of = {pid: address for address, pid in pids.items()}
    out = {address: {"samples": 0, "tokens": 0} for address in pids}
    for event in ended:
        row, sample = (int(part[1:]) for part in event.request_id.split("-")[:2])  # p<row>-s<sample>
        out[worker_of[event.pid]]["samples"] += 1
        out[worker_of[event.pid]]["tokens"] += int(lengths[row, sample])
    return out


def _last(sources: dict, column: str) -> float | None:
    values = sources[THROUGHPUT_SOURCE][column]
    return values[-1] if values else None


def _assert_drawn(browser, path: Path, figures: dict[str, tuple[str, ...]]) -> None:
    """Keep a screenshot of the page at ``path`` and check it is a picture of it: many colours, and each
    data source drawn in its colours inside the figures that show it."""
    boxes = figure_boxes(browser, *figures)
    screenshot(browser, path)
    assert len(colours(path)) > 50, f"a blank screenshot: {path}"
    for name, hex_colours in figures.items():
        found = colours(path, boxes[name])
        missing = [c for c in hex_colours if rgb(c) not in found]
        assert not missing, f"{path.name}: colours {missing} not drawn in the figures of {name} at {boxes[name]}"


@pytest.fixture(scope="module")
def browser():
    """One Chromium for the module's browser tests."""
    with chromium() as driver:
        yield driver


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_page_in_a_browser_during_and_after_a_run(tmp_path, browser):
    """A run on an existing LocalCluster (worker processes): the page shows progress while it streams and,
    after it, the store's numbers; its figures' data, read in the browser, are the store's: the committed
    series ends at the store's committed prompts and tokens, the histogram holds the store's response
    lengths by finish reason, the per-worker data the samples each worker generated, the samples per policy
    version the store's (every sample on the run's model, version 0, here)."""
    store, gate, shots = tmp_path / "out.zarr", tmp_path / "gate", artifacts_dir()
    # As daskgen's local clusters: nannies export Dask's pre-spawn environment into *this* process's
    # os.environ, and MALLOC_TRIM_THRESHOLD_ would then reach every later worker of the test session.
    spawn_env = dict(dask.config.get("distributed.nanny.pre-spawn-environ"))
    spawn_env.pop("MALLOC_TRIM_THRESHOLD_", None)
    with (
        dask.config.set({"distributed.nanny.pre-spawn-environ": spawn_env}),
        LocalCluster(n_workers=2, threads_per_worker=8, processes=True, dashboard_address="127.0.0.1:0") as cluster,
    ):
        url = page_link(cluster.dashboard_link)
        with Client(cluster) as client:  # the probe's request log names worker processes
            pids = client.run(os.getpid)
        proc = popen_cli(*_run_args(tmp_path, store, "--scheduler-address", cluster.scheduler_address, "--no-progress"))
        try:
            _wait_state(url, lambda s: s["run"] is not None)  # the run installed the plugin and reported
            open_page(browser, url)
            assert "Daskgen" in browser.find_element("id", "myTopnav").text  # in Dask's navigation bar
            during = wait_until_shown(
                browser,
                lambda v: number(v["done"]) == N_PROMPTS - PARTITION and number(v["gap"]) > 0,
            )
            assert number(during["pending"]) == PARTITION and during["state"] == "generating"
            held = _store_truth(store)  # the held partition keeps the store still
            sources = wait_for_sources(  # the figure's own data shows the gap the numbers show (drawn after them)
                browser, SOURCES, lambda s: _last(s, "committed_prompts") == held["done"] and (_last(s, "gap") or 0) > 0
            )
            assert _last(sources, "committed_tokens") == held["tokens"]
            _assert_drawn(
                browser,
                shots / "dashboard-during-run.png",
                {THROUGHPUT_SOURCE: (ENGINE_COLOR, COMMITTED_COLOR, GAP_COLOR)},
            )
            _finish(proc, gate)
            truth = _store_truth(store)
            after = wait_until_shown(browser, lambda v: v["state"] == "finished" and number(v["gap"]) == 0)
            assert number(after["done"]) == truth["done"] == N_PROMPTS
            assert number(after["pending"]) == 0 and number(after["failed"]) == 0
            assert number(after["samples-0"]) + number(after["samples-1"]) == N_SAMPLED
            sources = wait_for_sources(  # the figures are redrawn after the numbers: wait for their last update
                browser,
                SOURCES,
                lambda s: (
                    _last(s, "committed_prompts") == N_PROMPTS
                    and sum(s[WORKERS_SOURCE]["samples"]) == sum(s[VERSIONS_SOURCE]["samples"]) == N_SAMPLED
                ),
            )
            hist = _store_histogram(store)
            drawn = {
                THROUGHPUT_SOURCE: (ENGINE_COLOR, COMMITTED_COLOR, GAP_COLOR),
                LENGTHS_SOURCE: tuple(map(FINISH_COLORS.get, hist["counts"])),
                VERSIONS_SOURCE: (VERSION_COLOR,),
            }
            _assert_drawn(browser, shots / "dashboard-after-run.png", drawn)
            console = severe_console_errors(browser)
            state = _state(url)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert not console, f"severe errors in the browser console: {console}"
    assert _last(sources, "committed_tokens") == _last(sources, "engine_tokens") == truth["tokens"]
    assert _last(sources, "gap") == 0
    bars = sources[LENGTHS_SOURCE]
    assert sum(map(sum, hist["counts"].values())) == truth["samples"]  # every done sample is in a bar
    assert bars["left"] == hist["edges"][:-1] and bars["right"] == hist["edges"][1:]
    for reason in REASON_LABELS:
        assert bars[reason] == hist["counts"].get(reason, [0] * len(bars["left"])), reason
    versions = sources[VERSIONS_SOURCE]
    assert {k: versions[k] for k in ("version", "samples", "continued")} == _store_versions(store)
    workers = sources[WORKERS_SOURCE]
    columns = zip(workers["worker"], workers["samples"], workers["tokens"], strict=True)
    by_worker = _store_by_worker(store, tmp_path / "events.log", pids)
    assert {w: {"samples": n, "tokens": t} for w, n, t in columns} == by_worker
    assert all(w["samples"] > 0 for w in by_worker.values())
    progress = state["progress"]
    assert progress["engine_tokens"] == progress["committed_tokens"] == truth["tokens"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_page_of_daskgens_own_scheduler_process_over_tls(tmp_path, browser):
    """``cluster.scheduler_process`` with TLS: the scheduler process serves the page from its start, the
    progress line prints its address, the browser shows the run; the store keeps the run's record."""
    store, gate = tmp_path / "out.zarr", tmp_path / "gate"
    config = tmp_path / "run.yaml"
    config.write_text(
        "cluster: {kind: local, n_workers: 2, threads_per_worker: 8, scheduler_process: true, tls: true}\n"
    )
    proc = popen_cli(*_run_args(tmp_path, store, "--config", config))  # progress on: it prints the address
    try:
        line = _read_until(proc, "daskgen: live view at ")
        url = line.split("live view at ", 1)[1].strip()
        open_page(browser, url)
        shown = wait_until_shown(browser, lambda v: number(v["done"]) > 0 and number(v["engine-tps"]) > 0)
        assert number(shown["pending"]) > 0  # the held rows keep the run going
        assert not severe_console_errors(browser)
        state = _state(url)
        assert len(state["workers"]) == 2 and state["run"]["store"] == str(store)
        _finish(proc, gate)
    finally:
        if proc.poll() is None:
            proc.kill()
    from daskgen.store import read_store_attrs

    record = read_store_attrs(store).runs[-1]["engines"]
    truth = _store_truth(store)
    assert record["engine_tokens"] == record["committed_tokens"] == truth["tokens"]
    assert sum(w["samples"] for w in record["workers"].values()) == truth["samples"]
    assert record["series"]["committed_prompts"][-1] == N_PROMPTS


def _read_until(proc: subprocess.Popen, marker: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        if marker in line:
            return line
        assert time.monotonic() < deadline, f"no line with {marker!r} within {timeout} s"
    raise AssertionError(f"the run ended without printing {marker!r} (exit {proc.wait()})")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("prefix", ["", "/dask"])
def test_dask_scheduler_with_the_preload_serves_the_page(tmp_path, prefix):
    """``dask scheduler --preload daskgen.dashboard``: a scheduler daskgen did not start serves the page
    before any run, and its navigation bar links to it; under ``--dashboard-prefix`` the page is too."""
    scheduler_file = tmp_path / "scheduler.json"
    cmd = [sys.executable, "-m", "distributed.cli.dask_scheduler", "--preload", "daskgen.dashboard"]
    cmd += ["--scheduler-file", str(scheduler_file), "--host", "127.0.0.1", "--port", "0", "--dashboard-address", ":0"]
    cmd += ["--dashboard-prefix", prefix] if prefix else []
    proc = subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.2)
        with Client(scheduler_file=str(scheduler_file), timeout="30s") as client:
            port = client.scheduler_info()["services"]["dashboard"]
            url = f"http://127.0.0.1:{port}{prefix}/daskgen"
            if not prefix:  # Dask's own link (the one the progress line prints) leads to the same page
                assert page_link(client.dashboard_link) == url
            state = _state(url)
            assert state["run"] is None and state["progress"]["state"] == "waiting for a run"
            with urllib.request.urlopen(url, timeout=10) as answer:
                page = answer.read().decode()
            assert answer.status == 200 and "bokeh" in page.lower() and 'href="daskgen"' in page
            client.unregister_scheduler_plugin(PLUGIN_NAME)
            with pytest.raises(urllib.error.HTTPError, match="404"):  # no plugin, no numbers
                urllib.request.urlopen(url + "/state.json", timeout=10)
            client.register_plugin(DashboardPlugin(), name=PLUGIN_NAME)  # registered again: the same page
            assert _state(url)["run"] is None
            pages = client.run_on_scheduler(  # a lambda: pickled by value for the scheduler's process
                lambda dask_scheduler: sum(
                    "/daskgen" in getattr(a, "app_paths", ()) for a in dask_scheduler.http_application.applications
                )
            )
            assert pages == 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_worker_meter_counts_generated_tokens_not_carried_ones():
    from daskgen.agents import Trajectory
    from daskgen.dashboard.metrics import WorkerMeter
    from daskgen.engines.base import FinishReason

    meter = WorkerMeter()
    meter.record([Trajectory([1, 2, 3, 4], [1, 1, 1, 1], finish_reason=FinishReason.LENGTH, carried=3)])
    meter.record([Trajectory([5, 6, 7], [1, 0, 1], finish_reason=FinishReason.STOP)])  # a tool token: not generated
    meter.record([Trajectory(error="EngineError: x", finish_reason=FinishReason.ERROR)])
    report = meter.report("tcp://w:1", state="ready")
    assert report["tokens"] == 1 + 2 and report["samples"] == 3 and report["error"] == "EngineError: x"
    assert report["lengths"] == {"length": [4], "stop": [3], "error": [0]}
    assert meter.report("tcp://w:1")["lengths"] == {}  # sent once
    assert np.isfinite(report["time"])


def test_samples_per_policy_version_from_the_workers_cumulative_reports():
    from daskgen.agents import Trajectory
    from daskgen.dashboard.metrics import WorkerMeter

    meter = WorkerMeter()
    meter.record([Trajectory([1, 2], [1, 1], versions=[(0, 0)])])
    meter.record([Trajectory([3, 4, 5], [1, 1, 1], versions=[(0, 0), (2, 1)])])  # continued onto version 1
    meter.record([Trajectory([6], [1], versions=[(0, 1)]), Trajectory(error="EngineError: x")])  # no model token
    assert meter.report("tcp://a:1")["versions"] == [[0, 2, 1], [1, 1, 0]]
    assert meter.report("tcp://a:1")["versions"] == [[0, 2, 1], [1, 1, 0]]  # cumulative: a lost report loses none
    state = DashboardState()
    state.ingest(WORKER_TOPIC, _worker_msg("tcp://a:1", 1000.0, 0, versions=[[0, 1, 0]]))
    state.ingest(WORKER_TOPIC, _worker_msg("tcp://b:1", 1000.0, 0, versions=[[0, 4, 0], [2, 3, 1]]))
    state.ingest(WORKER_TOPIC, _worker_msg("tcp://a:1", 1001.0, 0, versions=[[0, 2, 1], [1, 1, 0]]))  # replaces a's
    expected = {"version": [0, 1, 2], "samples": [6, 1, 3], "continued": [1, 0, 1]}
    assert state.snapshot(now=1001.0)["versions"] == expected == state.record()["versions"]
    assert DashboardState().snapshot(now=0.0)["versions"] == {"version": [], "samples": [], "continued": []}
