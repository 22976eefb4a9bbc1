"""Partitions in flight on workers with few thread slots (``dask worker --nthreads 1``, as a user starts them).

A probe engine (daskgen.testing.probes) holds one sample of every partition at a gate and lets the others
finish at once, so each running partition keeps one request outstanding and ``window: auto`` wants 32
partitions for an engine of 16 slots and 8 requests per partition (tests/test_window.py derives it).
The tests count the partitions that really reach the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from daskgen.config import RunConfig

WANTED = 32  # the rule's fixed point for this engine (tests/test_window.py)
ROWS = 4 * (WANTED + 4)


def gated_config(tmp_path, rows: int = ROWS) -> RunConfig:
    """A run of the probe engine (16 slots) that holds sample 0 of every partition of 4 rows at a gate."""
    return RunConfig(
        model="sim",
        store=str(tmp_path / "s.zarr"),
        engine="daskgen.testing.probes:ProbeEngine",
        n_samples=2,
        partition_size=4,
        max_prompt_tokens=64,
        progress=False,
        engine_args={
            "events_path": str(tmp_path / "events.log"),
            "gate_path": str(tmp_path / "gate"),
            "gate_rows": list(range(0, rows, 4)),  # the first row of every partition,
            "gate_sample": 0,  # its first sample
            "max_batch": 16,
            "time_scale": 0.0,
        },
    )


@contextmanager
def _gated_run(tmp_path, nthreads: int, hold_threads: bool) -> Iterator[tuple[Any, Any, dict]]:
    """A run on one worker of ``nthreads`` thread slots, gated; yields (client, held partitions, outcome)."""
    import dask
    from distributed import Client, LocalCluster

    from daskgen.client.runner import run
    from daskgen.testing.probes import in_flight_after, read_events

    config = gated_config(tmp_path)

    def held() -> int:
        return sum(len(ids) for ids in in_flight_after(read_events(tmp_path / "events.log")).values())

    settings = {"distributed.worker.daemon": False, "daskgen.partitions-hold-threads": hold_threads}
    with (
        dask.config.set(settings),
        LocalCluster(n_workers=1, threads_per_worker=nthreads, processes=True, dashboard_address=":0") as lc,
        Client(lc) as client,
    ):
        config.scheduler_address = lc.scheduler_address
        outcome: dict = {"config": config}
        rows = [f"prompt {i}" for i in range(ROWS)]
        runner = threading.Thread(target=lambda: outcome.update(summary=run(config, rows, handle_signals=False)))
        runner.start()
        try:
            yield client, held, outcome
        finally:
            (tmp_path / "gate").touch()
            runner.join(timeout=180)
    assert outcome["summary"].done == ROWS


def _wait_for(held: Any, n: int) -> None:
    deadline = time.monotonic() + 120
    while held() < n:
        assert time.monotonic() < deadline, f"{held()} partitions reached the engine, expected {n}"
        time.sleep(0.1)


def _worker_status(client: Any) -> dict:
    """The engine plugin's status on the run's one worker (its window and its count of admission ticks)."""
    from daskgen.worker.plugin import plugin_status

    (status,) = client.run(plugin_status).values()
    return status


def _after_admission_ticks(client: Any, ticks: int = 40) -> dict:
    """The worker's status once ``window: auto`` applied its rule ``ticks`` more times to the frozen occupancy:
    a window past the rule's would have grown on one of them (it never shrinks while every partition stays
    running), and the partitions it admitted would have reached the engine."""
    at = _worker_status(client)["admission_ticks"]
    deadline = time.monotonic() + 120
    while (now := _worker_status(client))["admission_ticks"] < at + ticks:
        assert time.monotonic() < deadline, f"{now} after {at} admission ticks"
        time.sleep(0.05)
    return now


@pytest.mark.timeout(240)
def test_one_thread_slot_keeps_the_window_the_engine_wants(tmp_path):
    """Partition tasks give their thread slot back: one slot per worker still holds the 32 partitions."""
    with _gated_run(tmp_path, nthreads=1, hold_threads=False) as (client, held, _):
        _wait_for(held, WANTED)
        status = _after_admission_ticks(client)
        assert status["window"] == WANTED, status
        assert held() == WANTED, f"the engine holds {held()} partitions, the rule says {WANTED}"


@pytest.mark.timeout(240)
def test_thread_slots_capping_the_window_are_named_with_the_fix(tmp_path, caplog):
    """Tasks holding their slots (``partitions-hold-threads: true``) on 2 threads: 2 partitions in flight, and
    the client says so in one line naming the slots, the wanted window and ``--nthreads``; so do the store's
    status and the worker's dashboard row."""
    from daskgen.analysis.summary import status_report
    from daskgen.dashboard.metrics import WORKER_TOPIC
    from daskgen.dashboard.page import workers_html
    from daskgen.dashboard.state import DashboardState
    from daskgen.worker.plugin import metrics_report

    caplog.set_level(logging.WARNING, logger="daskgen.client.engines")
    with _gated_run(tmp_path, nthreads=2, hold_threads=True) as (client, held, outcome):
        _wait_for(held, 2)
        status = _after_admission_ticks(client)  # the rule ran on: the two thread slots still cap what runs
        assert status["window"] == 2, status
        assert held() == 2, f"the engine holds {held()} partitions; 2 thread slots hold 2"
        notes = [r.getMessage() for r in caplog.records if r.name == "daskgen.client.engines"]
        assert len(notes) == 1, notes
        assert "1 of 1 workers run 2 partitions at most (their thread slots)" in notes[0]
        assert "capacity 16 requests) wants 16 in flight" in notes[0]  # the starting window, 8 x 16 / 8
        assert "`dask worker ADDRESS --nthreads 16`" in notes[0]
        state = DashboardState()
        for report in client.run(metrics_report).values():
            state.ingest(WORKER_TOPIC, report)
        page = workers_html(state.worker_rows(time.time()))
        assert 'data-daskgen="slots-short"' in page and "2 thread slots / " in page
    assert f"workers:  {notes[0]}" in status_report(outcome["config"].store).splitlines()
