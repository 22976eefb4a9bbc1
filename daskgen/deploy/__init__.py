"""Build the Dask cluster a run executes on: a local cluster, or SLURM/PBS jobs via dask-jobqueue.

The ``cluster:`` section of a run config (see ``docs/hpc.md``) is a flat mapping; ``kind`` picks
the backend.  On GPU nodes every job starts one Dask worker process per GPU (``--nworkers``),
each advertising ``--resources GPU=<gpus_per_worker>`` and running ``threads_per_worker`` task
slots (the in-flight window of partitions).  Worker processes are non-daemonic so engines can
start subprocesses, and every worker retires shortly before the job's walltime (``--lifetime``)
so that adaptive scaling submits a replacement job in time.  Anything the spec leaves out comes
from dask's ``jobqueue.<kind>.*`` configuration (``~/.config/dask/jobqueue.yaml``), as with
plain dask-jobqueue; list settings (prologue, directives, worker arguments) extend the
configured ones.  ``dask_jobqueue`` is optional (extra ``[hpc]``) and imported lazily.

The package is split by concern: :mod:`daskgen.deploy.spec` (the ``cluster:`` keys, validation,
:class:`ClusterInfo`), :mod:`daskgen.deploy.jobqueue` (dask-jobqueue jobs, job scripts, walltime
and worker lifetimes) and :mod:`daskgen.deploy.local` (the LocalCluster and its workers'
environment).  Everything public is importable from ``daskgen.deploy``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from daskgen.deploy.jobqueue import _JobReaperMixin as _JobReaperMixin  # for the job reaper's tests
from daskgen.deploy.jobqueue import (
    _make_hpc_cluster,
    job_of_worker,
    jobqueue_kwargs,
    parse_walltime,
    render_job_script,
    worker_lifetime,
)
from daskgen.deploy.local import _make_local_cluster
from daskgen.deploy.spec import (
    CLUSTER_KEYS,
    DEFAULT_THREADS_PER_WORKER,
    KINDS,
    ClusterInfo,
    ClusterSpec,
    apply_cli_overrides,
    parse_cluster_spec,
)

__all__ = [
    "CLUSTER_KEYS",
    "DEFAULT_THREADS_PER_WORKER",
    "KINDS",
    "ClusterInfo",
    "ClusterSpec",
    "apply_cli_overrides",
    "job_of_worker",
    "jobqueue_kwargs",
    "make_cluster",
    "parse_cluster_spec",
    "parse_walltime",
    "render_job_script",
    "worker_lifetime",
]


def make_cluster(spec: Mapping[str, Any] | None = None) -> tuple[Any, ClusterInfo]:
    """Start the cluster described by a ``cluster:`` config section.

    Parameters
    ----------
    spec
        The section (see :data:`CLUSTER_KEYS` and ``docs/hpc.md``); ``None`` means local.

    Returns
    -------
    (cluster, info)
        A running ``distributed.LocalCluster`` or dask-jobqueue cluster (already adaptive:
        fixed-size HPC clusters use ``min == max`` so that expired jobs are resubmitted), and a
        :class:`ClusterInfo` describing it.  Close the cluster when done.

    Raises
    ------
    ConfigError
        Unknown keys, bad values, missing memory (HPC) or missing dask-jobqueue.

    Notes
    -----
    For ``local``, the process-wide dask setting ``distributed.worker.daemon`` is set to
    ``False``: nannies read it each time they (re)start a worker, and engines such as SGLang
    need non-daemonic workers to start their own subprocesses.
    """
    s = parse_cluster_spec(spec)
    if s.kind == "local":
        return _make_local_cluster(s)
    return _make_hpc_cluster(s)
