"""The refresh-under-adapters step of ``benchmarks/validate_gpu.py`` (``--lora --refresh``): an engine holding a LoRA
adapter loads new base weights in place, and the adapter then applies to them.

A rank-8 adapter is made with peft (:func:`daskgen.testing.lora.make_adapter`) and a checkpoint with perturbed
weights (:func:`refresh_check.checkpoints`).  daskgen's engine starts on the model with the adapter, answers every
prompt greedily with the adapter, loads the checkpoint in place (``Engine.update_weights``) and answers every prompt
again with and without the adapter, in one batch.  The same engine class then starts fresh on the checkpoint with
the same adapter and answers the same batch.  Reported: how many adapter answers and how many base answers after the
load equal the fresh engine's, and how many adapter answers the load changed (the new weights must change outputs).
That an adapter's answers equal the adapter merged into the weights it applies to is the LoRA step's check
(:mod:`lora_check`); with it, this step shows the adapter applies to the new weights as merged into them.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.lora_check import greedy
from benchmarks.refresh_check import checkpoints


async def refreshed(
    engine_name: str, model: str, args: dict[str, Any], prompts: list[list[int]], max_new: int, adapter: str, ckpt: str
) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Greedy answers of daskgen's engine on ``model`` holding ``adapter``: with it before loading ``ckpt`` in place,
    then with and without it after (the three lists in that order)."""
    from daskgen.engines import get_engine_class
    from daskgen.engines.base import GenerationRequest, SamplingParams

    engine = get_engine_class(engine_name)(model, adapters={"lora": adapter}, **args)

    async def batch(tag: str, names: list[str | None]) -> list[list[int]]:
        requests = [
            GenerationRequest(f"{tag}-{name}-{i}", p, SamplingParams(max_new, 0.0, adapter=name))
            for name in names
            for i, p in enumerate(prompts)
        ]
        results = await asyncio.gather(*(engine.generate(r) for r in requests))
        errors = [r.error for r in results if r.error]
        if errors:
            raise SystemExit(f"refresh-under-adapters step: {len(errors)} requests failed, e.g. {errors[0]}")
        return [r.output_ids for r in results]

    await engine.start()
    try:
        before = await batch("before", ["lora"])
        await engine.update_weights(ckpt)
        after = await batch("after", ["lora", None])
    finally:
        await engine.shutdown()
    return before, after[: len(prompts)], after[len(prompts) :]


def refresh_lora_check(
    engine_name: str, model: str, args: dict[str, Any], prompts: list[list[int]], max_new: int
) -> dict:
    """Run the comparison (see the module docstring), print it and return the counts."""
    from daskgen.testing.lora import make_adapter

    n = len(prompts)
    with tempfile.TemporaryDirectory(prefix="daskgen-refresh-lora-check-") as folder:
        adapter = make_adapter(model, Path(folder) / "adapter", seed=1, scale=0.05)
        (ckpt,) = checkpoints(model, Path(folder), 1, 0.05)
        run = refreshed(engine_name, model, args, prompts, max_new, str(adapter), str(ckpt))
        before, with_lora, without = asyncio.run(run)
        fresh = asyncio.run(greedy(engine_name, str(ckpt), args, prompts, max_new, str(adapter)))
    result = {
        "lora_equal_fresh_new": sum(a == b for a, b in zip(with_lora, fresh[:n], strict=True)),
        "base_equal_new": sum(a == b for a, b in zip(without, fresh[n:], strict=True)),
        "lora_changed_by_refresh": sum(a != b for a, b in zip(with_lora, before, strict=True)),
        "prompts": n,
    }
    say = "refresh under adapters:"
    print(f"{say} adapter answers equal to a fresh engine's on the new weights: {result['lora_equal_fresh_new']}/{n}")
    print(f"{say} base answers (same batch) equal to the fresh engine's: {result['base_equal_new']}/{n}")
    print(f"{say} adapter answers the load changed: {result['lora_changed_by_refresh']}/{n}")
    return result
