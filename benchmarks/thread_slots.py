"""Benchmark: an engine's occupancy on workers with few threads, partitions holding a worker thread or not.

Workers as a user starts them (``dask worker ADDRESS --nthreads 2``): the benchmark starts a LocalCluster of
``--workers`` worker processes with ``--nthreads`` threads each and the run joins it (``scheduler_address``),
each worker with a simulated engine of ``--max-batch`` slots in real time (``window: auto``).  Two sides, the
tunable ``daskgen.partitions-hold-threads`` set on the workers: ``true`` (a partition task keeps its worker
thread slot for its whole run, Dask's default: at most ``--nthreads`` partitions in flight per worker) and
``false`` (daskgen's default: the task gives its slot back as it starts; the window alone bounds the
partitions in flight).  ``--repeats`` runs per side, the order alternating (A/B, B/A, ...) because the
machine is shared; medians per side.  Per run, from engines ready to the last commit: the engine's slots in
use (running requests / ``max_batch``, step-weighted over the engine's steps, and sampled every
``--sample-period`` s), the dashboard's batch occupancy (running + queued requests / ``max_batch``, sampled),
tokens/s and the wall time.

    python benchmarks/thread_slots.py
    python benchmarks/thread_slots.py --repeats 3 --no-record
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
from common import cli, records, runs, simulation
from common.prompts import prompt_rows

TITLE = "Thread slots: engine occupancy on workers started with few threads"
SIDES = {"hold": True, "free": False}
LABELS = {"hold": "partitions hold a thread (true)", "free": "partitions free their thread (false, default)"}


def one_run(a: argparse.Namespace, work: Path, side: str, repeat: int) -> dict[str, Any]:
    """A run joining a cluster of ``--nthreads``-thread workers started with the side's setting."""
    import dask
    from distributed import Client, LocalCluster

    settings = {"daskgen.partitions-hold-threads": SIDES[side], "distributed.worker.daemon": False}
    with (
        dask.config.set(settings),
        LocalCluster(
            n_workers=a.workers, threads_per_worker=a.nthreads, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        seen = set(client.run(lambda: dask.config.get("daskgen.partitions-hold-threads")).values())
        if seen != {SIDES[side]}:
            raise SystemExit(f"the workers read partitions-hold-threads {seen}, not {SIDES[side]}")
        config = simulation.make_config(a, work / f"{side}-{repeat}.zarr", "auto")  # type: ignore[arg-type]
        config = dataclasses.replace(config, scheduler_address=cluster.scheduler_address, n_workers=None)
        result = runs.run_streaming(config, prompt_rows(a.prompts), a.time_scale, a.sample_period)
    return figures(a, result)


def figures(a: argparse.Namespace, result: runs.SideResult) -> dict[str, Any]:
    """Occupancy and throughput of one run (samples taken between engines ready and the last commit)."""
    end = result.t0_wall + result.wall_s
    sampled = [s for samples in result.samples.values() for s in samples if result.t0_wall <= s[0] <= end]
    running = np.array([s[1] for s in sampled], dtype=float)
    queued = np.array([s[2] for s in sampled], dtype=float)
    return {
        "slots": result.mean_batch() / a.max_batch,
        "slots sampled": float(running.mean() / a.max_batch) if len(sampled) else float("nan"),
        "dashboard": float((running + queued).mean() / a.max_batch) if len(sampled) else float("nan"),
        "peak running": int(running.max()) if len(sampled) else 0,
        "tokens/s": result.tokens / result.wall_s,
        "wall s": result.wall_s,
        "tokens": result.tokens,
    }


def part_occupancy(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """Both sides, ``--repeats`` times, the order alternating; a row per run and the medians per side."""
    runs_by_side: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    rows = []
    for repeat in range(1, a.repeats + 1):
        for side in ("hold", "free") if repeat % 2 else ("free", "hold"):
            got = one_run(a, work, side, repeat)
            runs_by_side[side].append(got)
            rows.append([LABELS[side], repeat, *(got[k] for k in COLUMNS)])
    rows.sort(key=lambda row: (row[0] != LABELS["hold"], row[1]))
    medians = {side: {k: float(np.median([r[k] for r in got])) for k in COLUMNS} for side, got in runs_by_side.items()}
    rows += [[f"median: {LABELS[side]}", "", *(m[k] for k in COLUMNS)] for side, m in medians.items()]
    tokens = {r["tokens"] for got in runs_by_side.values() for r in got}
    rec.note(
        f"Workload: {a.prompts:,} prompts x {a.n_samples} samples, simulated engine in real time (max_batch "
        f"{a.max_batch}, step = {a.step_base} + {a.step_per_seq} x running model s, time_scale {a.time_scale}, "
        f"lognormal lengths mean {a.length_mean:g}, sigma {a.length_sigma:g}, up to {a.max_new_tokens}), "
        f"partitions of {a.partition_size} prompts ({a.partition_size * a.n_samples} requests), window auto. "
        f"{a.workers} worker process(es) with {a.nthreads} threads each, started by the benchmark (a LocalCluster "
        f"the run joins by its scheduler address). {a.repeats} runs per side, the order alternating (the machine "
        f"is shared with other jobs). The same token count in every run: {len(tokens) == 1}."
    )
    header = ["partitions", "run", "engine slots in use (step-weighted)", "slots in use (sampled)"]
    header += ["dashboard batch occupancy (running + queued)", "peak running", "tokens/s", "wall s", "tokens"]
    rec.table(header, rows)
    ratio = medians["free"]["tokens/s"] / medians["hold"]["tokens/s"]
    rec.note(f"Median tokens/s, partitions free their thread / hold it: {ratio:.2f}x.")


COLUMNS = ("slots", "slots sampled", "dashboard", "peak running", "tokens/s", "wall s", "tokens")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = cli.parser(__doc__)
    cli.add_flags(p, workers=1, prompts=256, n_samples=2, repeats=2, partition_size=4)
    p.add_argument("--nthreads", type=int, default=2, help="threads per worker (dask worker --nthreads)")
    cli.add_flags(p, max_batch=64, step_base=0.02, step_per_seq=0.0002, time_scale=1.0)
    cli.add_flags(p, length_mean=32.0, length_sigma=0.8, max_new_tokens=256, sample_period=0.05, seed=0)
    return cli.parse(p, argv)


if __name__ == "__main__":
    raise SystemExit(cli.run_parts(parse_args(), TITLE, {"occupancy": part_occupancy}, "occupancy"))
