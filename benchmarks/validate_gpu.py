"""Validate an in-process engine on a GPU: the raw ``sglang.Engine``/vLLM ``AsyncLLM`` vs daskgen's engine.

Both sides get the same token-id prompts and greedy decoding; each side's generated tokens per
second (model load and a warm-up batch excluded) and their ratio are printed, plus how many
outputs agree token for token.  Both sides run on one engine: daskgen's
:class:`daskgen.engines.sglang.SGLangEngine` or :class:`daskgen.engines.vllm.VLLMEngine` is started,
and the raw side drives the ``sglang.Engine`` or ``AsyncLLM`` it holds with the engine's own API: sglang's one
batched ``async_generate`` call (its offline best case), vLLM's ``AsyncLLM.generate`` with every prompt submitted
at once.  The engine's caches are then dropped (prefix, and vLLM's processed-image and encoder caches), and
daskgen's side submits each prompt as its own request (the path a Dask worker uses), all at once.  So both sides
have exactly the same engine settings, and the sides run one after the other, never sharing the GPU.

    python benchmarks/validate_gpu.py --model /path/to/hf-model                  # sglang
    python benchmarks/validate_gpu.py --engine vllm --model /path/to/hf-model
    python benchmarks/validate_gpu.py --model M --n-prompts 512 --max-new-tokens 256 \\
        --engine-arg mem_fraction_static=0.8 --json result.json

``--lora`` adds a LoRA step (`benchmarks/lora_check.py`): daskgen's engine serving a peft adapter made for the
model, in one batch with base requests, against the same engine on the merged model (``merge_and_unload``).

``--refresh`` adds a policy refresh step (`benchmarks/refresh_check.py`): daskgen's engine loads perturbed weights
in place (timed), and its greedy answers are compared with a fresh engine started on those weights.

``--lora --refresh`` adds a step of a refresh under adapters (`benchmarks/refresh_lora_check.py`): the engine
holding an adapter loads new weights in place, and its answers with and without the adapter are compared with a
fresh engine's on those weights with the same adapter (``--lora`` checks an adapter against it merged).

``--images`` (with a vision-language model folder, e.g. Qwen2-VL's) adds an images step (`benchmarks/images_check.py`):
daskgen's engine on image prompts prepared as its workers prepare them, against the raw engine given the same
images its own way; the outputs must agree token for token and the prompts expand to the same length.
:data:`FEATURE_FLAGS` names the options that check each request feature.

``--device cpu`` runs the same comparison on a CPU (for a smoke test of the script only; the
numbers mean nothing for GPUs).  Exit code 2 when no CUDA GPU is visible and ``--device cuda``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


#: The request features (``daskgen/engines/features.py``) a GPU run checks, with the options that check each.
FEATURE_FLAGS: dict[str, tuple[str, ...]] = {
    "lora": ("--lora",),
    "refresh": ("--refresh",),
    "refresh_with_lora": ("--lora", "--refresh"),
    "images": ("--images",),
}


@dataclass
class Side:
    """Measured throughput of one side."""

    name: str
    requests: int
    output_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("nan")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face model folder")
    parser.add_argument("--engine", default="sglang", choices=["sglang", "vllm"])
    parser.add_argument("--n-prompts", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="sglang.Engine / vllm.AsyncEngineArgs option for both sides (VALUE parsed as JSON when it can be)",
    )
    parser.add_argument("--lora", action="store_true", help="also check LoRA adapters against the merged model")
    parser.add_argument("--refresh", action="store_true", help="also check loading new weights in place")
    parser.add_argument(
        "--images",
        action="store_true",
        help="also check image prompts (a vision-language model) against the raw engine",
    )
    parser.add_argument("--json", type=Path, help="also write the results to this file")
    return parser.parse_args(argv)


def engine_args(pairs: list[str], device: str | None) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as engine options (VALUE as JSON if it parses), plus the device if given."""
    out: dict[str, Any] = {} if device is None else {"device": device}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg expects KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def make_prompts(model: str, n: int, length: int) -> list[list[int]]:
    """``n`` deterministic prompts of ``length`` token ids within the model's vocabulary."""
    config = json.loads((Path(model) / "config.json").read_text())
    vocab = int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size"))
    low, span = 100, max(1, min(vocab, 32000) - 100)
    return [[low + (i * 7919 + j * 104729) % span for j in range(length)] for i in range(n)]


async def raw_sglang(native: Any, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """sglang's own offline path: one batched ``async_generate`` call on the ``sglang.Engine``."""
    params = {"max_new_tokens": max_new, "temperature": 0.0}
    outputs = await native.async_generate(input_ids=prompts, sampling_params=params)
    return [list(o["output_ids"]) for o in outputs]


async def raw_vllm(native: Any, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """vLLM's own ``AsyncLLM.generate``, every prompt submitted at once."""
    from vllm import SamplingParams as VLLMSamplingParams

    from benchmarks.common.engine_batch import vllm_outputs

    params = VLLMSamplingParams(max_tokens=max_new, temperature=0.0, detokenize=False)
    outputs = await vllm_outputs(native, [{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


RAW_SIDES = {"sglang": ("raw sglang.Engine", raw_sglang), "vllm": ("raw vllm AsyncLLM", raw_vllm)}


async def timed(batch: Awaitable[list[list[int]]]) -> tuple[list[list[int]], float]:
    """``batch``'s outputs and the seconds it took."""
    start = time.perf_counter()
    tokens = await batch
    return tokens, time.perf_counter() - start


async def run_sides(
    engine_name: str, model: str, args: dict[str, Any], prompts: list[list[int]], warmup: list[list[int]], max_new: int
) -> tuple[tuple[Side, list[list[int]]], tuple[Side, list[list[int]]]]:
    """Both sides on one engine: daskgen's (``SGLangEngine`` or ``VLLMEngine``) is started, the raw side runs on the
    ``sglang.Engine``/``AsyncLLM`` it holds, the engine's caches are dropped, then daskgen's side sends one request
    per prompt, all at once.  Each side warms up first; the model load is not timed."""
    from benchmarks.common.engine_batch import drop_caches, results_of, running
    from daskgen.engines import get_engine_class
    from daskgen.engines.base import GenerationRequest, SamplingParams

    engine = get_engine_class(engine_name)(model, **args)
    raw_name, raw_call = RAW_SIDES[engine_name]
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0)

    async def raw(batch: list[list[int]]) -> list[list[int]]:
        return await engine.on_engine_loop(lambda native: raw_call(native, batch, max_new))

    async def ours(tag: str, batch: list[list[int]]) -> list[list[int]]:
        requests = [GenerationRequest(f"{tag}-{i}", p, params) for i, p in enumerate(batch)]
        return [r.output_ids for r in await results_of(engine, requests, "daskgen side")]

    async with running(engine):
        await raw(warmup)
        raw_tokens, raw_seconds = await timed(raw(prompts))
        await drop_caches(engine, "validate_gpu")
        await ours("warmup", warmup)
        our_tokens, our_seconds = await timed(ours("p", prompts))
    raw_side = Side(raw_name, len(prompts), sum(map(len, raw_tokens)), raw_seconds)
    our_side = Side(f"daskgen {type(engine).__name__}", len(prompts), sum(map(len, our_tokens)), our_seconds)
    return (raw_side, raw_tokens), (our_side, our_tokens)


def report(raw: Side, ours: Side, agree: int, n: int) -> dict[str, Any]:
    """Print the comparison and return it as a dict."""
    ratio = ours.tokens_per_s / raw.tokens_per_s
    print(f"{'side':<24}{'requests':>10}{'out tokens':>12}{'seconds':>10}{'tok/s':>10}")
    for side in (raw, ours):
        print(
            f"{side.name:<24}{side.requests:>10}{side.output_tokens:>12}{side.seconds:>10.2f}{side.tokens_per_s:>10.1f}"
        )
    print(f"ratio daskgen/raw tok/s: {ratio:.3f}")
    print(f"greedy outputs identical on both sides: {agree}/{n}")
    return {
        "raw": {**asdict(raw), "tokens_per_s": raw.tokens_per_s},
        "daskgen": {**asdict(ours), "tokens_per_s": ours.tokens_per_s},
        "ratio": ratio,
        "identical_outputs": agree,
        "prompts": n,
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.device == "cpu":
        if a.engine == "sglang":
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    else:
        import torch

        if not torch.cuda.is_available():
            print("validate_gpu: no CUDA GPU visible (use --device cpu for a smoke test)", file=sys.stderr)
            return 2
    args = engine_args(a.engine_arg, a.device if a.engine == "sglang" else None)  # vLLM picks its device
    prompts = make_prompts(a.model, a.n_prompts, a.prompt_len)
    warmup = make_prompts(a.model, a.n_prompts + 8, a.prompt_len)[-8:]
    (raw, raw_tokens), (ours, our_tokens) = asyncio.run(
        run_sides(a.engine, a.model, args, prompts, warmup, a.max_new_tokens)
    )
    agree = sum(x == y for x, y in zip(raw_tokens, our_tokens, strict=True))
    result = report(raw, ours, agree, len(prompts))
    result.update(
        engine=a.engine, model=a.model, max_new_tokens=a.max_new_tokens, prompt_len=a.prompt_len, engine_args=args
    )
    if a.lora:
        from lora_check import lora_check

        result["lora"] = lora_check(a.engine, a.model, args, prompts[:32], min(a.max_new_tokens, 32))
    if a.refresh:
        from refresh_check import refresh_check

        result["refresh"] = refresh_check(a.engine, a.model, args, prompts[:32], min(a.max_new_tokens, 32))
    if a.lora and a.refresh:
        from refresh_lora_check import refresh_lora_check

        result["refresh_with_lora"] = refresh_lora_check(
            a.engine, a.model, args, prompts[:32], min(a.max_new_tokens, 32)
        )
    if a.images:
        from images_check import images_check

        result["images"] = images_check(a.engine, a.model, args, min(a.n_prompts, 16), min(a.max_new_tokens, 32))
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
