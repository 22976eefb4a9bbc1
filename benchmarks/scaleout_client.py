"""Scale-out: where daskgen's client saturates, in up to four cluster layouts, against Dask's own floor.

Where the client saturates: daskgen's runner with an *instant* engine and short outputs, so
generating is never the limit (on 2 cores the workers' store writes are): prompts/s at 1, 2, 4 workers, and
the CPU seconds the client process spends per partition (``time.process_time`` of this process from engines
ready to the last commit). ``partition_size / CPU per partition`` is the rate at which the client process
would fill one core.
It runs in up to four layouts (``--scheduler``; ``slurm`` needs a running SLURM, so it is not in the default):

* ``in-process`` — daskgen makes a LocalCluster, whose scheduler and nannies run in the client process
  (as with daskgen's default local cluster and dask-jobqueue clusters), so their CPU is included;
* ``process`` — daskgen makes the LocalCluster with ``cluster.scheduler_process: true`` (the default of
  SLURM/PBS clusters): daskgen starts the scheduler in a process of its own, the nannies stay in the client
  process; the scheduler process's CPU is reported in a column of its own;
* ``slurm`` — daskgen's default HPC path on the local single-node SLURM (``.ci/slurm-setup.sh``): one job
  of N worker processes submitted through dask-jobqueue, TLS with a per-run certificate and the scheduler in
  a process of its own (both defaults for batch clusters); the client process holds the client alone;
* ``separate`` — ``dask scheduler`` and ``dask worker --nworkers N`` run as processes of their own
  (``common.processes.separate_scheduler``) and daskgen connects with ``scheduler_address`` (as
  ``daskgen run --scheduler-address``): the client CPU is the client alone, and the scheduler's and
  the nannies' CPU over the same span are reported in columns of their own.

With ``--floor`` (the default) each run also gets Dask's own floor on the same cluster, right after it:
trivial async tasks submitted much as daskgen submits partitions (one ``Client.submit`` each, where daskgen
puts partitions freed together on one worker into one ``Client.map``; the ``daskgen-engine`` resource, a
loose worker restriction, the same window, results through
``as_completed``, futures released) at the run's partitions/s, and the client's CPU per task;
"daskgen above the floor" is the difference.  The per-task cost of Dask falls as the rate rises
(messages are batched), so the floor is measured at the run's rate, and a client CPU per partition
measured below saturation overstates the cost at saturation; "at full speed" is the same floor with
tasks that return at once (as many per second as the cluster takes: near the client's saturation).
With ``--full-speed`` (the default) each layout and worker count runs once more on ``--full-speed-prompts``
prompts with the partition task swapped for an instant stand-in (``common.dask_floor.instant_partitions``: the
result of a finished partition, nothing generated or written) and ``--full-speed-window`` partitions per
worker: partitions then flow as fast as the cluster takes them, and the client's CPU per partition there is
its cost near saturation — the saturation estimate uses it.
"Idle share" is the client process's CPU share with engines ready and nothing submitted (2 s before
the run).  The client CPU per partition is also split by thread (``/proc/self/task``): distributed's
event loop (client comms, and in-process the scheduler and nannies), the main thread (daskgen's loop:
building, submitting and collecting tasks, committing; ``Client.map`` runs here) and the other
threads (Zarr's I/O loop and pools writing the commits, Dask's offload thread).  The commit itself
(``store.commit`` of one partition) is timed on a store with ``--commit-rows`` rows.

``scaleout.py --part client`` runs the same comparison.

    python benchmarks/scaleout_client.py                  # ~5 minutes on 2 cores
    python benchmarks/scaleout_client.py --scheduler separate --workers 2   # ~1 minute
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import cli, cpu, dask_floor, processes, records

from daskgen.config import RunConfig

TITLE = "Scale-out: the client bottleneck"

#: --scheduler modes of the client part: where the scheduler and the nannies run.
WHERE = {
    "in-process": "scheduler and nannies in the client process (LocalCluster)",
    "process": "LocalCluster with `cluster.scheduler_process: true`: daskgen runs the scheduler in a process of "
    "its own, the nannies stay in the client process; the scheduler's CPU is the last columns",
    "slurm": "daskgen's default SLURM cluster (one job of N workers on the local single-node SLURM, TLS, "
    "`scheduler_process` on): the client process holds the client alone; the scheduler's CPU is the last "
    "columns",
    "separate": "`dask scheduler` and `dask worker --nworkers N` in processes of their own (`scheduler_address`): "
    "client CPU is the client alone; the scheduler's and the nannies' CPU are the last columns",
}
#: Processes besides the client whose CPU each mode reports: key in the run's ``procs`` -> column label.
OTHER_PROCESSES = {
    "process": {"scheduler": "scheduler"},
    "slurm": {"scheduler": "scheduler"},
    "separate": {"scheduler": "scheduler", "nannies": "nanny"},
}


def client_run(a: argparse.Namespace, work: Path, w: int, scheduler: str, instant: bool = False) -> dict[str, Any]:
    """One client-part run with ``w`` workers in the layout ``scheduler`` (:data:`WHERE`).

    ``instant``: the full-speed run — partition tasks are :func:`dask_floor.instant_partitions`'
    stand-in, ``--full-speed-prompts`` prompts, no floor."""
    name = f"cl-{scheduler}-{w}{'-instant' if instant else ''}.zarr"
    window = a.full_speed_window if instant else a.client_window
    config = RunConfig(
        model="simulated-client",
        engine="simulated",
        store=str(work / name),
        engine_args={"time_scale": 0.0, "length_dist": "fixed", "length_mean": 8},
        n_samples=a.n_samples,
        max_new_tokens=16,
        max_prompt_tokens=64,
        partition_size=a.partition_size,  # temperature 1, seed 0: RunConfig's defaults
        n_workers=w,
        window=window,
        progress=False,
    )
    prompts = [f"q{i}" for i in range(a.full_speed_prompts if instant else a.client_prompts)]
    with dask_floor.instant_partitions() if instant else contextlib.nullcontext():
        return client_run_in(work, w, scheduler, config, prompts, floor=a.floor and not instant)


def client_run_in(
    work: Path, w: int, scheduler: str, config: RunConfig, prompts: list[str], floor: bool
) -> dict[str, Any]:
    """:func:`run_measured` of ``config`` on the cluster layout ``scheduler`` (``config.window`` + 1 threads
    per worker)."""
    if scheduler == "in-process":
        return dask_floor.run_measured(config, prompts, floor=floor)
    if scheduler == "process":
        config.cluster = {"kind": "local", "scheduler_process": True}
    if scheduler == "slurm":  # daskgen's defaults for batch clusters: TLS, scheduler_process
        config.cluster = {
            "kind": "slurm",
            "workers_per_node": w,
            "cores": 2,
            "memory": "4GB",
            "walltime": "00:30:00",
            "threads_per_worker": int(config.window) + 1,
            "dashboard_address": ":0",
            "log_directory": str(work / "slurm-logs"),
            "python": sys.executable,
            "tls_directory": str(work / "tls"),
        }
    if config.cluster:
        with processes.importable_here():
            return dask_floor.run_measured(config, prompts, floor=floor, own_scheduler=True)
    with processes.separate_scheduler(w, int(config.window) + 1, work) as (address, procs):
        config.scheduler_address = address
        return dask_floor.run_measured(config, prompts, procs, floor=floor)


def part_client(a: argparse.Namespace, work: Path, rec: records.Record) -> list[dict[str, Any]]:
    """Instant engines: pipeline-limited rate, client CPU per partition, and Dask's floor at that rate."""
    results = []
    rec.note(
        f"Part client: instant simulated engine, 8-token outputs, {a.client_prompts:,} prompts × {a.n_samples} "
        f'samples, partitions of {a.partition_size}, window {a.client_window} per worker. "Dask floor": '
        "trivial async tasks submitted like partitions (resource, loose worker restriction, the same "
        "window, results through `as_completed`, released) on the same cluster right after the run, at "
        "the run's partitions/s; client CPU per task. Idle share: the client process's CPU with engines "
        "ready and nothing submitted (2 s before the run)."
        + (
            f' "Full speed": the same run on {a.full_speed_prompts:,} prompts, window {a.full_speed_window} per '
            "worker, with each partition task replaced "
            "by a stand-in that returns a finished partition's result at once (nothing generated or written; "
            "`common.dask_floor.instant_partitions`), so partitions flow as fast as the cluster takes them and "
            "the client's own work per partition (build, submit, collect, commit) is measured near "
            "saturation."
            if a.full_speed
            else ""
        )
    )
    for scheduler in schedulers(a):
        rows = []
        for w in cli.counts(a.workers):
            r = client_run(a, work, w, scheduler)
            r["workers"], r["scheduler"] = w, scheduler
            results.append(r)
            cpu_pp = r["client_cpu"] / r["partitions"]
            row = [
                w,
                r["partitions"],
                r["wall"],
                r["prompts"] / r["wall"],
                r["partitions"] / r["wall"],
                r["client_cpu"] / r["wall"],
                cpu_pp * 1000,
                a.partition_size / cpu_pp,
            ]
            row += [r["threads"].get(k, float("nan")) / r["partitions"] * 1000 for k in cpu.THREAD_GROUPS]
            if a.floor:
                f = r["floor"]
                fast = r["fast"]
                row += [
                    f["tasks"] / f["wall"],
                    f["client_cpu"] / f["tasks"] * 1000,
                    (cpu_pp - f["client_cpu"] / f["tasks"]) * 1000,
                    r["idle_share"],
                    fast["tasks"] / fast["wall"],
                    fast["client_cpu"] / fast["tasks"] * 1000,
                ]
            if scheduler != "in-process":
                row += [r["procs"][k] / r["partitions"] * 1000 for k in OTHER_PROCESSES[scheduler]]
                if a.floor:
                    row += [r[k]["scheduler"] / r[k]["tasks"] * 1000 for k in ("floor", "fast")]
            if a.full_speed:
                fs = client_run(a, work, w, scheduler, instant=True)
                fs["workers"], fs["scheduler"], r["full_speed"] = w, scheduler, fs
                fs_pp = fs["client_cpu"] / fs["partitions"]
                row += [
                    fs["partitions"] / fs["wall"],
                    fs["client_cpu"] / fs["wall"],
                    fs_pp * 1000,
                    a.partition_size / fs_pp,
                ]
                row += [fs["procs"][k] / fs["partitions"] * 1000 for k in OTHER_PROCESSES.get(scheduler, {})]
            rows.append(row)
        header = [
            "workers",
            "partitions",
            "wall s",
            "prompts/s",
            "partitions/s",
            "client CPU share of a core",
            "client CPU ms per partition",
            "prompts/s at one full client core",
            *(f"... of which {k} ms" for k in cpu.THREAD_GROUPS),
        ]
        if a.floor:
            header += [
                "Dask floor: tasks/s",
                "Dask floor: client CPU ms per trivial task",
                "daskgen above the floor, ms",
                "idle share",
                "Dask floor at full speed: tasks/s",
                "Dask floor at full speed: client CPU ms per task",
            ]
        if scheduler != "in-process":
            header += [f"{label} process CPU ms per partition" for label in OTHER_PROCESSES[scheduler].values()]
            header += ["Dask floor: scheduler CPU ms per trivial task", "... at full speed"] if a.floor else []
        if a.full_speed:
            header += [
                "full speed: partitions/s",
                "full speed: client CPU share of a core",
                "full speed: client CPU ms per partition",
                "full speed: prompts/s per client core",
            ]
            header += [
                f"full speed: {label} CPU ms per partition" for label in OTHER_PROCESSES.get(scheduler, {}).values()
            ]
        rec.table(header, rows, caption=f"Scheduler {scheduler}: {WHERE[scheduler]}.")
    return results


def commit_latency(a: argparse.Namespace, work: Path) -> tuple[float, float]:
    """Median and p90 seconds of ``store.commit`` for one partition on a ``--commit-rows`` store."""
    from daskgen import store

    layout = store.Layout(a.commit_rows, a.n_samples, 64, 256, a.partition_size, 0)
    path = work / "commit.zarr"
    store.GenerationStore.create(
        path, store.StoreAttrs(layout, extra={"benchmark": "commit latency"}), [f"r{i}" for i in range(a.commit_rows)]
    )
    rng = np.random.default_rng(0)
    starts = rng.choice(np.arange(0, a.commit_rows, a.partition_size), size=a.commit_samples, replace=False)
    times = []
    for start in starts:
        n = min(a.partition_size, a.commit_rows - start)
        t0 = time.perf_counter()
        store.GenerationStore.open(path).commit(int(start), np.ones(n, dtype="int8"), None, np.full(n, time.time()))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), float(np.percentile(times, 90))


def part_client_and_commit(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """The client part plus the commit latency, and the client-saturation estimate from both."""
    client = part_client(a, work, rec)
    med, p90 = commit_latency(a, work)
    rec.note(
        f"`store.commit` of one {a.partition_size}-row partition on a {a.commit_rows:,}-row store: median "
        f"{med * 1000:.1f} ms, p90 {p90 * 1000:.1f} ms (rewrites one 65,536-row chunk of `status` and "
        f"of `committed_at`; the runner commits at most once per `daskgen.commit-interval`, so this "
        f"is a cost per commit, not per partition)."
    )
    for scheduler in schedulers(a):
        runs = [r.get("full_speed", r) for r in client if r["scheduler"] == scheduler]
        worst = max(r["client_cpu"] / r["partitions"] for r in runs)
        how = "at full speed" if a.full_speed else "at the engines' rate"
        rec.note(
            f"**Client saturation estimate, scheduler {scheduler}: one client core per {worst * 1000:.1f} ms "
            f"per partition ({how}, worst worker count) → about {a.partition_size / worst:,.0f} prompts/s "
            f"({1 / worst:.0f} partitions/s) with partitions of {a.partition_size}.**"
        )


def schedulers(a: argparse.Namespace) -> list[str]:
    """``--scheduler``: the layouts to run (:data:`WHERE`)."""
    chosen = [x.strip() for x in a.scheduler.split(",") if x.strip()]
    if set(chosen) - set(WHERE):
        raise SystemExit(f"--scheduler takes {', '.join(WHERE)}, not {a.scheduler!r}")
    return chosen


def add_args(p: argparse.ArgumentParser) -> None:
    """This comparison's flags."""
    p.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated")
    cli.add_flags(p, n_samples=4, partition_size=64)
    p.add_argument("--client-prompts", type=int, default=16384)
    p.add_argument("--client-window", type=int, default=4)
    p.add_argument(
        "--scheduler",
        default="in-process,process,separate",
        help="client part, comma-separated: in-process (LocalCluster in the client process), process "
        "(LocalCluster with cluster.scheduler_process), slurm (daskgen's SLURM cluster on a local "
        "SLURM), separate (`dask scheduler` + `dask worker` processes)",
    )
    p.add_argument(
        "--full-speed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="client part: also run each layout with instant stand-in partition tasks (client near saturation)",
    )
    p.add_argument("--full-speed-prompts", type=int, default=65536, help="prompts of each full-speed run")
    p.add_argument(
        "--full-speed-window",
        type=int,
        default=8,
        help="partitions per worker in the full-speed runs (8: where window auto starts for this run's "
        "engine, 8 x 256 batch slots / 256 requests per partition)",
    )
    p.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="client part: also measure Dask's own floor (trivial tasks) and the idle CPU share",
    )
    p.add_argument("--commit-rows", type=int, default=1_000_000)
    p.add_argument("--commit-samples", type=int, default=50)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    return cli.parse_parts(__doc__, argv, add_args)


if __name__ == "__main__":
    raise SystemExit(cli.run_parts(parse_args(), TITLE, {"client": part_client_and_commit}))
