"""Build the Dask cluster a run executes on: a local cluster, or SLURM/PBS jobs via dask-jobqueue.

The ``cluster:`` section of a run config (see ``docs/hpc.md``) is a flat mapping; ``kind`` picks the
deployment class, one per kind: :class:`LocalDeployment`, :class:`SLURMDeployment`,
:class:`PBSDeployment`. Each takes the keys of its kind as keyword arguments, and its signature is the
schema of those keys (types, defaults, help); for SLURM and PBS a key left out falls back to Dask's
``jobqueue.<kind>.*`` configuration (``~/.config/dask/jobqueue.yaml``), as with plain dask-jobqueue, and
list settings (prologue, directives, worker arguments) extend the configured ones. ``dask_jobqueue`` is
optional (extra ``[hpc]``) and imported lazily.

Modules, one concern each: :mod:`~daskgen.deploy.keys` (reading the keys from a class's signature,
checking a value), :mod:`~daskgen.deploy.spec` (the keys of all kinds, validation, CLI overrides),
:mod:`~daskgen.deploy.deployment` (the keys every kind shares, :class:`ClusterInfo`),
:mod:`~daskgen.deploy.walltime` (walltimes and worker lifetimes), :mod:`~daskgen.deploy.job_script` (the
lines daskgen adds to a worker job), :mod:`~daskgen.deploy.assembly` (adaptive bounds, partition
durations, the job reaper), :mod:`~daskgen.deploy.batch` (what SLURM and PBS share),
:mod:`~daskgen.deploy.slurm`, :mod:`~daskgen.deploy.pbs`, :mod:`~daskgen.deploy.local`,
:mod:`~daskgen.deploy.scheduler_process` and :mod:`~daskgen.deploy.security`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from daskgen.deploy.assembly import JobReaperMixin, job_of_worker
from daskgen.deploy.batch import BatchDeployment
from daskgen.deploy.deployment import DEFAULT_THREADS_PER_WORKER, ClusterInfo, Deployment
from daskgen.deploy.local import LocalDeployment
from daskgen.deploy.pbs import PBSDeployment
from daskgen.deploy.slurm import SLURMDeployment
from daskgen.deploy.spec import (
    CLUSTER_KEYS,
    DEPLOYMENTS,
    KINDS,
    ClusterSpec,
    apply_cli_overrides,
    ignored_notes,
    kind_values,
    parse_cluster_spec,
)
from daskgen.deploy.walltime import parse_walltime, worker_lifetime
from daskgen.errors import ConfigError

__all__ = [
    "CLUSTER_KEYS",
    "DEFAULT_THREADS_PER_WORKER",
    "DEPLOYMENTS",
    "KINDS",
    "BatchDeployment",
    "ClusterInfo",
    "ClusterSpec",
    "Deployment",
    "JobReaperMixin",
    "LocalDeployment",
    "PBSDeployment",
    "SLURMDeployment",
    "apply_cli_overrides",
    "deployment",
    "job_of_worker",
    "jobqueue_kwargs",
    "make_cluster",
    "parse_cluster_spec",
    "parse_walltime",
    "render_job_script",
    "worker_lifetime",
]


def deployment(spec: Mapping[str, Any] | ClusterSpec | None) -> Any:
    """The deployment of a ``cluster:`` section: its kind's class, built from the keys of that kind.

    Raises
    ------
    ConfigError
        Unknown keys or bad values.
    """
    s = spec if isinstance(spec, ClusterSpec) else parse_cluster_spec(spec)
    return DEPLOYMENTS[s.kind](**kind_values(s))


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
        Unknown keys, bad values, missing memory (HPC), missing dask-jobqueue or submit command.

    Notes
    -----
    For ``local``, the process-wide dask setting ``distributed.worker.daemon`` is set to
    ``False``: nannies read it each time they (re)start a worker, and engines such as SGLang
    need non-daemonic workers to start their own subprocesses.
    """
    s = parse_cluster_spec(spec)
    cluster, info = deployment(s).start()
    return cluster, dataclasses.replace(info, notes=info.notes + ignored_notes(s))


def jobqueue_kwargs(spec: Mapping[str, Any] | ClusterSpec) -> dict[str, Any]:
    """Keyword arguments for ``SLURMCluster``/``PBSCluster`` (and their Job classes) of a SLURM/PBS section.

    Raises
    ------
    ConfigError
        For a local spec, a missing memory size or an inconsistent layout.
    """
    return _batch(spec, "jobqueue_kwargs()").jobqueue_kwargs()


def render_job_script(spec: Mapping[str, Any] | ClusterSpec, scheduler_address: str, security: Any = None) -> str:
    """The batch script of one worker job, for a scheduler you started yourself.

    Submit it with ``sbatch``/``qsub`` as many times as you want nodes.  Workers are named
    ``daskgen-$SLURM_JOB_ID-<i>`` (``$PBS_JOBID`` on PBS) so that several jobs never clash.
    No scheduler is started.  For a ``tls://`` scheduler the workers get ``--protocol tls://``
    and ``--tls-ca-file``/``--tls-cert``/``--tls-key``: the files of ``security`` (a
    :class:`distributed.security.Security` naming files), by default those of Dask's
    ``distributed.comm.tls.ca-file`` and ``distributed.comm.tls.worker.*`` configuration.

    Raises
    ------
    ConfigError
        A bad spec, or a ``tls://`` scheduler without worker certificate files.
    """
    return _batch(spec, "render_job_script()").job_script(scheduler_address, security)


def _batch(spec: Mapping[str, Any] | ClusterSpec, what: str) -> BatchDeployment:
    s = spec if isinstance(spec, ClusterSpec) else parse_cluster_spec(spec)
    if s.kind == "local":
        raise ConfigError(f"{what} is for kind slurm or pbs, not local")
    return deployment(s)
