"""The EnginePlugin state machine on real in-process Dask workers (``gen_cluster``), simulated engine.

States: ``new`` -> ``starting`` -> ``ready`` (resource advertised) | ``failed`` (nothing advertised);
``ready`` -> ``restarting`` (``mark_broken``, failed ``check_health``) -> ``ready`` again, or ``failed``
with the resource withdrawn when the restart fails.  The hung engine is the labelled test double
``daskgen.testing.engines.RecordingEngine`` around the real simulated engine.
"""

from __future__ import annotations

import asyncio
import copy
import tempfile
from pathlib import Path

import dask
import pytest
from distributed.utils_test import gen_cluster

from daskgen.engines.base import GenerationRequest, SamplingParams
from daskgen.engines.simulated import SimulatedEngine
from daskgen.errors import EngineError, EngineUnavailable
from daskgen.store import GenerationStore, Layout, StoreAttrs
from daskgen.store.location import locate
from daskgen.worker.partition import run_partition
from daskgen.worker.plugin import PLUGIN_NAME, RESOURCE, EnginePlugin
from daskgen.worker.task import PartitionTask

SIM = {"time_scale": 0.0, "length_mean": 4, "length_dist": "fixed"}
ONE_WORKER = [("127.0.0.1", 4)]


@pytest.fixture(autouse=True)
def _restore_dask_config():
    """gen_cluster resets Dask's config to what it was when distributed.utils_test was imported,
    dropping defaults added later (daskgen's, dask-jobqueue's): put them back for later tests."""
    saved = copy.deepcopy(dask.config.config)
    yield
    dask.config.config.clear()
    dask.config.config.update(saved)


async def _until(predicate, what: str, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def _register(c, a, plugin: EnginePlugin) -> EnginePlugin:
    await c.register_plugin(plugin, name=PLUGIN_NAME)
    return a.plugins[PLUGIN_NAME]


def _advertised(s, a) -> float:
    return s.workers[a.address].resources.get(RESOURCE, 0.0)


@pytest.mark.timeout(120)
@gen_cluster(client=True, nthreads=ONE_WORKER)
async def test_start_advertises_the_window_only_after_a_health_check(c, s, a):
    plugin = await _register(c, a, EnginePlugin("simulated", "sim", SIM, window=3))
    assert (await plugin.get_engine()) is plugin.engine and isinstance(plugin.engine, SimulatedEngine)
    assert plugin.state == "ready" and plugin.error is None and plugin.resolved_window == 3
    await _until(lambda: _advertised(s, a) == 3.0, "the scheduler to see the resource")
    assert await plugin.check_health() and plugin.state == "ready"


@pytest.mark.timeout(120)
@gen_cluster(client=True, nthreads=ONE_WORKER)
async def test_start_failure_is_recorded_and_nothing_is_advertised(c, s, a):
    plugin = await _register(c, a, EnginePlugin("simulated", "sim", {"max_batch": 0}, window=2))
    with pytest.raises(EngineError, match="failed: ConfigError: simulated engine: max_batch"):
        await plugin.get_engine()
    assert plugin.state == "failed" and plugin.status()["state"] == "failed"
    assert RESOURCE not in s.workers[a.address].resources and a.state.total_resources[RESOURCE] == 0  # no slot
    assert not await plugin.check_health()  # nothing to check: stays failed


@pytest.mark.timeout(120)
@gen_cluster(client=True, nthreads=ONE_WORKER)
async def test_broken_engine_restarts_in_place_and_keeps_the_resource(c, s, a):
    plugin = await _register(c, a, EnginePlugin("simulated", "sim", SIM, window=2))
    first = await plugin.get_engine()
    await _until(lambda: _advertised(s, a) == 2.0, "the resource to be advertised")  # sent after the engine is ready
    await plugin.mark_broken("engine crashed (test)")
    assert plugin.state == "restarting" and plugin.error == "engine crashed (test)"
    assert _advertised(s, a) == 2.0
    assert await plugin.came_back()  # waits for the restart, which succeeds
    second = await plugin.get_engine()
    assert second is not first and plugin.state == "ready" and plugin.error is None
    assert _advertised(s, a) == 2.0  # never dropped while restarting
    await plugin.mark_broken("again")  # restarts any number of times
    assert (await plugin.get_engine()) is not second


@pytest.mark.timeout(120)
@gen_cluster(client=True, nthreads=ONE_WORKER)
async def test_hung_engine_fails_its_health_check_and_is_restarted(c, s, a):
    with tempfile.TemporaryDirectory() as tmp:
        flag = Path(tmp) / "hung-once"  # the first engine instance to find no flag hangs after 1 real call
        args = {"inner": "simulated", "hang_once_flag": str(flag), "hang_after": 0, **SIM}
        engine = "daskgen.testing.engines:RecordingEngine"
        plugin = await _register(c, a, EnginePlugin(engine, "sim", args, window=2))
        hung = await plugin.get_engine()
        request = GenerationRequest("p0-s0", [1, 2, 3], SamplingParams(max_new_tokens=4))
        stuck = asyncio.ensure_future(hung.generate(request))  # never answers: the engine now hangs
        await _until(flag.exists, "the engine to hang")
        assert not await plugin.check_health(timeout=0.5)  # health times out: the engine counts as broken
        assert plugin.state in ("restarting", "ready")  # check_health itself started the restart
        fresh = await plugin.get_engine()  # the new instance finds the flag and does not hang
        assert fresh is not hung and plugin.state == "ready" and await plugin.check_health(timeout=10)
        assert not stuck.done()
        stuck.cancel()


@pytest.mark.timeout(120)
@gen_cluster(client=True, nthreads=ONE_WORKER)
async def test_failed_restart_withdraws_the_resource(c, s, a):
    plugin = await _register(c, a, EnginePlugin("simulated", "sim", SIM, window=2))
    await plugin.get_engine()
    await _until(lambda: _advertised(s, a) == 2.0, "the resource to be advertised")
    plugin.engine_args = {"max_batch": 0}  # the restart now fails (invalid engine args)
    await plugin.mark_broken("engine crashed (test)")
    assert not await plugin.came_back()  # waits for the restart, which fails
    with pytest.raises(EngineUnavailable, match="failed"):  # not the prompts' fault: the client requeues
        await plugin.get_engine()
    assert plugin.state == "failed"
    await _until(lambda: _advertised(s, a) == 0.0, "the scheduler to see the resource withdrawn")
    assert a.state.total_resources[RESOURCE] == 0.0


@pytest.mark.timeout(120)
@gen_cluster(client=True, nthreads=ONE_WORKER, clean_kwargs={"threads": False})  # zarr's I/O threads stay
async def test_an_isolated_row_is_not_failed_when_its_engine_cannot_be_restarted(c, s, a):
    """``isolate`` mode blames a row only if the engine runs again after it failed.  Here the engine hangs
    (health check included) and its restart fails, as when its server stopped answering: the partition task
    raises EngineUnavailable (the client requeues it) instead of committing its rows failed.  The same on
    real parts, through the client: ``tests/test_engine_hang.py``."""
    with tempfile.TemporaryDirectory() as tmp:
        where = locate(str(Path(tmp) / "out.zarr"))
        GenerationStore.create(where, StoreAttrs(Layout(2, 1, 8, 4, 2, 0)), ["a", "b"])
        args = {"inner": "simulated", "hang_once_flag": str(Path(tmp) / "hung"), "hang_after": 0, **SIM}
        plugin = await _register(c, a, EnginePlugin("daskgen.testing.engines:RecordingEngine", "sim", args))
        await plugin.get_engine()
        plugin.engine_args = {"max_batch": 0}  # the restart now fails (invalid engine args)
        task = PartitionTask(
            GenerationStore.open(where), 0, 2, [0, 1], [[5, 6], [7, 8]], 1, SamplingParams(max_new_tokens=4), 0
        )
        task.timeout_s, task.isolate = 0.5, True
        blamed_on_the_engine = pytest.raises(EngineUnavailable, match="row 0 failed .* could not be restarted: Config")
        with dask.config.set({"daskgen.health-timeout": 0.5}), blamed_on_the_engine:
            await c.submit(run_partition, task, pure=False)
        assert plugin.state == "failed"
        assert not GenerationStore.open(where).read_region(0, 2, ("response_length",))["response_length"].any()
