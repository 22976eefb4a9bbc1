"""The ``vllm`` engine's arguments: ``vllm.AsyncEngineArgs`` fields, daskgen's CPU defaults and environment.

:func:`check_engine_args` refuses names ``AsyncEngineArgs`` does not know (with close matches);
:func:`launch_kwargs` adds the model and, without CUDA, :data:`CPU_DEFAULTS`;
:func:`vllm_thread_environment` keeps the worker's thread counts from vLLM's processes on a CPU.
Importing this module does not import vllm.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

from daskgen.engines.args import check_known_args

__all__ = [
    "CPU_DEFAULTS",
    "MAX_LOGPROBS_DEFAULT",
    "THREAD_VARIABLES",
    "check_engine_args",
    "launch_kwargs",
    "max_logprobs",
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


def check_engine_args(args: Mapping[str, Any], valid: list[str]) -> None:
    """Raise :class:`ConfigError` for keys of ``args`` not in ``valid`` (with close matches)."""
    check_known_args("vllm", args, valid, "vllm.AsyncEngineArgs fields")


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


@contextlib.contextmanager
def vllm_thread_environment(cuda: bool) -> Iterator[None]:
    """While vLLM starts its processes on a CPU, the environment without :data:`THREAD_VARIABLES`.

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
    try:
        yield
    finally:
        os.environ.update(saved)
