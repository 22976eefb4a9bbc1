"""sglang's weight updates: from host memory (staged tensors), and when requests still ran.

The in-process engine reads a policy version's tensors into host memory while it generates (:func:`read_tensors`)
and, in the pause, hands them to sglang's ``update_weights_from_tensor`` (:func:`load_tensors`), so the pause reads
no file; where that load fails it loads the folder with ``update_weights_from_disk``, which keeps the old weights
when it fails.

sglang (0.5.23) answers ``update_weights_from_disk`` with ``success: false`` and a message saying the cache was
not flushed when requests were running or queued; the new weights are in place.  The in-process engine
(:mod:`daskgen.engines.sglang.engine`) and the managed HTTP server (:mod:`daskgen.engines.openai.server`) both
count that as loaded and drop the cache once the requests have finished (:func:`flush_when_idle`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daskgen.errors import RefreshError

__all__ = [
    "FLUSH_CALL_S",
    "FLUSH_WAIT_S",
    "StagedTensors",
    "flush_when_idle",
    "load_tensors",
    "loaded_but_not_flushed",
    "read_tensors",
]

#: The part of sglang's answer that says the weights loaded but the cache stayed.
_NOT_FLUSHED = "cache was not flushed"
#: How long one flush call lets sglang wait for running requests, and how long the flush waits in all.
FLUSH_CALL_S = 5
FLUSH_WAIT_S = 120


def loaded_but_not_flushed(message: str) -> bool:
    """Whether sglang's refusal ``message`` means the weights loaded and only the cache flush was refused."""
    return _NOT_FLUSHED in message


async def flush_when_idle(flush: Callable[[float], Awaitable[bool]], path: str, server: str) -> None:
    """Call ``flush(timeout_s)`` (sglang's ``flush_cache``, true once it flushed) until it flushes, for up to
    :data:`FLUSH_WAIT_S`; else :class:`~daskgen.errors.RefreshError` naming ``server`` and the checkpoint ``path``."""
    for _ in range(FLUSH_WAIT_S // FLUSH_CALL_S):
        if await flush(FLUSH_CALL_S):
            return
    raise RefreshError(
        f"{server} loaded {path!r} but kept serving requests for {FLUSH_WAIT_S} s, so its prefix cache of the old "
        "weights could not be dropped"
    )


@dataclass(frozen=True)
class StagedTensors:
    """A checkpoint folder's tensors read into host memory while the engine generates (``stage_weights``): one
    flat byte tensor in shared memory and where each named tensor lies in it (sglang's flattened bucket)."""

    path: str
    flat: Any
    metadata: list[Any]


def read_tensors(path: str) -> StagedTensors | None:
    """Every tensor of the safetensors files in the folder ``path``, packed into one tensor in shared memory, so
    that handing them to sglang's scheduler process passes one handle (blocking); ``None`` when ``path`` holds no
    safetensors file (no folder, or weights in another format: sglang loads those from disk in the pause)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    tensors = []
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            tensors += [(name, handle.get_tensor(name)) for name in handle.keys()]  # noqa: SIM118
    bucket = FlattenedTensorBucket(named_tensors=tensors)
    return StagedTensors(path, bucket.get_flattened_tensor().share_memory_(), bucket.get_metadata())


async def load_tensors(manager: Any, staged: StagedTensors, tp_size: int) -> tuple[bool, str]:
    """Load ``staged`` into the running model with sglang's ``update_weights_from_tensor`` (one payload per
    tensor-parallel rank, each a handle to the shared tensor), inside the weight-update session sglang asks for;
    ``(success, message)``.  ``manager``: the engine's ``tokenizer_manager``."""
    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput,
        UpdateWeightsFromTensorReqInput,
    )
    from sglang.srt.utils.common import MultiprocessingSerializer

    began, message = await manager.begin_weight_update(BeginWeightUpdateReqInput(), None)
    if not began:
        return False, message
    try:
        bucket = {"flattened_tensor": staged.flat, "metadata": staged.metadata}
        payload = [MultiprocessingSerializer.serialize(bucket) for _ in range(tp_size)]
        request = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payload, load_format="flattened_bucket", flush_cache=True
        )
        loaded, message = await manager.update_weights_from_tensor(request, None)
    finally:
        ended, end_message = await manager.end_weight_update(EndWeightUpdateReqInput(), None)
    return bool(loaded and ended), str(message if not loaded else end_message if not ended else message)
