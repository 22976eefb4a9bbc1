"""``openai`` engine: an SGLang-native or OpenAI-compatible HTTP server, optionally one per worker.

* ``api="sglang"``: SGLang's native ``POST /generate``, token ids in, ``output_ids`` and
  ``meta_info.output_token_logprobs`` out (token-exact).  Each attempt carries
  ``rid = "<request_id>#<random>"``; :meth:`OpenAIEngine.abort` posts ``/abort_request``.
* ``api="completions"``/``"chat"``: prompt ids are decoded to text, streamed through
  ``/v1/completions`` (or ``/v1/chat/completions``, as one user message), and the returned text
  is re-tokenized: ``meta["retokenized"] = True``, ``describe()["retokenized"] = True``.  Stop
  token ids and ``max_new_tokens`` are applied to the re-tokenized output; logprobs are the
  server's where its tokens line up, else NaN (``meta["logprobs"] = "unavailable"``).
* ``api="vllm"``: vLLM's ``/v1/completions`` with the prompt as token ids and
  ``return_token_ids`` (token-exact, seeds honoured; :mod:`daskgen.engines.openai.vllm_protocol`).
* ``api="auto"`` takes the native path when ``GET /get_model_info`` answers like SGLang, the
  vLLM path when ``GET /version`` answers like vLLM, else ``completions``.
* :meth:`~OpenAIEngine.start` fails fast (:class:`~daskgen.errors.EngineError`) when the server
  is unreachable, the key is refused, or the model is not served.  429, 408, 5xx and connection
  errors are retried (tenacity, exponential backoff with jitter); then the request returns
  ``error``.  When the server never answered it (unreachable, or nothing for ``timeout_s``: stopped
  or hung), :meth:`~OpenAIEngine.crash` reports the server down, so the partition fails as a whole
  and the worker restarts the engine instead of marking the prompt failed.
* ``managed=True`` starts one sglang server subprocess per engine
  (:class:`~daskgen.engines.openai.server.ManagedServer`) with a random API key of its own; when it
  dies, ``generate`` raises (the partition is retried after the plugin restarts the engine) and
  ``health`` fails.  Only a managed server loads published policy versions in place
  (:meth:`~OpenAIEngine.update_weights`: the ``refresh`` feature with ``managed=true``).
* The API key comes from the environment variable named by ``api_key_env`` and never appears in
  logs, ``describe()`` or messages.

Wire formats (payloads, answers, streamed events, limits on re-tokenized output) live in
:mod:`daskgen.engines.openai.protocol`; the HTTP client and the managed server in
:mod:`daskgen.engines.openai.client` and :mod:`daskgen.engines.openai.server`.
Details, limits and the tested servers: ``docs/engines.md`` (HTTP engines).  Engine args:
:class:`~daskgen.engines.openai.args.OpenAIArgs`.  Needs ``httpx`` and ``tenacity`` (``pip install 'daskgen[http]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import asdict
from typing import Any

from daskgen.engines.args import parse_engine_args
from daskgen.engines.base import (
    Engine,
    EngineStatus,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    aborted_result,
    error_result,
    started,
)
from daskgen.engines.continuation import request_limit
from daskgen.engines.inprocess import cuda_available
from daskgen.engines.openai.args import OpenAIArgs
from daskgen.engines.openai.client import HTTPClient, NoAnswer, RequestFailed
from daskgen.engines.openai.fingerprint import ServerFingerprint
from daskgen.engines.openai.native_images import managed_refusals
from daskgen.engines.openai.protocol import Flight, OpenAITextProtocol, SGLangNativeProtocol, WireProtocol
from daskgen.engines.openai.server import ManagedServer, update_server_weights
from daskgen.engines.openai.vllm_protocol import VLLMProtocol, is_vllm_version
from daskgen.engines.request_check import request_error
from daskgen.engines.sglang.args import SAMPLING_RANGES, prefix_admission
from daskgen.engines.sglang.mapping import max_running_requests
from daskgen.errors import EngineError, RefreshError
from daskgen.input.tokenizer import load_hf_tokenizer
from daskgen.redaction import redact_url

__all__ = ["OpenAIEngine"]

logger = logging.getLogger(__name__)

_PING = SamplingParams(max_new_tokens=1, temperature=0.0)


class OpenAIEngine(ServerFingerprint, Engine):
    """Generate through an SGLang-native or OpenAI-compatible HTTP server (see the module docstring)."""

    name = "openai"
    features = frozenset({"per_row_sampling", "stop", "stop_token_ids", "structured_outputs", "top_logprobs", "lora"})
    #: Refresh and fingerprints: only the (sglang) servers the engine starts itself, not someone else's; images also
    #: on a vLLM server (``api="vllm"``: :mod:`daskgen.engines.openai.vllm_images`).
    features_by_arg = {
        **dict.fromkeys(("refresh", "policy_fingerprint"), (("managed", True),)),
        "images": (("managed", True), ("api", "vllm")),
    }
    max_total_tokens: int | None = None  # the server's context length, known after start
    vocab_size: int | None = None  # the tokenizer's size, known after start

    @classmethod
    def refused_features(cls, engine_args: dict[str, Any]) -> dict[str, str]:
        """What a managed sglang server cannot serve (:func:`.native_images.managed_refusals`)."""
        return managed_refusals(engine_args, cuda_available)

    @classmethod
    def ranges_with(cls, engine_args: dict[str, Any]) -> dict[str, Any]:
        """A managed (sglang) server refuses what sglang refuses; someone else's server is not known here."""
        return SAMPLING_RANGES if engine_args.get("managed") is True else {}

    @classmethod
    def prefix_admission(cls, engine_args: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """A managed sglang server launched as the ``sglang`` engine would be; someone else's server is not changed."""
        if engine_args.get("managed") is not True:
            return engine_args, False
        server_args, admits = prefix_admission(engine_args.get("server_args") or {})
        return {**engine_args, "server_args": server_args}, admits

    def __init__(self, model: str, adapters: dict[str, str] | None = None, **engine_args: Any) -> None:
        super().__init__(model, **engine_args)
        self.args = parse_engine_args("openai", OpenAIArgs, engine_args)
        #: LoRA adapters (name -> folder): a managed server loads them; any server serves each under its name.
        self.adapters: dict[str, str] = dict(adapters or {})
        self.protocol: str | None = None
        self.wire: WireProtocol | None = None
        self._server_seeds = False
        self.model_name: str | None = self.args.model_name
        self._tokenizer: Any = None
        self._http: HTTPClient | None = None
        self._server: ManagedServer | None = None
        self._flights: dict[str, list[Flight]] = {}
        self._limit = asyncio.Semaphore(self.args.max_concurrency)
        self.concurrency = self.args.max_concurrency
        self.server_capacity: int | None = None
        self._no_answer: str | None = None

    @property
    def managed_server(self) -> ManagedServer | None:
        """The sglang server this engine started (``managed: true``); ``None`` for a given ``base_url``."""
        return self._server

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, loaded at :meth:`start` when ids go over the wire as text; else ``None``."""
        return self._tokenizer

    @property
    def supports_seed(self) -> bool:
        """True against vLLM, or an SGLang server with deterministic inference on (known after :meth:`start`)."""
        return self._server_seeds or self.protocol == "vllm"  # vLLM seeds each request's sampler

    @property
    def retokenized(self) -> bool:
        """True when outputs are re-tokenized text (OpenAI protocols), False when token-exact."""
        return self.protocol in ("chat", "completions")

    # ------------------------------------------------------------------ lifecycle

    async def load(self) -> None:
        """Start the managed server (if any), ping the server and load the tokenizer."""
        # OpenAIArgs checks that base_url is an http(s) URL unless the server is managed.
        base_url = await self._start_server() if self.args.managed else str(self.args.base_url)
        http = self._http = self._client(base_url)
        self.protocol = await self._detect_protocol(http)
        await self._check_model(http)
        await self._load_tokenizer()
        self.wire = self._wire_protocol()
        if self.protocol == "sglang":
            http = await self._read_server_info(http, base_url)
        else:
            await self._ping_generate()
        logger.info("openai engine: %s protocol on %s (model %s)", self.protocol, http.where, self.model_name)

    def _client(self, base_url: str) -> HTTPClient:
        own_key = self._server.api_key if self._server is not None else None
        return HTTPClient(
            base_url,
            api_key_env=self.args.api_key_env,
            api_key=own_key,
            timeout_s=self.args.timeout_s,
            max_connections=self.concurrency,
            max_retries=self.args.max_retries,
            backoff_s=self.args.backoff_s,
            on_retry=_log_retry,
            give_up=self._server_died,
            trust_env=not self.args.managed,
        )

    async def _start_server(self) -> str:
        self._server = ManagedServer(
            self.model,
            self.args.server_args,
            start_timeout_s=self.args.server_start_timeout_s,
            adapters=self.adapters,
        )
        await self._server.start()
        return self._server.url

    async def _detect_protocol(self, http: HTTPClient) -> str:
        if self.args.api in ("chat", "completions", "vllm"):
            return self.args.api
        status, info = await http.probe_json("/get_model_info", allow_status=(404, 405))
        if status == 200 and isinstance(info, dict) and "model_path" in info:
            return "sglang"
        if self.args.api == "sglang":
            raise EngineError(
                f"{http.where} is not an SGLang server (GET /get_model_info answered "
                f"HTTP {status}); use api='completions' or 'chat' for OpenAI-compatible servers"
            )
        if self.args.api == "auto":
            status, version = await http.probe_json("/version", allow_status=(404, 405))
            if is_vllm_version(status, version):
                return "vllm"
        return "completions"

    async def _check_model(self, http: HTTPClient) -> None:
        status, listing = await http.probe_json("/v1/models", allow_status=(404, 405, 500, 501))
        cards = listing.get("data") if status == 200 and isinstance(listing, dict) else None
        if not isinstance(cards, list) or not cards:
            logger.warning(
                "openai engine: %s lists no models (GET /v1/models: HTTP %s); the model name is "
                "checked by the first request instead",
                http.where,
                status,
            )
            self.model_name = self.model_name or self.model
            return
        served = [str(card.get("id")) for card in cards]
        self._check_adapters_served(http, served)
        served = [name for name in served if name not in self.adapters]
        if self.model_name is not None and self.model_name not in served:
            raise EngineError(f"model_name {self.model_name!r} is not served by {http.where}; it serves {served}")
        if self.model_name is None:
            if len(served) > 1 and self.model not in served:
                raise EngineError(f"{http.where} serves several models {served}; choose one with model_name")
            self.model_name = self.model if self.model in served else served[0]
        length = cards[served.index(self.model_name)].get("max_model_len")
        self.max_total_tokens = int(length) if isinstance(length, int) and length > 0 else None

    def _check_adapters_served(self, http: HTTPClient, served: list[str]) -> None:
        """Raise :class:`EngineError` when an adapter of the run is not a model the server lists."""
        missing = sorted(set(self.adapters) - set(served))
        if missing:
            raise EngineError(
                f"LoRA adapters {missing} are not served by {http.where} (it serves {served}); serve each under its "
                "adapter name: vLLM `--enable-lora --lora-modules NAME=FOLDER`, SGLang `--enable-lora --lora-paths "
                "NAME=FOLDER`"
            )

    async def _load_tokenizer(self) -> None:
        path = self.args.tokenizer or self.model
        try:
            self._tokenizer = await asyncio.to_thread(load_hf_tokenizer, path)
        except Exception as exc:
            if self.retokenized:
                raise EngineError(
                    f"openai engine: cannot load the tokenizer {path!r} that decodes prompts and "
                    f"re-tokenizes outputs ({type(exc).__name__}: {exc}); set tokenizer=PATH"
                ) from exc
            logger.warning(
                "openai engine: no tokenizer at %r (%s); prompt ids are not checked against the vocabulary", path, exc
            )
            return
        self.vocab_size = len(self._tokenizer)

    def _wire_protocol(self) -> WireProtocol:
        """The protocol object of the detected API."""
        extra = self.args.extra_body
        if self.protocol == "sglang":
            return SGLangNativeProtocol(self.model_name, extra)
        if self.protocol == "vllm":
            return VLLMProtocol(self.model_name, extra)
        return OpenAITextProtocol(self.protocol or "completions", self.model_name, extra, self._tokenizer)

    async def _read_server_info(self, http: HTTPClient, base_url: str) -> HTTPClient:
        """Seeds (deterministic inference) and batch slots of an SGLang server; widen the client's
        concurrency to keep the server's queue fed unless ``max_concurrency`` was given (the client in use)."""
        status, info = await http.probe_json("/get_server_info", allow_status=(404, 405))
        info = info if status == 200 and isinstance(info, dict) else {}
        self._server_seeds = bool(info.get("enable_deterministic_inference"))
        prompts = info.get("max_req_input_len")
        if isinstance(prompts, int) and prompts > 0:  # a continuation's prompt and tokens so far must fit it too
            self.max_total_tokens = min(self.max_total_tokens or request_limit(prompts), request_limit(prompts))
        self.server_capacity = _server_running_requests(info)
        wanted = 2 * (self.server_capacity or 0)
        if "max_concurrency" not in self.engine_args and wanted > self.concurrency:
            self.concurrency = wanted
            self._limit = asyncio.Semaphore(wanted)
            old, http = http, self._client(base_url)
            self._http = http
            await old.close()
            logger.info(
                "openai engine: the server runs %d requests at once; keeping up to %d in flight",
                self.server_capacity,
                wanted,
            )
        return http

    async def _ping_generate(self) -> None:
        request = GenerationRequest("daskgen-ping", [self.health_token_id()], _PING)
        wire, http = self._connection()
        try:
            await wire.send(http, request, Flight())
        except RequestFailed as exc:
            raise EngineError(f"openai engine: a one-token request to {http.where} failed: {exc}") from None

    async def unload(self) -> None:
        """Fail requests in flight, close the client and stop the managed server."""
        for flights in list(self._flights.values()):
            for flight in flights:
                flight.cancel()
        if self._http is not None:
            await self._http.close()
        if self._server is not None:
            await self._server.stop()

    async def health(self) -> None:
        """Raise unless the server process (managed) is alive and one token can be generated.

        Re-tokenized protocols only need an answer: one generated token's text may re-tokenize to
        zero (a stripped EOS) or several tokens.
        """
        self._check_server()
        problem = self.not_serving()
        if problem is not None:
            raise EngineError(problem)
        if not self.retokenized:
            return await super().health()
        result = await self.generate(GenerationRequest("daskgen-health", [self.health_token_id()], _PING))
        if result.error is not None:
            raise EngineError(f"engine 'openai' failed its health check: {result.error}")

    # ------------------------------------------------------------------ requests

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one sample; failures come back as ``error`` (a dead managed server raises)."""
        problem = self.not_serving() or request_error(
            request, vocab_size=self.vocab_size, max_total_tokens=self.max_total_tokens, adapters=self.adapters
        )
        if problem is not None:
            return error_result(request, problem)
        self._check_server()
        flight = Flight()
        self._flights.setdefault(request.request_id, []).append(flight)
        try:
            async with self._limit:
                return await self._run(request, flight)
        finally:
            self._forget(request.request_id, flight)

    async def _run(self, request: GenerationRequest, flight: Flight) -> GenerationResult:
        if flight.aborted:
            return aborted_result(request)
        wire, http = self._connection()
        flight.task = asyncio.ensure_future(wire.send(http, request, flight))
        try:
            await asyncio.wait({flight.task})
        except asyncio.CancelledError:  # the caller gave up: stop the request on the server too
            flight.cancel()
            asyncio.ensure_future(wire.forget(http, flight))
            raise
        if flight.task.cancelled():
            return wire.aborted(request, flight)
        try:
            return flight.task.result()
        except RequestFailed as exc:
            self._check_server()
            if isinstance(exc, NoAnswer):  # not the request's fault: the server is down or hangs (crash())
                self._no_answer = str(exc)
            return error_result(request, str(exc))

    def _connection(self) -> tuple[WireProtocol, HTTPClient]:
        return started(self.name, self.wire), started(self.name, self._http)

    def _server_died(self) -> bool:
        return self._server is not None and self.status is EngineStatus.RUNNING and not self._server.alive

    def _check_server(self) -> None:
        if self._server is not None and self._server_died():
            raise EngineError(f"the managed sglang server {self._server.exit_description()}")

    def crash(self) -> str | None:
        """The last request the server never answered (after its retries), or ``None``.

        A request that errors once the server stopped answering is not the prompt's fault: the worker
        restarts the engine (whose start checks the server) and Dask retries the partition.
        """
        return None if self._no_answer is None else f"the server stopped answering: {self._no_answer}"

    def _forget(self, request_id: str, flight: Flight) -> None:
        flights = self._flights.get(request_id, [])
        with contextlib.suppress(ValueError):
            flights.remove(flight)
        if not flights:
            self._flights.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Abort every in-flight request with this id (unknown ids are ignored)."""
        for flight in list(self._flights.get(request_id, [])):
            flight.aborted = True
            wire, http = self._connection()
            await wire.abort(http, flight)

    def answering(self, request_id: str) -> bool:
        """Whether the server sent output (a token, or text) for a request with this id in flight."""
        return any(f.ids or f.tokens or f.text for f in self._flights.get(request_id, ()))

    async def update_weights(self, path: str) -> None:
        """Load the checkpoint in the folder ``path`` into the managed server in place
        (:func:`~daskgen.engines.openai.server.update_server_weights`); called with no request of the run in flight.

        Raises
        ------
        RefreshError
            The server is not managed (``base_url``: not daskgen's to change), or it refused the checkpoint.
        EngineError
            The managed server died or did not answer.
        """
        if self._server is None:
            raise RefreshError(
                "openai engine: only a server daskgen starts (managed=true) loads new weights in place; the server "
                "at base_url is not daskgen's to change. Use --engine-arg managed=true or an in-process engine "
                "(transformers, sglang, vllm), or run without `refresh`."
            )
        self._check_server()
        try:
            await update_server_weights(started(self.name, self._http), path)
        except EngineError:
            self._check_server()  # a dead server says so (and why)
            raise

    # ------------------------------------------------------------------ misc

    @property
    def capacity(self) -> int:
        """The SGLang server's ``max_running_requests`` when it reports one, else ``max_concurrency``."""
        return self.server_capacity or self.concurrency

    def describe(self) -> dict[str, Any]:
        """Engine identity for the store attrs: protocol, server, model, ``retokenized`` (no secrets)."""
        info = super().describe()
        args = asdict(self.args)
        args["base_url"] = None if self.args.managed else redact_url(self.args.base_url)
        info.update(api=self.protocol or self.args.api, retokenized=self.retokenized, model=self.model)
        info.update(model_name=self.model_name, supports_seed=self.supports_seed)
        info.update(tokenizer=self.args.tokenizer or self.model, engine_args=args, concurrency=self.concurrency)
        info.update(server_max_running_requests=self.server_capacity)
        return info


def _log_retry(what: str, attempt: int, wait: float) -> None:
    logger.warning("openai engine: %s; retry %d in %.1f s", what, attempt, wait)


def _server_running_requests(info: dict[str, Any]) -> int | None:
    """Requests an SGLang server runs at once, from ``GET /get_server_info``, or ``None``."""
    states = info.get("internal_states")
    return max_running_requests(states[0]) if isinstance(states, list) and states else None
