"""The floor under daskgen's pipeline: the least a Dask cluster does to run the instant engine and store its output.

:func:`run_floor` starts a LocalCluster of the same shape as a daskgen run and runs one plain Dask task per
partition: the worker tokenizes the partition's prompts (as daskgen's workers do); its instant engine (started once
per worker by :class:`FloorWorker`, with the model's tokenizer) generates the partition's samples as one batch;
their tokens, logprobs, lengths and finish reasons are placed into a padded region of the store's data arrays (the
other arrays keep their fill values) and written the way the direct writer writes (:func:`write_region`: every array
of the region side by side on Zarr's event loop), in a worker thread; or, with writer processes, handed to daskgen's
own writer processes (:class:`~daskgen.worker.writers.pool.WriterPool`) that write it as daskgen's workers do (the
store's region write). The task returns the partition's start. The client submits every partition at
once and waits for them with ``as_completed``. Its workers' garbage collector is set as the daskgen under test sets
a worker's. Nothing is checkpointed, resumed, validated, counted or reported: besides Dask, Zarr and the engine,
this pipeline does only what must happen to store a sample: its rate is what a pipeline with one process per worker
(as daskgen with ``writer-processes: 0``), or with N writer processes per worker, reaches on this cluster, engine
and store layout when it does nothing more.

Functions here run on Dask workers; the ``common`` package is pickled by value.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import numpy as np
from distributed.diagnostics.plugin import WorkerPlugin

from . import profiling

PLUGIN = "daskgen-bench-floor"


async def write_region(arrays: dict[str, Any], start: int, region: dict[str, np.ndarray]) -> None:
    """Write each array of ``region`` at rows ``start..`` of the Zarr async ``arrays``, side by side."""
    await asyncio.gather(*(arrays[n].setitem(slice(start, start + len(v)), v) for n, v in region.items()))


class FloorWorker(WorkerPlugin):
    """A worker's instant engine, the model's tokenizer and the store's arrays, opened once when the plugin is set
    up."""

    name = PLUGIN

    def __init__(self, store: str, model: str, engine_args: dict[str, Any], writer_processes: int = 0) -> None:
        self.store, self.model, self.engine_args = store, model, engine_args
        self.writer_processes = writer_processes
        self.writers: Any = None  # daskgen's writer processes of this worker, or None: it writes in a thread
        self.opened: Any = None  # the store whose region write the writer processes run
        self.engine: Any = None
        self.tokenizer: Any = None
        self.layout: Any = None
        self.arrays: dict[str, Any] = {}

    async def setup(self, worker: Any) -> None:
        """Start the writer processes (if any), the engine, load the tokenizer; open the store's data arrays."""
        import zarr

        from daskgen import store
        from daskgen.engines.simulated import SimulatedEngine
        from daskgen.engines.tokenizer import load_tokenizer

        if self.writer_processes:
            from daskgen.worker.writers.pool import WriterPool

            self.writers = WriterPool(self.writer_processes)
            self.opened = store.GenerationStore.open(self.store)
        self.engine = SimulatedEngine(self.model, **self.engine_args)
        await self.engine.start()
        self.tokenizer = load_tokenizer(self.model, "simulated", self.engine_args)
        tune_collector()
        self.layout = store.read_store_attrs(self.store).layout
        group = zarr.open_group(self.store, mode="r+")
        self.arrays = {name: group[name].async_array for name in self.layout.data_arrays()}

    async def teardown(self, worker: Any) -> None:
        """Stop the engine and the writer processes."""
        await self.engine.shutdown()
        if self.writers is not None:
            self.writers.close()


def tune_collector() -> None:
    """The garbage collector as the daskgen under test sets a worker's once its engine started
    (:func:`daskgen.gc_tuning.tune_collector`); with a daskgen that has no such setting, frozen and collected
    every 10,000 allocations."""
    import gc
    import importlib

    for module in ("daskgen.gc_tuning", "daskgen.worker.collector"):  # the latter: where older versions had it
        try:
            daskgens = importlib.import_module(module).tune_collector
        except ImportError:
            continue
        daskgens()
        return
    gc.freeze()
    gc.set_threshold(10_000, *gc.get_threshold()[1:])


def _region(layout: Any, prompts: list[list[int]], results: list[Any], n_samples: int) -> dict[str, np.ndarray]:
    """The padded region of a partition: its prompts, and its samples' tokens, mask, logprobs, length and finish
    reason (row-major ``results``), placed with daskgen's array scatter; every other array at its fill values."""
    from daskgen.store.layout import empty_region
    from daskgen.worker.samples.region import place_prompts, scatter

    region = empty_region(layout, len(prompts))
    place_prompts(region, range(len(prompts)), prompts, layout.pad_token_id)
    slots = np.arange(len(results))
    lengths = np.fromiter((len(r.output_ids) for r in results), dtype=np.int64, count=len(results))
    total = int(lengths.sum())
    for name, lists, fill in (
        ("response_ids", [r.output_ids for r in results], layout.pad_token_id),
        ("logprobs", [r.logprobs for r in results], np.nan),
    ):
        values = np.fromiter(itertools.chain.from_iterable(lists), dtype=region[name].dtype, count=total)
        scatter(region, name, slots, lengths, values, fill)
    scatter(region, "response_mask", slots, lengths, np.ones(total, dtype=region["response_mask"].dtype), 0)
    region["response_length"][:] = lengths.reshape(len(prompts), n_samples)
    reasons = np.fromiter((int(r.finish_reason) for r in results), dtype=np.int64, count=len(results))
    region["finish_reason"][:] = reasons.reshape(len(prompts), n_samples)
    region["num_turns"][:] = 1
    return region


async def floor_partition(start: int, texts: list[str], seeds: list[int], params: Any, n_samples: int) -> int:
    """Dask task: tokenize one partition's prompts, generate its samples on the worker's instant engine, store them;
    returns ``start``."""
    from distributed import get_worker
    from zarr.core.sync import sync

    from daskgen.engines.base import GenerationRequest
    from daskgen.worker.samples.seeds import with_seed

    plugin = get_worker().plugins[PLUGIN]
    prompts = await asyncio.to_thread(lambda: [list(plugin.tokenizer(text)["input_ids"]) for text in texts])
    requests = [
        GenerationRequest(f"p{start + r}-s{s}", prompt, with_seed(params, seeds[r * n_samples + s]))
        for r, prompt in enumerate(prompts)
        for s in range(n_samples)
    ]
    results: list[Any] = [None] * len(requests)
    async for group in plugin.engine.generate_batch(requests):
        for j, result in group:
            results[j] = result

    def store() -> None:
        sync(write_region(plugin.arrays, start, _region(plugin.layout, prompts, results, n_samples)))

    if plugin.writers is None:
        await asyncio.to_thread(store)
    else:  # placed in a thread, written by a writer process, handed over as daskgen's workers hand theirs over
        region = await asyncio.to_thread(_region, plugin.layout, prompts, results, n_samples)
        await write_by_writer(plugin.writers, plugin.opened, start, region)
    return start


async def write_by_writer(writers: Any, store: Any, start: int, region: dict[str, np.ndarray]) -> None:
    """``region`` written at rows ``start..`` of ``store`` by one of daskgen's writer processes ``writers``, handed
    over as the daskgen under test hands a region over (in shared memory; pickled before it had that)."""
    if hasattr(writers, "write_region"):
        await writers.write_region(store, start, region)
    else:  # a daskgen before its shared-memory hand-over (DASKGEN_SRC)
        await writers.run(store.write_region, start, region)


def run_floor(
    store: str, config: Any, texts: list[str], requests: list[Any], writer_processes: int = 0, in_flight: int = 4
) -> dict[str, Any]:
    """Store the samples of ``texts`` (the prompts of a daskgen run of ``config``; ``requests``: every request of
    that run, row-major, for its sampling params and seeds) into ``store`` (created with
    the run's layout) through the floor pipeline on ``config.n_workers`` workers, each running up to ``in_flight``
    partitions at once (its threads) and writing through ``writer_processes`` spawned processes (0: in a thread of
    the worker); ``seconds`` from the first submit to the last result, and the CPU seconds
    of the workers (their writer processes included) and of this process (the scheduler included)."""
    import dataclasses

    import dask.config
    from distributed import Client, LocalCluster, as_completed

    from daskgen import store as stores

    layout = stores.read_store_attrs(store).layout
    n, size = config.n_samples, layout.partition_size
    params = dataclasses.replace(requests[0].params, seed=None)
    with (
        dask.config.set({"distributed.worker.daemon": False}),
        LocalCluster(n_workers=config.n_workers, threads_per_worker=in_flight, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(FloorWorker(store, config.model, config.engine_args, writer_processes))
        client.run(profiling.start_worker, profile=False)
        client0, t0 = time.process_time(), time.perf_counter()
        futures = []
        for start in layout.partitions():
            stop = min(start + size, layout.n_prompts)
            seeds = [r.params.seed for r in requests[start * n : stop * n]]
            futures.append(client.submit(floor_partition, start, texts[start:stop], seeds, params, n, pure=False))
        for future in as_completed(futures):
            future.result()
        seconds = time.perf_counter() - t0
        client_cpu = time.process_time() - client0
        workers = client.run(profiling.stop_worker)
    return {
        "seconds": seconds,
        "workers_cpu": sum(w["process"] + w["child processes"] for w in workers.values()),
        "client_cpu": client_cpu,
        "partitions": len(futures),
    }
