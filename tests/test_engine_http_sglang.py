"""The ``openai`` engine against the real sglang HTTP server (the sglang CPU lane).

Everything here needs the pinned sglang (``.ci/sglang-lane``: ``SGLANG_USE_CPU_ENGINE=1`` and the
import-only ``sgl_kernel`` shim on ``PYTHONPATH``, both inherited by the server subprocesses).
Servers are real ``python -m sglang.launch_server`` processes on loopback, started by the engine itself
(``managed=True``):

* the module's managed engine, whose server (its own random API key, a small ``max_running_requests``)
  also serves, as an external server, the native conformance suite, the completions path, model-name and
  API-key checks; the managed-mode checks run after those and end with the server's death;
* a full ``daskgen run`` whose server is killed mid-run.

A launch costs ~20-60 s on 2 cores, hence the sharing.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import json
import logging
import math
import os
import shutil
import signal
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from daskgen.engines.base import FinishReason, GenerationRequest, SamplingParams
from daskgen.engines.openai import OpenAIEngine
from daskgen.errors import EngineError
from daskgen.testing.conformance import EngineConformance, EventLoopThread, longest_running
from tests.conftest import tiny_model_once

MISSING = [name for name in ("sglang", "soundfile", "httpx", "tenacity") if find_spec(name) is None]
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(
        bool(MISSING),
        reason=f"needs {MISSING} (the sglang lane: .ci/sglang-lane; sglang's HTTP "
        "server imports soundfile, the openai engine needs httpx and tenacity)",
    ),
]

MANAGED_RUNNING = 4  # the shared managed server's max_running_requests
KEY_ENV = "DASKGEN_TEST_SGLANG_KEY"
PROMPT = [1, 504, 3458, 282, 4649, 314]


def tiny_model() -> str:
    """The project's tiny Llama (``daskgen.models.build_tiny_model``), one folder for this module."""
    return tiny_model_once("daskgen-http-sglang-tiny-")


def request(rid: str, prompt: list[int] | None = None, **params: Any) -> GenerationRequest:
    return GenerationRequest(
        rid, list(prompt or PROMPT), SamplingParams(**{"max_new_tokens": 16, "temperature": 0.0, **params})
    )


@functools.lru_cache(maxsize=1)
def managed_engine() -> tuple[EventLoopThread, Any]:
    """The module's managed engine and the loop it runs on, started on first use (stopped by the module fixture).

    A small max_running_requests, so that more requests than the server runs at once are cheap
    (``TestManagedServer``)."""
    runner = EventLoopThread()
    engine = engine_on(
        runner, managed=True, server_start_timeout_s=600, server_args={"max_running_requests": MANAGED_RUNNING}
    )
    atexit.register(_kill_group, engine.managed_server)
    return runner, engine


def shared_server() -> Any:
    """The managed engine's server (its ``url`` and ``api_key``), which the other engines here use as an external
    server."""
    return managed_engine()[1].managed_server


def _kill_group(server: Any) -> None:
    """Last resort at interpreter exit (the module fixture normally stops the server)."""
    if server.process is not None and server.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)


@pytest.fixture(scope="module", autouse=True)
def _stop_managed_engine():
    yield
    if managed_engine.cache_info().currsize:
        runner, engine = managed_engine()
        try:
            runner.run(engine.shutdown(), 120)
        finally:
            runner.close()
            managed_engine.cache_clear()


def engine_on(runner: EventLoopThread, **engine_args: Any) -> Any:
    from daskgen.engines.openai import OpenAIEngine

    engine = OpenAIEngine(tiny_model(), **engine_args)
    runner.run(engine.start(), 900)
    return engine


# --------------------------------------------------------------------------- native protocol: the shared suite


class TestSGLangNativeConformance(EngineConformance):
    """The shared suite through SGLang's native ``/generate`` (token ids in and out), with an API key: the managed
    engine's server, used as an external one."""

    engine_class = OpenAIEngine
    timeout_s = 300.0
    probe_max_new_tokens = 64
    long_max_new_tokens = 1500
    abort_timeout_s = 30.0
    concurrency = 24
    not_applicable = {
        "test_seeded_reproducible": "the CPU sglang server runs without enable_deterministic_inference "
        "(GPU attention backends only), so it does not honour seeds",
        "test_feature_lora": "the shared server runs without LoRA adapters (serving them takes a server start of "
        "its own); the engine's LoRA requests (the adapter as the served model, SGLang's lora_path, a managed "
        "server's LoRA flags) are checked in tests/test_lora.py",
    }

    @classmethod
    def setup_class(cls) -> None:
        os.environ[KEY_ENV] = shared_server().api_key
        cls.model = tiny_model()
        cls.engine_args = {"base_url": shared_server().url, "api_key_env": KEY_ENV}
        super().setup_class()

    def test_native_and_token_exact(self) -> None:
        """Auto-detected as SGLang; logprobs are the model's own log-softmax at the returned ids."""
        import torch
        from transformers import AutoModelForCausalLM

        info = self.engine.describe()
        assert info["api"] == "sglang" and info["retokenized"] is False, info
        assert self.engine.supports_seed is False  # why test_seeded_reproducible is not applicable
        sampled = self.run(self.one(request("exact", max_new_tokens=12, temperature=1.3, logprobs=True)))
        assert "retokenized" not in sampled.meta
        model = AutoModelForCausalLM.from_pretrained(self.model, dtype=torch.float32)
        ids = torch.tensor([PROMPT + sampled.output_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(PROMPT) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(sampled.output_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(sampled.logprobs), expected, atol=2e-3), (sampled.logprobs, expected)

    def test_eos_is_kept_and_reported_as_stop(self) -> None:
        results = self.run(
            self.generate_all(
                [request(f"eos-{i}", self.prompt(200 + i), max_new_tokens=32, temperature=1.0) for i in range(16)]
            )
        )
        stopped = [r for r in results if r.finish_reason == FinishReason.STOP]
        assert stopped, "no sample reached EOS (the tiny model ends about half of them)"
        assert all(r.output_ids[-1] == 2 for r in stopped), stopped

    def test_abort_right_after_submit(self) -> None:
        async def submit_then_abort() -> Any:
            task = asyncio.ensure_future(self.engine.generate(request("abort-now", max_new_tokens=1500)))
            await asyncio.sleep(0)
            await self.engine.abort("abort-now")
            return await task

        result = self.run(submit_then_abort())
        assert result.finish_reason == FinishReason.ABORT and len(result.output_ids) < 1500, result

    def test_bad_prompts_are_refused_before_they_reach_the_server(self) -> None:
        """An out-of-vocabulary id would crash sglang's scheduler; an overlong prompt is refused by length."""
        oov = self.run(self.engine.generate(request("oov", [1, 10**7])))
        assert oov.finish_reason == FinishReason.ERROR and "vocabulary" in oov.error, oov
        long = self.run(self.engine.generate(request("too-long", [5] * 2100, max_new_tokens=4)))
        limit = self.engine.max_total_tokens
        assert limit is not None and limit < 2100, limit
        assert long.finish_reason == FinishReason.ERROR and f"limit of {limit} tokens" in long.error, long
        assert self.run(self.one(request("still-alive", max_new_tokens=2))).error is None

    def test_completions_path_on_the_same_server(self) -> None:
        """api='completions' re-tokenizes; sglang returns logprobs, used where the tokens line up."""
        runner = EventLoopThread()
        engine = engine_on(runner, base_url=shared_server().url + "/v1", api="completions", api_key_env=KEY_ENV)
        try:
            assert engine.describe()["retokenized"] is True
            results = runner.run(
                _gather(
                    engine, [request(f"c{i}", self.prompt(300 + i), max_new_tokens=6, logprobs=True) for i in range(8)]
                ),
                300,
            )
            assert all(r.error is None and r.meta["retokenized"] for r in results), results
            aligned = [r for r in results if "logprobs" not in r.meta]
            assert aligned and all(math.isfinite(x) and x <= 0 for r in aligned for x in r.logprobs), results
            order = runner.run(_short_overtakes_long(engine), 300)
            assert order == ["short", "long"], order
        finally:
            runner.run(engine.shutdown(), 60)
            runner.close()

    def test_wrong_model_name_lists_the_served_models(self) -> None:
        runner = EventLoopThread()
        try:
            with pytest.raises(EngineError) as info:
                engine_on(runner, base_url=shared_server().url, api_key_env=KEY_ENV, model_name="other")
            assert "'other' is not served" in str(info.value) and tiny_model() in str(info.value)
        finally:
            runner.close()

    def test_api_key_checks_and_no_leak(
        self, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        caplog.set_level(logging.DEBUG)
        runner = EventLoopThread()
        try:
            with pytest.raises(EngineError, match="needs an API key"):
                engine_on(runner, base_url=shared_server().url)
            monkeypatch.setenv("DASKGEN_TEST_WRONG_KEY", "sk-wrong-key-123")
            with pytest.raises(EngineError) as wrong:
                engine_on(runner, base_url=shared_server().url, api_key_env="DASKGEN_TEST_WRONG_KEY")
            assert "HTTP 401" in str(wrong.value) and "DASKGEN_TEST_WRONG_KEY" in str(wrong.value)
            assert "sk-wrong-key-123" not in str(wrong.value)
            engine = engine_on(runner, base_url=shared_server().url, api_key_env=KEY_ENV)
            runner.run(engine.health(), 120)
            assert shared_server().api_key not in json.dumps(engine.describe())
            runner.run(engine.shutdown(), 60)
        finally:
            runner.close()
        assert shared_server().api_key not in caplog.text and "sk-wrong-key-123" not in caplog.text


async def _gather(engine: Any, requests: list[GenerationRequest]) -> list[Any]:
    return list(await asyncio.gather(*(engine.generate(r) for r in requests)))


async def _short_overtakes_long(engine: Any) -> list[str]:
    """Submit a long greedy request, then a one-token one; return the order in which they come back (the long
    one is aborted once the short one is back)."""
    probes = [request(f"probe-{i}", [1, 700 + i, 3458, 282], max_new_tokens=64) for i in range(16)]
    results = await _gather(engine, probes)
    cap = TestSGLangNativeConformance.long_max_new_tokens
    # of the greedy prompts that ran the probe's 64 tokens, the one that runs longest to the long cap (one that
    # stopped soon after 64 could finish before the short request is back)
    runs = [
        request(f"run-{i}", p.prompt_ids, max_new_tokens=cap)
        for i, (p, r) in enumerate(zip(probes, results, strict=True))
        if r.finish_reason == FinishReason.LENGTH
    ][:4]
    assert runs, "no greedy probe ran 64 tokens without stopping"
    long_prompt = (await longest_running(engine, runs)).prompt_ids
    order: list[str] = []

    async def timed(name: str, req: GenerationRequest) -> None:
        await engine.generate(req)
        order.append(name)

    # a cap the greedy prompt runs far past 64 tokens towards, aborted once the short one is back: a fast
    # server could finish a few hundred tokens before the short request even arrives.  min_new_tokens (min_tokens on
    # this path) keeps it from ending at an end token: re-tokenized text and batch-dependent numerics on a CPU can
    # make the greedy run end sooner than the probe did
    long_request = request("long", long_prompt, max_new_tokens=cap, min_new_tokens=cap)
    long = asyncio.ensure_future(timed("long", long_request))
    while not engine.answering("long"):  # the long request streams before the short one is sent
        assert not long.done(), "the long request ended before it streamed"
        await asyncio.sleep(0.01)
    await timed("short", request("short", max_new_tokens=1))
    await engine.abort("long")
    await asyncio.wait_for(long, TestSGLangNativeConformance.abort_timeout_s)
    return order


# --------------------------------------------------------------------------- managed mode


class TestManagedServer:
    """One engine with its own sglang server subprocess (the module's managed engine; its server dies last)."""

    @classmethod
    def setup_class(cls) -> None:
        cls.runner, cls.engine = managed_engine()

    def test_managed_server_serves_natively(self) -> None:
        info = self.engine.describe()
        assert info["api"] == "sglang" and info["engine_args"]["managed"] is True, info
        assert self.engine.managed_server.url.startswith("http://127.0.0.1:")
        result = self.runner.run(self.engine.generate(request("managed", logprobs=True)), 120)
        assert result.error is None and len(result.logprobs) == len(result.output_ids) > 0
        self.runner.run(self.engine.health(), 120)

    def test_an_idle_server_leaves_the_cores_idle(self) -> None:
        """The managed server gets the CPU defaults, ``--sleep-on-idle`` among them: idle, it leaves the cores idle."""
        import psutil

        from tests.test_engine_sglang import idle_cpu_seconds

        self.runner.run(self.engine.generate(request("wake", max_new_tokens=2)), 120)
        assert "--sleep-on-idle" in self.engine.managed_server.process.args
        assert idle_cpu_seconds([psutil.Process(self.engine.managed_server.process.pid)]) < 0.3 * 3.0

    def test_capacity_is_the_servers_and_its_queue_is_kept_fed(self) -> None:
        """The server's max_running_requests sizes ``window: auto``; the client keeps twice that in flight,
        so the server holds a queue: seen in its own load report (``/v1/loads``) while requests run."""
        import httpx

        server = self.engine.managed_server
        url, headers = server.url, {"Authorization": f"Bearer {server.api_key}"}
        info = httpx.get(url + "/get_server_info", timeout=60, headers=headers).json()
        running = int(info["internal_states"][0]["effective_max_running_requests_per_dp"])
        assert self.engine.capacity == running == MANAGED_RUNNING
        assert self.engine.concurrency == max(128, 2 * running)
        assert self.engine.describe()["server_max_running_requests"] == running
        # each answer held to 64 tokens (none ends early), six per slot: the queue lasts while several load reports
        # are made, however fast the engine generates or the client sends
        requests = [
            request(f"fed-{i}", [1, 700 + i, 3458, 282], max_new_tokens=64, min_new_tokens=64)
            for i in range(6 * running)
        ]
        loads = self.runner.run(_loads_while_generating(self.engine, url, requests, headers), 600)
        assert max(load["num_running_reqs"] for load in loads) == running, loads
        assert max(load["num_waiting_reqs"] for load in loads) > 0, f"the server never held a queue: {loads}"

    def test_managed_server_requires_its_key(self) -> None:
        """Loopback is open to every user of the node: the server refuses requests without its random key."""
        import httpx

        server = self.engine.managed_server
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
        anonymous = httpx.post(server.url + "/generate", json=body, timeout=120)
        assert anonymous.status_code == 401, anonymous.text
        wrong = httpx.post(
            server.url + "/generate", json=body, timeout=120, headers={"Authorization": "Bearer daskgen-not-the-key"}
        )
        assert wrong.status_code == 401, wrong.text
        keyed = httpx.post(
            server.url + "/generate", json=body, timeout=120, headers={"Authorization": f"Bearer {server.api_key}"}
        )
        assert keyed.status_code == 200 and len(keyed.json()["output_ids"]) == 2, keyed.text
        assert httpx.get(server.url + "/health", timeout=60).status_code == 200  # probes stay open
        cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes().decode()
        assert server.api_key not in cmdline and server.config_dir is None  # not in `ps`; key file removed
        assert server.api_key not in json.dumps(self.engine.describe())

    @pytest.mark.proves("openai", "policy_fingerprint")  # a managed server
    def test_after_a_refresh_the_server_holds_the_published_tensors(self, tmp_path: Path) -> None:
        """The server loads the published folder, then the version rebuilt from its delta in the node's cache; each
        tensor read back through ``POST /get_weights_by_name`` as in-process sglang reads it
        (``tests/refresh_fingerprint.py``)."""
        from tests.refresh_fingerprint import COMPARED, check_a_refresh_holds_the_published_tensors

        check_a_refresh_holds_the_published_tensors(
            self.runner.run,
            self.engine,
            tiny_model(),
            tmp_path,
            compared=COMPARED["sglang"],
            reloads=lambda _stage_dir, step1, rebuilt: [step1, rebuilt],
        )

    @pytest.mark.proves("openai", "refresh")  # a managed server (engine arg managed=true)
    def test_update_weights_refreshes_the_server_in_place(self, tmp_path: Path) -> None:
        """A new policy checkpoint (the tiny model with other weights, saved locally) loaded through the server's
        ``/update_weights_from_disk``: the same server process then answers greedy probes as the new checkpoint does
        (each token its argmax, the logprobs its log-softmax); a folder without weights is refused and the new
        weights stay; the base model loads back and gives the first answers again."""
        from daskgen.errors import RefreshError
        from daskgen.models import build_tiny_model

        assert "refresh" in type(self.engine).features_with(self.engine.engine_args)
        probes = [request(f"probe-{i}", [1, 504 + 37 * i, 3458, 282], max_new_tokens=12, logprobs=True) for i in (0, 1)]

        def answers() -> list[Any]:
            return [self.runner.run(self.engine.generate(probe), 300) for probe in probes]

        before, pid = answers(), self.engine.managed_server.process.pid
        new = build_tiny_model(tmp_path / "step-1", seed=1)
        self.runner.run(self.engine.update_weights(str(new)), 600)
        after = answers()
        assert self.engine.managed_server.process.pid == pid  # in place: no restart
        for probe, result in zip(probes, after, strict=True):
            assert_greedy_answer_of(new, probe.prompt_ids, result)
        assert [r.output_ids for r in after] != [r.output_ids for r in before]
        (tmp_path / "empty").mkdir()
        with pytest.raises(RefreshError, match="could not load policy checkpoint"):
            self.runner.run(self.engine.update_weights(str(tmp_path / "empty")), 600)
        assert [r.output_ids for r in answers()] == [r.output_ids for r in after]
        self.runner.run(self.engine.update_weights(tiny_model()), 600)
        assert [r.output_ids for r in answers()] == [r.output_ids for r in before]

    def test_zz_server_death_fails_health_and_shutdown_stops_the_group(self) -> None:
        server = self.engine.managed_server
        group = server.process.pid
        os.kill(server.process.pid, signal.SIGKILL)  # the server leader dies (its children may linger)
        deadline = time.monotonic() + 30
        while server.alive and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(EngineError, match="exited with code"):
            self.runner.run(self.engine.health(), 60)
        with pytest.raises(EngineError, match="exited with code"):  # raised: the partition task is retried
            self.runner.run(self.engine.generate(request("after-death")), 60)
        self.runner.run(self.engine.shutdown(), 120)  # returns once the whole group is gone
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)
        assert server.log_path.exists()  # a server that died keeps its log (messages point to it)
        server.log_path.unlink()


async def _loads_while_generating(
    engine: Any, url: str, requests: list[GenerationRequest], headers: dict[str, str]
) -> list[dict]:
    """Generate ``requests`` at once through ``engine``; meanwhile poll the server's ``/v1/loads``."""
    import httpx

    tasks = asyncio.gather(*(engine.generate(r) for r in requests))
    loads: list[dict] = []
    async with httpx.AsyncClient(timeout=30, headers=headers) as client:
        while not tasks.done():
            response = await client.get(url + "/v1/loads", params={"include": "core"})
            loads.extend(response.json()["loads"])
            await asyncio.sleep(0.05)
    results = await tasks
    assert all(r.error is None for r in results), results
    return loads


def assert_greedy_answer_of(model: Path, prompt: list[int], result: Any) -> None:
    """``result`` is the greedy answer of the checkpoint ``model`` to ``prompt``: over prompt + answer (one forward
    pass), each answer token is the most likely one (up to float noise) and its logprob is the model's."""
    import torch
    from transformers import AutoModelForCausalLM

    assert result.error is None and result.output_ids, result
    checkpoint = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        logits = checkpoint(torch.tensor([prompt + result.output_ids])).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits.float(), -1)
    chosen = logprobs.gather(1, torch.tensor(result.output_ids)[:, None])[:, 0]
    assert (chosen >= logprobs.max(-1).values - 2e-3).all(), (result.output_ids, logprobs.argmax(-1).tolist())
    assert torch.allclose(torch.tensor(result.logprobs), chosen, atol=2e-3), (result.logprobs, chosen)


def test_managed_launch_failure_quotes_the_server_log() -> None:
    from daskgen.engines.openai import OpenAIEngine

    engine = OpenAIEngine("/nonexistent/daskgen-model", managed=True, server_start_timeout_s=300)
    with pytest.raises(EngineError) as info:
        asyncio.run(engine.start())
    message = str(info.value)
    assert "exited with code" in message and "last lines of its log" in message, message
    assert "/nonexistent/daskgen-model" in message, message
    engine.managed_server.log_path.unlink()  # kept on failure for the user to read


# --------------------------------------------------------------------------- a whole run, server killed mid-run


def _server_processes(model: str) -> list[Any]:
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if "sglang.launch_server" in cmdline and model in cmdline:
            found.append(proc)
    return found


def _wait_for_server(model: str, exclude: set[int], timeout: float = 600) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fresh = [p for p in _server_processes(model) if p.pid not in exclude]
        if fresh:
            return fresh[0]
        time.sleep(0.5)
    raise AssertionError("no managed sglang server appeared")


def _requests_in_flight(log_dir: Path) -> set[str]:
    """The partition requests a server received and did not finish, from its own request log
    (``--log-requests`` in JSON lines, written to ``log_dir``)."""
    received, finished = set(), set()
    for path in log_dir.glob("*.log*"):
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line[line.index("{") :])
            except ValueError:  # not a request record
                continue
            rid = str(event.get("rid", ""))
            if rid.startswith("p"):  # a partition's sample, not a health check
                {"request.received": received, "request.finished": finished}.get(event.get("event"), set()).add(rid)
    return received - finished


def _wait_for_requests_in_flight(log_dir: Path, timeout: float = 600) -> set[str]:
    deadline = time.monotonic() + timeout
    while not (flying := _requests_in_flight(log_dir)):
        assert time.monotonic() < deadline, f"the server's request log shows nothing in flight after {timeout} s"
        time.sleep(0.1)
    return flying


#: Two partitions of four prompts, two samples each: the server is killed with some of them in flight.
N_DEATH_PROMPTS = 8


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_run_with_managed_server_survives_its_death(tmp_path: Path) -> None:
    """``daskgen run --engine openai`` (managed): the server is killed mid-run, the plugin restarts the
    engine (a new server), the partition is retried, and the run ends with every prompt done.

    The server logs every request it receives and finishes (sglang's ``--log-requests``, JSON lines in
    a folder of the test's): the test kills it while that log shows partition requests in flight, and
    checks after the kill that they never finished there."""
    import xarray as xr

    from tests.conftest import popen_cli, write_prompts

    model = str(shutil.copytree(tiny_model(), tmp_path / "model"))  # its own path: other servers here use tiny_model()
    prompts = write_prompts(tmp_path / "p.jsonl", N_DEATH_PROMPTS)
    out, log_dir = tmp_path / "out.zarr", tmp_path / "server-requests"
    requests_log = {
        "log_requests": True,
        "log_requests_level": 0,
        "log_requests_format": "json",
        "log_requests_target": [str(log_dir)],
    }
    run = popen_cli(
        "run",
        "--prompts",
        prompts,
        "--model",
        model,
        "--store",
        out,
        "--engine",
        "openai",
        "--engine-arg",
        "managed=true",
        "--n-samples",
        "2",
        "--max-new-tokens",
        "128",
        "--min-new-tokens",
        "64",
        "--temperature",
        "0",
        "--partition-size",
        "4",
        "--max-retries",
        "3",
        "--engine-arg",
        "server_args=" + json.dumps(requests_log),
        env={"TMPDIR": str(tmp_path)},
    )  # the killed server's log stays in tmp_path
    try:
        first = _wait_for_server(model, set())
        assert first.parent().pid != os.getpid(), "found a server of this test process, not of the run"
        # every sample takes at least 64 tokens (--min-new-tokens), so the requests the log shows received stay in
        # flight while the test reads it; waiting for a commit first could find the run already done
        _wait_for_requests_in_flight(log_dir)
        first.kill()
        assert _ends(first)
        cut = _requests_in_flight(log_dir)  # the next server is not up yet: this is the killed one's log
        assert cut, "no request was in flight when the server died"
        second = _wait_for_server(model, {first.pid})
        output, _ = run.communicate(timeout=900)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert run.returncode == 0, output[-5000:]
    assert f"{N_DEATH_PROMPTS} done, 0 failed, 0 pending of {N_DEATH_PROMPTS} prompts" in output, output[-5000:]
    assert (xr.open_zarr(out).status.values == 1).all()
    assert second.pid != first.pid
    assert _ends(second), f"the restarted server outlived the run: {second}"


def _ends(proc: Any, timeout: float = 30.0) -> bool:
    """Whether ``proc`` is gone within ``timeout``.  A zombie counts as gone: it holds no memory or
    port, only a process-table entry that its parent reaps -- in a container whose PID 1 does not
    reap (CI), orphaned children of a killed server stay zombies forever."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.5)
    return False
