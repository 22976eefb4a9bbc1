"""The local cluster: ``distributed.LocalCluster`` sized from the visible GPUs, and its workers' environment.

One worker process per GPU (or per ``gpus_per_worker`` GPUs), else a CPU-based count; workers
are non-daemonic (engines start subprocesses), get the GPU layout and thread counts in their
environment, and keep glibc's dynamic malloc threshold.
"""

from __future__ import annotations

import copy
import os
import re
import tempfile
from pathlib import Path
from typing import Annotated, Any

import dask

from daskgen import tunables
from daskgen.deploy.assembly import adaptive_bounds, dashboard_link, declare_partition_duration
from daskgen.deploy.deployment import DEFAULT_THREADS_PER_WORKER, ClusterInfo, Deployment
from daskgen.deploy.keys import AtLeast
from daskgen.deploy.security import TLSFiles, temporary_security
from daskgen.errors import ConfigError
from daskgen.node import ENV_GPUS_PER_WORKER, ENV_LOCAL_RANK, ENV_WORKERS_PER_NODE
from daskgen.worker.gpu import count_visible_gpus

__all__ = ["LocalDeployment", "cpu_threads_per_worker", "keep_glibc_malloc_defaults"]


def cpu_threads_per_worker(n_workers: int) -> int:
    """OMP/MKL threads of each of ``n_workers`` local workers (torch's CPU threads).

    The ``daskgen.local-cpu-threads`` tunable when set, else the machine's cores shared out among the workers.
    """
    return int(tunables.get("local-cpu-threads") or max(1, (os.cpu_count() or 1) // n_workers))


def keep_glibc_malloc_defaults() -> None:
    """Stop the nanny from exporting ``MALLOC_TRIM_THRESHOLD_`` to engine workers.

    Dask's default ``distributed.nanny.pre-spawn-environ`` sets ``MALLOC_TRIM_THRESHOLD_=65536``. A fixed
    threshold turns off glibc's dynamic mmap threshold, so every large tensor buffer of an inference
    step is mmap'ed and unmapped again: the ``transformers`` engine generated 1.6-1.8x fewer tokens per
    second on CPU with it (benchmarks/overhead.py, engine part).  Like the daemon setting, nannies read
    this whenever they (re)start a worker, so it is changed process-wide.
    """
    environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ", None) or {})
    if environ.pop("MALLOC_TRIM_THRESHOLD_", None) is not None:
        dask.config.set({"distributed.nanny.pre-spawn-environ": environ})


def add_preprocess_workers(cluster: Any, n: int) -> None:
    """Start ``n`` workers named ``preprocess-<i>`` beside ``cluster``'s, with the preprocessing resource (they run
    no engine: :data:`~daskgen.worker.images.PREPROCESS_RESOURCE`)."""
    from daskgen.worker.images import PREPROCESS_RESOURCE

    for i in range(n):
        spec = copy.deepcopy(cluster.new_spec)
        spec["options"] = {**spec.get("options", {}), "resources": {PREPROCESS_RESOURCE: 1}}
        cluster.worker_spec[f"preprocess-{i}"] = spec
    if n:
        cluster.sync(cluster._correct_state)


def expanded_folder(path: str | None) -> str | None:
    """``path`` with ``~`` and environment variables expanded here, as a batch job's shell expands them in its
    script: ``local_directory: $TMPDIR`` means the same folder in a local run as in a job.  A variable that is not
    set is a :class:`ConfigError`, never a folder named after it."""
    if path is None:
        return None
    expanded = os.path.expandvars(os.path.expanduser(path))
    unset = re.findall(r"\$\{?(\w+)", expanded)
    if unset:
        raise ConfigError(
            f"cluster.local_directory {path!r}: the environment variable {', '.join(unset)} is not set here "
            "(daskgen expands a local cluster's folder as a batch job's shell does); set it, or give the folder"
        )
    return expanded


class LocalDeployment(Deployment):
    """A ``distributed.LocalCluster`` on this machine: one worker process per ``gpus_per_worker`` visible GPUs.

    Parameters are the ``cluster:`` keys of kind ``local`` (``docs/hpc.md``): these and, through
    ``**keys``, those of :class:`~daskgen.deploy.deployment.Deployment`; ``None`` means "not given".
    Without GPUs, ``n_workers`` defaults to a quarter of the CPUs (1 to 4) with 2 task slots each.

    Parameters
    ----------
    n_workers
        Worker processes (default: one per visible GPU, else a CPU-based count).
    memory_limit
        Memory limit per worker (default: machine memory / workers).
    preprocess_workers
        Worker processes beside them that run no engine and preprocess the images of prompts
        (``daskgen-preprocess`` resource, :mod:`daskgen.client.preprocess`; default 0: each engine worker does).

    Raises
    ------
    ConfigError
        When the GPUs cannot hold the requested workers, or for adaptive bounds on a GPU machine.
    """

    kind = "local"

    def __init__(
        self,
        *,
        n_workers: Annotated[int | None, AtLeast(1)] = None,
        memory_limit: str | None = None,
        preprocess_workers: Annotated[int, AtLeast(0)] = 0,
        **keys: Any,
    ) -> None:
        self.gpus = count_visible_gpus()
        super().__init__(**keys)
        self.n_workers, self.gpus_per_worker = self._workers(self.gpus, n_workers, self.gpus_per_worker)
        self.elastic = self.min_workers is not None or self.max_workers is not None
        if self.gpus and self.elastic:
            raise ConfigError("min_workers/max_workers (adaptive scaling) are not supported on a local GPU machine")
        self.bounds = adaptive_bounds(self.min_workers, self.max_workers, self.n_workers)[:2]
        self.options = {"memory_limit": memory_limit, "local_directory": expanded_folder(self.local_directory)}
        self.preprocess_workers = preprocess_workers
        if preprocess_workers and self.elastic:
            raise ConfigError("cluster.preprocess_workers cannot be combined with min_workers/max_workers")
        self.dashboard_address = self.dashboard_address or ":0"

    def default_threads_per_worker(self) -> int:
        """4 task slots per GPU worker, 2 per CPU worker."""
        return DEFAULT_THREADS_PER_WORKER if self.gpus else 2

    @staticmethod
    def _workers(gpus: int, n_workers: int | None, per_worker: int) -> tuple[int, int]:
        """(n_workers, gpus_per_worker) for the visible GPUs, or a CPU-based count without GPUs."""
        if not gpus:
            return n_workers or max(1, min(4, (os.cpu_count() or 1) // 4)), 0
        slots = gpus // per_worker
        if slots == 0:
            raise ConfigError(f"cluster.gpus_per_worker={per_worker} but only {gpus} GPU(s) are visible")
        n = n_workers or slots
        if n > slots:
            raise ConfigError(f"cluster.n_workers={n} needs {n * per_worker} GPUs, only {gpus} are visible")
        return n, per_worker

    def cluster_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``LocalCluster`` (without security)."""
        n = self.n_workers
        intra_op = str(cpu_threads_per_worker(n))  # undo the nanny's OMP_NUM_THREADS=1 for CPU engines
        env = {
            "OMP_NUM_THREADS": intra_op,
            "MKL_NUM_THREADS": intra_op,
            ENV_WORKERS_PER_NODE: str(n),
            ENV_LOCAL_RANK: "",  # workers are named 0..n-1: the name is the rank
        }
        kwargs: dict[str, Any] = {
            "n_workers": n,
            "threads_per_worker": self.threads_per_worker,
            "processes": True,
            "dashboard_address": self.dashboard_address,
            "env": env,
            **{key: value for key, value in self.options.items() if value is not None},
        }
        if self.gpus_per_worker:
            kwargs["resources"] = {"GPU": self.gpus_per_worker}
            env[ENV_GPUS_PER_WORKER] = str(self.gpus_per_worker)
        return kwargs

    def start(self) -> tuple[Any, ClusterInfo]:
        """Start the cluster (adaptive when ``min_workers``/``max_workers`` are given).

        Sets two process-wide Dask settings that nannies read whenever they (re)start a worker:
        ``distributed.worker.daemon`` is ``False`` (engines such as SGLang start subprocesses), and
        :func:`keep_glibc_malloc_defaults`.
        """
        from distributed import LocalCluster

        from daskgen.deploy import scheduler_process as own

        dask.config.set({"distributed.worker.daemon": False})
        keep_glibc_malloc_defaults()
        if self.elastic:  # declared before the cluster starts (a scheduler process takes the config it starts with)
            declare_partition_duration()
        kwargs, files = self.cluster_kwargs(), None
        if self.tls and self.scheduler_process:  # the scheduler process reads its certificate from files
            files = TLSFiles(temporary_security(), Path(tempfile.gettempdir()) / "daskgen-tls")
            kwargs["security"] = files.security
        elif self.tls:
            kwargs["security"] = temporary_security()  # in memory: the nannies pass it to their workers
        cluster: LocalCluster
        if self.scheduler_process:
            cluster = own.LocalClusterOwnScheduler(**kwargs)
            cluster.tls_files = files
        else:
            cluster = LocalCluster(**kwargs)
        if self.elastic:
            cluster.adapt(minimum=self.bounds[0], maximum=self.bounds[1])
        add_preprocess_workers(cluster, self.preprocess_workers)
        notes = (("TLS with a per-run certificate",) if self.tls else ()) + own.notes(cluster)
        sizes = (self.n_workers, self.threads_per_worker, self.gpus_per_worker, *self.bounds)
        return cluster, ClusterInfo("local", *sizes, self.elastic, None, notes, dashboard_link(cluster))
