"""The node contract: the environment variables through which a deployment, the worker and an engine's processes
tell each other where a Dask worker sits on its node.

The deployments (:mod:`daskgen.deploy`) set the node's worker count and GPUs per worker, the engine plugin sets the
rank it resolved (:func:`daskgen.worker.gpu.export_local_rank`) and the pinning markers
(:func:`daskgen.worker.gpu.pin_gpu`), and an engine reads its worker's place (:mod:`daskgen.engines.cpus`).
Nothing here imports anything: every side reads the names from this one place.
"""

from __future__ import annotations

__all__ = [
    "ENV_GPUS_PER_WORKER",
    "ENV_LOCAL_RANK",
    "ENV_ORIGINAL_DEVICES",
    "ENV_PINNED_DEVICES",
    "ENV_RESOLVED_RANK",
    "ENV_WORKERS_PER_NODE",
]

#: Explicit local rank of this worker on its node (overrides the worker name).
ENV_LOCAL_RANK = "DASKGEN_LOCAL_RANK"
#: Number of Dask worker processes per node/job (set by :mod:`daskgen.deploy`).
ENV_WORKERS_PER_NODE = "DASKGEN_WORKERS_PER_NODE"
#: The local rank the engine plugin resolved for its worker, for the engine's processes; apart from
#: ``DASKGEN_LOCAL_RANK`` so that workers sharing a process do not take it as an explicit rank.
ENV_RESOLVED_RANK = "DASKGEN_RESOLVED_LOCAL_RANK"
#: GPUs each worker gets (default 1; more for tensor-parallel engines).
ENV_GPUS_PER_WORKER = "DASKGEN_GPUS_PER_WORKER"
#: ``CUDA_VISIBLE_DEVICES`` as it was before the first pinning, so re-running setup is idempotent.
ENV_ORIGINAL_DEVICES = "DASKGEN_ORIGINAL_CUDA_VISIBLE_DEVICES"
#: The value pinning set; ``ENV_ORIGINAL_DEVICES`` is trusted only while it is still in place
#: (batch systems copy the submitting shell's environment, stale markers included).
ENV_PINNED_DEVICES = "DASKGEN_PINNED_CUDA_VISIBLE_DEVICES"
