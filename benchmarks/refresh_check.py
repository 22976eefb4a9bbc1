"""The refresh step of ``benchmarks/validate_gpu.py``: an engine loading new weights in place, against a fresh one.

A checkpoint of the model with perturbed weights (:func:`checkpoints`, ``save_pretrained``) is made; daskgen's
engine on the model answers the prompts greedily, loads the checkpoint in place (``Engine.update_weights``, timed)
and answers them again; then the same engine class started on the checkpoint answers them.  Reported: the load's
seconds, how many answers after the load equal the fresh engine's token for token, and how many changed with the
load (the new weights must change outputs).  ``benchmarks/refresh.py`` uses :func:`checkpoints` for its runs.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any


def checkpoints(base: str, folder: Path, k: int, noise: float, share: float = 1.0) -> list[Path]:
    """``k`` checkpoints of ``base`` in ``folder/v1 ...``: each multiplies every weight of the one before (with
    ``share`` < 1, a random ``share`` of each tensor's values) by ``1 + noise × N(0, 1)`` (seeded by its version)
    and is saved with ``save_pretrained`` (with the tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(base), AutoTokenizer.from_pretrained(base)
    out = []
    for version in range(1, k + 1):
        generator = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for param in model.parameters():
                factor = 1 + noise * torch.randn(param.shape, generator=generator, dtype=param.dtype)
                if share < 1:
                    factor[torch.rand(param.shape, generator=generator) >= share] = 1
                param.mul_(factor)
        path = folder / f"v{version}"
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        out.append(path)
    return out


async def answers(
    engine_name: str, model: str, args: dict[str, Any], prompts: list[list[int]], max_new: int, load: str | None
) -> tuple[list[list[int]], list[list[int]], float]:
    """Greedy answers of daskgen's engine on ``model``; with ``load``, answers again after loading that checkpoint in
    place: (before, after, seconds of the load)."""
    from daskgen.engines import get_engine_class
    from daskgen.engines.base import GenerationRequest, SamplingParams

    engine = get_engine_class(engine_name)(model, **args)
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0)

    async def batch(tag: str) -> list[list[int]]:
        results = await asyncio.gather(
            *(engine.generate(GenerationRequest(f"{tag}-{i}", p, params)) for i, p in enumerate(prompts))
        )
        errors = [r.error for r in results if r.error]
        if errors:
            raise SystemExit(f"refresh step: {len(errors)} requests failed, e.g. {errors[0]}")
        return [r.output_ids for r in results]

    await engine.start()
    try:
        before = await batch("before")
        if load is None:
            return before, [], 0.0
        start = time.perf_counter()
        await engine.update_weights(load)
        seconds = time.perf_counter() - start
        return before, await batch("after"), seconds
    finally:
        await engine.shutdown()


def refresh_check(engine_name: str, model: str, args: dict[str, Any], prompts: list[list[int]], max_new: int) -> dict:
    """Run the comparison (see the module docstring), print it and return the counts."""
    with tempfile.TemporaryDirectory(prefix="daskgen-refresh-check-") as folder:
        (ckpt,) = checkpoints(model, Path(folder), 1, 0.05)
        before, after, seconds = asyncio.run(answers(engine_name, model, args, prompts, max_new, str(ckpt)))
        fresh, _, _ = asyncio.run(answers(engine_name, str(ckpt), args, prompts, max_new, None))
    equal = sum(a == b for a, b in zip(after, fresh, strict=True))
    changed = sum(a != b for a, b in zip(after, before, strict=True))
    print(
        f"refresh: update_weights took {seconds:.2f} s; of {len(prompts)} greedy answers after the load, {equal} equal"
    )
    print(f"refresh: a fresh engine's on the checkpoint, and {changed} differ from the answers before the load")
    return {
        "update_weights_s": seconds,
        "refreshed_equal_fresh": equal,
        "changed_by_refresh": changed,
        "prompts": len(prompts),
    }
