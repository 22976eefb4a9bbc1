"""Pieces every kind of cluster is assembled from: adaptive bounds, task durations, the job reaper.

:class:`JobReaperMixin` and :func:`job_of_worker` make dask-jobqueue replace jobs that run several
workers (``--nworkers``); :func:`declare_partition_duration` lets adaptive scaling size a cluster
before the first partition finished; :func:`adaptive_bounds` turns ``min_workers``/``max_workers``
into the bounds of ``cluster.adapt``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import dask
from dask.utils import parse_timedelta

from daskgen.errors import ConfigError

__all__ = [
    "DEFAULT_PARTITION_DURATION",
    "PARTITION_TASK_PREFIX",
    "JobReaperMixin",
    "adaptive_bounds",
    "dashboard_link",
    "declare_partition_duration",
    "job_of_worker",
]

#: Key prefix of the runner's partition tasks (``daskgen-partition-<start>-<ns>``).
PARTITION_TASK_PREFIX = "daskgen-partition"
#: First guess of a partition's duration for adaptive scaling, until real ones are measured.
DEFAULT_PARTITION_DURATION = "60s"


def declare_partition_duration() -> None:
    """Tell the scheduler that partition tasks are long before the first one ends.

    Adaptive scaling sizes the cluster from the expected duration of queued tasks; an unknown
    task counts 0.5 s, which would keep an elastic cluster at one or two workers until the first
    partition (minutes, engine start included) has finished.  A configured value wins.  Call it
    before the scheduler starts: a scheduler process takes the configuration it starts with.
    """
    durations = dict(dask.config.get("distributed.scheduler.default-task-durations", None) or {})
    if PARTITION_TASK_PREFIX not in durations:
        durations[PARTITION_TASK_PREFIX] = DEFAULT_PARTITION_DURATION
        dask.config.set({"distributed.scheduler.default-task-durations": durations})


def adaptive_bounds(min_workers: int | None, max_workers: int | None, fixed: int) -> tuple[int, int, bool]:
    """(minimum, maximum, adaptive): ``fixed`` workers when neither bound is given, else the given bounds.

    Raises
    ------
    ConfigError
        When the maximum is below 1 or below the minimum.
    """
    if min_workers is None and max_workers is None:
        return fixed, fixed, False
    lo = min_workers or 0
    hi = max_workers if max_workers is not None else max(lo, fixed)
    if hi < lo or hi < 1:
        raise ConfigError(f"cluster.max_workers={hi} must be >= 1 and >= min_workers={lo}")
    return lo, hi, True


def dashboard_link(cluster: Any) -> str | None:
    """The cluster's dashboard address, or ``None`` without a dashboard (bokeh missing or disabled)."""
    try:
        return cluster.dashboard_link
    except Exception:
        return None


def job_of_worker(worker_state: Any) -> str:
    """Adaptive grouping key: the job of a worker named ``<job>-<i>`` (scale down whole jobs only)."""
    return str(worker_state.name).rsplit("-", 1)[0]


class JobReaperMixin:
    """``SpecCluster`` mixin: forget a multi-worker job once all of its workers have left.

    ``SpecCluster`` only notices a finished job when the departing worker's name is the job's
    name, which is not the case with ``--nworkers N`` (workers ``<job>-0 ... <job>-{N-1}``): a
    job that reached its walltime would stay in the plan forever and adaptive scaling would
    never replace it.  After ``distributed.deploy.lost-worker-timeout`` without any of its
    workers, the job is closed and dropped, so the cluster resubmits it.
    """

    def _update_worker_status(self, op: str, msg: Any) -> None:
        if op == "remove":
            info = self.scheduler_info["workers"].get(msg)  # type: ignore[attr-defined]
            job = self._job_of(str(info["name"])) if info else None
            if job is not None:
                delay = parse_timedelta(dask.config.get("distributed.deploy.lost-worker-timeout"))
                handle = self.workers.get(job)  # type: ignore[attr-defined]
                asyncio.get_running_loop().call_later(delay, self._reap_if_gone, job, handle)
        super()._update_worker_status(op, msg)  # type: ignore[misc]

    def _job_members(self, job: Any) -> set[str]:
        group = self.worker_spec.get(job, {}).get("group", ())  # type: ignore[attr-defined]
        return {f"{job}{suffix}" for suffix in group}

    def _job_of(self, worker_name: str) -> Any:
        for job in self.worker_spec:  # type: ignore[attr-defined]
            if worker_name in self._job_members(job):
                return job
        return None

    def _reap_if_gone(self, job: Any, handle: Any) -> None:
        if handle is None or self.workers.get(job) is not handle:  # type: ignore[attr-defined]
            return  # already closed, or already replaced by a new job of the same name
        members = self._job_members(job)
        alive = {str(w["name"]) for w in self.scheduler_info["workers"].values()}  # type: ignore[attr-defined]
        if not members & alive:
            self._futures.add(asyncio.ensure_future(self.workers[job].close()))  # type: ignore[attr-defined]
            del self.workers[job]  # type: ignore[attr-defined]
