"""The ``vllm`` engine's arguments: ``vllm.AsyncEngineArgs`` fields, daskgen's CPU defaults and environment.

:func:`check_engine_args` refuses names ``AsyncEngineArgs`` does not know (with close matches);
:func:`launch_kwargs` adds the model and, without CUDA, :data:`CPU_DEFAULTS`;
:func:`vllm_thread_environment` keeps the worker's thread counts from vLLM's processes on a CPU and
gives each worker's engine its own cores (:func:`omp_threads_bind`); :func:`shared_caches` names the
machine's caches vLLM's processes keep using from their own temporary folder.
Importing this module does not import vllm.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from daskgen.engines.args import check_known_args
from daskgen.engines.cpus import node_position, one_cpu_per_core

logger = logging.getLogger(__name__)

__all__ = [
    "BIND_VARIABLE",
    "CPU_DEFAULTS",
    "MAX_LOGPROBS_DEFAULT",
    "THREAD_VARIABLES",
    "check_engine_args",
    "engine_arg_names",
    "launch_kwargs",
    "max_logprobs",
    "omp_threads_bind",
    "shared_caches",
    "vllm_thread_environment",
]

#: Defaults on machines without CUDA (any of them can be overridden in ``engine_args``): eager
#: mode (no torch.compile of the model at start; vLLM runs its CPU worker in a process of its own),
#: and no chunked prefill: with it, vllm 0.32.0 on CPU rewinds the generator of a seeded request
#: whose sampled token it discards (a partly prefilled prompt) with ``Generator.set_offset``, which
#: CPU generators refuse ("RuntimeError: CPU Generator does not use offset"), and its EngineCore dies.
CPU_DEFAULTS: dict[str, Any] = {"enforce_eager": True, "enable_chunked_prefill": False}
#: vLLM's ``max_logprobs`` when the engine args do not set it (``ModelConfig.max_logprobs``; -1 there: no cap).
MAX_LOGPROBS_DEFAULT = 20


def max_logprobs(engine_args: Mapping[str, Any]) -> int | None:
    """The most logprobs vLLM gives per token with these engine args: its ``max_logprobs`` (``None``: no cap; a
    value that is not an integer is vLLM's to refuse at start)."""
    value = engine_args.get("max_logprobs", MAX_LOGPROBS_DEFAULT)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


#: Thread counts a Dask worker's environment carries (the nanny sets 1; daskgen's local cluster sets
#: CPUs / workers) that vLLM's processes must not inherit on a CPU (:func:`vllm_thread_environment`).
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: The cores vLLM's CPU build binds its model worker's OpenMP threads to: ``auto`` (its default), ``nobind``
#: or a core list such as ``0-3`` (:func:`omp_threads_bind`).
BIND_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"


def engine_arg_names() -> list[str]:
    """Names of the engine arguments vLLM takes (its ``AsyncEngineArgs`` fields but ``model``, which daskgen sets).

    Imports vllm.
    """
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    return [f.name for f in dataclasses.fields(AsyncEngineArgs) if f.name != "model"]


def check_engine_args(args: Mapping[str, Any], valid: list[str] | None = None) -> None:
    """Raise :class:`ConfigError` for keys of ``args`` not in ``valid`` (with close matches); ``valid`` defaults to
    :func:`engine_arg_names` (which imports vllm)."""
    check_known_args("vllm", args, engine_arg_names() if valid is None else valid, "vllm.AsyncEngineArgs fields")


#: The LoRA ranks vLLM's ``max_lora_rank`` accepts (vllm.config.lora.MaxLoRARanks).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def launch_kwargs(
    model: str, engine_args: Mapping[str, Any], cuda_available: bool, adapters: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``AsyncEngineArgs`` keyword arguments: ``model``, CPU defaults without CUDA, LoRA settings for the
    ``adapters`` (:func:`lora_kwargs`), then ``engine_args``."""
    defaults = {} if cuda_available else CPU_DEFAULTS
    return {"model": model, **defaults, **lora_kwargs(adapters or {}, cuda_available), **engine_args}


def lora_kwargs(adapters: Mapping[str, str], cuda_available: bool) -> dict[str, Any]:
    """``enable_lora``, ``max_loras`` and ``max_lora_rank`` (the smallest rank vLLM accepts that holds the largest
    adapter) for ``adapters``; nothing without adapters.

    ``max_loras`` is the number of adapters (all in one batch), plus one slot on a CPU: vllm 0.32.0's CPU LoRA ops
    pick each token's weights with ``weights[lora_index]``, and a token without an adapter has index -1, which
    Python indexing reads as the last slot; that slot, never loaded, holds zeros (measured: with exactly one slot
    per adapter, requests without an adapter in a batch with adapter requests got the adapter's output).
    """
    if not adapters:
        return {}
    from daskgen.input.adapters import max_rank

    rank = max_rank(adapters)
    return {
        "enable_lora": True,
        "max_loras": len(adapters) + (0 if cuda_available else 1),
        "max_lora_rank": next((r for r in LORA_RANKS if r >= rank), rank),
    }


def omp_threads_bind(rank: int | None, workers: int | None, cpus: list[int], user: str | None) -> str | None:
    """The :data:`BIND_VARIABLE` value for the engine of worker ``rank`` of a node's ``workers``; ``None``: vLLM's own.

    vLLM's ``auto`` binds an engine's model worker to the cores of the first NUMA node in the process's CPU
    affinity, less one core it leaves to the engine's scheduler (``EngineCore``) process: on one node, every
    engine of the node binds to the same cores (on 2 cores, all of them to core 0).  So each worker's engine
    gets its own share instead: the ``cpus`` (the worker process's affinity) split into ``workers`` equal runs,
    run ``rank`` for this worker, less its last core when the run has more than one (left to the
    ``EngineCore``, as ``auto`` does).

    Parameters
    ----------
    rank
        The worker's index among its node's workers (``None``: unknown).
    workers
        Dask workers on the node (``None``: unknown, e.g. the engine runs outside a worker daskgen started).
    cpus
        The cores the worker may use, one per physical core.
    user
        The user's own :data:`BIND_VARIABLE`, if set.

    Returns
    -------
    str or None
        ``user`` when set; ``None`` (vLLM's ``auto``) for the only worker of its node or when ``workers`` is
        unknown; ``"nobind"`` (placement left to the operating system) when the rank is unknown or out of range
        or there are fewer cores than workers; else this worker's cores, e.g. ``"2,3,4"``.
    """
    if user is not None:
        return user
    if workers is None or workers <= 1:
        return None
    if rank is None or not 0 <= rank < workers or len(cpus) < workers:
        return "nobind"
    size = len(cpus) // workers
    share = sorted(cpus)[rank * size : (rank + 1) * size]
    bound = share[:-1] if size > 1 else share
    return ",".join(str(cpu) for cpu in bound)


def worker_omp_threads_bind() -> str | None:
    """:func:`omp_threads_bind` for this process: its node position, CPU affinity (every CPU where the system
    has none) and environment."""
    rank, workers = node_position()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cpus = one_cpu_per_core(sorted(affinity))
    return omp_threads_bind(rank, workers, cpus, os.environ.get(BIND_VARIABLE))


@contextlib.contextmanager
def vllm_thread_environment(cuda: bool) -> Iterator[None]:
    """While vLLM starts its processes on a CPU, the environment without :data:`THREAD_VARIABLES`, and with
    this worker's cores in :data:`BIND_VARIABLE` (:func:`omp_threads_bind`) unless the user set it.

    vLLM's CPU build sizes its threads itself: its model worker binds to cores
    (``VLLM_CPU_OMP_THREADS_BIND``, default ``auto``) with one thread per bound core, and its
    ``EngineCore`` process keeps one torch thread, because idle OpenMP threads spin-wait and take the
    CPU from the step's serial work -- unless ``OMP_NUM_THREADS`` is set, which vLLM respects.  A Dask
    worker always has it set, so vLLM inherited e.g. 2 threads in the ``EngineCore`` on a 2-core
    machine whose other core its model worker was bound to, and generated many times slower than
    the same engine started from a shell (``benchmarks/overhead.py --part engine --engine vllm``).
    The variables are restored once the processes started; with CUDA nothing changes.
    """
    saved = {} if cuda else {name: os.environ.pop(name) for name in THREAD_VARIABLES if name in os.environ}
    bind = None if cuda or BIND_VARIABLE in os.environ else worker_omp_threads_bind()
    if bind is not None:
        logger.info("vllm engine: %s=%s (this worker's share of the node's cores)", BIND_VARIABLE, bind)
        os.environ[BIND_VARIABLE] = bind
    try:
        yield
    finally:
        if bind is not None:
            os.environ.pop(BIND_VARIABLE, None)
        os.environ.update(saved)


def shared_caches() -> tuple[Path, ...]:
    """The machine's caches vLLM's processes keep using although they start with a temporary folder of their own
    (:func:`~daskgen.engines.leftovers.temp_folder_for_children`): torch's compiler cache in the machine's
    temporary folder, where torch's C++ compiler keeps its precompiled headers (placed by the temporary folder torch
    sees at import, whatever ``TORCHINDUCTOR_CACHE_DIR`` says).  Without it every engine start on a CPU compiles
    them again before its first sampled token.  Empty when torch does not say where (another torch release)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return ()
    return (Path(default_cache_dir()),)
