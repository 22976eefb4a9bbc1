"""The size of the ``vllm`` engine's KV cache on a CPU, and what a start that ran out of memory says.

vLLM's CPU build reserves ``gpu_memory_utilization`` (0.92 by default) of the machine's memory for its model worker
and gives what the worker does not use otherwise to the KV cache, unless ``kv_cache_memory_bytes`` (engine arg) or
``VLLM_CPU_KVCACHE_SPACE`` (GiB, environment; it wins over the engine arg) sets the size: on a machine of 24 GiB
about 21 GiB, which the model worker fills at start and the kernel kills it for (exit -9) where anything else
needs memory, or where several workers share the node.  So when none of these is set, daskgen sets
``kv_cache_memory_bytes`` itself (:func:`cpu_kv_cache`): the ``daskgen.vllm.cpu-kv-cache-share`` of the memory
this engine may use -- the memory available at start over the node's workers (``DASKGEN_WORKERS_PER_NODE``), at most
the Dask worker's memory limit (``DASKGEN_WORKER_MEMORY_LIMIT``, set by the engine plugin) -- less the model's
weights, and at least :data:`MIN_KV_CACHE_BYTES` (:func:`kv_cache_bytes`).  A start that fails anyway names the
size and the settings (:func:`start_hint`).  Importing this module does not import vllm.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from daskgen import tunables
from daskgen.engines.cpus import node_position, worker_memory_limit

__all__ = ["KV_ARG", "KV_ENV", "MIN_KV_CACHE_BYTES", "cpu_kv_cache", "kv_cache_bytes", "start_hint"]

logger = logging.getLogger(__name__)

GIB = 1 << 30
#: vLLM's environment variable for the CPU KV cache, in GiB (read by its CPU platform; wins over the engine arg).
KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
#: The ``AsyncEngineArgs`` field that sizes the KV cache in bytes.
KV_ARG = "kv_cache_memory_bytes"
#: Engine args with which the user chose the size (daskgen then leaves it to vLLM).
USER_ARGS = (KV_ARG, "gpu_memory_utilization")
#: The smallest KV cache daskgen chooses (a tiny model's needs are far below; a large one's are the user's call).
MIN_KV_CACHE_BYTES = GIB // 4
#: Files of a model folder that hold its weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def kv_cache_bytes(available: int, workers: int | None, memory_limit: int | None, weights: int, share: float) -> int:
    """The KV cache daskgen chooses: ``share`` of ``available`` memory over the node's ``workers`` (at most the
    worker's ``memory_limit``), less the model's ``weights``, and at least :data:`MIN_KV_CACHE_BYTES`."""
    budget = available // max(1, workers or 1)
    if memory_limit:
        budget = min(budget, memory_limit)
    return max(MIN_KV_CACHE_BYTES, int(share * budget) - weights)


def weight_bytes(model: str) -> int:
    """Bytes of the weight files in the model folder (0 when ``model`` is not a folder)."""
    folder = Path(model)
    if not folder.is_dir():
        return 0
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES))


def cpu_kv_cache(model: str, kwargs: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``{kv_cache_memory_bytes: size}`` chosen by :func:`kv_cache_bytes` for a CPU engine, or nothing when the
    user set the size (:data:`USER_ARGS` in ``kwargs``, or :data:`KV_ENV`)."""
    env = os.environ if environ is None else environ
    if any(name in kwargs for name in USER_ARGS) or env.get(KV_ENV, "").strip():
        return {}
    import psutil

    available, workers = psutil.virtual_memory().available, node_position(env)[1]
    share = float(tunables.get("vllm.cpu-kv-cache-share"))
    size = kv_cache_bytes(available, workers, worker_memory_limit(env), weight_bytes(model), share)
    logger.info(
        "vllm engine: KV cache of %.2f GiB (%s of %.1f GiB available over %s workers, less the weights; set %s or "
        "the engine arg %s to choose)", size / GIB, share, available / GIB, workers or 1, KV_ENV, KV_ARG,
    )  # fmt: skip
    return {KV_ARG: size}


def start_hint(kwargs: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> str:
    """What to check when the engine failed to start on a CPU: the KV cache size it asked for and how to set it."""
    env = os.environ if environ is None else environ
    if env.get(KV_ENV, "").strip():
        size = f"{env[KV_ENV].strip()} GiB ({KV_ENV})"
    elif KV_ARG in kwargs:
        size = f"{int(kwargs[KV_ARG]) / GIB:.2f} GiB (engine arg {KV_ARG})"
    else:
        utilization = kwargs.get("gpu_memory_utilization", 0.92)
        size = f"what vLLM left of gpu_memory_utilization={utilization} of the machine's memory"
    return (
        f"On a CPU, vLLM's model worker reserves its KV cache at start: {size}. A worker process killed at start "
        f"(exit -9) most often ran out of memory: set a smaller size with the environment variable {KV_ENV} (GiB) "
        f"or --engine-arg {KV_ARG}=<bytes>, or lower daskgen.vllm.cpu-kv-cache-share."
    )
