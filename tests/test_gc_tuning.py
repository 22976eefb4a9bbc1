"""A daskgen process's garbage collector: a worker's (``daskgen.worker-gc``) frozen and with a higher threshold once
its engine started, the client's (``daskgen.client-gc``) while a run streams.

Real runs on a LocalCluster worker process with the instant simulated engine (the runs of tests/test_writers.py):
after the run the worker's collector holds the objects it had loaded in its permanent generation and collects young
objects at the configured threshold, or is left as Python sets it when configured so; the client's collector is
tuned during the run (seen by the collections themselves) and Python's again after it; bad settings are refused
with the fix.
"""

from __future__ import annotations

import gc
import weakref

import dask
import numpy as np
import pytest

from daskgen.client.runner import run
from daskgen.engines.base import FinishReason
from daskgen.errors import ConfigError
from daskgen.gc_tuning import CLIENT, collector_settings, collector_tuned, thaw_collector, tune_collector
from daskgen.store.generation_store import GenerationStore
from tests.conftest import runs_cluster
from tests.test_writers import ROWS, config, prompts

pytestmark = pytest.mark.timeout(240)


def collector_state() -> tuple[int, int]:
    """``client.run`` target: the worker process's frozen objects and its youngest generation's threshold."""
    return gc.get_freeze_count(), gc.get_threshold()[0]


def run_and_read_collector(tmp_path, **settings: object) -> tuple[int, int]:
    """A run on a worker started with ``settings``; the worker's collector state after it (every row done)."""
    with runs_cluster(**settings) as (cluster, client):
        before = next(iter(client.run(collector_state).values()))
        summary = run(config(str(tmp_path / "s.zarr"), cluster.scheduler_address), prompts())
        after = next(iter(client.run(collector_state).values()))
    assert summary.ok and summary.done == ROWS, summary.line()
    reasons = GenerationStore.open(str(tmp_path / "s.zarr")).read_region(0, ROWS, ("finish_reason",))
    assert np.isin(reasons["finish_reason"], (FinishReason.STOP, FinishReason.LENGTH)).all()
    assert before == (0, 700), before  # a fresh worker process: Python's own collector settings
    return after


def test_a_worker_freezes_what_it_loaded_and_collects_young_objects_less_often(tmp_path):
    frozen, threshold = run_and_read_collector(tmp_path)
    assert frozen > 10_000, "Dask, the engine and the worker's modules are in the permanent generation"
    assert threshold == dask.config.get("daskgen.worker-gc.threshold") == 50_000  # the shipped default


def test_a_worker_configured_to_leave_the_collector_alone_does(tmp_path):
    settings = {"daskgen.worker-gc.freeze": False, "daskgen.worker-gc.threshold": 0}
    assert run_and_read_collector(tmp_path, **settings) == (0, 700)


def test_tune_collector_in_this_process_and_undo():
    before = gc.get_threshold()
    try:
        with dask.config.set({"daskgen.worker-gc.freeze": True, "daskgen.worker-gc.threshold": 5000}):
            tune_collector()
        assert gc.get_freeze_count() > 0 and gc.get_threshold() == (5000, *before[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_thawing_frees_an_old_engines_objects_held_only_in_cycles():
    """What the worker froze at its engine's start is collected once the engine shut down (thaw_collector)."""

    class Node:
        pass

    engine = Node()
    engine.myself = engine  # a reference cycle: only the collector frees it
    alive = weakref.ref(engine)
    gc.freeze()
    try:
        del engine
        gc.collect()
        assert alive() is not None, "frozen: no collection sees it"
        thaw_collector()
        assert alive() is None and gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("freeze", "yes", "must be true or false"),
        ("threshold", -1, "integer >= 0"),
        ("threshold", 2.5, "integer >= 0"),
        ("threshold", True, "integer >= 0"),
    ],
)
@pytest.mark.parametrize("section", ["worker-gc", "client-gc"])
def test_bad_collector_settings_are_refused_with_the_fix(key, value, expected, section):
    with dask.config.set({f"daskgen.{section}.{key}": value}), pytest.raises(ConfigError) as err:
        collector_settings(section)
    env = f"DASK_DASKGEN__{section.upper().replace('-', '_')}__"
    assert expected in str(err.value) and env in str(err.value) and repr(value) in str(err.value)
    assert f"daskgen.{section}.{key}" in str(err.value)


def test_the_client_tunes_its_collector_while_a_run_streams_and_gives_it_back(tmp_path):
    seen: list[tuple[int, int]] = []  # (youngest threshold, frozen objects) at each collection during the run

    def look(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append((gc.get_threshold()[0], gc.get_freeze_count()))

    before = gc.get_threshold()
    with runs_cluster() as (cluster, _client):
        gc.callbacks.append(look)
        try:  # a low threshold: the short run's streaming sees collections
            with dask.config.set({"daskgen.client-gc.threshold": 500}):
                summary = run(config(str(tmp_path / "s.zarr"), cluster.scheduler_address), prompts())
        finally:
            gc.callbacks.remove(look)
    assert summary.ok and summary.done == ROWS, summary.line()
    tuned = [(threshold, frozen) for threshold, frozen in seen if threshold == 500]
    assert tuned and all(frozen > 10_000 for _, frozen in tuned), seen[:5]
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0, "Python's settings again after the run"


def test_collector_tuned_leaves_a_process_that_froze_objects_itself_frozen():
    before = gc.get_threshold()
    gc.freeze()
    try:
        with dask.config.set({"daskgen.client-gc.threshold": 7000}), collector_tuned(CLIENT):
            assert gc.get_threshold()[0] == 7000
        assert gc.get_threshold() == before and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_a_worker_with_a_bad_collector_setting_refuses_the_run_before_loading_its_engine(tmp_path):
    with runs_cluster(**{"daskgen.worker-gc.threshold": -5}) as (cluster, _client), pytest.raises(Exception) as err:
        run(config(str(tmp_path / "s.zarr"), cluster.scheduler_address), prompts())
    assert "daskgen.worker-gc.threshold must be an integer >= 0" in str(err.value), err.value
