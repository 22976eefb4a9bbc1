"""Where CPU goes: CPU seconds by process, by role around an engine, and by thread of this process.

Read from ``/proc`` (psutil): :func:`cpu_by_role` splits a side of ``overhead_engine.py`` into the engine's
own processes, the process hosting it and the driver; :func:`thread_cpu` splits the client process of
``scaleout_client.py`` by thread.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import psutil


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
