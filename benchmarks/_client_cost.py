"""Helpers of ``scaleout.py --part client``: where the client's CPU goes, and Dask's own floor.

* :func:`separate_scheduler` starts ``dask scheduler`` and ``dask worker --nworkers N`` (nannies
  in one process, workers in their own) as subprocesses, so that the client process holds only
  the client; their CPU is read from ``/proc`` (psutil) and reported apart.
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

Like ``_bench``, this module is pickled by value, so workers need not import ``benchmarks``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _bench
import cloudpickle
import psutil

cloudpickle.register_pickle_by_value(sys.modules[__name__])

RESOURCE = "daskgen-engine"


def cpu_seconds(procs: dict[Any, psutil.Process]) -> dict[Any, float]:
    """User + system CPU seconds of each process (children not included); a process that ended is left out."""
    out = {}
    for name, proc in procs.items():
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            out[name] = times.user + times.system
    return out


#: Where a side of ``overhead.py --part engine`` spent its CPU (:func:`cpu_by_role`).
CPU_ROLES = ("engine's own processes", "engine's host process", "driver process", "other processes")


def tree_cpu_seconds() -> dict[int, float]:
    """:func:`cpu_seconds` of this process and every process below it, by pid."""
    me = psutil.Process()
    return cpu_seconds({p.pid: p for p in [me, *me.children(recursive=True)]})


def cpu_by_role(before: dict[int, float], after: dict[int, float], host: int) -> dict[str, float]:
    """CPU seconds used between two :func:`tree_cpu_seconds` snapshots, by :data:`CPU_ROLES`.

    ``host`` holds the engine's front end (this process when the engine is driven directly, the Dask
    worker under daskgen); the engine's own processes are those below it.  The driver process is this
    one: daskgen's client and, on a local cluster, the scheduler and the nannies.
    """
    engine: set[int] = set()
    with contextlib.suppress(psutil.NoSuchProcess):
        engine = {p.pid for p in psutil.Process(host).children(recursive=True)}
    roles = {**dict.fromkeys(engine, CPU_ROLES[0]), host: CPU_ROLES[1]}
    roles.setdefault(os.getpid(), CPU_ROLES[2])
    used = dict.fromkeys(CPU_ROLES, 0.0)
    for pid, seconds in after.items():
        used[roles.get(pid, CPU_ROLES[3])] += seconds - before.get(pid, 0.0)
    return used


def scheduler_child() -> psutil.Process:
    """The ``dask scheduler`` process daskgen started as a child of this process (``scheduler_process``)."""
    found = [c for c in psutil.Process().children() if "daskgen.deploy.scheduler_process" in " ".join(c.cmdline())]
    if len(found) != 1:
        raise SystemExit(f"expected one scheduler child process, found {len(found)}")
    return found[0]


#: Thread groups of the client process: distributed's event loop (client comms, and a LocalCluster's
#: scheduler and nannies), the main thread (daskgen's loop, building and submitting tasks, committing),
#: and the rest (Zarr's I/O loop and pools that write the commits, Dask's offload thread).
THREAD_GROUPS = ("event loop", "main thread", "other threads")


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads so far, by :data:`THREAD_GROUPS`
    (from ``/proc/self/task``; empty where there is none).  Threads that ended are not counted."""
    import threading

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = dict.fromkeys(THREAD_GROUPS, 0.0)
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        name = names.get(int(tid), "")
        group = "event loop" if name == "IO loop" else "main thread" if name == "MainThread" else "other threads"
        out[group] += (int(fields[11]) + int(fields[12])) / tick
    return out


def idle_share(seconds: float = 2.0) -> float:
    """CPU share of a core this process uses over ``seconds`` while it only sleeps in the main thread
    (the event loop, scheduler and nannies of a LocalCluster keep ticking)."""
    t0, c0 = time.perf_counter(), time.process_time()
    time.sleep(seconds)
    return (time.process_time() - c0) / (time.perf_counter() - t0)


def benchmark_pythonpath() -> str:
    """``PYTHONPATH`` for other processes that must import daskgen from ``$DASKGEN_SRC`` and this folder
    (a scheduler unpickles the floor's tasks by reference)."""
    return os.pathsep.join([str(_bench.DASKGEN_SRC), str(_bench.HERE), os.environ.get("PYTHONPATH", "")])


@contextlib.contextmanager
def importable_here() -> Iterator[None]:
    """While inside: processes this one starts (daskgen's scheduler process, batch jobs) import as above."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = benchmark_pythonpath()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


@contextlib.contextmanager
def separate_scheduler(n_workers: int, nthreads: int, work: Path) -> Iterator[tuple[str, dict[str, psutil.Process]]]:
    """A scheduler and ``n_workers`` workers (``nthreads`` each) in processes of their own.

    Yields the scheduler address and ``{"scheduler": ..., "nannies": ...}`` processes.  Both import
    daskgen from ``$DASKGEN_SRC`` (the scheduler runs daskgen's drain plugin and unpickles the tasks,
    workers run the engine) and can import ``benchmarks/`` (the floor's tasks).
    """
    from distributed import Client

    env = {**os.environ, "PYTHONPATH": benchmark_pythonpath()}
    sched_file = work / f"scheduler-{time.time_ns()}.json"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
    sched = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distributed.cli.dask_scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--no-dashboard",
            "--scheduler-file",
            str(sched_file),
        ],
        **quiet,
    )
    workers = None
    try:
        address = _wait_for_address(sched_file, sched)
        workers = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distributed.cli.dask_worker",
                address,
                "--nworkers",
                str(n_workers),
                "--nthreads",
                str(nthreads),
                "--no-dashboard",
                "--host",
                "127.0.0.1",
            ],
            **quiet,
        )
        with Client(address, timeout=60) as client:
            client.wait_for_workers(n_workers, timeout=120)
        yield address, {"scheduler": psutil.Process(sched.pid), "nannies": psutil.Process(workers.pid)}
    finally:
        for proc in (workers, sched):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _wait_for_address(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"dask scheduler exited with status {proc.returncode}")
        with contextlib.suppress(OSError, ValueError, KeyError):
            return json.loads(path.read_text())["address"]
        time.sleep(0.1)
    raise SystemExit(f"dask scheduler did not write {path} within {timeout:.0f} s")


async def _trivial_partition(start: int, rows: list[int], seconds: float) -> dict[str, Any]:
    """A stand-in partition: waits ``seconds`` (the engine), returns a result of a partition's size."""
    await asyncio.sleep(seconds)
    return {"start": start, "stop": start + len(rows), "rows": rows, "failed": {}, "aborted": [], "tokens": 0}


async def _instant_partition(task: Any) -> Any:
    """Benchmark stand-in for ``daskgen.worker.partition.run_partition``: the result of a partition whose rows all
    finished (8 tokens per sample), handed back at once without generating or writing anything."""
    from daskgen.worker.partition import PartitionResult

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

    workers = list(client.scheduler_info(n_workers=-1)["workers"])
    seconds = 0.0 if rate is None else len(workers) * window / max(rate, 1e-9)  # each worker holds `window`
    load = dict.fromkeys(workers, 0)
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

    before, c0, t0 = cpu_seconds(procs or {}), time.process_time(), time.perf_counter()
    for _ in range(min(n_tasks, window * len(workers))):
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
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = cpu_seconds(procs or {})
    return {"tasks": n_tasks, "wall": wall, "client_cpu": cpu, **{k: after[k] - before[k] for k in after}}
