"""One batch of requests through a daskgen engine, as the GPU validation steps run them, and the raw engine
beneath it.

The engine is started, every request submitted at once (as a worker submits a partition's), and shut down; a
failed request stops the step, naming it.  A step that compares daskgen with the raw engine runs the raw side on
the engine daskgen started (the engine's ``on_engine_loop`` hands it the ``sglang.Engine`` or vLLM ``AsyncLLM`` it
holds), then drops the engine's caches (:func:`drop_caches`) so that no answer of daskgen's side can come from the
raw side's work.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any


@contextlib.asynccontextmanager
async def running(engine: Any) -> AsyncIterator[Any]:
    """``engine``, started here and shut down on leaving."""
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()


async def results_of(engine: Any, requests: Sequence[Any], step: str) -> list[Any]:
    """The results of ``requests`` on the started ``engine``, all submitted at once; ``SystemExit`` naming ``step``
    and the first error when any request failed."""
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    errors = [r.error for r in results if r.error]
    if errors:
        raise SystemExit(f"{step}: {len(errors)} requests failed, e.g. {errors[0]}")
    return list(results)


async def generate_all(engine: Any, requests: Sequence[Any], step: str) -> list[Any]:
    """:func:`results_of` on ``engine``, started here and shut down."""
    async with running(engine):
        return await results_of(engine, requests, step)


async def drop_caches(engine: Any, step: str) -> None:
    """Drop what ``engine`` (``sglang`` or ``vllm``) keeps from earlier requests: its prefix cache, and vLLM's
    processed-image and encoder caches; ``SystemExit`` naming ``step`` when sglang would not."""

    async def drop(native: Any) -> bool:
        await native.reset_mm_cache()
        await native.reset_encoder_cache()
        return bool(await native.reset_prefix_cache())

    dropped = await (engine.flush_cache(120.0) if engine.name == "sglang" else engine.on_engine_loop(drop))
    if not dropped:
        raise SystemExit(f"{step}: the engine did not drop its prefix cache between the two sides")


_RAW_IDS = itertools.count()


async def vllm_outputs(native: Any, prompts: Sequence[Any], params: Any) -> list[Any]:
    """The final ``RequestOutput`` of each of ``prompts`` (vLLM prompt dicts) on the vLLM ``AsyncLLM`` ``native``,
    every prompt submitted at once through its own ``generate`` (run it on the engine's loop: ``on_engine_loop``)."""

    async def one(prompt: Any) -> Any:
        outputs = [out async for out in native.generate(prompt, params, f"raw-{next(_RAW_IDS)}")]
        return outputs[-1]

    return list(await asyncio.gather(*(one(p) for p in prompts)))
