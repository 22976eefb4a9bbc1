"""Worker-side probes of the benchmarks: engine statistics, the utilisation sampler, the synchronous shard.

Functions here run on Dask workers; the ``common`` package is pickled by value, so workers need not
import ``benchmarks``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

#: Name under which the utilisation sampler plugin is registered on workers.
SAMPLER_NAME = "daskgen-bench-sampler"
ENGINE_PLUGIN = "daskgen-engine"


# --------------------------------------------------------------------------- worker-side probes


def engine_stats(dask_worker: Any) -> dict[str, Any] | None:
    """``client.run`` target: the worker's engine statistics (``SimulatedEngine.stats``), if any."""
    plugin = dask_worker.plugins.get(ENGINE_PLUGIN)
    engine = getattr(plugin, "engine", None)
    stats = getattr(engine, "stats", None)
    return stats() if callable(stats) else None


def reset_engine_stats(dask_worker: Any) -> bool:
    """``client.run`` target: start a new statistics window on the worker's engine."""
    plugin = dask_worker.plugins.get(ENGINE_PLUGIN)
    reset = getattr(getattr(plugin, "engine", None), "reset_stats", None)
    if callable(reset):
        reset()
        return True
    return False


class UtilisationSampler(WorkerPlugin):
    """Worker plugin that samples the engine's running/waiting requests and tokens every ``period`` s.

    Registered next to daskgen's ``EnginePlugin``; it only reads the engine's public ``stats()``.
    """

    name = SAMPLER_NAME

    def __init__(self, period: float = 0.05) -> None:
        self.period = period
        self.samples: list[tuple[float, int, int, int]] = []
        self._task: asyncio.Task | None = None

    async def setup(self, worker: Any) -> None:
        """Start sampling on the worker's event loop."""
        self.samples = []
        self._task = asyncio.create_task(self._loop(worker))

    async def _loop(self, worker: Any) -> None:
        while True:
            stats = engine_stats(worker)
            if stats is not None:
                self.samples.append(
                    (time.time(), int(stats["running"]), int(stats["waiting"]), int(stats["tokens_generated"]))
                )
            await asyncio.sleep(self.period)

    async def teardown(self, worker: Any) -> None:
        """Stop sampling."""
        if self._task is not None:
            self._task.cancel()


def sampler_samples(dask_worker: Any) -> list[tuple[float, int, int, int]]:
    """``client.run`` target: the sampler's samples on this worker."""
    plugin = dask_worker.plugins.get(SAMPLER_NAME)
    return list(plugin.samples) if plugin is not None else []


def start_sampler(client: Any, period: float = 0.05) -> None:
    """Register a fresh :class:`UtilisationSampler` on every worker."""
    client.register_plugin(UtilisationSampler(period), name=SAMPLER_NAME)


def as_client(connection: Any) -> Any:
    """The client from what ``daskgen.client.cluster.connect`` yields (a client, or ``(client, info)``)."""
    return connection[0] if isinstance(connection, tuple) else connection


async def generate_on_worker(requests: list[Any]) -> list[int]:
    """Dask task: run ``requests`` on this worker's daskgen engine at once; return output lengths.

    This is how a synchronous rollout drives an engine: the whole shard is submitted together and
    the call returns when its longest sample is done.  Nothing is stored.
    """
    from distributed import get_worker

    plugin = get_worker().plugins[ENGINE_PLUGIN]
    engine = await plugin.get_engine()
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    bad = [r.error for r in results if r.error is not None]
    if bad:
        raise RuntimeError(f"{len(bad)} request(s) failed, first: {bad[0]}")
    return [len(r.output_ids) for r in results]


def contiguous_shards(items: Sequence[Any], n: int) -> list[list[Any]]:
    """Split ``items`` into ``n`` contiguous shards of (nearly) equal size, like a data-parallel dispatch."""
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        stop = start + size + (1 if i < extra else 0)
        out.append(list(items[start:stop]))
        start = stop
    return out
