"""Placement of partitions that ask for the engine resource (``daskgen/worker/scheduler.py``), on a real
in-process Dask cluster (``gen_cluster``) with daskgen's scheduler plugin installed."""

from __future__ import annotations

import asyncio
import copy

import dask
import pytest
from distributed import get_worker
from distributed.utils_test import gen_cluster

from daskgen.worker.plugin import RESOURCE
from daskgen.worker.scheduler import DrainBeforeRetire

TWO_WORKERS = [("127.0.0.1", 1), ("127.0.0.1", 1)]


@pytest.fixture(autouse=True)
def _restore_dask_config():
    """gen_cluster resets Dask's config: put daskgen's defaults back for later tests."""
    saved = copy.deepcopy(dask.config.config)
    yield
    dask.config.config.clear()
    dask.config.config.update(saved)


def where() -> str:
    """The address of the worker running this task."""
    return get_worker().address


@pytest.mark.timeout(60)
@gen_cluster(client=True, nthreads=TWO_WORKERS)
async def test_a_partition_preferring_a_worker_without_the_resource_waits_for_one_that_offers_it(c, s, a, b):
    await c.register_plugin(DrainBeforeRetire(timeout=5), name=DrainBeforeRetire.name)
    # as the client submits a partition: to a preferred worker, loosely (it may have been restarted meanwhile)
    fut = c.submit(where, workers=[b.address], allow_other_workers=True, resources={RESOURCE: 1}, pure=False)
    while fut.key not in s.tasks or s.tasks[fut.key].state != "no-worker":
        await asyncio.sleep(0.02)  # no worker offers the resource (engines loading): it waits, placed nowhere
    await a.set_resources(**{RESOURCE: 1.0})  # a's engine is ready
    assert await asyncio.wait_for(fut, 20) == a.address


@pytest.mark.timeout(60)
@gen_cluster(client=True, nthreads=TWO_WORKERS)
async def test_resources_of_a_worker_the_scheduler_already_removed_are_ignored(c, s, a, b):
    await c.register_plugin(DrainBeforeRetire(timeout=5), name=DrainBeforeRetire.name)
    # a draining worker's last word may arrive after the scheduler removed it: no error, nothing recorded
    assert s.handlers["set_resources"](worker="tcp://127.0.0.1:9", resources={RESOURCE: 0.0}) == "OK"
    assert "tcp://127.0.0.1:9" not in s.resources.get(RESOURCE, {})
    await a.set_resources(**{RESOURCE: 2.0})  # a worker the scheduler knows is still updated
    assert s.workers[a.address].resources[RESOURCE] == 2.0


def test_a_partition_reaching_a_worker_before_its_engine_is_ready_waits_for_a_slot():
    """Distributed's own worker state machine: with the resource unknown the task fails it (KeyError, the
    scheduler then loses the worker); with it offered at 0 from the plugin's setup, the task waits, and runs
    once the window is advertised."""
    from types import SimpleNamespace

    from distributed.worker_state_machine import ComputeTaskEvent, Execute, UnpauseEvent, WorkerState

    from daskgen.worker.thread_slots import offer_no_slot_yet

    def arrives(state: WorkerState, key: str) -> list:
        event = ComputeTaskEvent.dummy(key, resource_restrictions={RESOURCE: 1}, stimulus_id=f"arrive-{key}")
        return state.handle_stimulus(event)

    with pytest.raises(KeyError, match=RESOURCE):
        arrives(WorkerState(nthreads=1, resources={}), "unknown")
    state = WorkerState(nthreads=1, resources={})
    offer_no_slot_yet(SimpleNamespace(state=state), RESOURCE)
    assert arrives(state, "early") == [] and state.tasks["early"].state == "constrained"
    state.total_resources[RESOURCE] = state.available_resources[RESOURCE] = 2.0  # what set_resources does
    assert state.handle_stimulus(UnpauseEvent(stimulus_id="window")) == [Execute(key="early", stimulus_id="window")]
