"""The LoRA step of ``benchmarks/validate_gpu.py``: an engine serving a LoRA adapter against the merged model.

A rank-8 adapter for the model is made with peft (non-zero ``lora_B``, :func:`daskgen.testing.lora.make_adapter`)
and merged into a copy of the model (``merge_and_unload``).  daskgen's engine is started with the adapter and
generates greedily for every prompt twice in one batch, once with the adapter and once without; then the same
engine class runs on the merged copy and on the base model.  Reported: how many adapter outputs equal the merged
model's token for token, how many base outputs equal the base model's, and how many adapter outputs differ from
the base ones (the adapter must change outputs).  On a GPU, LoRA kernels and merged weights round differently in
bf16, so long greedy outputs may part after many tokens; the counts say how often.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common.engine_batch import generate_all


def merged_copy(model: str, adapter: Path, dest: Path) -> Path:
    """Save ``model`` with ``adapter`` merged into its weights (and the model's tokenizer) to ``dest``."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().save_pretrained(str(dest))
    AutoTokenizer.from_pretrained(model).save_pretrained(str(dest))
    return dest


async def greedy(
    engine_name: str, model: str, args: dict[str, Any], prompts: list[list[int]], max_new: int, adapter: str | None
) -> list[list[int]]:
    """Greedy outputs of daskgen's engine on ``model``: with ``adapter`` (a folder) each prompt runs with and
    without it in one batch (adapter outputs first), else once."""
    from daskgen.engines import get_engine_class
    from daskgen.engines.base import GenerationRequest, SamplingParams

    lora = {"adapters": {"lora": adapter}} if adapter else {}
    engine = get_engine_class(engine_name)(model, **args, **lora)
    names = ["lora", None] if adapter else [None]
    requests = [
        GenerationRequest(f"{name}-{i}", p, SamplingParams(max_new_tokens=max_new, temperature=0.0, adapter=name))
        for name in names
        for i, p in enumerate(prompts)
    ]
    return [r.output_ids for r in await generate_all(engine, requests, "LoRA step")]


def lora_check(engine_name: str, model: str, args: dict[str, Any], prompts: list[list[int]], max_new: int) -> dict:
    """Run the comparison (see the module docstring), print it and return the counts."""
    from daskgen.testing.lora import make_adapter

    with tempfile.TemporaryDirectory(prefix="daskgen-lora-check-") as folder:
        adapter = make_adapter(model, Path(folder) / "adapter", seed=1, scale=0.05)
        merged = merged_copy(model, adapter, Path(folder) / "merged")
        both = asyncio.run(greedy(engine_name, model, args, prompts, max_new, str(adapter)))
        with_lora, without = both[: len(prompts)], both[len(prompts) :]
        merged_out = asyncio.run(greedy(engine_name, str(merged), args, prompts, max_new, None))
        base_out = asyncio.run(greedy(engine_name, model, args, prompts, max_new, None))
    result = {
        "lora_equal_merged": sum(a == b for a, b in zip(with_lora, merged_out, strict=True)),
        "base_equal_base": sum(a == b for a, b in zip(without, base_out, strict=True)),
        "lora_changed_output": sum(a != b for a, b in zip(with_lora, base_out, strict=True)),
        "prompts": len(prompts),
    }
    n = len(prompts)
    print(f"LoRA: adapter outputs equal to the merged model's: {result['lora_equal_merged']}/{n}")
    print(f"LoRA: base outputs (same batch) equal to the base model's: {result['base_equal_base']}/{n}")
    print(f"LoRA: adapter outputs that differ from the base model's: {result['lora_changed_output']}/{n}")
    return result
