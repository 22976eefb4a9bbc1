"""The ``openai`` engine against a real OpenAI-compatible server: ``transformers serve`` on loopback.

``transformers serve`` (:mod:`tests.openai_server`) runs the project's tiny Llama on the CPU, offline,
from a local folder.  It has no token endpoints, so the engine takes the re-tokenizing completions
path.  One server is shared by the whole module; ``tests/test_engine_hang.py`` freezes servers of its own.

Two tests put a **test double** in front of the real server: :class:`FlakyProxy`, a tiny stdlib
reverse proxy that answers 429 a given number of times and checks the bearer token (``transformers
serve`` has no API-key option).  Everything it does not refuse reaches the real server unchanged.

The SGLang-native path and managed mode are tested against the real sglang server in
``tests/test_engine_http_sglang.py`` (the sglang lane).
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import http.server
import json
import logging
import math
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from daskgen.engines import create_engine
from daskgen.engines.base import FinishReason, GenerationRequest, SamplingParams
from daskgen.engines.openai import OpenAIEngine
from daskgen.engines.openai.client import split_base_url
from daskgen.engines.openai.protocol import apply_limits, native_payload, native_result, openai_payload
from daskgen.engines.openai.server import free_port, server_flags
from daskgen.errors import ConfigError, EngineError
from daskgen.redaction import redact_url
from daskgen.testing.conformance import EngineConformance, EventLoopThread
from tests.openai_server import ServeProcess, tiny_model

SECRET = "sk-daskgen-planted-secret-8d1f0c"
KEY_ENV = "DASKGEN_TEST_OPENAI_KEY"
PROMPT = [1, 504, 3458, 282, 4649, 314]


def request(rid: str, prompt: list[int] | None = None, **params: Any) -> GenerationRequest:
    return GenerationRequest(
        rid, list(prompt or PROMPT), SamplingParams(**{"max_new_tokens": 8, "temperature": 0.0, **params})
    )


# --------------------------------------------------------------------------- servers


@functools.lru_cache(maxsize=1)
def _server() -> ServeProcess:
    server = ServeProcess(tiny_model())
    atexit.register(server.stop)
    return server


def shared_server() -> ServeProcess:
    """The module's ``transformers serve`` (stopped by the module fixture below, or at exit), started again on its
    port when a test stopped it: ``test_zz_server_killed_mid_run`` kills it, and under ``--dist loadscope`` the
    module's functions and its conformance class are separate scopes that one process may run in either order."""
    server = _server()
    if server.process is None or server.process.poll() is not None:
        server.start()
    return server


@pytest.fixture(scope="module", autouse=True)
def _stop_shared_server():
    yield
    _server().stop()


class FlakyProxy:
    """TEST DOUBLE: a stdlib reverse proxy in front of a real server.

    It answers ``429 Too Many Requests`` (``Retry-After: 0``) to the next ``fail_next`` POSTs and,
    with ``require_key``, ``401`` to requests whose bearer token is not that key; everything
    else is forwarded to ``upstream`` unchanged (bodies are buffered, streams included).
    """

    def __init__(self, upstream: str, require_key: str | None = None) -> None:
        self.upstream = upstream
        self.require_key = require_key
        self.fail_next = 0
        self.refused = 0
        self.forwarded = 0
        self.seen_auth: list[str | None] = []
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _verdict(self, method: str, auth: str | None) -> int | None:
        with self._lock:
            self.seen_auth.append(auth)
            if self.require_key is not None and auth != f"Bearer {self.require_key}":
                return 401
            if method == "POST" and self.fail_next > 0:
                self.fail_next -= 1
                self.refused += 1
                return 429
            self.forwarded += 1
            return None

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                self._relay("GET")

            def do_POST(self) -> None:
                self._relay("POST")

            def _relay(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0)) if method == "POST" else None
                status = proxy._verdict(method, self.headers.get("authorization"))
                if status is not None:
                    payload = json.dumps({"error": {"message": "refused by the test proxy"}}).encode()
                    self._send(status, "application/json", payload, {"Retry-After": "0"} if status == 429 else {})
                    return
                forward = urllib.request.Request(
                    proxy.upstream + self.path, data=body, method=method, headers={"content-type": "application/json"}
                )
                try:
                    with urllib.request.urlopen(forward, timeout=120) as response:
                        self._send(response.status, response.headers.get("content-type", ""), response.read())
                except urllib.error.HTTPError as exc:
                    self._send(exc.code, exc.headers.get("content-type", ""), exc.read())

            def _send(self, status: int, content_type: str, payload: bytes, extra: dict | None = None) -> None:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(payload)))
                for key, value in (extra or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(payload)

        return Handler


def started(**engine_args: Any) -> tuple[OpenAIEngine, EventLoopThread]:
    """A started engine (and the loop it lives on) for the tiny model."""
    runner = EventLoopThread()
    engine = OpenAIEngine(tiny_model(), **engine_args)
    try:
        runner.run(engine.start(), 300)
    except BaseException:
        runner.close()
        raise
    return engine, runner


def stop(engine: OpenAIEngine, runner: EventLoopThread) -> None:
    try:
        runner.run(engine.shutdown(), 60)
    finally:
        runner.close()


# --------------------------------------------------------------------------- pure unit tests


def test_registered_and_args_are_checked() -> None:
    engine = create_engine("openai", "/m", base_url="http://127.0.0.1:1/v1")
    assert isinstance(engine, OpenAIEngine) and not engine.supports_seed
    h = "http://h"
    bad = [
        ({}, "base_url"),
        ({"base_url": "localhost:80"}, "base_url"),
        ({"base_url": h, "api": "x"}, "api"),
        ({"base_url": h, "managed": True}, "not both"),
        ({"managed": True, "server_args": {"port": 1}}, "port"),
        ({"managed": True, "server_args": {"api_key": "x"}}, "api_key"),
        ({"managed": True, "api_key_env": "K"}, "random API key of its own"),
        ({"managed": True, "server_args": {"config": "x.yaml"}}, "config"),
        ({"base_url": h, "server_args": {"tp_size": 2}}, "managed"),
        ({"base_url": h, "max_retries": -1}, "max_retries"),
        ({"base_url": h, "timeout_s": 0}, "timeout_s"),
        ({"base_url": h, "bogus": 1}, "bogus"),
    ]
    for args, needle in bad:
        with pytest.raises(ConfigError, match=needle):
            OpenAIEngine("/m", **args)


def test_only_a_managed_server_refreshes_and_the_plan_says_so(tmp_path: Path) -> None:
    """`refresh` on someone else's server is refused before anything starts, naming the engines (and the openai
    engine arg) that refresh; the engine itself refuses too.  A managed server's refresh: the sglang lane."""
    import daskgen
    from daskgen.errors import RefreshError

    assert "refresh" in OpenAIEngine.features_with({"managed": True})
    assert "refresh" not in OpenAIEngine.features_with({"base_url": "http://h"}) | OpenAIEngine.features
    external = {"base_url": "http://127.0.0.1:1"}
    options = dict(model=tiny_model(), store=str(tmp_path / "s"), engine="openai", engine_args=external)
    with pytest.raises(ConfigError) as info:
        daskgen.generate(["a"], **options, refresh="drain", n_workers=1, progress=False)
    text = str(info.value)
    assert "engine 'openai' cannot serve" in text and "refresh: loading published policy versions" in text
    serving = text.split("engines that serve it:")[1]
    assert "openai (with engine arg managed=true)" in serving and "transformers" in serving, text
    assert not (tmp_path / "s").exists()
    with pytest.raises(RefreshError, match=r"only a server daskgen starts \(managed=true\)"):
        asyncio.run(OpenAIEngine(tiny_model(), **external).update_weights(str(tmp_path)))


def test_a_key_given_as_api_key_env_is_not_echoed() -> None:
    with pytest.raises(ConfigError) as info:
        OpenAIEngine("/m", base_url="http://h", api_key_env=SECRET)
    assert SECRET not in str(info.value) and "NAME of an environment variable" in str(info.value)


def test_native_payload_and_result_mapping() -> None:
    req = request("r", max_new_tokens=5, top_k=0, stop_token_ids=(9, 3, 9), seed=7, logprobs=True)
    body = native_payload(req, "r#1", {"sampling_params": {"min_p": 0.1}, "custom": 1})
    assert body == {
        "input_ids": PROMPT,
        "rid": "r#1",
        "return_logprob": True,
        "stream": False,
        "custom": 1,
        "sampling_params": {
            "max_new_tokens": 5,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "stop_token_ids": [3, 9],
            "sampling_seed": 7,
            "min_p": 0.1,
        },
    }
    for kind, reason in [
        ("stop", FinishReason.STOP),
        ("length", FinishReason.LENGTH),
        ("abort", FinishReason.ABORT),
        ("weird", FinishReason.ERROR),
    ]:
        out = {
            "output_ids": [5, 6],
            "meta_info": {
                "finish_reason": {"type": kind},
                "prompt_tokens": 6,
                "output_token_logprobs": [[-0.5, 5, None], [-1.5, 6, None]],
            },
        }
        result = native_result(req, out)
        assert (result.output_ids, result.finish_reason, result.logprobs) == ([5, 6], reason, [-0.5, -1.5])
        assert (result.error is None) == (reason != FinishReason.ERROR)
    assert native_result(req, {"output_ids": [5], "meta_info": {}}).finish_reason == FinishReason.ERROR
    assert native_result(req, {"detail": "nope"}).error


def test_openai_payload() -> None:
    req = request("r", max_new_tokens=5, top_k=20, seed=3, logprobs=True)
    path, body = openai_payload("completions", "m", "hi", req, {"skip_special_tokens": False})
    assert path == "/v1/completions" and body["prompt"] == "hi" and body["logprobs"] == 1
    assert body["max_tokens"] == 5 and body["top_k"] == 20 and body["seed"] == 3 and body["stream"] is True
    assert body["skip_special_tokens"] is False
    path, body = openai_payload("chat", "m", "hi", request("r"), {})
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "hi"}]
    assert "logprobs" not in body and "top_k" not in body and "seed" not in body


def test_retokenized_limits() -> None:
    stop = request("r", max_new_tokens=4, stop_token_ids=(7,))
    assert apply_limits([5, 7, 8], [-1.0, -2.0, -3.0], FinishReason.LENGTH, stop) == (
        [5, 7],
        [-1.0, -2.0],
        FinishReason.STOP,
    )
    assert apply_limits([5, 6, 8, 9, 10], None, FinishReason.LENGTH, stop) == ([5, 6, 8, 9], None, FinishReason.LENGTH)
    assert apply_limits([5, 6], None, FinishReason.STOP, stop) == ([5, 6], None, FinishReason.STOP)


def test_url_helpers() -> None:
    assert split_base_url("http://h:1/v1/") == ("http://h:1", "http://h:1/v1")
    assert split_base_url("https://h") == ("https://h", "https://h/v1")
    assert redact_url("http://user:pw@h:1/v1") == "http://h:1/v1"
    assert server_flags(
        {"tp_size": 2, "enable_x": True, "off": False, "none": None, "ids": [1, 2], "cfg": {"a": 1}}
    ) == ["--tp-size", "2", "--enable-x", "--ids", "1", "2", "--cfg", '{"a": 1}']


def test_server_down_at_start_is_a_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    engine = OpenAIEngine("/m", base_url=url)
    with pytest.raises(EngineError) as info:
        asyncio.run(engine.start())
    message = str(info.value)
    assert url in message and "Check that it is running" in message, message
    result = asyncio.run(engine.generate(request("late")))
    assert result.finish_reason == FinishReason.ERROR and "not running" in result.error


# --------------------------------------------------------------------------- the real server: conformance


class TestTransformersServeConformance(EngineConformance):
    """The shared suite through the completions path of ``transformers serve`` (re-tokenized).

    Checks that cannot apply to such a server are overridden below, each saying why.
    """

    engine_class = OpenAIEngine
    timeout_s = 180.0
    probe_max_new_tokens = 32
    probe_prompts = 8
    long_max_new_tokens = 512
    concurrency = 16
    context_tokens = 2048  # the tiny model's positions: transformers serve lists no max_model_len
    not_applicable = {
        "test_feature_lora": "transformers serve does not serve LoRA adapters as models; the engine's LoRA requests "
        "are checked in tests/test_lora.py",
        "test_seeded_reproducible": "transformers serve takes no per-request seed (the engine reports "
        "supports_seed False, checked in test_detects_completions_and_says_retokenized)",
        "test_results_arrive_as_each_finishes": "transformers serve (without --continuous-batching) runs one request "
        "at a time, so a short request waits behind a long one on the server; "
        "the engine's side is checked against sglang's server "
        "(test_engine_http_sglang.py) and the completions path there",
        "test_feature_per_row_sampling": "transformers serve refuses min_tokens (a vLLM/SGLang extension of the "
        "OpenAI API); checked against sglang's and vLLM's servers in their lanes",
        "test_feature_min_p": "transformers serve refuses min_p (a vLLM/SGLang extension of the OpenAI API); "
        "checked against sglang's and vLLM's servers in their lanes",
        "test_long_prompts": "transformers serve answers in text that the engine re-tokenizes: near the context "
        "limit its answers do not match the model's tokens (one came back empty); long prompts are checked token "
        "for token against vLLM's and sglang's servers in their lanes",
        "test_prompt_over_the_limit": "transformers serve lists no max_model_len and generates past the model's "
        "positions instead of refusing; the refusal is checked against vLLM's and sglang's servers in their lanes",
        "test_long_continuation": "a continuation through re-tokenized text is not token-exact; checked against "
        "vLLM's and sglang's servers in their lanes",
        "test_continuation_min_new_tokens": "transformers serve refuses min_tokens (see test_feature_per_row_sampling)",
        "test_continuation_penalties": "transformers serve refuses repetition_penalty (an extension of the OpenAI API)",
        "test_continuation_response_format": "transformers serve refuses response_format on its completions path",
        "test_feature_structured_outputs": "transformers serve refuses response_format on its completions path; "
        "checked against sglang's and vLLM's servers in their lanes",
        "test_continuation_top_logprobs": "transformers serve returns no top-k alternatives (the engine flags them "
        "unavailable); checked against vLLM's and sglang's servers in their lanes",
        "test_top_logprobs_equal_a_forward_pass": "transformers serve returns no top-k alternatives (the engine "
        "flags them unavailable); checked against vLLM's and sglang's servers in their lanes",
        "test_feature_penalties": "transformers serve refuses repetition_penalty (an extension of the OpenAI API); "
        "checked against sglang's and vLLM's servers in their lanes",
        "test_feature_stop_strings": "transformers serve leaves the matched stop string out of its text without "
        "naming it, so the re-tokenized output cannot keep it; checked token-exactly against sglang's and "
        "vLLM's servers in their lanes",
    }

    @classmethod
    def setup_class(cls) -> None:
        cls.model = tiny_model()
        cls.engine_args = {"base_url": shared_server().url, "max_retries": 1, "backoff_s": 0.1}
        super().setup_class()

    def test_detects_completions_and_says_retokenized(self) -> None:
        info = self.engine.describe()
        assert info["api"] == "completions" and info["retokenized"] is True, info
        assert self.engine.supports_seed is False  # so test_seeded_reproducible is rightly not applicable
        result = self.run(self.one(self.request("meta", 1, max_new_tokens=4)))
        assert result.meta["retokenized"] is True

    def test_logprobs(self) -> None:
        """Not applicable as written: ``transformers serve`` returns no logprobs.

        What the engine guarantees instead: one NaN per token, flagged in ``meta``, same tokens.
        """
        plain = self.run(self.one(self.request("lp-off", 5, max_new_tokens=12)))
        with_lp = self.run(self.one(self.request("lp-on", 5, max_new_tokens=12, logprobs=True)))
        assert plain.logprobs is None and with_lp.output_ids == plain.output_ids
        assert len(with_lp.logprobs) == len(with_lp.output_ids) and all(math.isnan(x) for x in with_lp.logprobs)
        assert with_lp.meta["logprobs"] == "unavailable"

    def test_top_logprobs(self) -> None:
        """Not applicable as written: ``transformers serve`` returns no logprobs.

        What the engine guarantees instead: no entries for any token, flagged in ``meta``, same tokens.
        """
        plain = self.run(self.one(self.request("top-off", 5, max_new_tokens=12)))
        top = self.run(self.one(self.request("top-on", 5, max_new_tokens=12, top_logprobs=3)))
        assert top.output_ids == plain.output_ids and top.top_logprobs == [[] for _ in top.output_ids]
        assert top.meta["top_logprobs"] == "unavailable"

    def test_length_cap(self) -> None:
        """Weakened: re-tokenizing N generated tokens' text can give fewer than N tokens.

        So a ``LENGTH`` result may be shorter than ``max_new_tokens``; it is never longer.
        """
        requests = [self.request(f"cap-{i}", i, max_new_tokens=4) for i in range(8)]
        results = self.run(self.generate_all(requests))
        for result in results:
            assert result.error is None and len(result.output_ids) <= 4, result
            assert result.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), result
        assert any(r.finish_reason == FinishReason.LENGTH for r in results)


def test_chat_api_round_trip() -> None:
    engine, runner = started(base_url=shared_server().url + "/v1", api="chat")
    try:
        assert engine.describe()["api"] == "chat"
        result = runner.run(engine.generate(request("chat", max_new_tokens=6)), 120)
        assert result.error is None and 0 < len(result.output_ids) <= 6 and result.meta["retokenized"]
    finally:
        stop(engine, runner)


def test_wrong_model_name_fails_at_start() -> None:
    with pytest.raises(EngineError) as info:
        started(base_url=shared_server().url, model_name="no-such-model")
    # the engine's own check against /v1/models, or (servers that do not list models) the server's refusal
    message = str(info.value)
    assert "no-such-model" in message and ("is not served by" in message or "pinned" in message), message


@pytest.mark.slow
def test_daskgen_run_through_transformers_serve(tmp_path: Path) -> None:
    """The real CLI on a LocalCluster, every worker's engine talking to the shared server."""
    import xarray as xr

    from tests.conftest import run_cli, write_prompts

    out = tmp_path / "out.zarr"
    res = run_cli(
        "run",
        "--prompts",
        write_prompts(tmp_path / "p.jsonl", 6),
        "--model",
        tiny_model(),
        "--store",
        out,
        "--engine",
        "openai",
        "--engine-arg",
        f"base_url={shared_server().url}/v1",
        "--n-samples",
        "2",
        "--max-new-tokens",
        "12",
        "--partition-size",
        "3",
        timeout=400,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "6 done, 0 failed, 0 pending of 6 prompts" in res.stdout, res.stdout
    ds = xr.open_zarr(out)
    assert (ds.status.values == 1).all() and (ds.response_length.values >= 1).all()
    assert (ds.response_length.values <= 12).all()


def test_top_logprobs_a_server_does_not_give_leave_a_store_that_verifies(tmp_path: Path) -> None:
    """``transformers serve`` gives no top-k alternatives (flagged ``top_logprobs: unavailable``): a run asking for
    them completes, its store verifies sound, and a follow reads every row."""
    from daskgen.analysis.accessor import open_store
    from daskgen.worker.samples.top_logprobs import TOP_UNAVAILABLE
    from tests.conftest import run_cli, write_prompts

    out = tmp_path / "out.zarr"
    res = run_cli(
        *("run", "--prompts", write_prompts(tmp_path / "p.jsonl", 4), "--model", tiny_model(), "--store", out),
        *("--engine", "openai", "--engine-arg", f"base_url={shared_server().url}/v1", "--top-logprobs", "3"),
        *("--max-new-tokens", "8", "--partition-size", "2"),
        timeout=400,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    ds = open_store(str(out))
    assert (ds.status.values == 1).all() and (ds.response_length.values >= 1).all()
    assert (ds.top_logprob_ids.values == -1).all(), "transformers serve gives no alternatives"
    assert all(note == TOP_UNAVAILABLE for note in ds.error.values), ds.error.values  # each row says so
    checked = run_cli("verify", out, timeout=300)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    exported = run_cli("export", out, "--format", "jsonl", "--out", tmp_path / "out.jsonl", timeout=300)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * ds.sizes["sample"] and all(not any(r["top_logprob_ids"]) for r in rows), rows[0]


# --------------------------------------------------------------------------- 429, API keys, secrets


def test_429_is_retried_then_returned_as_error() -> None:
    proxy = FlakyProxy(shared_server().url)  # TEST DOUBLE in front of the real server
    engine, runner = started(base_url=proxy.url, max_retries=3, backoff_s=0.05)
    try:
        proxy.fail_next = 3
        ok = runner.run(engine.generate(request("after-429s")), 120)
        assert ok.error is None and ok.output_ids and proxy.refused == 3
        proxy.fail_next = 10
        failed = runner.run(engine.generate(request("too-many-429s")), 120)
        assert failed.finish_reason == FinishReason.ERROR and "HTTP 429" in failed.error
        assert "4 attempts" in failed.error and proxy.refused == 7
    finally:
        proxy.fail_next = 0
        stop(engine, runner)
        proxy.close()


def test_api_key_from_env_and_bad_key(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    proxy = FlakyProxy(shared_server().url, require_key=SECRET)  # TEST DOUBLE checking the bearer token
    try:
        monkeypatch.setenv(KEY_ENV, SECRET)
        engine, runner = started(base_url=proxy.url, api_key_env=KEY_ENV)
        try:
            assert runner.run(engine.generate(request("keyed")), 120).error is None
            runner.run(engine.health(), 120)
            described = json.dumps(engine.describe())
            assert KEY_ENV in described and SECRET not in described and SECRET not in repr(engine.engine_args)
        finally:
            stop(engine, runner)
        assert set(proxy.seen_auth) == {f"Bearer {SECRET}"}
        monkeypatch.setenv(KEY_ENV, "sk-wrong-" + SECRET[::-1])
        with pytest.raises(EngineError) as wrong:
            started(base_url=proxy.url, api_key_env=KEY_ENV)
        assert "HTTP 401" in str(wrong.value) and KEY_ENV in str(wrong.value)
        assert SECRET not in str(wrong.value) and SECRET[::-1] not in str(wrong.value)
        monkeypatch.delenv(KEY_ENV)
        with pytest.raises(EngineError, match=f"{KEY_ENV} .*not set"):
            started(base_url=proxy.url, api_key_env=KEY_ENV)
        with pytest.raises(EngineError, match="needs an API key"):
            started(base_url=proxy.url)
    finally:
        proxy.close()
    assert caplog.records and SECRET not in caplog.text and SECRET[::-1] not in caplog.text


# --------------------------------------------------------------------------- a server that dies


async def _gather_burst(engine: OpenAIEngine, n: int, tag: str) -> list[Any]:
    requests = [request(f"{tag}-{i}", [1, 504 + i, 3458, 282], max_new_tokens=48) for i in range(n)]
    return list(await asyncio.gather(*(engine.generate(r) for r in requests)))


def test_zz_server_killed_mid_run() -> None:
    """Killed mid-run and restarted during the backoff: every request completes after retries.

    The patient engine talks to the server through :class:`tests.probing.InFlightProxy` (a test double
    that forwards everything and counts what is in flight), so the test kills the server once a request
    is in flight and checks that one really broke under it.  Killed for good: requests come back with
    errors after their retries (nothing is raised), the engine reports its server as dead (``died()``) and
    health() fails, so the plugin restarts the engine instead of failing the prompts.  Runs last: it kills
    the shared server.
    """
    from tests.probing import InFlightProxy

    server = shared_server()
    proxy = InFlightProxy(server.url)
    patient, runner = started(base_url=proxy.url, max_retries=6, backoff_s=1.0)
    quick = OpenAIEngine(tiny_model(), base_url=server.url, max_retries=1, backoff_s=0.1)
    try:
        runner.run(quick.start(), 120)
        future = asyncio.run_coroutine_threadsafe(_gather_burst(patient, 8, "survive"), runner.loop)
        proxy.wait_for("in_flight")
        server.stop(signal.SIGKILL)
        assert proxy.wait_for("broken", timeout=30) and not future.done(), "a request broke when the server died"
        server.start()  # same port; the retries (after about 1, 2, 4, 8, ... s) span the restart
        results = future.result(timeout=300)
        assert all(r.error is None and r.output_ids for r in results), [r.error for r in results]
        server.stop(signal.SIGKILL)
        doomed = runner.run(_gather_burst(quick, 4, "doomed"), 120)
        assert all(
            r.finish_reason == FinishReason.ERROR and "cannot reach" in r.error and "2 attempts" in r.error
            for r in doomed
        ), doomed
        assert patient.died() is None  # its requests all got answers in the end
        death = quick.died()  # not the prompts' fault: the worker restarts the engine instead of failing rows
        assert death is not None and "the server stopped answering" in death and server.url in death, death
        with pytest.raises(EngineError):
            runner.run(quick.health(), 120)
    finally:
        runner.run(quick.shutdown(), 60)
        stop(patient, runner)
        proxy.close()
        server.stop(signal.SIGKILL)


def test_server_capacity_is_read_from_sglang_server_info() -> None:
    from daskgen.engines.sglang.mapping import max_running_requests

    state = {"effective_max_running_requests_per_dp": 48, "dp_size": 2}
    assert max_running_requests(state) == 96
    assert max_running_requests({"effective_max_running_requests_per_dp": 7}) == 7
    assert max_running_requests({}) is None  # not an SGLang server, or another version
    assert max_running_requests(None) is None
