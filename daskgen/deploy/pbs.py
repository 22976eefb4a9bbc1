"""PBS clusters: worker jobs submitted with ``qsub`` through dask-jobqueue's ``PBSCluster``."""

from __future__ import annotations

from typing import Annotated, Any

from dask.utils import parse_bytes

from daskgen.deploy.batch import BatchDeployment
from daskgen.deploy.job_script import JobLayout
from daskgen.deploy.keys import Jobqueue

__all__ = ["PBSDeployment"]


class PBSDeployment(BatchDeployment):
    """A PBS cluster: one job per node, ``#PBS`` directives, GPUs requested in the ``-l select=`` line.

    Takes the keywords of :class:`~daskgen.deploy.batch.BatchDeployment` plus ``resource_spec`` (the whole
    ``-l`` line), which falls back to ``jobqueue.pbs.resource-spec``, else is generated with ``ngpus``.

    Parameters
    ----------
    resource_spec
        The whole `-l select=...` resource line (replaces the generated one).
    """

    kind = "pbs"
    submit_command = "qsub"
    job_id_variable = "PBS_JOBID"
    jobqueue_cluster = "PBSCluster"

    def __init__(self, *, resource_spec: Annotated[str | None, Jobqueue("resource-spec")] = None, **keys: Any) -> None:
        super().__init__(**keys)
        self.resource_spec = self.setting("resource_spec", resource_spec)

    def system_kwargs(self, layout: JobLayout) -> dict[str, Any]:
        """The ``-l`` resource line: the given or configured one, else ``select=1:ncpus=..:ngpus=..:mem=..``."""
        if self.resource_spec:
            return {"resource_spec": str(self.resource_spec)}
        from dask_jobqueue.pbs import pbs_format_bytes_ceil

        cpus = layout.cpus or layout.workers_per_node * layout.threads_per_worker
        spec = f"select=1:ncpus={cpus}" + (f":ngpus={layout.gpus_per_node}" if layout.gpus_per_node else "")
        return {"resource_spec": spec + f":mem={pbs_format_bytes_ceil(parse_bytes(self.memory))}"}
