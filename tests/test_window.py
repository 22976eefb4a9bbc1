"""The per-worker in-flight window: ``window: auto`` sized from the engine's capacity."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from daskgen.config import RunConfig
from daskgen.errors import ConfigError
from daskgen.plugin import AUTO_MAX_WINDOW, AUTO_MIN_WINDOW, resolve_window


@pytest.mark.parametrize(("capacity", "per_partition", "nthreads", "expected"), [
    (256, 64 * 4, 17, 8),  # 8 x 256 requests in partitions of 256
    (256, 64 * 1, 17, AUTO_MAX_WINDOW),  # would be 32: clipped
    (4, 64 * 4, 17, AUTO_MIN_WINDOW),  # one partition already fills the engine: still 2
    (None, 64 * 4, 17, 8),  # unknown capacity: 256 assumed
    (256, 64 * 4, 5, 5),  # no more than the worker's task slots
    (64, 16 * 2, 17, 16),
    (64, 48, 17, 11),  # ceil(512 / 48)
])
def test_auto_window(capacity, per_partition, nthreads, expected):
    assert resolve_window("auto", capacity, per_partition, nthreads) == expected


def test_integer_window_is_kept_but_capped_by_task_slots(caplog):
    assert resolve_window(3, 1000, 1, 17) == 3
    assert resolve_window(8, None, 1, 3) == 3
    assert "task slots" in caplog.text


@pytest.mark.parametrize(("given", "expected"), [(None, "auto"), ("auto", "auto"), (4, 4), ("6", 6)])
def test_window_setting(given, expected):
    options = {} if given is None else {"window": given}
    assert RunConfig(model="m", store="s", **options).window == expected


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

    from daskgen.cluster import start_engines
    from daskgen.plugin import RESOURCE, plugin_status
    from daskgen.runner import in_flight_target

    config = RunConfig(model="sim", store=str(tmp_path / "s.zarr"), engine="simulated", n_samples=2,
                       partition_size=16, engine_args={"max_batch": 48, "time_scale": 0.0})
    with (dask.config.set({"distributed.worker.daemon": False}),
          LocalCluster(n_workers=2, threads_per_worker=AUTO_MAX_WINDOW + 1, processes=True,
                       dashboard_address=":0") as lc,
          Client(lc) as client):
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
        assert in_flight_target(client, plan) == 24
        plan.config = RunConfig(model="sim", store="s", partition_size=16, max_prompts_in_memory=100)
        assert in_flight_target(client, plan) == 6  # 100 prompts // 16
