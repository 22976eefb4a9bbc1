"""Benchmark 2: pipeline overhead of daskgen around the engine.

Part ``zarr`` — daskgen with an instant engine (``simulated``, ``time_scale=0``) on a LocalCluster vs
writing the very same arrays straight into a Zarr store with the same layout (same shapes, chunks and
codecs) from the same number of processes, arrays already in memory.  Rate = generated rows (prompt ×
sample) per second; MiB/s counts the uncompressed bytes of the data arrays.  daskgen's time runs from
engines ready to the last commit and includes the instant engine's own CPU work (planning fake tokens),
the worker-side region building, the Zarr writes, Dask scheduling and the client's commits.

Part ``engine`` — daskgen with a real in-process engine (``--engine transformers``, ``sglang`` or
``vllm``; one worker) vs the same engine class, same settings, driven directly in this process with
every request submitted at once: generated tokens per second, model load excluded on both sides.  The
sides alternate (direct, daskgen, direct, daskgen, ...); each row records the 1-minute load average at
its start, and the ratio is the median over the repeats.  Seeded sampling in ``transformers`` and
``vllm`` does not depend on the batch, so both sides generate the same tokens; sglang honours seeds only
on a GPU, so its default here is greedy decoding.  sglang and vllm run in their lanes' virtualenvs
(``.ci/sglang-env.sh``, ``.ci/vllm-env.sh``; sglang on a CPU also needs ``tests/sglang_shim`` on
``PYTHONPATH`` and ``SGLANG_USE_CPU_ENGINE=1``).

    python benchmarks/overhead.py                       # both parts, ~4 minutes on 2 cores
    python benchmarks/overhead.py --part zarr --prompts 512 --no-record
    python benchmarks/overhead.py --part engine --engine vllm --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import _bench
import _client_cost
import numpy as np

from daskgen.config import RunConfig

MIB = 2**20


# --------------------------------------------------------------------------- part zarr


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


def run_daskgen(config: RunConfig, prompts: list[Any]) -> dict[str, Any]:
    """``runner.run``; timed from engines ready to the last commit."""
    from daskgen.client.runner import run

    with _bench.instrument_run() as marks:
        summary = run(config, prompts)
    if not summary.ok:
        raise SystemExit(f"daskgen run did not finish: {summary.line()}")
    return {
        "seconds": marks["generate_s"],
        "prompts": summary.generated_prompts,
        "tokens": summary.response_tokens,
        "partitions": -(-summary.generated_prompts // config.partition_size),
    }


def _direct_writer(src: str, dst: str, starts: list[int], barrier: Any) -> tuple[float, float]:
    """Child process: load its partitions from ``src`` into memory, wait, then write them into ``dst``."""
    import zarr

    from daskgen import store

    layout = (store.read_store_attrs(src)).layout
    src_group = zarr.open_group(src, mode="r")
    data = []
    for start in starts:
        stop = min(start + layout.partition_size, layout.n_prompts)
        data.append((start, {name: np.asarray(src_group[name][start:stop]) for name in layout.data_arrays()}))
    group = zarr.open_group(dst, mode="r+")
    arrays = {name: group[name] for name in layout.data_arrays()}
    barrier.wait()
    t0 = time.perf_counter()
    for start, region in data:
        for name, values in region.items():
            arrays[name][start : start + len(values)] = values
    return t0, time.perf_counter()


def run_direct(src: Path, dst: Path, processes: int) -> dict[str, Any]:
    """Write every partition of ``src`` into a fresh store of the same layout from ``processes`` processes."""
    from daskgen import store

    attrs = store.read_store_attrs(src)
    layout = (attrs).layout
    ids = [
        str(x) for x in store.GenerationStore.open(src).read_region(0, layout.n_prompts, ("prompt_id",))["prompt_id"]
    ]
    store.GenerationStore.create(dst, store.StoreAttrs(layout, extra={"benchmark": "direct zarr writes"}), ids)
    starts = list(layout.partitions())
    shares = [starts[i::processes] for i in range(processes)]
    ctx = mp.get_context("spawn")
    with mp.Manager() as manager:
        barrier = manager.Barrier(processes)
        with ctx.Pool(processes) as pool:
            spans = pool.starmap(_direct_writer, [(str(src), str(dst), s, barrier) for s in shares])
    seconds = max(e for _, e in spans) - min(s for s, _ in spans)
    return {"seconds": seconds}


def data_bytes(path: Path) -> int:
    """Uncompressed bytes of the data arrays of a store (what a partition task writes)."""
    import zarr

    from daskgen import store

    group = zarr.open_group(str(path), mode="r")
    names = (store.read_store_attrs(path)).layout.data_arrays()
    return sum(int(np.prod(group[n].shape)) * group[n].dtype.itemsize for n in names)


def engine_cpu_seconds(config: RunConfig, prompts: list[str]) -> float:
    """CPU seconds the instant simulated engine itself spends planning these requests (in this process)."""
    from daskgen.engines.simulated.plan import SimulatedArgs, plan_output

    requests = _bench.run_requests(config, prompts)
    args = SimulatedArgs(**config.engine_args)
    t0 = time.process_time()
    for req in requests:
        plan_output(req, args)
    return time.process_time() - t0


def part_zarr(a: argparse.Namespace, work: Path, rec: _bench.Record) -> None:
    """daskgen with an instant engine vs direct Zarr writes of the same arrays."""
    prompts = [f"Row {i}: summarise document {i * 31 % 997}." for i in range(a.prompts)]
    config = zarr_config(a, work / "daskgen.zarr")
    runs = []
    for rep in range(a.repeats):
        cfg = zarr_config(a, work / f"daskgen-{rep}.zarr")
        dg = run_daskgen(cfg, prompts)
        direct = run_direct(Path(cfg.store), work / f"direct-{rep}.zarr", a.workers)
        direct1 = run_direct(Path(cfg.store), work / f"direct1-{rep}.zarr", 1)
        runs.append((dg, direct, direct1))
        config = cfg
    rows_total = a.prompts * a.n_samples
    nbytes = data_bytes(Path(config.store))
    eng_cpu = engine_cpu_seconds(zarr_config(a, work / "plan.zarr"), prompts)
    table = []
    for rep, (dg, direct, direct1) in enumerate(runs):
        for name, res in (
            (f"daskgen, {a.workers} workers, instant engine", dg),
            (f"direct zarr, {a.workers} processes", direct),
            ("direct zarr, 1 process", direct1),
        ):
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
    ratios = [direct["seconds"] / dg["seconds"] for dg, direct, _ in runs]
    rec.note(
        f"Part zarr: {a.prompts:,} prompts × {a.n_samples} samples, max_new_tokens {a.max_new_tokens}, "
        f"lognormal lengths mean {a.length_mean:g}, logprobs on; partitions of {a.partition_size}, window "
        f"{a.window}; {nbytes / MIB:,.0f} MiB of uncompressed data arrays per store "
        f"({runs[0][0]['partitions']} partition regions). The instant engine's own CPU work for these requests "
        f"is {eng_cpu:.1f} s (in daskgen's time, not in the direct writes)."
    )
    rec.table(["repeat", "writer", "seconds", "rows/s", "MiB/s (uncompressed)", "rate vs direct (same procs)"], table)
    rec.note(
        f"**daskgen / direct write rate: {', '.join(f'{r:.2f}' for r in ratios)} (median "
        f"{float(np.median(ratios)):.2f}; target ≥ 0.8).**"
    )


# --------------------------------------------------------------------------- part engine


#: Per engine: its ``engine_args`` on a CPU (``max_requests`` fills the batch-size option).
ENGINE_ARGS: dict[str, Any] = {
    "transformers": lambda a: {
        "device": "cpu",
        "dtype": "float32",
        "max_requests_per_batch": a.max_requests,
        "num_threads": a.threads,
    },
    "sglang": lambda a: {"device": "cpu", "dtype": "float32", "max_running_requests": a.max_requests},
    "vllm": lambda a: {
        "dtype": "float32",
        "max_model_len": 2048,
        "max_num_seqs": a.max_requests,
        "gpu_memory_utilization": 0.5,
    },
}


def engine_temperature(a: argparse.Namespace) -> float:
    """``--engine-temperature``, else greedy for sglang (no seeds on a CPU) and 0.7 seeded otherwise."""
    if a.engine_temperature is not None:
        return float(a.engine_temperature)
    return 0.0 if a.engine == "sglang" else 0.7


def engine_config(a: argparse.Namespace, model: str, store: Path) -> RunConfig:
    """daskgen settings of the real-engine run."""
    in_flight = 2 * a.max_requests
    window = max(1, -(-in_flight // (a.engine_partition_size * a.engine_samples)))
    return RunConfig(
        model=model,
        engine=a.engine,
        store=str(store),
        n_samples=a.engine_samples,
        engine_args=ENGINE_ARGS[a.engine](a),
        max_new_tokens=a.engine_max_new_tokens,
        max_prompt_tokens=256,
        temperature=engine_temperature(a),
        seed=0,
        partition_size=a.engine_partition_size,
        n_workers=1,
        window=window,
        progress=False,
    )


async def _direct_engine(engine: str, model: str, engine_args: dict[str, Any], requests: list[Any]) -> dict[str, Any]:
    from daskgen.engines import create_engine

    backend = create_engine(engine, model, **engine_args)
    await backend.start()
    await backend.health()
    try:
        cpu0, t0, wall0 = _client_cost.tree_cpu_seconds(), time.perf_counter(), time.time()
        results = await asyncio.gather(*(backend.generate(r) for r in requests))
        seconds = time.perf_counter() - t0
        cpu = _client_cost.cpu_by_role(cpu0, _client_cost.tree_cpu_seconds(), os.getpid())
    finally:
        await backend.shutdown()
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"direct engine run failed: {errors[0]}")
    tokens = sum(len(r.output_ids) for r in results)
    return {"seconds": seconds, "tokens": tokens, "window": (wall0, wall0 + seconds), "cpu": cpu}


def _worker_pid(client: Any) -> int:
    """The pid of the run's one worker process (the engine's host under daskgen)."""
    return int(next(iter(client.run(os.getpid).values())))


def _engine_on_worker(config: RunConfig, requests: list[Any]) -> dict[str, Any]:
    """The same engine on a daskgen worker (plugin), every request in one Dask task, no runner or store."""
    from daskgen.client.cluster import connect
    from daskgen.client.engines import start_engines

    with connect(config) as connection:
        client = _bench.as_client(connection)
        start_engines(client, config)
        host, cpu0, t0 = _worker_pid(client), _client_cost.tree_cpu_seconds(), time.perf_counter()
        lengths = client.submit(_bench.generate_on_worker, requests, pure=False).result()
        seconds = time.perf_counter() - t0
        cpu = _client_cost.cpu_by_role(cpu0, _client_cost.tree_cpu_seconds(), host)
    return {"seconds": seconds, "tokens": sum(lengths), "cpu": cpu}


ENGINE_DRIVERS = {
    "direct": "engine driven directly in this process (all requests at once)",
    "worker": "same engine on a Dask worker, all requests in one task (no runner, no store)",
    "daskgen": "daskgen runner, 1 worker",
}


#: The engine both sides drive when spans are measured: the labelled recording wrapper of
#: ``daskgen.testing.engines`` around the real engine, logging each request's wall-clock start and end.
TIMED = "daskgen.testing.engines:RecordingEngine"


def _drive(
    driver: str, a: argparse.Namespace, model: str, cfg: RunConfig, rows: list[Any], requests: list[Any], log: Path
) -> dict:
    """One side of one repeat, with the 1-minute load average at its start."""
    load = os.getloadavg()[0]
    timed = {"inner": a.engine, "timing_log": str(log), **cfg.engine_args}
    if driver == "direct":
        res = asyncio.run(_direct_engine(TIMED, model, timed, requests))
        gc.collect()
    elif driver == "worker":
        res = _engine_on_worker(cfg, requests)
    else:
        snap: dict[str, Any] = {}

        def on_ready(client: Any) -> None:
            snap.update(host=_worker_pid(client), cpu0=_client_cost.tree_cpu_seconds())

        def on_done(client: Any) -> dict[str, float]:
            return _client_cost.cpu_by_role(snap["cpu0"], _client_cost.tree_cpu_seconds(), snap["host"])

        with _bench.instrument_run(on_ready, on_done) as marks:
            res = run_daskgen(dataclasses.replace(cfg, engine=TIMED, engine_args=timed), rows)
        res["window"] = (marks["ready_wall"], marks["ready_wall"] + marks["generate_s"])
        res["cpu"] = marks["on_done"]
    return {**res, "load": load, **(engine_span(log, res["window"]) if "window" in res else {})}


def engine_span(log: Path, window: tuple[float, float]) -> dict[str, float]:
    """From the timing log: the engine's own span (first request in to last result out), and what the
    driver spent before the first request reached the engine and after the last result left it."""
    times = [(float(start), float(end)) for _, start, end, _ in (line.split() for line in log.read_text().splitlines())]
    first, last = min(t[0] for t in times), max(t[1] for t in times)
    return {"span": last - first, "before": first - window[0], "after": window[1] - last}


def cores(res: dict[str, Any]) -> list[float]:
    """Cores a side kept busy, by :data:`_client_cost.CPU_ROLES` and in all (CPU seconds / its seconds)."""
    per_role = [res["cpu"][role] / res["seconds"] for role in _client_cost.CPU_ROLES]
    return [*per_role, sum(per_role)]


def record_cpu(rec: _bench.Record, results: list[dict[str, dict[str, Any]]]) -> None:
    """The table of where each side's CPU went, and its medians: the engine's processes vs the rest."""
    rec.note(
        "Where each side's CPU went while it generated (CPU seconds of each process / the side's seconds, i.e. "
        "cores in use; processes read with psutil at the window's start and end). *Engine's host process*: "
        "the one holding the engine's front end (this process for the direct side, the Dask worker otherwise); "
        "*engine's own processes*: the processes below it; *driver process*: this one (daskgen's client and, "
        "on its local cluster, the scheduler and the nanny); *other*: any other process below this one."
    )
    rows = [[rep + 1, ENGINE_DRIVERS[d], *cores(res)] for rep, out in enumerate(results) for d, res in out.items()]
    rec.table(["repeat", "driver", *_client_cost.CPU_ROLES, "all"], rows)
    medians = []
    for driver in results[0]:
        engine, *_, everything = np.median([cores(o[driver]) for o in results], axis=0)
        medians.append(f"{driver} {engine:.3f} / {everything - engine:.3f}")
    rec.note(f"**Median cores, the engine's own processes / every other process: {'; '.join(medians)}.**")


def part_engine(a: argparse.Namespace, work: Path, rec: _bench.Record) -> None:
    """daskgen + an in-process engine vs the same engine driven directly, sides alternating."""
    from longtail_real import builtin_prompts

    drivers = [d.strip() for d in a.engine_drivers.split(",") if d.strip()]
    if drivers[:1] != ["direct"] or set(drivers) - set(ENGINE_DRIVERS):
        raise SystemExit(f"--engine-drivers must start with 'direct' and use {list(ENGINE_DRIVERS)}")
    model = a.model or str(__import__("daskgen.models", fromlist=["smollm2_instruct"]).smollm2_instruct())
    rows = builtin_prompts(a.engine_prompts, seed=1)
    results: list[dict[str, dict[str, Any]]] = []
    for rep in range(a.engine_repeats or a.repeats):
        cfg = engine_config(a, model, work / f"engine-{rep}.zarr")
        requests = _bench.run_requests(engine_config(a, model, work / f"engine-req-{rep}.zarr"), rows)
        logs = {driver: work / f"timing-{rep}-{driver}.log" for driver in drivers}
        results.append({driver: _drive(driver, a, model, cfg, rows, requests, logs[driver]) for driver in drivers})
    table = []
    for rep, out in enumerate(results):
        direct = out["direct"]["tokens"] / out["direct"]["seconds"]
        for driver, res in out.items():
            rate = res["tokens"] / res["seconds"]
            spans = [res.get(k, float("nan")) for k in ("span", "before", "after")]
            table.append(
                [
                    rep + 1,
                    ENGINE_DRIVERS[driver],
                    res["load"],
                    res["seconds"],
                    *spans,
                    res["tokens"],
                    rate,
                    rate / direct,
                ]
            )
    cfg = engine_config(a, model, work / "x.zarr")
    sampling = "greedy" if cfg.temperature == 0 else f"temperature {cfg.temperature:g} seeded"
    rec.note(
        f"Part engine: `{a.engine}` engine, {Path(model).name}, {a.engine_prompts} prompts × {a.engine_samples} "
        f"samples, {sampling}, max_new_tokens {a.engine_max_new_tokens}, CPU, engine_args {cfg.engine_args}; "
        f"daskgen partitions of {a.engine_partition_size}, window {cfg.window} (≥ 2 × the engine's batch "
        "requests in flight). Model load excluded; the drivers alternate within each repeat. Both the direct "
        "and the daskgen side drive the engine through the labelled recording wrapper (`daskgen.testing.engines`), "
        "which logs each request's wall-clock start and end: *engine span* is first request in to last result "
        "out; *before* / *after* are the driver's time before the first request reached the engine and after "
        "the last result left it (for daskgen: engines ready to the first request, the last result to the last "
        "commit). Spans differ between sides also because the engine admits the requests in another order."
    )
    rec.table(
        [
            "repeat",
            "driver",
            "load avg (1 min) at start",
            "seconds",
            "engine span s",
            "before first request s",
            "after last result s",
            "tokens",
            "tokens/s",
            "tokens/s vs direct",
        ],
        table,
    )
    record_cpu(rec, results)
    for driver in drivers[1:]:
        ratios = [
            (o[driver]["tokens"] / o[driver]["seconds"]) / (o["direct"]["tokens"] / o["direct"]["seconds"])
            for o in results
        ]
        rec.note(
            f"**{driver} / direct tokens/s, `{a.engine}` engine: {', '.join(f'{r:.3f}' for r in ratios)} (median "
            f"{float(np.median(ratios)):.3f}; target ≥ 0.97).**"
        )
        timed = [o for o in results if "before" in o[driver]]
        own = [(o[driver]["before"] + o[driver]["after"]) / o[driver]["seconds"] for o in timed]
        spans = [o[driver]["span"] / o["direct"]["span"] for o in timed]
        if own:
            shares = ", ".join(f"{100 * x:.1f} %" for x in own)
            rec.note(
                f"{driver}: time outside the engine's span (before its first request + after its last result) "
                f"{shares} of the run (median {100 * float(np.median(own)):.1f} %); engine span vs the direct "
                f"side's {', '.join(f'{x:.3f}' for x in spans)} (median {float(np.median(spans)):.3f})."
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--part", default="zarr,engine", help="comma-separated: zarr, engine")
    p.add_argument("--repeats", type=int, default=2, help="side-by-side repeats of each comparison")
    p.add_argument("--engine-repeats", type=int, default=None, help="repeats of the engine part (default --repeats)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8192)
    p.add_argument("--n-samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--length-mean", type=float, default=128.0)
    p.add_argument("--partition-size", type=int, default=64)
    p.add_argument("--window", default="auto", help="daskgen partitions in flight per worker (default: daskgen's auto)")
    p.add_argument("--model", default=None, help="local HF model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--engine-prompts", type=int, default=16)
    p.add_argument("--engine-samples", type=int, default=2)
    p.add_argument("--engine-max-new-tokens", type=int, default=96)
    p.add_argument("--engine-partition-size", type=int, default=4)
    p.add_argument(
        "--engine",
        default="transformers",
        choices=sorted(ENGINE_ARGS),
        help="in-process engine of the engine part (sglang and vllm: run in their lanes' virtualenvs)",
    )
    p.add_argument(
        "--engine-temperature",
        type=float,
        default=None,
        help="engine part's temperature (default: 0 for sglang, which has no seeds on a CPU; 0.7 seeded otherwise)",
    )
    p.add_argument(
        "--max-requests",
        type=int,
        default=16,
        help="the engine's batch: max_requests_per_batch, max_running_requests (sglang), max_num_seqs (vllm)",
    )
    p.add_argument(
        "--engine-drivers",
        default="direct,daskgen",
        help="comma-separated, starting with direct: direct, worker (engine on a Dask worker, one task), daskgen",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="transformers engine's torch threads, both sides (more than 1 on a shared machine can be many "
        "times slower)",
    )
    _bench.add_common_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the selected parts, print the tables, write their record."""
    title = "Pipeline overhead: daskgen vs direct Zarr writes and vs the engine alone"
    return _bench.run_parts(parse_args(argv), title, {"zarr": part_zarr, "engine": part_engine})


if __name__ == "__main__":
    raise SystemExit(main())
