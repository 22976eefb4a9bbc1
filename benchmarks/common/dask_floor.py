"""Dask's own floor under daskgen's client, and the client run at full speed.

* :func:`dask_floor` measures distributed's own cost per task on the cluster a daskgen run just
  used: trivial async tasks submitted much as daskgen submits partitions (one ``Client.submit``
  per task — daskgen puts partitions freed together on one worker into one ``Client.map`` — with
  the ``daskgen-engine`` resource and a loose worker restriction, a window per
  worker, results through ``as_completed(with_results=True)``, each future released), at the
  rate the daskgen run reached.  What daskgen costs above that floor is its own.
* :func:`instant_partitions` swaps the partition task of the client's runner for a stand-in that hands
  back a finished partition's result at once (nothing generated, nothing written), so daskgen's
  client runs as fast as the cluster takes partitions: its CPU per partition there is the client's
  cost near saturation, which the real engines of this 2-core machine never reach.
* :func:`run_measured` is a daskgen run with the client's CPU (by thread, and that of other processes)
  over the same span, optionally followed by the floor at its rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import psutil

from . import cpu, runs, workers

RESOURCE = "daskgen-engine"


async def _trivial_partition(start: int, rows: list[int], seconds: float) -> dict[str, Any]:
    """A stand-in partition: waits ``seconds`` (the engine), returns a result of a partition's size."""
    await asyncio.sleep(seconds)
    return {"start": start, "stop": start + len(rows), "rows": rows, "failed": {}, "aborted": [], "tokens": 0}


async def _instant_partition(task: Any) -> Any:
    """Benchmark stand-in for ``daskgen.worker.partition.run_partition``: the result of a partition whose rows all
    finished (8 tokens per sample), handed back at once without generating or writing anything."""
    from daskgen.worker.task import PartitionResult

    return PartitionResult(task.start, task.stop, list(task.rows), response_tokens=8 * task.n_samples * len(task.rows))


@contextlib.contextmanager
def instant_partitions() -> Iterator[None]:
    """While inside, daskgen runs started in this process submit :func:`_instant_partition` as their
    partition task (the client's own work — building, submitting, collecting, committing — is unchanged)."""
    import daskgen.client.driver as driver

    saved, driver.run_partition = driver.run_partition, _instant_partition
    try:
        yield
    finally:
        driver.run_partition = saved


def dask_floor(
    client: Any,
    n_tasks: int,
    window: int,
    rate: float | None,
    partition_size: int,
    procs: dict[str, psutil.Process] | None = None,
) -> dict[str, float]:
    """Client-process CPU per task (and that of ``procs``) for ``n_tasks`` trivial tasks at ``rate`` per s
    (``None``: as fast as the cluster takes them)."""
    from distributed import as_completed

    addresses = list(client.scheduler_info(n_workers=-1)["workers"])
    seconds = 0.0 if rate is None else len(addresses) * window / max(rate, 1e-9)  # each worker holds `window`
    load = dict.fromkeys(addresses, 0)
    done = as_completed(with_results=True, raise_errors=False)
    owner: dict[Any, str] = {}
    submitted = finished = 0

    def submit() -> None:
        nonlocal submitted
        worker = min(load, key=load.get)
        rows = list(range(submitted * partition_size, (submitted + 1) * partition_size))
        fut = client.submit(
            _trivial_partition,
            submitted * partition_size,
            rows,
            seconds,
            pure=False,
            key=f"floor-{submitted}-{time.time_ns()}",
            resources={RESOURCE: 1},
            workers=[worker],
            allow_other_workers=True,
        )
        load[worker] += 1
        owner[fut] = worker
        done.add(fut)
        submitted += 1

    before, c0, t0 = cpu.cpu_seconds(procs or {}), time.process_time(), time.perf_counter()
    for _ in range(min(n_tasks, window * len(addresses))):
        submit()
    while finished < n_tasks:
        for fut, value in done.next_batch(block=True):
            if fut.status != "finished":
                raise SystemExit(f"a Dask-floor task ended {fut.status}: {value!r}")
            load[owner.pop(fut)] -= 1
            fut.release()
            finished += 1
            if submitted < n_tasks:
                submit()
    wall, client_cpu = time.perf_counter() - t0, time.process_time() - c0
    after = cpu.cpu_seconds(procs or {})
    return {"tasks": n_tasks, "wall": wall, "client_cpu": client_cpu, **{k: after[k] - before[k] for k in after}}


def run_measured(
    config: Any,
    prompts: list[str],
    procs: dict[str, Any] | None = None,
    floor: bool = False,
    own_scheduler: bool = False,
) -> dict[str, Any]:
    """``runner.run``; wall time from engines ready to the last commit, client CPU over the same span.

    ``procs`` (name -> ``psutil.Process``, e.g. a separate scheduler): their CPU over the same span.
    ``own_scheduler``: the cluster daskgen makes runs its scheduler in a child process, added to ``procs``
    as ``scheduler`` once the engines are ready.
    ``floor``: also the client's idle CPU share (engines ready, nothing submitted) before the run, and
    Dask's own floor (:func:`dask_floor`) on the same cluster at the run's rate after it.
    """
    used: dict[str, Any] = {}
    procs = {} if procs is None else procs

    def on_ready(client: Any) -> None:
        client.run(workers.reset_engine_stats)
        if own_scheduler:
            procs["scheduler"] = cpu.scheduler_child()
        if floor:
            used["idle_share"] = cpu.idle_share()
        used["procs"] = cpu.cpu_seconds(procs)
        used["threads"] = cpu.thread_cpu()
        used["ready"], used["ready_s"] = time.process_time(), time.perf_counter()

    def on_done(client: Any) -> list[dict[str, Any]]:
        used["done"], seconds = time.process_time(), time.perf_counter() - used["ready_s"]
        threads = cpu.thread_cpu()
        used["threads"] = {k: v - used["threads"].get(k, 0.0) for k, v in threads.items()}
        after = cpu.cpu_seconds(procs)
        used["procs"] = {k: after[k] - v for k, v in used["procs"].items()}
        stats = [s for s in client.run(workers.engine_stats).values() if s]
        if floor:
            n = -(-len(prompts) // config.partition_size)
            used["floor"] = dask_floor(client, n, int(config.window), n / seconds, config.partition_size, procs)
            used["fast"] = dask_floor(client, n, int(config.window), None, config.partition_size, procs)
        return stats

    summary, marks = runs.timed_run(config, prompts, on_ready, on_done)
    return {
        "wall": marks["generate_s"],
        "tokens": summary.response_tokens,
        "prompts": summary.generated_prompts,
        "partitions": runs.partitions_of(summary, config.partition_size),
        "client_cpu": used["done"] - used["ready"],
        "stats": marks["on_done"],
        "procs": used["procs"],
        "threads": used["threads"],
        "idle_share": used.get("idle_share"),
        "floor": used.get("floor"),
        "fast": used.get("fast"),
    }
