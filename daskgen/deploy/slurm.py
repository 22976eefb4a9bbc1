"""SLURM clusters: worker jobs submitted with ``sbatch`` through dask-jobqueue's ``SLURMCluster``."""

from __future__ import annotations

import re
import sys
from typing import Any

from daskgen.deploy.batch import BatchDeployment
from daskgen.deploy.job_script import JobLayout
from daskgen.deploy.keys import same_queue

__all__ = ["SIGNAL_LEAD_S", "SLURMDeployment"]

#: SLURM signals a worker job's batch shell (the ``dask worker`` command, exec'd) this many seconds
#: before its walltime, so its workers drain (hand back in-flight work) before SLURM kills the job.
SIGNAL_LEAD_S = 120


class SLURMDeployment(BatchDeployment):
    """A SLURM cluster: one job per node, ``#SBATCH`` directives, GPUs requested with ``--gres``.

    Takes the keywords of :class:`~daskgen.deploy.batch.BatchDeployment` plus ``partition``, an alias
    of ``queue``.  ``cores`` falls back to ``jobqueue.slurm.job-cpu``, then ``jobqueue.slurm.cores``,
    and ``python`` to ``jobqueue.slurm.python``, then this interpreter.

    Parameters
    ----------
    partition
        Alias of `queue` (SLURM's word for it).
    """

    kind = "slurm"
    submit_command = "sbatch"
    job_id_variable = "SLURM_JOB_ID"
    jobqueue_cluster = "SLURMCluster"
    #: Directives (either one) by which a job already requests GPUs.
    gpu_directives = re.compile(r"^\s*(--gres|--gpus|-G\b)")

    def __init__(self, *, partition: str | None = None, **keys: Any) -> None:
        super().__init__(queue=same_queue(keys.pop("queue", None), partition), **keys)

    def directives(self, layout: JobLayout) -> list[str]:
        """The configured and given directives, the GPU request unless one is there, and the drain signal."""
        directives = super().directives(layout)
        if layout.gpus_per_node and not any(self.gpu_directives.match(d) for d in directives):
            directives.append(f"--gres=gpu:{layout.gpus_per_node}")
        if not any(re.match(r"^\s*--signal", d) for d in directives):
            directives.append(f"--signal=B:TERM@{SIGNAL_LEAD_S}")
        return directives

    def system_kwargs(self, layout: JobLayout) -> dict[str, Any]:
        """CPUs per job (``job_cpu``) and the job's python prefixed with ``exec``: the batch shell becomes
        ``dask worker`` and receives the ``--signal`` itself."""
        python = self.passed_through.get("python") or sys.executable
        kwargs = {"python": python if python.lstrip().startswith("exec ") else f"exec {python}"}
        return {**kwargs, "job_cpu": layout.cpus} if layout.cpus else kwargs
