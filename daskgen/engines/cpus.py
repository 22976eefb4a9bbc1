"""Which cores a worker's engine may bind its CPU threads to: the worker's place on its node, one CPU per core.

Engines that bind their threads to cores on a CPU (vLLM's CPU build, ``VLLM_CPU_OMP_THREADS_BIND``) choose
the same cores in every process of a node unless told otherwise; these facts let an engine take its worker's
share instead (:func:`daskgen.engines.vllm.args.omp_threads_bind`).  Nothing here imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from daskgen.node import ENV_RESOLVED_RANK, ENV_WORKERS_PER_NODE

__all__ = ["ENV_MEMORY_LIMIT", "export_memory_limit", "node_position", "one_cpu_per_core", "worker_memory_limit"]

#: The memory limit of the Dask worker an engine runs in (bytes), set by the engine plugin for engines that size
#: their caches from it (:func:`daskgen.engines.vllm.memory.cpu_kv_cache`).
ENV_MEMORY_LIMIT = "DASKGEN_WORKER_MEMORY_LIMIT"

#: Linux's CPU topology folder (``cpuN/topology/thread_siblings_list``).
CPU_TOPOLOGY = Path("/sys/devices/system/cpu")


def node_position(environ: Mapping[str, str] | None = None) -> tuple[int | None, int | None]:
    """(this worker's local rank, Dask workers on its node) from ``DASKGEN_RESOLVED_LOCAL_RANK`` and
    ``DASKGEN_WORKERS_PER_NODE``; ``None`` for either when unset or not an integer.

    daskgen's deployments set the node's worker count, and the engine plugin sets the rank it resolved
    (``DASKGEN_LOCAL_RANK``, else the worker name's number: :func:`daskgen.worker.gpu.export_local_rank`);
    an engine outside a Dask worker sees neither.
    """
    env = os.environ if environ is None else environ

    def integer(name: str) -> int | None:
        value = env.get(name, "").strip()
        return int(value) if value.isdigit() else None

    return integer(ENV_RESOLVED_RANK), integer(ENV_WORKERS_PER_NODE)


def export_memory_limit(limit: float | None, environ: MutableMapping[str, str] | None = None) -> None:
    """Set :data:`ENV_MEMORY_LIMIT` to the worker's memory limit (Dask's ``memory_limit``; removed without one)."""
    env = os.environ if environ is None else environ
    if limit:
        env[ENV_MEMORY_LIMIT] = str(int(limit))
    else:
        env.pop(ENV_MEMORY_LIMIT, None)


def worker_memory_limit(environ: Mapping[str, str] | None = None) -> int | None:
    """The memory limit of the Dask worker this engine runs in (:data:`ENV_MEMORY_LIMIT`), ``None`` when unknown."""
    value = (os.environ if environ is None else environ).get(ENV_MEMORY_LIMIT, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def one_cpu_per_core(cpus: list[int], topology: Path = CPU_TOPOLOGY) -> list[int]:
    """The ``cpus`` less hardware-thread siblings: the first listed CPU of each physical core.

    A CPU whose siblings cannot be read (no such folder, another system) is kept.
    """
    allowed, kept, seen = set(cpus), [], set[int]()
    for cpu in sorted(allowed):
        siblings = _siblings(topology / f"cpu{cpu}" / "topology" / "thread_siblings_list") & allowed or {cpu}
        if not siblings & seen:
            kept.append(cpu)
        seen |= siblings
    return kept


def _siblings(path: Path) -> set[int]:
    """The CPUs of a ``thread_siblings_list`` file (e.g. ``0,64`` or ``0-1``); empty when unreadable."""
    try:
        text = path.read_text().strip()
    except OSError:
        return set()
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus
