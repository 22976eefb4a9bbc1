"""What every deployment shares: the ``cluster:`` keys of all kinds, and what a started cluster reports.

:class:`Deployment` takes the keys every kind accepts; :class:`~daskgen.deploy.local.LocalDeployment`
and :class:`~daskgen.deploy.batch.BatchDeployment` add their own and forward the rest with ``**keys``,
so that the signatures of the deployment classes are the ``cluster:`` schema
(:mod:`daskgen.deploy.keys`).  :class:`ClusterInfo` describes the cluster a deployment started.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar

from daskgen.deploy.keys import AtLeast, Jobqueue
from daskgen.deploy.security import cluster_tls

__all__ = ["DEFAULT_THREADS_PER_WORKER", "ClusterInfo", "Deployment", "runs_scheduler_process"]

#: Task slots per worker: how many partitions one engine has in flight at once.
DEFAULT_THREADS_PER_WORKER = 4


def runs_scheduler_process(kind: str, value: bool | None = None) -> bool:
    """Whether the scheduler runs in a process of its own (:mod:`daskgen.deploy.scheduler_process`):
    ``value`` (``cluster.scheduler_process``), else the kind's default.

    Batch clusters (many nodes, where the client's core is the ceiling) default to it; a local cluster,
    whose few engines cannot produce enough partitions per second to load the client, does not.
    """
    return bool(value if value is not None else kind != "local")


class Deployment:
    """The ``cluster:`` keys of every kind; ``None`` means "not given" (the kind's default applies).

    Parameters
    ----------
    threads_per_worker
        Task slots per worker; `daskgen run` uses `window + 1` (65 for `window: auto`).
    gpus_per_worker
        GPUs per worker (engine), >1 for tensor parallelism.
    min_workers
        Adaptive lower bound, in workers (`--min-workers`).
    max_workers
        Adaptive upper bound, in workers (`--max-workers`).
    local_directory
        Node-local scratch for workers, e.g. `$TMPDIR` (expanded by the job's shell; for a local cluster, by
        daskgen, and an unset variable is an error).
    dashboard_address
        Scheduler dashboard, e.g. `:8787`; `:0` for any free port (the local default).
    tls
        TLS with a per-run certificate: default true for slurm/pbs, false for local.
    scheduler_process
        Run the Dask scheduler in a process of its own: default true for slurm/pbs, false for local.
    """

    #: ``cluster.kind`` of the class (and its ``jobqueue.<kind>`` configuration section).
    kind: ClassVar[str]

    def __init__(
        self,
        *,
        threads_per_worker: Annotated[int | None, AtLeast(1)] = None,
        gpus_per_worker: Annotated[int, AtLeast(1)] = 1,
        min_workers: Annotated[int | None, AtLeast(0)] = None,
        max_workers: Annotated[int | None, AtLeast(1)] = None,
        local_directory: Annotated[str | None, Jobqueue("local-directory")] = None,
        dashboard_address: str | None = None,
        tls: bool | None = None,
        scheduler_process: bool | None = None,
    ) -> None:
        self.threads_per_worker = threads_per_worker or self.default_threads_per_worker()
        self.gpus_per_worker = gpus_per_worker or 1
        self.min_workers, self.max_workers = min_workers, max_workers
        self.local_directory = local_directory
        self.dashboard_address = dashboard_address
        self.tls = cluster_tls(self.kind, tls)
        self.scheduler_process = runs_scheduler_process(self.kind, scheduler_process)

    def default_threads_per_worker(self) -> int:
        """Task slots per worker when ``threads_per_worker`` is not given."""
        return DEFAULT_THREADS_PER_WORKER


@dataclass(frozen=True)
class ClusterInfo:
    """What :func:`make_cluster` built, for logs and for sizing the runner's submission window."""

    kind: str
    workers_per_node: int
    threads_per_worker: int
    gpus_per_worker: int
    min_workers: int
    max_workers: int
    adaptive: bool
    lifetime: str | None = None
    notes: tuple[str, ...] = ()
    dashboard: str | None = None

    @property
    def in_flight_window(self) -> int:
        """Partitions to keep submitted so every worker slot is busy and adaptivity scales up.

        The scheduler's adaptive target is roughly (queued + running tasks) / threads per
        worker, so the client must keep at least ``max_workers * threads_per_worker`` tasks
        submitted for the cluster to grow to ``max_workers``.
        """
        return self.max_workers * self.threads_per_worker

    def __str__(self) -> str:
        gpus = f", {self.gpus_per_worker} GPU(s) each" if self.gpus_per_worker else ""
        size = (
            f"adaptive {self.min_workers}..{self.max_workers} workers"
            if self.adaptive
            else f"{self.max_workers} workers"
        )
        text = (
            f"{self.kind} cluster: {size}, {self.workers_per_node} per node{gpus}, "
            f"{self.threads_per_worker} partitions in flight per worker"
        )
        if self.lifetime:
            text += f"; {self.lifetime}"
        if self.dashboard:
            text += f"; dashboard {self.dashboard}"
        return "; ".join([text, *self.notes])
