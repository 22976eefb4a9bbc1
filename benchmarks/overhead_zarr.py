"""Pipeline overhead, storage side: daskgen with an instant engine vs direct Zarr writes of the same arrays.

daskgen with an instant engine (``simulated``, ``time_scale=0``) on a LocalCluster vs writing the very same
arrays straight into a Zarr store with the same layout (same shapes, chunks and codecs) from the same
number of processes, arrays already in memory.  Rate = generated rows (prompt × sample) per second; MiB/s
counts the uncompressed bytes of the data arrays.  daskgen's time runs from engines ready to the last
commit and includes the instant engine's own CPU work (planning fake tokens, its step loop and result
objects; measured alone and reported, so the workers' CPU is also given without it), the worker-side region
building, the Zarr writes, Dask scheduling and the client's commits.  ``overhead.py --part zarr`` runs the
same comparison.  ``--writer-processes 0,1`` runs the daskgen side once per setting of
``daskgen.writer-processes`` in each repeat (the writer processes' CPU counts with their worker's).  Each
repeat also runs the floor (``common/pipeline_floor.py``; ``--no-floor`` skips it): plain Dask tasks on the
same cluster shape running the same engine and the same region writes and nothing else, once per writer-process
setting: how close to the direct writes a pipeline of that shape gets on this machine when it does nothing more.

    python benchmarks/overhead_zarr.py                       # ~2 minutes on 2 cores
    python benchmarks/overhead_zarr.py --prompts 512 --no-record
    python benchmarks/overhead_zarr.py --workers 1 --writer-processes 0,1
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import dask.config
import numpy as np
from common import cli, pipeline_floor, profiling, records, runs

from daskgen.config import RunConfig

MIB = 2**20
TITLE = "Pipeline overhead: daskgen vs direct Zarr writes"


def prompt_texts(n: int) -> list[str]:
    """The comparison's ``n`` prompts."""
    return [f"Row {i}: summarise document {i * 31 % 997}." for i in range(n)]


def zarr_config(a: argparse.Namespace, store: Path) -> RunConfig:
    """daskgen settings of the instant-engine run."""
    return RunConfig(
        model="simulated-overhead",
        engine="simulated",
        store=str(store),
        engine_args={
            "time_scale": 0.0,
            "length_dist": "lognormal",
            "length_mean": a.length_mean,
            "length_sigma": 0.8,
            "max_batch": 256,
        },
        n_samples=a.n_samples,
        max_new_tokens=a.max_new_tokens,
        max_prompt_tokens=64,
        temperature=1.0,
        seed=0,
        logprobs=True,
        partition_size=a.partition_size,
        n_workers=a.workers,
        window=int(a.window) if a.window.isdigit() else a.window,
        progress=False,
    )


def direct_writer(src: str, dst: str, starts: list[int], barrier: Any) -> tuple[float, float]:
    """Child process: load its partitions from ``src`` into memory, wait, then write them into ``dst`` (each
    partition's arrays written side by side in one call on Zarr's event loop, the fastest way Zarr offers)."""
    import zarr
    from zarr.core.sync import sync

    from daskgen import store

    layout = (store.read_store_attrs(src)).layout
    src_group = zarr.open_group(src, mode="r")
    data = []
    for start in starts:
        stop = min(start + layout.partition_size, layout.n_prompts)
        data.append((start, {name: np.asarray(src_group[name][start:stop]) for name in layout.data_arrays()}))
    group = zarr.open_group(dst, mode="r+")
    arrays = {name: group[name].async_array for name in layout.data_arrays()}
    barrier.wait()
    t0 = time.perf_counter()
    for start, region in data:
        sync(pipeline_floor.write_region(arrays, start, region))
    return t0, time.perf_counter()


def fresh_store(src: Path, dst: Path, what: str) -> Any:
    """An empty store at ``dst`` with the layout and prompt ids of ``src``; its layout."""
    from daskgen import store

    layout = store.read_store_attrs(src).layout
    ids = [
        str(x) for x in store.GenerationStore.open(src).read_region(0, layout.n_prompts, ("prompt_id",))["prompt_id"]
    ]
    store.GenerationStore.create(dst, store.StoreAttrs(layout, extra={"benchmark": what}), ids)
    return layout


def run_floor_sides(
    work: Path, rep: int, config: RunConfig, prompts: list[str], requests: list[Any], settings: list[int]
) -> dict[int, dict[str, Any]]:
    """The floor pipeline (:mod:`common.pipeline_floor`) of repeat ``rep`` with each number of writer processes in
    ``settings``, each into a fresh store of ``config``'s layout."""
    floors = {}
    for writers in settings:
        floor_store = work / f"floor-{rep}-{writers}.zarr"
        fresh_store(Path(config.store), floor_store, "pipeline floor")
        floors[writers] = pipeline_floor.run_floor(str(floor_store), config, prompts, requests, writers)
    return floors


def run_direct(src: Path, dst: Path, processes: int) -> dict[str, Any]:
    """Write every partition of ``src`` into a fresh store of the same layout from ``processes`` processes."""
    layout = fresh_store(src, dst, "direct zarr writes")
    starts = list(layout.partitions())
    shares = [starts[i::processes] for i in range(processes)]
    ctx = mp.get_context("spawn")
    with mp.Manager() as manager:
        barrier = manager.Barrier(processes)
        with ctx.Pool(processes) as pool:
            spans = pool.starmap(direct_writer, [(str(src), str(dst), s, barrier) for s in shares])
    seconds = max(e for _, e in spans) - min(s for s, _ in spans)
    return {"seconds": seconds}


def data_bytes(path: Path) -> int:
    """Uncompressed bytes of the data arrays of a store (what a partition task writes)."""
    import zarr

    from daskgen import store

    group = zarr.open_group(str(path), mode="r")
    names = (store.read_store_attrs(path)).layout.data_arrays()
    return sum(int(np.prod(group[n].shape)) * group[n].dtype.itemsize for n in names)


def engine_cpu_seconds(config: RunConfig, requests: list[Any]) -> float:
    """CPU seconds the instant simulated engine itself spends on ``requests`` (a run's, row-major: planning, its
    step loop, its result objects), each partition's requests sent as one batch as daskgen's workers send them,
    in this process with nothing of daskgen around it."""
    import asyncio

    from daskgen.engines.simulated import SimulatedEngine

    per_task = config.partition_size * config.n_samples

    async def run() -> float:
        engine = SimulatedEngine(config.model, **config.engine_args)
        await engine.start()
        t0 = time.process_time()
        for start in range(0, len(requests), per_task):
            async for _group in engine.generate_batch(requests[start : start + per_task]):
                pass
        spent = time.process_time() - t0
        await engine.shutdown()
        return spent

    return asyncio.run(run())


def part_zarr(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """daskgen with an instant engine vs direct Zarr writes of the same arrays."""
    prompts = prompt_texts(a.prompts)
    config = zarr_config(a, work / "daskgen.zarr")
    plan = zarr_config(a, work / "plan.zarr")  # a store of the run's layout, planned with no data
    requests = runs.run_requests(plan, prompts)  # every request of the run
    results, settings = [], cli.counts(a.writer_processes)
    for rep in range(a.repeats):
        floor_first = a.floor and rep % 2 == 1  # the floor after daskgen's sides, then before them: ABBA
        floors = run_floor_sides(work, rep, plan, prompts, requests, settings) if floor_first else {}
        sides = {}
        for writers in settings:  # each setting of daskgen.writer-processes, one after the other
            cfg = zarr_config(a, work / f"daskgen-{rep}-{writers}.zarr")
            with dask.config.set({"daskgen.writer-processes": writers}):
                sides[writers] = runs.measured_side(cfg, prompts, *profiling.hooks(profile=False))
        if a.floor and not floor_first:
            floors = run_floor_sides(work, rep, plan, prompts, requests, settings)
        direct = run_direct(Path(cfg.store), work / f"direct-{rep}.zarr", a.workers)
        direct1 = run_direct(Path(cfg.store), work / f"direct1-{rep}.zarr", 1)
        results += [(dg, direct, direct1, writers, floors.get(writers)) for writers, dg in sides.items()]
        config = cfg
    rows_total = a.prompts * a.n_samples
    nbytes = data_bytes(Path(config.store))
    eng_cpu = engine_cpu_seconds(config, requests)
    table = []
    for k, (dg, direct, direct1, writers, _floor) in enumerate(results):
        rep = k // len(settings)
        daskgen_side = [(f"daskgen, {a.workers} workers, instant engine, writer processes {writers}", dg)]
        direct_sides = [(f"direct zarr, {a.workers} processes", direct), ("direct zarr, 1 process", direct1)]
        for name, res in daskgen_side + (direct_sides if k % len(settings) == len(settings) - 1 else []):
            table.append(
                [
                    rep + 1,
                    name,
                    res["seconds"],
                    rows_total / res["seconds"],
                    nbytes / MIB / res["seconds"],
                    direct["seconds"] / res["seconds"],
                ]
            )
    ratios = {
        w: [direct["seconds"] / dg["seconds"] for dg, direct, _, n, _floor in results if n == w] for w in settings
    }
    rec.note(
        f"Part zarr: {a.prompts:,} prompts × {a.n_samples} samples, max_new_tokens {a.max_new_tokens}, "
        f"lognormal lengths mean {a.length_mean:g}, logprobs on; partitions of {a.partition_size}, window "
        f"{a.window}; {nbytes / MIB:,.0f} MiB of uncompressed data arrays per store "
        f"({results[0][0]['partitions']} partition regions). The instant engine's own CPU work for these requests "
        f"(planning, step loop, results; measured alone) is {eng_cpu:.1f} s (in daskgen's time, not in the direct "
        "writes)."
    )
    rec.table(["repeat", "writer", "seconds", "rows/s", "MiB/s (uncompressed)", "rate vs direct (same procs)"], table)
    for writers, values in ratios.items():
        rec.note(
            f"**daskgen / direct write rate, writer processes {writers}: {', '.join(f'{r:.2f}' for r in values)} "
            f"(median {float(np.median(values)):.2f}; goal ≥ 0.5).**"
        )
    cpu_table(rec, results, rows_total, eng_cpu)
    if a.floor:
        floor_table(rec, results, len(settings), rows_total, eng_cpu)
        for writers in settings:
            shares = [floor["seconds"] / dg["seconds"] for dg, *_, w, floor in results if w == writers]
            rec.note(
                f"**daskgen / the floor's rate, writer processes {writers}: {', '.join(f'{r:.2f}' for r in shares)} "
                f"(median {float(np.median(shares)):.2f}).**"
            )
    if a.profile:
        with dask.config.set({"daskgen.writer-processes": settings[-1]}):
            profile_tables(rec, zarr_config(a, work / "profiled.zarr"), prompts, rows_total, settings[-1])


def cpu_table(rec: records.Record, results: list[Any], samples: int, engine_s: float) -> None:
    """CPU per sample of each daskgen repeat (no profiler): the workers, the workers without the engine's own
    work (and without the Zarr writes), the client process (scheduler included), the machine's cores kept busy,
    and the best rate vs direct the run could reach on this machine if its workers only wrote."""
    rows, cores = [], len(os.sched_getaffinity(0))
    for rep, (dg, direct, direct1, writers_n, _floor) in enumerate(results):
        cpu = dg["marks"]["on_done"]
        writers = sum(w.get("child processes", 0.0) for w in cpu["workers"].values())
        workers = sum(w["process"] for w in cpu["workers"].values()) + writers
        client = cpu["client"]["process"]
        collector = sum(w.get("garbage collector", 0.0) for w in cpu["workers"].values())
        loops = sum(w["event loop"] for w in cpu["workers"].values())
        # if the workers did nothing but the writes, the run would still spend the writes, the engine's own work
        # and the client's process on the machine's cores: the best rate vs direct it could reach here
        floor_s = (direct1["seconds"] + engine_s + client) / cores
        rows.append(
            [
                rep + 1,
                writers_n,
                workers / samples * 1e6,
                (workers - engine_s) / samples * 1e6,
                (workers - engine_s - direct1["seconds"]) / samples * 1e6,
                writers / samples * 1e6,
                (workers - engine_s - writers) / samples * 1e6,
                loops / samples * 1e6,
                loops / len(cpu["workers"]) / dg["seconds"],
                collector / samples * 1e6,
                client / samples * 1e6,
                cpu["client"]["thread"] / samples * 1e6,
                cpu["client"].get("garbage collector", 0.0) / samples * 1e6,
                (workers + client) / dg["seconds"],
                direct1["seconds"] / samples * 1e6,
                direct["seconds"] / floor_s,
            ]
        )
    rec.table(
        [
            "run",
            "writer processes",
            "workers' CPU µs/sample (all threads, writer processes included)",
            "the same without the engine's own work",
            "the same without the Zarr writes (the direct writer's time)",
            "of the workers' CPU: in writer processes",
            "worker processes' own CPU µs/sample (without the engine's own work and the writer processes)",
            "of the worker processes' CPU: their event-loop threads µs/sample (the engine's own work included)",
            "a worker's event-loop thread busy (share of the run's time, mean over the workers)",
            "worker processes: CPU in the garbage collector µs/sample",
            "client process CPU µs/sample (scheduler included)",
            "of the client process: the run's own thread µs/sample (the rest: the scheduler and Dask's comms)",
            "client process: CPU in the garbage collector µs/sample",
            "cores busy (workers + client)",
            "direct zarr, 1 process: µs/sample",
            "bound: rate vs direct if the workers only wrote",
        ],
        rows,
        "CPU per sample, daskgen side (process CPU time from engines ready to the last commit, no profiler). "
        "The direct writer's time per sample is what the Zarr writes alone cost one core. The bound is the rate vs "
        "direct a run would reach if its workers did nothing but the Zarr writes: the writes, the engine's own "
        f"work and the client's process CPU, spread over all {cores} cores at best. A worker's event-loop thread runs "
        "its engine (here the instant one), the partitions' generation and Dask's task and comms handling: one core "
        "at most, whatever the cores beside it.",
    )


def floor_table(rec: records.Record, results: list[Any], settings: int, samples: int, engine_s: float) -> None:
    """The floor pipeline (:mod:`common.pipeline_floor`) of each repeat and writer-process setting (``settings``
    of them per repeat) against the direct writes."""
    rows = []
    for k, (_dg, direct, _direct1, writers, floor) in enumerate(results):
        rows.append(
            [
                k // settings + 1,
                writers,
                floor["seconds"],
                samples / floor["seconds"],
                direct["seconds"] / floor["seconds"],
                floor["workers_cpu"] / samples * 1e6,
                (floor["workers_cpu"] - engine_s) / samples * 1e6,
                floor["client_cpu"] / samples * 1e6,
            ]
        )
    rec.table(
        [
            "repeat",
            "writer processes",
            "seconds",
            "rows/s",
            "rate vs direct (same procs)",
            "workers' CPU µs/sample (writer processes included)",
            "the same without the engine's own work",
            "client process CPU µs/sample (scheduler included)",
        ],
        rows,
        "The floor: the same cluster shape, one plain Dask task per partition running the same instant engine and "
        "writing the same region, in a thread of the worker the way the direct writer does (writer processes 0) or "
        "in spawned writer processes of the worker (`common/pipeline_floor.py`; nothing checkpointed, validated or "
        "reported), run after daskgen's sides in odd repeats and before them in even ones: what a pipeline of that "
        "shape reaches with this engine, cluster and store layout when it does nothing more.",
    )
    for writers in sorted({row[1] for row in rows}):
        ceiling = [row[4] for row in rows if row[1] == writers]
        rec.note(
            f"**The floor / direct write rate, writer processes {writers}: {', '.join(f'{r:.2f}' for r in ceiling)} "
            f"(median {float(np.median(ceiling)):.2f}): how close to the direct writes a pipeline of this shape gets "
            "here when it does nothing more.**"
        )


def profile_tables(rec: records.Record, config: RunConfig, prompts: list[str], samples: int, writers: int) -> None:
    """One more daskgen run under cProfile (workers' event loops, the client's thread): CPU per stage per sample."""
    dg = runs.measured_side(config, prompts, *profiling.hooks(profile=True))
    cpu = dg["marks"]["on_done"]
    header = ["stage", "µs per sample (profiled)", "share of the profiled thread"]
    rec.table(
        header,
        profiling.worker_rows(cpu["workers"], samples),
        f"Workers, CPU per stage per sample (cProfile, thread CPU time, summed over the workers; writer processes "
        f"{writers}; one extra run at "
        f"{samples / dg['seconds']:,.0f} rows/s under the profiler, which inflates every call: read the shares).",
    )
    rec.table(header, profiling.client_rows(cpu["client"], samples), "Client, CPU per stage per sample (same run).")


def add_args(p: argparse.ArgumentParser) -> None:
    """This comparison's flags."""
    cli.add_flags(
        p, repeats=2, workers=2, prompts=8192, n_samples=4, max_new_tokens=512, length_mean=128.0, partition_size=64
    )
    p.add_argument("--window", default="auto", help="daskgen partitions in flight per worker (default: daskgen's auto)")
    p.add_argument(
        "--writer-processes",
        default="0",
        help="comma-separated settings of daskgen.writer-processes, each run side by side in every repeat",
    )
    p.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="in every repeat, also the floor pipeline (plain Dask tasks, the same engine and writes; no daskgen)",
    )
    p.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one more daskgen run under cProfile: CPU per stage per sample",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    return cli.parse_parts(__doc__, argv, add_args)


if __name__ == "__main__":
    raise SystemExit(cli.run_parts(parse_args(), TITLE, {"zarr": part_zarr}))
