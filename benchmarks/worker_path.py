"""Benchmark: a worker's CPU per sample on its result path, stage by stage, in one process without Dask.

The pipeline comparison (``overhead.py --part zarr``) runs daskgen on a cluster, where the cores are shared by
the worker, its writer process, the client and the scheduler, and two runs of the same code differ by more than
a few microseconds per sample.  This script runs exactly the work a worker does for each partition of the same
workload, in this process, one stage after the other, and times each stage with the process's CPU clock:

- **engine alone**: the instant simulated engine given each partition's requests as one batch (its planning,
  step loop and result objects), with nothing of daskgen around it;
- **generation**: the partition's generation as a worker runs it
  (:class:`daskgen.worker.partition.PartitionGeneration`: seeds and params, requests, the engine, trajectories,
  counts for the dashboard); minus the engine alone, what daskgen adds;
- **placement**: the finished samples placed into the partition's padded region
  (:func:`daskgen.worker.partition.place_partition`);
- **hand-over**: the region handed to one writer process (``daskgen.writer-processes: 1``) and written there,
  the worker's side (this process's CPU, its pool threads included) and the writer process's side apart;
- **Zarr write in the worker**: the same region written by this process (``writer-processes: 0``).

Every stage runs over all partitions in each of ``--repeats`` passes; the record gives each stage's µs per sample
in every pass and the median.  The garbage collector is set as a worker sets its own once its engine started
(``daskgen.worker-gc``), and partitions go one after the other, each placed once generated.  The stand-in for the
worker's engine plugin (:class:`BenchPlugin`) holds what a partition's generation reads of it: the engine, the
dashboard's counters and the count of unfinished samples.

    python benchmarks/worker_path.py                 # ~1 minute on 2 cores
    python benchmarks/worker_path.py --prompts 1024 --repeats 2 --no-record
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import overhead_zarr
from common import cli, profiling, records, runs
from common.pipeline_floor import write_by_writer

TITLE = "Worker result path: CPU per sample by stage"
STAGES = (
    "engine alone",
    "generation",
    "daskgen's part of generation (generation - engine alone)",
    "placement",
    "hand-over to a writer process: the worker's side",
    "hand-over to a writer process: the writer process (its Zarr write included)",
    "Zarr write in the worker (writer processes 0)",
)


class BenchPlugin:
    """Stand-in for the worker's engine plugin (which needs a Dask worker): what a partition's generation reads."""

    def __init__(self, engine: Any) -> None:
        from daskgen.dashboard.metrics import WorkerMeter

        self.engine = engine
        self.meter = WorkerMeter()
        self.outstanding = 0
        self.prompt_order = None

    async def get_engine(self) -> Any:
        """The engine (it never restarts here)."""
        return self.engine

    def tokenizer(self) -> Any:
        """No tokenizer: the workload has no stop strings."""
        return None


def workload(a: argparse.Namespace, work: Path) -> tuple[Any, list[Any], list[Any]]:
    """The pipeline comparison's config and prompts (:mod:`overhead_zarr`), its partition tasks (prompts tokenized)
    and every request of the run, row-major."""
    from daskgen.client.plan import pending_tasks, prepare
    from daskgen.input.rows import tokenize_rows

    texts = overhead_zarr.prompt_texts(a.prompts)
    config = overhead_zarr.zarr_config(a, work / "path.zarr")
    plan = prepare(config, texts)
    tasks = list(pending_tasks(plan, plan.store.read_status()))
    for task in tasks:
        if task.prompts is None:
            task.prompts = tokenize_rows(task.inputs or [], plan.tokenizer, task.chat_template)
    return config, tasks, runs.run_requests(config, texts)


def generation_class() -> Any:
    """The partition-generation class of the daskgen under test (``_Generation`` in versions before it was named
    public, for a before/after record with ``DASKGEN_SRC``)."""
    from daskgen.worker import partition

    return getattr(partition, "PartitionGeneration", None) or getattr(partition, "_Generation")  # noqa: B009


async def one_pass(config: Any, tasks: list[Any], pool: Any, engine_s: float) -> dict[str, float]:
    """CPU seconds of each stage over every partition, in this order: generation, placement, hand-over (worker and
    writer process), Zarr write in the worker; ``engine_s``: the engine alone on the same requests."""
    from daskgen.agents import EngineHandle, create_agent
    from daskgen.engines.simulated import SimulatedEngine
    from daskgen.worker.partition import place_partition
    from daskgen.worker.slot import PartitionSlot

    engine = SimulatedEngine(config.model, **config.engine_args)
    await engine.start()
    spent = dict.fromkeys(STAGES, 0.0)
    spent["engine alone"] = engine_s
    plugin, agent, generation = BenchPlugin(engine), create_agent("single_turn", config.model, {}), generation_class()
    regions = []
    for task in tasks:  # partition by partition, as a worker goes: its samples live until they are placed
        slot = PartitionSlot(plugin, len(task.rows) * task.n_samples)
        t0 = time.process_time()
        samples = await generation(plugin, EngineHandle(engine), agent, task, {}, slot).run()
        t1 = time.process_time()
        regions.append(place_partition(task, None, samples, None)[0])
        spent["generation"] += t1 - t0
        spent["placement"] += time.process_time() - t1
    await engine.shutdown()
    await hand_over(tasks, regions, pool, spent)
    spent["same"] = float(all(stored_equal(task, region) for task, region in zip(tasks, regions, strict=True)))
    t0 = time.process_time()
    for task, region in zip(tasks, regions, strict=True):
        task.store.write_region(task.start, region)
    spent["Zarr write in the worker (writer processes 0)"] = time.process_time() - t0
    spent["daskgen's part of generation (generation - engine alone)"] = spent["generation"] - spent["engine alone"]
    return spent


async def hand_over(tasks: list[Any], regions: list[Any], pool: Any, spent: dict[str, float]) -> None:
    """Each region written by the writer process as a worker with ``writer-processes: 1`` has it written (two
    at a time, as partitions finish side by side); this process's CPU and the writer process's, apart."""
    writer0 = writer_cpu()
    t0 = time.process_time()
    waiting: set[asyncio.Future[Any]] = set()
    for task, region in zip(tasks, regions, strict=True):
        if len(waiting) >= 2:
            _done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        waiting.add(asyncio.ensure_future(write_by_writer(pool, task.store, task.start, region)))
    await asyncio.gather(*waiting)
    spent["hand-over to a writer process: the worker's side"] = time.process_time() - t0
    spent["hand-over to a writer process: the writer process (its Zarr write included)"] = writer_cpu() - writer0


def stored_equal(task: Any, region: dict[str, Any]) -> bool:
    """Whether the store holds exactly ``region`` at the task's rows (NaN logprobs equal NaN)."""
    stored = task.store.read_region(task.start, task.stop, tuple(region))
    return all(np.array_equal(stored[n], values, equal_nan=values.dtype.kind == "f") for n, values in region.items())


def writer_cpu() -> float:
    """CPU seconds of this process's child processes (the writer process)."""
    return sum(profiling.children_cpu().values())


def part_path(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """``--repeats`` passes over every partition; a row per stage: µs per sample in each pass and the median."""
    from common.pipeline_floor import tune_collector

    from daskgen.worker.writers.pool import WriterPool

    config, tasks, requests = workload(a, work)
    samples = len(requests)
    pool = WriterPool(1)
    tune_collector()  # as a worker's once its engine started: what is loaded frozen, young objects collected rarely
    try:
        asyncio.run(pool.run(os.getpid))  # after the writer process has started and imported Zarr
        passes = []
        for _ in range(a.repeats):
            engine_s = overhead_zarr.engine_cpu_seconds(config, requests)
            passes.append(asyncio.run(one_pass(config, tasks, pool, engine_s)))
    finally:
        pool.close()
    rows = []
    for stage in STAGES:
        values = [p[stage] / samples * 1e6 for p in passes]
        rows.append([stage, *values, float(np.median(values))])
    rec.note(
        f"Workload: {a.prompts:,} prompts × {a.n_samples} samples ({samples:,} samples), the instant simulated engine "
        f"(lognormal lengths mean {a.length_mean:g}, max_new_tokens {a.max_new_tokens}), logprobs on, partitions of "
        f"{a.partition_size} ({len(tasks)} partitions). CPU time of this process (all its threads) per stage, and of "
        "the writer process for its side of the hand-over."
    )
    header = ["stage", *(f"pass {i + 1}: µs per sample" for i in range(a.repeats)), "median µs per sample"]
    rec.table(header, rows)
    same = all(p["same"] for p in passes)
    rec.note(f"The store read back after each hand-over equals every region handed over: {same}.")
    own = [p["daskgen's part of generation (generation - engine alone)"] + p["placement"] for p in passes]
    own_hand = [o + p["hand-over to a writer process: the worker's side"] for o, p in zip(own, passes, strict=True)]
    rec.note(
        f"**daskgen's own work per sample on a worker besides its engine: generation and placement "
        f"{float(np.median(own)) / samples * 1e6:.1f} µs (median); with the hand-over to a writer process "
        f"{float(np.median(own_hand)) / samples * 1e6:.1f} µs.**"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = cli.parser(__doc__)
    cli.add_flags(p, prompts=8192, n_samples=4, max_new_tokens=512, length_mean=16.0, partition_size=64, repeats=5)
    p.set_defaults(workers=1, window="auto")  # what the pipeline comparison's config reads; no cluster here
    return cli.parse(p, argv)


if __name__ == "__main__":
    raise SystemExit(cli.run_parts(parse_args(), TITLE, {"path": part_path}, "path"))
