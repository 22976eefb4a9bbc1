"""The sglang engine: pure unit tests (every lane) and, with the real sglang, the conformance suite.

Tests that need sglang carry ``@pytest.mark.sglang`` and skip cleanly when it is not
importable; they run in the sglang CPU lane (``.ci/sglang-lane``), which installs the pinned
sglang, puts the import-only ``sgl_kernel`` shim (``tests/sglang_shim``) on ``PYTHONPATH`` and
sets ``DASKGEN_SGL_KERNEL_SHIM_LOG``.  One ``sglang.Engine`` launch costs ~20-50 s on a 2-core
CPU, so each class shares one engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from daskgen.engines import create_engine
from daskgen.engines.base import FinishReason, GenerationRequest, SamplingParams
from daskgen.engines.inprocess import DAEMON_FIX
from daskgen.engines.sglang import SGLangEngine
from daskgen.engines.sglang.args import CPU_DEFAULTS, check_engine_args, launch_kwargs
from daskgen.engines.sglang.mapping import result_from_output, sampling_params_for
from daskgen.engines.sglang.sigquit import install_sigquit_handler
from daskgen.errors import ConfigError, EngineError
from daskgen.testing.conformance import EngineConformance, EventLoopThread
from tests.conftest import run_cli, tiny_model_once, write_prompts
from tests.prefix_cache_stored import stored_cached_prompt_tokens
from tests.refresh_fingerprint import COMPARED, check_a_refresh_holds_the_published_tensors

HAVE_SGLANG = find_spec("sglang") is not None
HAVE_CUDA = HAVE_SGLANG and find_spec("torch") is not None and __import__("torch").cuda.is_available()
SHIM_LOG_ENV = "DASKGEN_SGL_KERNEL_SHIM_LOG"
PROMPT = [1, 504, 3458, 282, 4649, 314]


def tiny_model_path() -> str:
    """The project's tiny Llama (``daskgen.models.build_tiny_model``), one folder for this module."""
    return tiny_model_once("daskgen-sglang-tiny-")


def request(rid: str, prompt: list[int] | None = None, **params: Any) -> GenerationRequest:
    return GenerationRequest(rid, list(prompt or PROMPT), SamplingParams(**{"max_new_tokens": 16, **params}))


# --------------------------------------------------------------------------- pure unit tests (no sglang)


def test_registered_under_sglang() -> None:
    engine = create_engine("sglang", "/some/model", tp_size=2)
    assert isinstance(engine, SGLangEngine) and engine.name == "sglang"
    assert not engine.supports_seed and not engine.simulated
    assert SGLangEngine("/m", enable_deterministic_inference=True).supports_seed


def test_sampling_params_mapping() -> None:
    params = SamplingParams(max_new_tokens=7, temperature=0.0, top_p=0.9, top_k=0, seed=5, stop_token_ids=(9, 3, 9))
    assert sampling_params_for(params) == {
        "max_new_tokens": 7,
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": -1,
        "stop_token_ids": [3, 9],
        "sampling_seed": 5,
    }
    plain = sampling_params_for(SamplingParams(top_k=20))
    assert plain["top_k"] == 20 and "stop_token_ids" not in plain and "sampling_seed" not in plain


@pytest.mark.parametrize(
    ("kind", "finish"),
    [
        ("stop", FinishReason.STOP),
        ("length", FinishReason.LENGTH),
        ("abort", FinishReason.ABORT),
        ("weird", FinishReason.ERROR),
    ],
)
def test_result_from_output(kind: str, finish: FinishReason) -> None:
    output = {
        "output_ids": [5, 6, 2],
        "meta_info": {
            "finish_reason": {"type": kind},
            "prompt_tokens": 4,
            "cached_tokens": 1,
            "output_token_logprobs": [(-0.5, 5, None), (-1.0, 6, None), (-2.0, 2, None)],
        },
    }
    with_lp = result_from_output(request("r", logprobs=True), output)
    assert with_lp.output_ids == [5, 6, 2] and with_lp.finish_reason == finish
    assert with_lp.logprobs == [-0.5, -1.0, -2.0]
    assert with_lp.meta == {"prompt_tokens": 4, "cached_tokens": 1}
    assert (with_lp.error is None) == (finish != FinishReason.ERROR)
    assert result_from_output(request("r"), output).logprobs is None


def test_unknown_engine_args_suggest_close_matches() -> None:
    valid = ["tp_size", "mem_fraction_static", "context_length", "dtype"]
    check_engine_args({"tp_size": 2, "dtype": "bfloat16"}, valid=valid)
    with pytest.raises(ConfigError) as info:
        check_engine_args({"tp_sise": 2, "zzz": 1}, valid=valid)
    message = str(info.value)
    assert "'tp_sise' (did you mean 'tp_size'?)" in message and "'zzz'" in message
    assert "mem_fraction_static" in message  # the valid names are listed
    with pytest.raises(ConfigError, match="model_path"):
        SGLangEngine("/m", model_path="/other")


def test_launch_kwargs_cpu_defaults() -> None:
    cpu = launch_kwargs("/m", {"dtype": "bfloat16"}, cuda_available=False)
    assert cpu == {**CPU_DEFAULTS, "model_path": "/m", "device": "cpu", "dtype": "bfloat16"}
    gpu = launch_kwargs("/m", {"tp_size": 2}, cuda_available=True)
    assert gpu == {"model_path": "/m", "device": "cuda", "tp_size": 2}
    forced = launch_kwargs("/m", {"device": "cpu"}, cuda_available=True)
    assert forced["attention_backend"] == "torch_native"


def _start_in_this_process(queue: Any) -> None:
    try:
        asyncio.run(SGLangEngine("/nonexistent").start())
        queue.put("started")
    except EngineError as exc:
        queue.put(f"EngineError: {exc}")
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        queue.put(f"{type(exc).__name__}: {exc}")


def test_daemonic_process_is_refused_with_the_fix() -> None:
    """Dask workers are daemonic by default; sglang cannot start its subprocesses there."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_start_in_this_process, args=(queue,), daemon=True)
    proc.start()
    message = queue.get(timeout=120)
    proc.join(timeout=30)
    assert message.startswith("EngineError") and "daemonic" in message, message
    assert "distributed.worker.daemon" in message and DAEMON_FIX in message


def test_generate_before_start_is_an_error() -> None:
    engine = SGLangEngine("/m")
    result = asyncio.run(engine.generate(request("early")))
    assert result.finish_reason == FinishReason.ERROR and "not running" in result.error
    with pytest.raises(EngineError):
        asyncio.run(engine.health())
    asyncio.run(engine.shutdown())
    asyncio.run(engine.sleep())  # a no-op where memory release is unsupported


# --------------------------------------------------------------------------- the real sglang


def idle_cpu_seconds(processes: list[Any], seconds: float = 3.0) -> float:
    """CPU seconds ``processes`` (``psutil.Process``, with their descendants) used over ``seconds`` of idling: an
    sglang scheduler polling without pause uses about one per second."""
    import psutil

    def used() -> float:
        total = 0.0
        for proc in processes:
            for each in (proc, *proc.children(recursive=True)):
                with contextlib.suppress(psutil.NoSuchProcess):
                    times = each.cpu_times()
                    total += times.user + times.system
        return total

    before = used()
    time.sleep(seconds)
    return used() - before


def shim_events(kind: str) -> list[dict[str, Any]]:
    """Events of ``kind`` the sgl_kernel shim logged (all processes), if a log is configured."""
    path = os.environ.get(SHIM_LOG_ENV)
    if not path or not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as stream:
        events = [json.loads(line) for line in stream if line.strip()]
    return [e for e in events if e["kind"] == kind]


class _SharedSGLang:
    """Starts the engine with the SIGQUIT handler installed from the main thread first."""

    engine_class = SGLangEngine
    engine_args: dict[str, Any] = {}
    timeout_s = 300.0
    start_timeout_s = 600.0

    @classmethod
    def setup_class(cls) -> None:
        import logging

        install_sigquit_handler()  # the suite starts engines on a background thread
        cls.model = tiny_model_path()
        root = logging.getLogger()
        before = (root.level, list(root.handlers))
        super().setup_class()  # type: ignore[misc]
        cls.root_logging = (before, (root.level, list(root.handlers)))  # around the start (sglang reconfigures it)


@pytest.mark.sglang
@pytest.mark.skipif(not HAVE_SGLANG, reason="sglang is not installed (run the sglang lane: .ci/sglang-lane)")
class TestSGLangConformance(_SharedSGLang, EngineConformance):
    """The shared suite, plus sglang-specific checks on the same engine."""

    probe_max_new_tokens = 64
    long_max_new_tokens = 1500
    abort_timeout_s = 30.0
    concurrency = 24
    not_applicable = {
        "test_feature_lora": "sglang 0.5.23 cannot serve LoRA on a CPU: its LoRA layers allocate pinned host memory "
        "(sglang/srt/lora/layers.py, torch.tensor(..., pin_memory=True)), which needs CUDA, so the engine fails to "
        "start ('Found no NVIDIA driver on your system'); checked on a GPU by TestSGLangConformanceCUDA",
        "test_seeded_reproducible": "sglang honours seeds only with enable_deterministic_inference, "
        "which needs a GPU attention backend (TestSGLangConformanceCUDA)",
    }

    def test_cached_prompt_tokens_reach_the_stored_sample(self) -> None:
        """A prompt sharing 300 tokens with the one before: its stored sample says the radix cache held them."""
        first, second = stored_cached_prompt_tokens(self)
        assert 0 <= first < second and second >= 256, (first, second)

    def test_sglang_and_shim_are_real(self) -> None:
        """The lane runs the pinned sglang; sgl_kernel (on CPU) is the import-only shim."""
        import sglang

        from daskgen.engines.sglang.engine import TESTED_SGLANG_VERSION

        assert sglang.__version__ == TESTED_SGLANG_VERSION
        info = self.engine.describe()
        assert info["sglang_version"] == TESTED_SGLANG_VERSION and info["dtype"]
        # the seeded check is declared not applicable exactly when the engine says it ignores seeds
        assert self.engine.supports_seed is ("test_seeded_reproducible" not in self.not_applicable)
        if not HAVE_CUDA:
            import sgl_kernel

            assert getattr(sgl_kernel, "IS_DASKGEN_SHIM", False), sgl_kernel.__file__

    def test_an_idle_engine_leaves_the_cores_idle(self) -> None:
        """On CPU ``sleep_on_idle`` is on: sglang's processes use well under a tenth of a core while no request
        runs (without it the scheduler polls for requests and holds a whole core)."""
        self.run(self.one(request("wake", max_new_tokens=2)))
        assert idle_cpu_seconds(self.engine.backend.children) < 0.3 * 3.0

    def test_capacity_is_the_schedulers_max_running_requests(self) -> None:
        """sglang sizes max_running_requests itself; the engine reads it back for ``window: auto``."""
        capacity = self.engine.capacity
        assert isinstance(capacity, int) and capacity >= 1, capacity
        assert self.engine.describe()["max_running_requests"] == capacity

    @pytest.mark.proves("sglang", "refresh")
    def test_update_weights_loads_a_checkpoint_in_place_and_keeps_its_weights_on_a_bad_one(self, tmp_path) -> None:
        """The refresh path: other weights (seed 1) change the greedy answer, a folder without weights is refused
        (sglang keeps the loaded ones), and loading the first checkpoint again gives its answer back."""
        from daskgen.errors import RefreshError
        from daskgen.models import build_tiny_model

        assert "refresh" in SGLangEngine.features
        greedy = request("policy", max_new_tokens=12, temperature=0.0)
        before = self.run(self.one(greedy)).output_ids
        other = build_tiny_model(tmp_path / "step1", seed=1)
        self.run(self.engine.update_weights(str(other)))
        after = self.run(self.one(greedy)).output_ids
        (tmp_path / "empty").mkdir()
        with pytest.raises(RefreshError, match="keeps its weights"):
            self.run(self.engine.update_weights(str(tmp_path / "empty")))
        assert self.run(self.one(greedy)).output_ids == after != before
        self.run(self.engine.update_weights(tiny_model_path()))
        assert self.run(self.one(greedy)).output_ids == before

    def test_the_engines_start_left_the_root_logger_as_it_was(self) -> None:
        """sglang's launch reconfigures the root logger; the engine puts its level and handlers back."""
        before, after = self.root_logging
        assert after == before

    @pytest.mark.proves("sglang", "policy_fingerprint")
    def test_after_a_refresh_the_engine_holds_the_published_tensors(self, tmp_path) -> None:
        """Loaded from the staged tensors in host memory (``update_weights`` is never given a folder, and no
        fallback to the folder is logged): every tensor compared, q/k/v among them
        (``tests/refresh_fingerprint.py``)."""
        check_a_refresh_holds_the_published_tensors(
            self.run, self.engine, self.model, tmp_path, compared=COMPARED["sglang"], reloads=lambda *_: []
        )

    def test_eos_is_kept_and_reported_as_stop(self) -> None:
        results = self.run(
            self.generate_all(
                [request(f"eos-{i}", self.prompt(200 + i), max_new_tokens=32, temperature=1.0) for i in range(16)]
            )
        )
        stopped = [r for r in results if r.finish_reason == FinishReason.STOP]
        assert stopped, "no sample reached EOS (the tiny model ends about half of them)"
        for result in stopped:
            assert result.output_ids[-1] in self.engine.eos_token_ids, result

    def test_logprobs_are_untempered_model_logprobs(self) -> None:
        """Per-token logprobs equal log_softmax of the model's logits, whatever the temperature."""
        import torch
        from transformers import AutoModelForCausalLM

        sampled = self.run(self.one(request("lp-hot", max_new_tokens=12, temperature=1.7, logprobs=True)))
        model = AutoModelForCausalLM.from_pretrained(self.model, dtype=torch.float32)
        ids = torch.tensor([PROMPT + sampled.output_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(PROMPT) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(sampled.output_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(sampled.logprobs), expected, atol=2e-3), (sampled.logprobs, expected)

    def long_greedy(self, rid: str) -> GenerationRequest:
        """A greedy request that runs for 1500 tokens unless stopped."""
        prompt = self.run(self._long_candidates(1))[0][0].prompt_ids
        return request(rid, prompt, max_new_tokens=1500, temperature=0.0)

    def test_abort_right_after_submit(self) -> None:
        long_request = self.long_greedy("abort-now")

        async def submit_then_abort() -> Any:
            task = asyncio.ensure_future(self.engine.generate(long_request))
            await asyncio.sleep(0)
            await self.engine.abort("abort-now")
            return await task

        result = self.run(submit_then_abort())
        assert result.finish_reason == FinishReason.ABORT and len(result.output_ids) < 1500, result

    def test_cancelled_caller_aborts_inside_sglang(self) -> None:
        """Cancelling the awaiting task (e.g. a cancelled Dask task) also ends the request in sglang."""
        backend = self.engine.backend
        long_request = self.long_greedy("cancel-me")

        def in_sglang() -> list[str]:
            return [rid for rid in backend.engine.tokenizer_manager.rid_to_state if rid.startswith("cancel-me#")]

        async def cancel_once_running() -> None:
            task = asyncio.ensure_future(self.engine.generate(long_request))
            deadline = time.monotonic() + 30
            while not in_sglang() and not task.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.002)
            assert in_sglang(), "the request never reached sglang"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        self.run(cancel_once_running())
        deadline = time.monotonic() + 10
        while in_sglang() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not in_sglang() and "cancel-me" not in backend.rids
        assert self.run(self.one(request("after-cancel", max_new_tokens=2))).error is None

    def test_prompt_too_long_is_an_error(self) -> None:
        result = self.run(self.engine.generate(request("too-long", [5] * 2100, max_new_tokens=4)))
        assert result.finish_reason == FinishReason.ERROR and "2100" in result.error, result

    def test_sleep_and_wake_are_noops_on_cpu(self) -> None:
        if HAVE_CUDA:
            pytest.skip("CPU behaviour")
        assert not self.engine.sleep_supported
        self.run(self.engine.sleep())
        self.run(self.engine.wake())
        assert self.run(self.one(request("after-sleep", max_new_tokens=2))).error is None


@pytest.mark.sglang
@pytest.mark.skipif(not HAVE_SGLANG, reason="sglang is not installed (run the sglang lane: .ci/sglang-lane)")
class TestSGLangOnSmolLM2:
    """Checks on one engine of the real SmolLM2-135M-Instruct, in this order: structured outputs (a model that ends
    its answers, which a random one does not), then a crashing sglang subprocess, which does not take the process
    down, and a shutdown that kills only sglang's processes (last: it ends the engine)."""

    @classmethod
    def setup_class(cls) -> None:
        from daskgen.models import smollm2_instruct

        install_sigquit_handler()
        cls.runner = EventLoopThread()
        cls.engine = SGLangEngine(str(smollm2_instruct()))
        cls.runner.run(cls.engine.start(), 600)

    @classmethod
    def teardown_class(cls) -> None:
        try:
            cls.runner.run(cls.engine.shutdown(), 120)
        finally:
            cls.runner.close()

    def test_structured_outputs_of_smollm2_conform_to_their_formats(self) -> None:
        """Every kind of response_format through sglang's own fields: every response ends by stop and conforms."""
        from transformers import AutoTokenizer

        from daskgen.testing.structured import structured_run

        tokenizer = AutoTokenizer.from_pretrained(self.engine.model)
        valid, sent = self.runner.run(structured_run(self.engine, tokenizer), 900)
        assert valid == sent == 8, (valid, sent)

    def test_scheduler_crash_is_reported_and_shutdown_is_targeted(self) -> None:
        """The crash fails what runs on the engine, daskgen's requests and a caller's own ``sglang.Engine`` calls
        (``on_engine_loop``) alike, and takes nothing else down."""
        bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        native = self._native_call_in_flight()
        try:
            self._crash_the_scheduler()
            self._check_crash_is_reported()
            ended = native.exception(timeout=60)  # a call still running after 60 s fails here (TimeoutError)
            assert isinstance(ended, EngineError) and "crashed" in str(ended), repr(ended)
            with pytest.raises(EngineError, match="crashed"):
                self.runner.run(self.engine.on_engine_loop(lambda _: asyncio.sleep(0)), 60)
            children = list(self.engine.backend.children)
            assert children
            self.runner.run(self.engine.shutdown(), 120)
            assert all(not p.is_running() for p in children), children
            assert bystander.poll() is None, "shutdown killed a process sglang did not start"
        finally:
            bystander.kill()
            bystander.wait()

    def _native_call_in_flight(self) -> Any:
        """A long ``async_generate`` of the caller's own on the engine's ``sglang.Engine``, running (its future)."""
        fields = {"input_ids": [1, 504, 3458], "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        future = self.runner.submit(self.engine.on_engine_loop(lambda engine: engine.async_generate(**fields)))
        deadline = time.monotonic() + 60
        while self.engine.requests_in_flight() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.engine.requests_in_flight() == 1 and not future.done(), "the caller's own call is not running"
        return future

    def _crash_the_scheduler(self) -> None:
        """An out-of-vocabulary token (which generate() refuses) kills sglang's scheduler."""
        backend = self.engine.backend
        bad = {"input_ids": [1, 10**7], "sampling_params": {"max_new_tokens": 4}}
        future = backend.submit(backend.generate("poison", bad))
        with pytest.raises(Exception):  # noqa: B017 - whatever sglang raises; the point is we survive
            future.result(timeout=120)

    def _check_crash_is_reported(self) -> None:
        deadline = time.monotonic() + 30
        while self.engine.backend.problem is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert self.engine.backend.problem, "the crash went unnoticed"
        result = self.runner.run(self.engine.generate(request("after-crash")), 60)
        assert result.finish_reason == FinishReason.ERROR and "crashed" in result.error, result
        with pytest.raises(EngineError, match="crashed"):
            self.runner.run(self.engine.health(), 60)


@pytest.mark.gpu
@pytest.mark.sglang
@pytest.mark.skipif(not HAVE_CUDA, reason="needs sglang and a CUDA GPU")
class TestSGLangConformanceCUDA(TestSGLangConformance):
    """The same suite on a GPU, with deterministic inference so that seeds are honoured."""

    engine_args = {"enable_deterministic_inference": True, "attention_backend": "triton", "mem_fraction_static": 0.5}
    not_applicable = {}


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not HAVE_SGLANG, reason="sglang is not installed (run the sglang lane: .ci/sglang-lane)")
def test_cli_run_sglang_agrees_with_transformers_under_greedy(tmp_path: Path) -> None:
    """`daskgen run --engine sglang` on a LocalCluster, greedy: each stored answer and its logprobs equal the model's
    own ``generate`` (transformers, float32) on the stored prompt ids."""
    import numpy as np
    import torch
    import xarray as xr
    from transformers import AutoModelForCausalLM

    model, prompts, n, new = tiny_model_path(), write_prompts(tmp_path / "p.jsonl", 12), 12, 24
    common = [
        *("--prompts", prompts, "--model", model, "--n-workers", "1", "--temperature", "0"),
        *("--max-new-tokens", str(new), "--partition-size", "4", "--logprobs", "--no-progress"),
    ]
    store = tmp_path / "sglang.zarr"
    res = run_cli("run", *common, "--engine", "sglang", "--store", store, timeout=900)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    assert f"{n} done, 0 failed, 0 pending of {n} prompts" in res.stdout, res.stdout
    sg = xr.open_zarr(store)
    assert sg.attrs["daskgen"]["identity"]["engine"] == "sglang"
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    same = 0
    for i in range(n):
        prompt = torch.tensor(sg.prompt_ids.values[i, : int(sg.prompt_length.values[i])]).long()[None]
        with torch.no_grad():
            out = hf.generate(
                prompt, max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
        ref = out.sequences[0, prompt.shape[1] :].numpy()
        steps = zip(out.logits, ref, strict=True)
        ref_logprobs = [torch.log_softmax(step[0].float(), -1)[tok].item() for step, tok in steps]
        length = int(sg.response_length.values[i, 0])
        if length == len(ref) and (sg.response_ids.values[i, 0, :length] == ref).all():
            same += 1
            np.testing.assert_allclose(sg.logprobs.values[i, 0, :length], ref_logprobs, atol=1e-3)
    print(f"greedy agreement sglang vs the model's generate: {same}/{n} responses identical")
    assert same >= n - 1, f"only {same}/{n} greedy responses agree"


def load_validate_gpu() -> Any:
    """``benchmarks/validate_gpu.py`` as a module (benchmarks is not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "validate_gpu.py"
    spec = importlib.util.spec_from_file_location("validate_gpu", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("validate_gpu", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_validate_gpu_helpers(tmp_path: Path) -> None:
    vg = load_validate_gpu()
    args = vg.engine_args(["tp_size=2", "attention_backend=triton", "mem_fraction_static=0.8"], "cuda")
    assert args == {"device": "cuda", "tp_size": 2, "attention_backend": "triton", "mem_fraction_static": 0.8}
    with pytest.raises(SystemExit):
        vg.engine_args(["no-equals-sign"], "cuda")
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 500}))
    prompts = vg.make_prompts(str(tmp_path), 3, 5)
    assert len(prompts) == 3 and all(len(p) == 5 and all(100 <= t < 500 for t in p) for p in prompts)
    assert len({tuple(p) for p in prompts}) == 3


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not HAVE_SGLANG, reason="sglang is not installed (run the sglang lane: .ci/sglang-lane)")
def test_validate_gpu_script_runs(tmp_path: Path) -> None:
    """The GPU validation script end to end (on the CPU here: a smoke test; on a GPU: the real thing)."""
    out = tmp_path / "result.json"
    device = "cuda" if HAVE_CUDA else "cpu"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve().parents[1] / "benchmarks" / "validate_gpu.py"),
        "--model",
        tiny_model_path(),
        "--device",
        device,
        "--n-prompts",
        "16",
        "--max-new-tokens",
        "16",
        "--prompt-len",
        "16",
        "--json",
        str(out),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1100)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    result = json.loads(out.read_text())
    print(res.stdout)
    assert result["raw"]["output_tokens"] > 0 and result["daskgen"]["output_tokens"] > 0
    assert result["ratio"] > 0 and result["identical_outputs"] >= 15, result


@pytest.mark.sglang
@pytest.mark.skipif(not HAVE_SGLANG, reason="sglang is not installed (run the sglang lane: .ci/sglang-lane)")
def test_zz_no_sgl_kernel_shim_function_was_called() -> None:
    """Runs last in this module; the lane script repeats the check over the whole session."""
    called = shim_events("call")
    assert not called, f"sgl_kernel shim functions were called: {called}"
    module = sys.modules.get("sgl_kernel")
    if module is not None and getattr(module, "IS_DASKGEN_SHIM", False):
        assert module.CALLS == [], module.CALLS


def test_runs_dispatched_by_prefix_start_sglang_under_lpm_unless_another_policy_is_set() -> None:
    from daskgen.engines.openai.engine import OpenAIEngine

    assert SGLangEngine.prefix_admission({"tp_size": 2}) == ({"tp_size": 2, "schedule_policy": "lpm"}, True)
    assert SGLangEngine.prefix_admission({"schedule_policy": "dfs-weight"}) == ({"schedule_policy": "dfs-weight"}, True)
    assert SGLangEngine.prefix_admission({"schedule_policy": "fcfs"}) == ({"schedule_policy": "fcfs"}, False)
    managed = OpenAIEngine.prefix_admission({"managed": True})
    assert managed == ({"managed": True, "server_args": {"schedule_policy": "lpm"}}, True)
    own = {"managed": True, "server_args": {"schedule_policy": "fcfs"}}
    assert OpenAIEngine.prefix_admission(own) == (own, False)
    theirs = {"base_url": "http://127.0.0.1:1"}
    assert OpenAIEngine.prefix_admission(theirs) == (theirs, False), "someone else's server is not changed"
    assert "schedule_policy" not in launch_kwargs("/m", {}, cuda_available=True), "other runs keep sglang's default"
