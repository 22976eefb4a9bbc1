"""Placement of partitions that ask for the engine resource (``daskgen/worker/placement.py``), on a real
in-process Dask cluster (``gen_cluster``) with daskgen's scheduler plugin installed."""

from __future__ import annotations

import asyncio
import copy

import dask
import pytest
from distributed import get_worker
from distributed.utils_test import gen_cluster

from daskgen.worker.drain import DrainBeforeRetire
from daskgen.worker.plugin import RESOURCE

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
