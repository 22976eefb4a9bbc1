"""Pipeline overhead, engine side: daskgen with a real in-process engine vs the same engine driven directly.

daskgen with a real in-process engine (``--engine transformers``, ``sglang`` or ``vllm``; one worker) vs the
same engine class, same settings, driven directly in this process with every request submitted at once:
generated tokens per second, model load excluded on both sides. The order of the sides alternates from one
repeat to the next (ABBA: direct, daskgen, then daskgen, direct, ...), so that neither side always runs first;
each row records the 1-minute load average at its start. The figure is the per-repeat ratio (daskgen / direct
within one repeat): its mean with a 95 % bootstrap interval, and its median. Seeded sampling in
``transformers`` and ``vllm`` does not depend on the batch, so both sides generate the same tokens; sglang
honours seeds only on a GPU, so its default here is greedy decoding. sglang and vllm run in their lanes'
virtualenvs (``.ci/sglang-env.sh``, ``.ci/vllm-env.sh``; sglang on a CPU also needs ``tests/sglang_shim`` on
``PYTHONPATH`` and ``SGLANG_USE_CPU_ENGINE=1``). ``overhead.py --part engine`` runs the same comparison.

    python benchmarks/overhead_engine.py                    # 10 repeats, the order alternating
    python benchmarks/overhead_engine.py --engine vllm --engine-repeats 10
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import cli, cpu, records, runs, stats, workers
from common.prompts import builtin_prompts

from daskgen.config import RunConfig

TITLE = "Pipeline overhead: daskgen vs the engine alone"


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


async def direct_engine(engine: str, model: str, engine_args: dict[str, Any], requests: list[Any]) -> dict[str, Any]:
    """The engine driven directly in this process, every request at once; its seconds, tokens and CPU."""
    from daskgen.engines import create_engine

    backend = create_engine(engine, model, **engine_args)
    await backend.start()
    await backend.health()
    try:
        cpu0, t0, wall0 = cpu.tree_cpu_seconds(), time.perf_counter(), time.time()
        results = await asyncio.gather(*(backend.generate(r) for r in requests))
        seconds = time.perf_counter() - t0
        used = cpu.cpu_by_role(cpu0, cpu.tree_cpu_seconds(), os.getpid())
    finally:
        await backend.shutdown()
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"direct engine run failed: {errors[0]}")
    tokens = sum(len(r.output_ids) for r in results)
    outputs = [r.output_ids for r in results]
    return {"seconds": seconds, "tokens": tokens, "window": (wall0, wall0 + seconds), "cpu": used, "outputs": outputs}


def worker_pid(client: Any) -> int:
    """The pid of the run's one worker process (the engine's host under daskgen)."""
    return int(next(iter(client.run(os.getpid).values())))


def engine_on_worker(config: RunConfig, requests: list[Any]) -> dict[str, Any]:
    """The same engine on a daskgen worker (plugin), every request in one Dask task, no runner or store."""
    from daskgen.client.cluster import connect
    from daskgen.client.engines import start_engines

    with connect(config) as connection:
        client = workers.as_client(connection)
        start_engines(client, config)
        host, cpu0, t0 = worker_pid(client), cpu.tree_cpu_seconds(), time.perf_counter()
        lengths = client.submit(workers.generate_on_worker, requests, pure=False).result()
        seconds = time.perf_counter() - t0
        used = cpu.cpu_by_role(cpu0, cpu.tree_cpu_seconds(), host)
    return {"seconds": seconds, "tokens": sum(lengths), "cpu": used}


ENGINE_DRIVERS = {
    "direct": "engine driven directly in this process (all requests at once)",
    "worker": "same engine on a Dask worker, all requests in one task (no runner, no store)",
    "daskgen": "daskgen runner, 1 worker",
}


#: The engine both sides drive when spans are measured: the labelled recording wrapper of
#: ``daskgen.testing.engines`` around the real engine, logging each request's wall-clock start and end.
TIMED = "daskgen.testing.engines:RecordingEngine"


def drive(
    driver: str, a: argparse.Namespace, model: str, cfg: RunConfig, rows: list[Any], requests: list[Any], log: Path
) -> dict:
    """One side of one repeat, with the 1-minute load average at its start."""
    load = os.getloadavg()[0]
    timed = {"inner": a.engine, "timing_log": str(log), **cfg.engine_args}
    if driver == "direct":
        res = asyncio.run(direct_engine(TIMED, model, timed, requests))
        gc.collect()
    elif driver == "worker":
        res = engine_on_worker(cfg, requests)
    else:
        snap: dict[str, Any] = {}

        def on_ready(client: Any) -> None:
            snap.update(host=worker_pid(client), cpu0=cpu.tree_cpu_seconds())

        def on_done(client: Any) -> dict[str, float]:
            return cpu.cpu_by_role(snap["cpu0"], cpu.tree_cpu_seconds(), snap["host"])

        res = runs.measured_side(dataclasses.replace(cfg, engine=TIMED, engine_args=timed), rows, on_ready, on_done)
        marks = res.pop("marks")
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
    """Cores a side kept busy, by :data:`cpu.CPU_ROLES` and in all (CPU seconds / its seconds)."""
    per_role = [res["cpu"][role] / res["seconds"] for role in cpu.CPU_ROLES]
    return [*per_role, sum(per_role)]


def record_cpu(rec: records.Record, results: list[dict[str, dict[str, Any]]]) -> None:
    """The table of where each side's CPU went, and its medians: the engine's processes vs the rest."""
    rec.note(
        "Where each side's CPU went while it generated (CPU seconds of each process / the side's seconds, i.e. "
        "cores in use; processes read with psutil at the window's start and end). *Engine's host process*: "
        "the one holding the engine's front end (this process for the direct side, the Dask worker otherwise); "
        "*engine's own processes*: the processes below it; *driver process*: this one (daskgen's client and, "
        "on its local cluster, the scheduler and the nanny); *other*: any other process below this one."
    )
    rows = [[rep + 1, ENGINE_DRIVERS[d], *cores(res)] for rep, out in enumerate(results) for d, res in out.items()]
    rec.table(["repeat", "driver", *cpu.CPU_ROLES, "all"], rows)
    medians = []
    for driver in results[0]:
        engine, *_, everything = np.median([cores(o[driver]) for o in results], axis=0)
        medians.append(f"{driver} {engine:.3f} / {everything - engine:.3f}")
    rec.note(f"**Median cores, the engine's own processes / every other process: {'; '.join(medians)}.**")


def abba(drivers: list[str], rep: int) -> list[str]:
    """The order the drivers run in repeat ``rep``: as given in even repeats, reversed in odd ones."""
    return list(drivers) if rep % 2 == 0 else list(reversed(drivers))


def part_engine(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """daskgen + an in-process engine vs the same engine driven directly, sides alternating."""
    drivers = [d.strip() for d in a.engine_drivers.split(",") if d.strip()]
    if drivers[:1] != ["direct"] or set(drivers) - set(ENGINE_DRIVERS):
        raise SystemExit(f"--engine-drivers must start with 'direct' and use {list(ENGINE_DRIVERS)}")
    model = a.model or str(__import__("daskgen.models", fromlist=["smollm2_instruct"]).smollm2_instruct())
    rows = builtin_prompts(a.engine_prompts, seed=1)
    results: list[dict[str, dict[str, Any]]] = []
    for rep in range(a.engine_repeats):
        cfg = engine_config(a, model, work / f"engine-{rep}.zarr")
        requests = runs.run_requests(engine_config(a, model, work / f"engine-req-{rep}.zarr"), rows)
        logs = {driver: work / f"timing-{rep}-{driver}.log" for driver in drivers}
        ran = {driver: drive(driver, a, model, cfg, rows, requests, logs[driver]) for driver in abba(drivers, rep)}
        results.append({driver: ran[driver] for driver in drivers})
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
                    abba(drivers, rep).index(driver) + 1,
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
        "requests in flight). Model load excluded; the drivers' order alternates from one repeat to the next "
        "(ABBA: the reverse order in every other repeat; column *order*). Both the direct "
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
            "order",
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
    same = sum(len({res["tokens"] for res in out.values()}) == 1 for out in results)
    rec.note(f"Generated tokens equal on every side in {same} of {len(results)} repeats.")
    record_cpu(rec, results)
    for driver in drivers[1:]:
        ratios = [
            (o[driver]["tokens"] / o[driver]["seconds"]) / (o["direct"]["tokens"] / o["direct"]["seconds"])
            for o in results
        ]
        low, high = stats.bootstrap_interval(ratios)
        rec.note(
            f"**{driver} / direct tokens/s, `{a.engine}` engine, per repeat: {', '.join(f'{r:.3f}' for r in ratios)} "
            f"(mean {float(np.mean(ratios)):.3f}, 95 % bootstrap interval {low:.3f}-{high:.3f}; median "
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


def add_args(p: argparse.ArgumentParser) -> None:
    """This comparison's flags."""
    cli.add_flags(p, repeats=2)
    p.add_argument("--engine-repeats", type=int, default=10, help="repeats of this comparison (order alternating)")
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    return cli.parse_parts(__doc__, argv, add_args)


if __name__ == "__main__":
    raise SystemExit(cli.run_parts(parse_args(), TITLE, {"engine": part_engine}))
