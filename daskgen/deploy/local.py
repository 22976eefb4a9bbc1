"""The local cluster: ``distributed.LocalCluster`` sized from the visible GPUs, and its workers' environment.

One worker process per GPU (or per ``gpus_per_worker`` GPUs), else a CPU-based count; workers
are non-daemonic (engines start subprocesses), get the GPU layout and thread counts in their
environment, and keep glibc's dynamic malloc threshold.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import dask

from daskgen.deploy.security import TLSFiles, cluster_tls, temporary_security
from daskgen.deploy.spec import (
    DEFAULT_THREADS_PER_WORKER,
    ClusterInfo,
    ClusterSpec,
    _dashboard,
    _declare_partition_duration,
    _ignored_notes,
    scheduler_process,
)
from daskgen.errors import ConfigError
from daskgen.worker.gpu import ENV_GPUS_PER_WORKER, ENV_LOCAL_RANK, ENV_WORKERS_PER_NODE, count_visible_gpus


def _local_workers(s: ClusterSpec, gpus: int) -> tuple[int, int]:
    """(n_workers, gpus_per_worker) for a local cluster."""
    per_worker = s.get("gpus_per_worker", 1)
    if gpus:
        slots = gpus // per_worker
        if slots == 0:
            raise ConfigError(f"cluster.gpus_per_worker={per_worker} but only {gpus} GPU(s) are visible")
        n = s.get("n_workers", slots)
        if n > slots:
            raise ConfigError(f"cluster.n_workers={n} needs {n * per_worker} GPUs, only {gpus} are visible")
        return n, per_worker
    cpus = os.cpu_count() or 1
    return s.get("n_workers", max(1, min(4, cpus // 4))), 0


def _keep_glibc_malloc_defaults() -> None:
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


def _make_local_cluster(s: ClusterSpec) -> tuple[Any, ClusterInfo]:
    from distributed import LocalCluster

    from daskgen.deploy import scheduler_process as own

    gpus = count_visible_gpus()
    n, per_worker = _local_workers(s, gpus)
    elastic = s.get("min_workers") is not None or s.get("max_workers") is not None
    if gpus and elastic:
        raise ConfigError("min_workers/max_workers (adaptive scaling) are not supported on a local GPU machine")
    threads = s.get("threads_per_worker", DEFAULT_THREADS_PER_WORKER if gpus else 2)
    # Read by each Nanny whenever it (re)starts a worker process, so it must stay set globally.
    dask.config.set({"distributed.worker.daemon": False})
    _keep_glibc_malloc_defaults()
    intra_op = str(max(1, (os.cpu_count() or 1) // n))  # undo the nanny's OMP_NUM_THREADS=1 for CPU engines
    kwargs: dict[str, Any] = {
        "n_workers": n,
        "threads_per_worker": threads,
        "processes": True,
        "dashboard_address": s.get("dashboard_address", ":0"),
        "env": {
            "OMP_NUM_THREADS": intra_op,
            "MKL_NUM_THREADS": intra_op,
            ENV_WORKERS_PER_NODE: str(n),
            ENV_LOCAL_RANK: "",  # workers are named 0..n-1: the name is the rank
        },
    }
    if per_worker:
        kwargs["resources"] = {"GPU": per_worker}
        kwargs["env"][ENV_GPUS_PER_WORKER] = str(per_worker)
    for key in ("memory_limit", "local_directory"):
        if s.get(key) is not None:
            kwargs[key] = s.get(key)
    lo, hi = n, n
    if elastic:  # checked and declared before the cluster starts (a scheduler process takes the config it starts with)
        lo, hi = s.get("min_workers", 0), s.get("max_workers", max(n, s.get("min_workers", 0)))
        if hi < max(lo, 1):
            raise ConfigError(f"cluster.max_workers={hi} must be >= 1 and >= min_workers={lo}")
        _declare_partition_duration()
    tls = cluster_tls("local", s.get("tls"))
    own_scheduler = scheduler_process(s)
    files = None
    if tls and own_scheduler:  # the scheduler process reads its certificate from files
        files = TLSFiles(temporary_security(), Path(tempfile.gettempdir()) / "daskgen-tls")
        kwargs["security"] = files.security
    elif tls:
        kwargs["security"] = temporary_security()  # in memory: the nannies pass it to their workers
    cluster = (own.LocalClusterOwnScheduler if own_scheduler else LocalCluster)(**kwargs)
    cluster.tls_files = files
    if elastic:
        cluster.adapt(minimum=lo, maximum=hi)
    notes = (("TLS with a per-run certificate",) if tls else ()) + own.notes(cluster) + _ignored_notes(s)
    info = ClusterInfo("local", n, threads, per_worker, lo, hi, elastic, None, notes, _dashboard(cluster))
    return cluster, info
