"""The images step of ``benchmarks/validate_gpu.py``: daskgen's engine on image prompts prepared as its workers
prepare them, against the raw engine given the same images its own way.

Each prompt asks about one generated image (:func:`daskgen.testing.images.write_generated_images`, several kinds,
deterministic) through the model's chat template, which renders an image content part as one placeholder.
daskgen's side preprocesses each image with :class:`daskgen.images.processor.ImageProcessing` (the model folder's
image processor), expands its placeholder (:func:`daskgen.input.image_tokens.expand`) and sends every request to
daskgen's engine at once, as a worker does.  The raw side runs first, on the ``sglang.Engine`` or vLLM ``AsyncLLM``
daskgen's engine started, given the same images its own way: vLLM's ``AsyncLLM.generate`` (the prompt ids with one
placeholder per image and the image in ``multi_modal_data``) or sglang's ``Engine.async_generate`` (the ids with one
placeholder per image and the image file in ``image_data``); each runs the model's processor itself.  The engine's
caches (prefix, and vLLM's processed-image and encoder caches) are dropped between the sides, so no answer of
daskgen's side can come from the raw side's work.  Greedy decoding on both sides.
Reported: how many outputs agree token for token, and how many prompts the raw engine expanded to the length of
daskgen's expanded prompt (a wrong placeholder count, or another processor setting, shows there first).
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common.engine_batch import drop_caches, results_of, running, vllm_outputs


@dataclass(frozen=True)
class Case:
    """One image prompt: the image file, and the prompt ids with one placeholder for it."""

    path: Path
    ids: list[int]


def image_cases(model: str, folder: Path, n: int) -> list[Case]:
    """``n`` prompts, each about one generated image (the kinds in turn, each question its own)."""
    from transformers import AutoTokenizer

    from daskgen.testing.images import write_generated_images

    tokenizer = AutoTokenizer.from_pretrained(model)
    paths = list(write_generated_images(folder).values())
    cases = []
    for i in range(n):
        content = [{"type": "image"}, {"type": "text", "text": f"Question {i}: what is in this picture?"}]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        cases.append(Case(paths[i % len(paths)], [int(t) for t in ids]))
    return cases


def daskgen_requests(model: str, cases: list[Case], max_new: int) -> list[Any]:
    """daskgen's requests for ``cases``: each image preprocessed and its placeholder expanded, as a worker does."""
    import hashlib

    from daskgen.engines.base import GenerationRequest, SamplingParams
    from daskgen.engines.media import IMAGE, ImageInput
    from daskgen.images.processor import ImageProcessing
    from daskgen.input.image_tokens import expand

    processing = ImageProcessing(model)
    requests = []
    for i, case in enumerate(cases):
        data = case.path.read_bytes()
        processed = processing.process(data)
        ids, (span,) = expand(case.ids, processing.tokens.image, [processed.tokens])
        image = ImageInput(hashlib.sha256(data).hexdigest(), data, processed.pixel_values, processed.grid, span, IMAGE)
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0, images=(image,))
        requests.append(GenerationRequest(f"image-{i}", ids, params))
    return requests


async def raw_sglang(native: Any, cases: list[Case], max_new: int) -> tuple[list[list[int]], list[int]]:
    """sglang's ``Engine.async_generate`` with each image file in ``image_data``: outputs and expanded lengths."""
    sampling = {"max_new_tokens": max_new, "temperature": 0.0}
    outputs = await asyncio.gather(
        *(native.async_generate(input_ids=c.ids, image_data=[str(c.path)], sampling_params=sampling) for c in cases)
    )
    return [list(o["output_ids"]) for o in outputs], [int(o["meta_info"]["prompt_tokens"]) for o in outputs]


async def raw_vllm(native: Any, cases: list[Case], max_new: int) -> tuple[list[list[int]], list[int]]:
    """vLLM's ``AsyncLLM.generate`` with each image in ``multi_modal_data``: outputs and expanded prompt lengths."""
    from PIL import Image
    from vllm import SamplingParams as VLLMSamplingParams

    prompts = [
        {"prompt_token_ids": case.ids, "multi_modal_data": {"image": Image.open(case.path).convert("RGB")}}
        for case in cases
    ]
    params = VLLMSamplingParams(max_tokens=max_new, temperature=0.0, detokenize=False)
    outputs = await vllm_outputs(native, prompts, params)
    return [list(o.outputs[0].token_ids) for o in outputs], [len(o.prompt_token_ids) for o in outputs]


async def both_sides(
    engine_name: str, model: str, args: dict[str, Any], cases: list[Case], max_new: int
) -> tuple[tuple[list[list[int]], list[int]], tuple[list[list[int]], list[int]]]:
    """Both sides on one engine: the raw side on the ``sglang.Engine``/``AsyncLLM`` daskgen's engine started, then,
    with the engine's caches dropped, daskgen's requests; each side's outputs and expanded prompt lengths."""
    from daskgen.engines import get_engine_class

    raw_call = raw_sglang if engine_name == "sglang" else raw_vllm
    requests = daskgen_requests(model, cases, max_new)
    async with running(get_engine_class(engine_name)(model, **args)) as engine:
        raw = await engine.on_engine_loop(lambda native: raw_call(native, cases, max_new))
        await drop_caches(engine, "images step")
        ours = await results_of(engine, requests, "images step")
    return raw, ([r.output_ids for r in ours], [len(r.prompt_ids) for r in requests])


def images_check(engine_name: str, model: str, args: dict[str, Any], n: int, max_new: int) -> dict[str, Any]:
    """Run the comparison (see the module docstring), print it and return the counts."""
    with tempfile.TemporaryDirectory(prefix="daskgen-images-check-") as folder:
        cases = image_cases(model, Path(folder), n)
        (raw, raw_lengths), (ours, our_lengths) = asyncio.run(both_sides(engine_name, model, args, cases, max_new))
    agree = sum(a == b for a, b in zip(raw, ours, strict=True))
    same_length = sum(a == b for a, b in zip(raw_lengths, our_lengths, strict=True))
    print(f"images: greedy outputs identical on both sides: {agree}/{n}")
    print(f"images: prompts the raw engine expanded to daskgen's length: {same_length}/{n}")
    return {"prompts": n, "identical_outputs": agree, "same_prompt_length": same_length}
