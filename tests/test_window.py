"""The per-worker in-flight window: ``window: auto`` sized from the engine's capacity."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from daskgen.config import RunConfig
from daskgen.errors import ConfigError
from daskgen.settings import resolve
from daskgen.worker.admission import (
    AUTO_MAX_WINDOW,
    AUTO_MIN_WINDOW,
    SHRINK_AFTER_READINGS,
    START_MAX_WINDOW,
    Admission,
    resolve_window,
)


@pytest.mark.parametrize(
    ("capacity", "per_partition", "nthreads", "expected"),
    [
        (256, 64 * 4, 17, 8),  # 8 x 256 requests in partitions of 256
        (256, 64 * 1, 17, START_MAX_WINDOW),  # would be 32: the starting window is clipped to 16
        (4, 64 * 4, 17, AUTO_MIN_WINDOW),  # one partition already fills the engine: still 2
        (None, 64 * 4, 17, 8),  # unknown capacity: 256 assumed
        (256, 64 * 4, 5, 5),  # no more than the worker's task slots
        (64, 16 * 2, 17, 16),
        (64, 48, 17, 11),  # ceil(512 / 48)
    ],
)
def test_auto_window(capacity, per_partition, nthreads, expected):
    assert resolve_window("auto", capacity, per_partition, nthreads) == expected


def test_admission_follows_occupancy():
    rule = Admission.for_engine(capacity=100, requests_per_partition=40, slots=65)
    assert rule.window(running_partitions=1, outstanding_requests=40) == 5  # 160 missing of 200: 4 more
    assert rule.window(running_partitions=5, outstanding_requests=200) == 5  # full: no more
    # a heavy tail: 12 partitions running, only 30 requests left in them (mostly finished samples)
    assert rule.window(running_partitions=12, outstanding_requests=30) == 12 + 5
    assert rule.window(running_partitions=0, outstanding_requests=0) == 5
    assert rule.window(running_partitions=60, outstanding_requests=10) == AUTO_MAX_WINDOW  # bounded
    assert Admission.for_engine(None, 40, 8).window(1, 0) == 8  # task slots bound it; unknown capacity: 256


def test_a_window_below_its_target_never_shrinks_while_partitions_are_on_their_way():
    """A fast engine empties its queue before the next partitions arrive: fewer running than admitted, no
    requests outstanding.  The window keeps what it admitted, plus one partition for the empty engine (the
    pipe to it is too short), and grows further when the running ones reach it."""
    rule = Admission.for_engine(capacity=256, requests_per_partition=256, slots=None)
    assert rule.window(running_partitions=3, outstanding_requests=0, current=12) == 13  # not 3 + 2, and not 12
    assert rule.window(running_partitions=3, outstanding_requests=100, current=12) == 12  # not empty: kept
    assert rule.window(running_partitions=11, outstanding_requests=0, current=12) == 14  # 11 + 2, + 1 empty
    assert rule.window(running_partitions=3, outstanding_requests=0) == 6  # without a current window: the rule alone
    assert rule.window(running_partitions=64, outstanding_requests=0, current=64) == AUTO_MAX_WINDOW  # bounded


def test_a_window_at_its_target_comes_down_one_partition_per_reading_once_held():
    """At or above the target no new partition is admitted.  Once the engine held its target for
    SHRINK_AFTER_READINGS readings in a row, the window comes down to the running ones one partition per
    reading: one reading of a queue that jumped by whole partitions cannot empty the pipeline."""
    rule = Admission.for_engine(capacity=256, requests_per_partition=256, slots=None)
    window, seen, held = 12, [], 0
    while window > 4:
        window = rule.window(running_partitions=4, outstanding_requests=768, current=window, held=held)
        held += 1
        seen.append(window)
    assert seen == [12] * (SHRINK_AFTER_READINGS - 1) + [11, 10, 9, 8, 7, 6, 5, 4]
    late = SHRINK_AFTER_READINGS - 1  # readings before this one at the target: it comes down
    assert rule.window(running_partitions=9, outstanding_requests=512, current=12, held=late) == 11
    assert rule.window(running_partitions=9, outstanding_requests=512, current=12, held=late - 1) == 12
    assert rule.window(running_partitions=12, outstanding_requests=512, current=12, held=late) == 12  # all running
    assert rule.window(running_partitions=1, outstanding_requests=600, current=3, held=late) == AUTO_MIN_WINDOW


def test_a_fast_engines_swinging_queue_never_shrinks_its_window():
    """An engine that empties its queue between readings swings between empty and full: the full readings never
    come SHRINK_AFTER_READINGS in a row, so the window only grows (one per empty reading) up to its bound."""
    rule = Admission.for_engine(capacity=256, requests_per_partition=256, slots=None)
    window, held, seen = 8, 0, []
    pattern = [0, 768] + [768] * (SHRINK_AFTER_READINGS - 2) + [0]  # never SHRINK_AFTER_READINGS full in a row
    for outstanding in pattern * 40:
        window, held = rule.follow(running_partitions=5, outstanding_requests=outstanding, current=window, held=held)
        seen.append(window)
    assert seen == sorted(seen), "the window never came down"
    assert seen[-1] == AUTO_MAX_WINDOW
    assert rule.at_target(512) and not rule.at_target(511)


def test_following_a_full_engine_counts_the_readings_in_a_row_and_comes_down_after_them():
    """``follow`` counts the readings in a row at the target (a reading below starts again) and the window comes
    down at the SHRINK_AFTER_READINGS-th of them, the way the plugin applies it every admission interval."""
    rule = Admission.for_engine(capacity=256, requests_per_partition=256, slots=None)
    window, held, trace = 12, 0, []
    for outstanding in [768] * (SHRINK_AFTER_READINGS - 1) + [300] + [768] * (SHRINK_AFTER_READINGS + 1):
        window, held = rule.follow(running_partitions=4, outstanding_requests=outstanding, current=window, held=held)
        trace.append((window, held))
    full = SHRINK_AFTER_READINGS - 1
    assert trace[:full] == [(12, k + 1) for k in range(full)], "held, not yet shrunk"
    assert trace[full] == (12, 0), "a reading below the target starts the count again"
    assert [w for w, _ in trace[full + 1 :]] == [12] * full + [11, 10]


def test_integer_window_is_kept_but_capped_by_task_slots(caplog):
    assert resolve_window(3, 1000, 1, 17) == 3
    assert resolve_window(8, None, 1, 3) == 3
    assert "task slots" in caplog.text


@pytest.mark.parametrize(("given", "expected"), [(None, "auto"), ("auto", "auto"), (4, 4), ("6", 6)])
def test_window_setting(given, expected, tmp_path):
    options = {} if given is None else {"window": given}
    config = RunConfig(model="sim", engine="simulated", store=str(tmp_path / "s.zarr"), **options)
    assert resolve(config, []).window == expected
    assert config.window == ("auto" if given is None else given), "the options stay as given"


@pytest.mark.parametrize("bad", [0, -1, "fast", 2.5, True])
def test_bad_window_names_what_is_allowed(bad):
    with pytest.raises(ConfigError, match="'window' must be 'auto' or an integer >= 1"):
        RunConfig(model="m", store="s", window=bad)


@pytest.mark.timeout(180)
def test_workers_advertise_the_auto_window_and_the_runner_sums_it(tmp_path):
    """Real worker processes: each engine reports its capacity (simulated ``max_batch``), the
    plugin advertises the resolved window as the ``daskgen-engine`` resource, and the runner's
    in-flight target is the sum over workers (capped by ``max_prompts_in_memory``)."""
    import dask
    from distributed import Client, LocalCluster

    from daskgen.client.driver import in_flight_target
    from daskgen.client.engines import start_engines
    from daskgen.client.windows import WindowBoard
    from daskgen.worker.plugin import RESOURCE, plugin_status

    config = RunConfig(
        model="sim",
        store=str(tmp_path / "s.zarr"),
        engine="simulated",
        n_samples=2,
        partition_size=16,
        engine_args={"max_batch": 48, "time_scale": 0.0},
    )
    with (
        dask.config.set({"distributed.worker.daemon": False}),
        LocalCluster(n_workers=2, threads_per_worker=AUTO_MAX_WINDOW + 1, processes=True, dashboard_address=":0") as lc,
        Client(lc) as client,
    ):
        start_engines(client, config)
        client.wait_for_workers(2)
        deadline = time.monotonic() + 60
        while not all(s["state"] == "ready" for s in client.run(plugin_status).values()):  # the second engine
            assert time.monotonic() < deadline, client.run(plugin_status)
            time.sleep(0.1)
        windows = [s["window"] for s in client.run(plugin_status).values()]
        assert windows == [12, 12]  # ceil(8 x 48 / (16 x 2))
        resources = [w["resources"] for w in client.scheduler_info(n_workers=-1)["workers"].values()]
        assert resources == [{RESOURCE: 12}, {RESOURCE: 12}]
        plan = SimpleNamespace(config=config, layout=SimpleNamespace(partition_size=16))
        board = WindowBoard(client, RESOURCE)
        board.refresh()
        assert in_flight_target(plan, board) == 24
        plan.config = RunConfig(model="sim", store="s", partition_size=16, max_prompts_in_memory=100)
        assert in_flight_target(plan, board) == 6  # 100 prompts // 16


def _fixed_point(rule: Admission, window: int) -> int:
    """Where the rule settles when every running partition keeps exactly one request outstanding."""
    while (wanted := rule.window(window, window)) != window:
        window = wanted
    return window


@pytest.mark.timeout(240)
def test_auto_window_grows_to_what_the_rule_says_and_the_run_completes(tmp_path):
    """A frozen heavy tail: a probe engine (daskgen.testing.probes) holds one sample of every partition at
    a gate and lets the others finish at once, so each running partition keeps exactly one request
    outstanding.  The rule then grows the window from its start (16) to the ``w`` at which ``w`` such
    partitions ask for no more: 32 for an engine of 16 slots and 8 requests per partition.  The test
    counts the partitions that really reach the engine: that many and no more; then it opens the gate
    and the run completes."""
    import threading

    import dask
    from distributed import Client, LocalCluster

    from daskgen import store
    from daskgen.client.runner import run
    from daskgen.testing.probes import in_flight_after, read_events
    from daskgen.worker.plugin import RESOURCE, plugin_status
    from tests.test_thread_slots import gated_config

    events, gate = tmp_path / "events.log", tmp_path / "gate"
    config = gated_config(tmp_path, 200)
    nthreads = AUTO_MAX_WINDOW + 1
    rule = Admission.for_engine(capacity=16, requests_per_partition=8, slots=nthreads)
    start = resolve_window("auto", 16, 8, nthreads)
    expected = _fixed_point(rule, start)
    assert (start, expected) == (16, 32)

    def held() -> int:
        return sum(len(ids) for ids in in_flight_after(read_events(events)).values())

    def worker_status() -> dict:
        (status,) = client.run(plugin_status).values()  # the one worker's
        return status

    with (
        dask.config.set({"distributed.worker.daemon": False}),
        LocalCluster(n_workers=1, threads_per_worker=nthreads, processes=True, dashboard_address=":0") as lc,
        Client(lc) as client,
    ):
        config.scheduler_address = lc.scheduler_address
        outcome: dict = {}
        rows = [f"prompt {i}" for i in range(200)]
        runner = threading.Thread(target=lambda: outcome.update(summary=run(config, rows, handle_signals=False)))
        runner.start()
        try:
            deadline = time.monotonic() + 120
            while held() < expected:
                assert time.monotonic() < deadline and runner.is_alive(), f"{held()} partitions reached the engine"
                time.sleep(0.1)
            # forty more applications of the rule to the frozen occupancy: a window past the rule's would
            # have grown on one of them (it never shrinks while every partition stays running)
            ticks_at = worker_status()["admission_ticks"]
            while (now := worker_status())["admission_ticks"] < ticks_at + 40:
                assert time.monotonic() < deadline and runner.is_alive(), f"{now} after {ticks_at} admission ticks"
                time.sleep(0.05)
            assert now["window"] == expected, now
            assert held() == expected, f"the engine holds {held()} partitions, the rule says {expected}"
            resources = [w["resources"] for w in client.scheduler_info(n_workers=-1)["workers"].values()]
            assert resources == [{RESOURCE: expected}], "the worker advertises the grown window"
        finally:
            gate.touch()
            runner.join(timeout=180)
    assert (
        outcome["summary"].done == 200 and (store.GenerationStore.open(config.store).read_status() == store.DONE).all()
    )


def test_one_partition_stays_submitted_when_no_worker_admits_any():
    """Every worker draining (window 0) while a replacement job starts: the run must not end with work left.

    Test double (labelled): a client whose ``submit`` only records; the real path runs in
    tests/test_slurm_e2e.py::test_slurm_worker_job_signalled_hands_back_its_partial_responses.
    """
    import dataclasses

    from daskgen.client.driver import Driver
    from daskgen.client.prefix_dispatch import TaskPool
    from daskgen.client.windows import WindowBoard

    @dataclasses.dataclass(frozen=True)
    class Recorded:
        key: str

    class RecordingClient:
        def __init__(self):
            self.submitted = []

        def map(self, fn, tasks, **kwargs):
            self.submitted += [(task, kwargs) for task in tasks]
            return [Recorded(key) for key in kwargs["key"]]

    board = WindowBoard.__new__(WindowBoard)
    board.windows, board.assigned, board.load = {"tcp://a": 0}, {}, {}
    client = RecordingClient()
    drv = Driver.__new__(Driver)  # the submit step alone, on a test double of the client
    drv.client, drv.board, drv.retry, drv.futures = client, board, [], {}
    drv.run = SimpleNamespace(
        stop=SimpleNamespace(stopping=False), plan=SimpleNamespace(config=SimpleNamespace(max_retries=0))
    )
    drv.tasks = iter([_bare_task(s) for s in (0, 4, 8)])
    drv.pool = TaskPool(drv.tasks)
    drv.done = SimpleNamespace(add=lambda fut: None)
    drv.submit_up_to(1)
    assert len(drv.futures) == 1 and "workers" not in client.submitted[0][1], "one unpinned partition is submitted"
    drv.submit_up_to(1)
    assert len(drv.futures) == 1, "but not more while no worker admits any"


def _bare_task(start: int) -> Any:
    """A partition task with only what the submit step reads (a real ``PartitionTask``, no store)."""
    from daskgen.engines.base import SamplingParams
    from daskgen.worker.task import PartitionTask

    return PartitionTask(None, start, start + 4, [start], None, 1, SamplingParams(), 0)  # type: ignore[arg-type]
