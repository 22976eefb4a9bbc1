"""Where a daskgen run's CPU goes, by stage: cProfile on each worker's event-loop thread and the client's thread.

:func:`profiled_hooks` gives the ``on_ready`` / ``on_done`` hooks of :func:`common.runs.measured_side`: at
engines ready it starts a profiler (timer: the thread's own CPU time) on every worker's event-loop thread
(``client.run`` runs a plain function there) and on the client's thread, and at the last commit stops them;
each worker sums its profile by stage before sending it (small), next to its process's CPU time.

A stage is the cumulative time of its root functions minus that of roots of another stage called inside
them (roots absent from the profiled code count 0, so the same table reads several versions of daskgen).
The profiler's own cost inflates every function call, so the stages' sum is larger than the CPU an
unprofiled run spends: the shares matter, and :func:`cpu_hooks` measures the unprofiled CPU per process.

Functions here run on Dask workers; the ``common`` package is pickled by value.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

#: A function named by the end of its file's path and its name.
Root = tuple[str, str]
_SIM, _CONT = "engines/simulated/engine.py", "worker/samples/continuation.py"
_PART = "worker/partition.py"
_AGENT = "agents/base.py"  # the single-turn loop's ``run``: one sample, the continuation of a stored one too

#: The simulated engine's own work: one request (``generate``), a batch (``_batch``), the step loop (``_run``).
_ENGINE: tuple[Root, ...] = ((_SIM, "generate"), (_SIM, "_batch"), (_SIM, "_run"))
#: Worker event-loop stages: (name, roots counted, roots subtracted).  A partition's plain samples go as one batch
#: (``batch``: requests built in ``request``; its trajectories made, stopped and counted as each group finishes);
#: other samples one by one (``calls``).
WORKER_STAGES: tuple[tuple[str, tuple[Root, ...], tuple[Root, ...]], ...] = (
    ("engine: the instant simulated engine (planning, step loop)", _ENGINE, ()),
    (
        "request path: agent loop, engine handle, trajectory",
        ((_AGENT, "run"), (_AGENT, "generate_batch")),
        _ENGINE[:2],  # the requests' own engine work (the step loop runs in its own task)
    ),
    (
        "sample status and dashboard metrics",
        (("worker/slot.py", "counted"), ("worker/slot.py", "count"), ("dashboard/metrics.py", "report")),
        ((_AGENT, "run"),),
    ),
    ("sample setup: seeds, params, coroutines", ((_PART, "calls"), (_PART, "request")), ()),
    (
        "result handling: gathering finished samples",
        (("asyncio/tasks.py", "_done_callback"), (_PART, "batch")),
        ((_PART, "request"), (_AGENT, "generate_batch"), ("worker/slot.py", "count")),
    ),
    ("region assembly on the event loop (0 where the write thread does it)", ((_PART, "fill_region"),), ()),
    (
        "partition task, rest: task creation, hand-offs to threads",
        ((_PART, "run_partition"),),
        ((_PART, "calls"), (_PART, "batch"), (_PART, "fill_region")),
    ),
)
#: Client thread stages.
CLIENT_STAGES: tuple[tuple[str, tuple[Root, ...], tuple[Root, ...]], ...] = (
    (
        "commit: status, commit times, commit log",
        (("client/commit.py", "commit_outcomes"), ("client/commit.py", "commit_overlong")),
        (),
    ),
    ("progress bar", (("client/progress.py", "update"),), ()),
)
_ATTR = "_daskgen_bench_profile"


def _cumulative(stats: dict[Any, Any], roots: tuple[Root, ...]) -> float:
    """Summed cumulative seconds of the profiled functions named by ``roots``."""
    total = 0.0
    for (path, _line, name), (_cc, _nc, _tt, cumulative, _callers) in stats.items():
        if any(name == n and path.replace("\\", "/").endswith(p) for p, n in roots):
            total += cumulative
    return total


def stage_seconds(
    profiler: Any, stages: tuple[tuple[str, tuple[Root, ...], tuple[Root, ...]], ...]
) -> dict[str, float]:
    """Seconds per stage in a stopped ``cProfile.Profile``; ``"profiled total"`` is every function's own time."""
    profiler.create_stats()
    stats = profiler.stats
    out = {name: max(0.0, _cumulative(stats, add) - _cumulative(stats, sub)) for name, add, sub in stages}
    out["profiled total"] = sum(tt for _cc, _nc, tt, _ct, _callers in stats.values())
    return out


class CollectorClock:
    """CPU seconds this process spends in Python's garbage collector (in whichever thread it runs), counted from
    ``gc.callbacks`` between :meth:`start` and :meth:`stop`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began: dict[int, float] = {}

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        import threading

        ident, now = threading.get_ident(), time.thread_time()
        if phase == "start":
            self._began[ident] = now
        else:
            self.seconds += now - self._began.pop(ident, now)

    def start(self) -> CollectorClock:
        """Count from now on."""
        import gc

        gc.callbacks.append(self)
        return self

    def stop(self) -> float:
        """Stop counting; the seconds counted."""
        import gc

        gc.callbacks.remove(self)
        return self.seconds


def start_worker(dask_worker: Any, profile: bool = True) -> bool:
    """``client.run`` target: note this process's and thread's CPU time, count its garbage collector's; start
    profiling the event-loop thread."""
    import cProfile

    profiler = cProfile.Profile(time.thread_time) if profile else None
    clock = CollectorClock().start()
    setattr(dask_worker, _ATTR, (profiler, time.process_time(), time.thread_time(), children_cpu(), clock))
    if profiler is not None:
        profiler.enable()
    return True


def children_cpu() -> dict[int, float]:
    """CPU seconds of each process below this one (a worker's writer processes, an engine's own processes)."""
    import psutil

    out = {}
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        out[child.pid] = times.user + times.system
    return out


def stop_worker(dask_worker: Any) -> dict[str, float]:
    """``client.run`` target: stop; the worker's CPU seconds since :func:`start_worker` (process, event-loop
    thread, garbage collector, the processes below it) and, when profiled, per stage."""
    profiler, process0, thread0, children0, clock = getattr(dask_worker, _ATTR)
    if profiler is not None:
        profiler.disable()
    out = {"process": time.process_time() - process0, "event loop": time.thread_time() - thread0}
    out["garbage collector"] = clock.stop()
    out["child processes"] = sum(seconds - children0.get(pid, 0.0) for pid, seconds in children_cpu().items())
    if profiler is not None:
        out.update(stage_seconds(profiler, WORKER_STAGES))
    return out


def hooks(profile: bool) -> tuple[Callable[[Any], None], Callable[[Any], dict[str, Any]]]:
    """``(on_ready, on_done)`` for :func:`common.runs.measured_side`: CPU time of every worker and of the
    client (process and its own thread), per stage when ``profile``.  ``on_done`` returns
    ``{"workers": {address: {...}}, "client": {...}}``."""
    import cProfile

    state: dict[str, Any] = {}

    def on_ready(client: Any) -> None:
        client.run(start_worker, profile=profile)
        state["profiler"] = cProfile.Profile(time.thread_time) if profile else None
        state["t0"] = (time.process_time(), time.thread_time())
        state["collector"] = CollectorClock().start()
        if state["profiler"] is not None:
            state["profiler"].enable()

    def on_done(client: Any) -> dict[str, Any]:
        profiler = state["profiler"]
        if profiler is not None:
            profiler.disable()
        process0, thread0 = state["t0"]
        own = {"process": time.process_time() - process0, "thread": time.thread_time() - thread0}
        own["garbage collector"] = state["collector"].stop()
        if profiler is not None:
            own.update(stage_seconds(profiler, CLIENT_STAGES))
        return {"workers": client.run(stop_worker), "client": own}

    return on_ready, on_done


def worker_rows(workers: dict[str, dict[str, float]], samples: int) -> list[list[Any]]:
    """Table rows ``[stage, µs per sample, share of the event loop's profiled time]``, summed over workers."""
    total = {k: sum(w.get(k, 0.0) for w in workers.values()) for k in next(iter(workers.values()))}
    loop = total["profiled total"]
    rows, named = [], 0.0
    for name, _add, _sub in WORKER_STAGES:
        named += total[name]
        rows.append([name, total[name] / samples * 1e6, total[name] / loop])
    rest = max(0.0, loop - named)
    rows.append(
        ["event loop, rest: asyncio, Dask worker (task state, comms, heartbeats)", rest / samples * 1e6, rest / loop]
    )
    rows.append(["event-loop thread, profiled total", loop / samples * 1e6, 1.0])
    threads = max(0.0, total["process"] - total["event loop"])
    rows.append(
        [
            "other threads (region assembly and Zarr writes, tokenizing), not profiled",
            threads / samples * 1e6,
            None,
        ]
    )
    if total.get("child processes"):
        writers = total["child processes"]
        rows.append(["writer processes (region assembly and Zarr writes), not profiled", writers / samples * 1e6, None])
    return rows


def client_rows(client: dict[str, float], samples: int) -> list[list[Any]]:
    """Table rows ``[stage, µs per sample, share of the client thread's profiled time]``."""
    loop = client["profiled total"]
    rows, named = [], 0.0
    for name, _add, _sub in CLIENT_STAGES:
        named += client[name]
        rows.append([name, client[name] / samples * 1e6, client[name] / loop])
    rows.append(
        [
            "run loop, rest: submitting, collecting results, housekeeping",
            max(0.0, loop - named) / samples * 1e6,
            max(0.0, loop - named) / loop,
        ]
    )
    rows.append(["client thread, profiled total", loop / samples * 1e6, 1.0])
    others = max(0.0, client["process"] - client["thread"])
    rows.append(
        ["client process, other threads (scheduler, Dask client loop), not profiled", others / samples * 1e6, None]
    )
    return rows
