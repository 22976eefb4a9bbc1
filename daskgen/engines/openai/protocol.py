"""The ``openai`` engine's wire protocols: one object per HTTP API, chosen once at start.

Each protocol knows how to send one request, read the answer, abort a request in flight and
build the result of an aborted one; :class:`~daskgen.engines.openai.engine.OpenAIEngine` only holds
the connection, the concurrency limit and the requests in flight (:class:`Flight`).

* :class:`SGLangNativeProtocol`: SGLang's ``POST /generate``, token ids in and out
  (:func:`native_payload`, :func:`native_result`, built on :mod:`daskgen.engines.sglang.mapping`,
  the format the in-process sglang engine shares); aborts post ``/abort_request``;
* :class:`OpenAITextProtocol`: OpenAI ``/v1/completions`` and ``/v1/chat/completions`` (streamed
  text, re-tokenized): :func:`openai_payload`, :func:`take_event`, and the limits (stop tokens,
  ``max_new_tokens``) applied to re-tokenized output (:func:`apply_limits`);
* ``VLLMProtocol`` (token ids through vLLM's completions) lives in :mod:`daskgen.engines.openai.vllm_protocol`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from daskgen import tunables
from daskgen.engines.base import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    aborted_result,
    error_result,
    finish_from_name,
    shaping_kwargs,
)
from daskgen.engines.media import data_urls
from daskgen.engines.openai.native_images import expansion_problem, image_fields
from daskgen.engines.openai.top_logprobs import ServerTop, retokenized_top, server_top
from daskgen.engines.sglang.mapping import logprob_request, result_from_output, sampling_params_for
from daskgen.engines.vllm.mapping import vllm_structured_outputs

if TYPE_CHECKING:
    from daskgen.engines.openai.client import HTTPClient
    from daskgen.input.response_format import ResponseFormat

__all__ = [
    "Flight",
    "OpenAITextProtocol",
    "SGLangNativeProtocol",
    "WireProtocol",
    "apply_limits",
    "native_payload",
    "native_result",
    "openai_payload",
    "take_event",
]


@dataclass
class Flight:
    """One generate() call in progress: what abort() needs and what was streamed so far."""

    rid: str | None = None
    task: asyncio.Task | None = None
    aborted: bool = False
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    #: The stop string the server says it matched (vLLM's ``stop_reason``, SGLang's ``matched_stop``).
    matched: Any = None
    top: ServerTop = field(default_factory=list)

    def reset(self) -> None:
        """Forget partial output (a retry starts over)."""
        self.text, self.logprobs, self.tokens, self.ids, self.matched, self.top = "", [], [], [], None, []

    def cancel(self) -> None:
        """Close the connection of the request (the server stops generating)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()


class WireProtocol:
    """How the ``openai`` engine talks to one kind of server (subclasses implement :meth:`send`).

    Parameters
    ----------
    model_name:
        The model named in OpenAI request bodies.
    extra_body:
        Merged into every request body.
    """

    #: The ``api`` name (``describe()["api"]``).
    name = ""
    #: True when outputs are text re-tokenized by daskgen.
    retokenized = False

    def __init__(self, model_name: str | None, extra_body: dict[str, Any]) -> None:
        self.model_name = model_name
        self.extra_body = extra_body

    async def send(self, http: HTTPClient, request: GenerationRequest, flight: Flight) -> GenerationResult:
        """Send ``request`` (retrying per the client's policy) and return its result."""
        raise NotImplementedError

    def aborted(self, request: GenerationRequest, flight: Flight) -> GenerationResult:
        """The result of a request whose connection was closed by an abort."""
        return aborted_result(request)

    async def abort(self, http: HTTPClient, flight: Flight) -> None:
        """Stop the request of ``flight`` (default: close its connection)."""
        flight.cancel()

    async def forget(self, http: HTTPClient, flight: Flight) -> None:
        """Tell the server a cancelled caller no longer wants ``flight`` (default: nothing to tell)."""


class SGLangNativeProtocol(WireProtocol):
    """SGLang's native ``POST /generate``: token ids in and out (token-exact)."""

    name = "sglang"

    async def send(self, http: HTTPClient, request: GenerationRequest, flight: Flight) -> GenerationResult:
        """Post one request with ``rid = "<request_id>#<random>"`` (what :meth:`abort` names)."""
        flight.rid = f"{request.request_id}#{uuid.uuid4().hex[:12]}"
        images = request.params.images
        urls = await asyncio.to_thread(data_urls, images) if images else []
        out = await http.post_json("/generate", native_payload(request, flight.rid, self.extra_body, urls))
        return native_result(request, out)

    async def abort(self, http: HTTPClient, flight: Flight) -> None:
        """Post ``/abort_request`` (the answer returns ``ABORT``); close the connection after a grace period."""
        if flight.rid is None:
            flight.cancel()
            return
        await self.forget(http, flight)
        asyncio.get_running_loop().call_later(tunables.seconds("http.abort-grace"), flight.cancel)

    async def forget(self, http: HTTPClient, flight: Flight) -> None:
        """Post ``/abort_request`` for the flight's rid, ignoring failures."""
        from daskgen.engines.openai.client import RequestFailed

        if flight.rid is not None:
            with contextlib.suppress(RequestFailed):
                await http.post_json("/abort_request", {"rid": flight.rid}, retry=False)


class OpenAITextProtocol(WireProtocol):
    """OpenAI completions or chat, streamed as text and re-tokenized with ``tokenizer``."""

    retokenized = True

    def __init__(self, api: str, model_name: str | None, extra_body: dict[str, Any], tokenizer: Any) -> None:
        super().__init__(model_name, extra_body)
        self.name = api
        self.tokenizer = tokenizer

    async def send(self, http: HTTPClient, request: GenerationRequest, flight: Flight) -> GenerationResult:
        """Decode the prompt, stream the answer's text into ``flight`` and re-tokenize it."""
        prompt = self.tokenizer.decode(
            request.prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        path, payload = openai_payload(self.name, self.model_name, prompt, request, self.extra_body)
        finish = await http.stream(path, payload, lambda event: take_event(event, flight), on_attempt=flight.reset)
        return self.result(request, flight, finish)

    def aborted(self, request: GenerationRequest, flight: Flight) -> GenerationResult:
        """The re-tokenized text so far, without its last (possibly cut) token."""
        return self.result(request, flight, None, partial=True)

    def result(
        self, request: GenerationRequest, flight: Flight, finish: str | None, partial: bool = False
    ) -> GenerationResult:
        """Re-tokenize the streamed text; align logprobs; apply the request's limits."""
        ids = self.tokenizer.encode(
            with_stop_text(flight.text, flight.matched, request.params.stop), add_special_tokens=False
        )
        if partial:
            ids = ids[:-1]
        params, aligned = request.params, self.aligned(ids, flight)
        logprobs = (flight.logprobs[: len(ids)] if aligned else [math.nan] * len(ids)) if params.logprobs else None
        reason, error = finish_from_name(finish, "server") if not partial else (FinishReason.ABORT, None)
        ids, logprobs, reason = apply_limits(ids, logprobs, reason, request)
        meta: dict[str, Any] = {"retokenized": True, "server_finish_reason": finish}
        if params.logprobs and logprobs is not None and any(math.isnan(x) for x in logprobs):
            meta["logprobs"] = "unavailable"
        top = None
        if params.top_logprobs:
            top = retokenized_top(flight.top[: len(ids)], params.top_logprobs, self.tokenizer) if aligned else []
            top += [[] for _ in range(len(ids) - len(top))]
            if ids and not any(top):
                meta["top_logprobs"] = "unavailable"
        return GenerationResult(request.request_id, ids, reason, logprobs, error=error, meta=meta, top_logprobs=top)

    def aligned(self, ids: list[int], flight: Flight) -> bool:
        """Whether the server's tokens (of its logprobs) decode like ``ids``: then its logprobs are theirs."""
        pieces = [self.tokenizer.decode([i]) for i in ids]
        return len(flight.logprobs) >= len(ids) and flight.tokens[: len(ids)] == pieces


# --------------------------------------------------------------------------- payloads and answers


def native_payload(
    request: GenerationRequest, rid: str, extra_body: dict[str, Any], image_urls: Sequence[str] = ()
) -> dict[str, Any]:
    """The body of SGLang's ``POST /generate`` for ``request`` (``image_urls``: its images' data URLs)."""
    sampling = sampling_params_for(request.params)
    extra = dict(extra_body)
    sampling.update(extra.pop("sampling_params", None) or {})
    return {
        "input_ids": list(request.prompt_ids),
        "sampling_params": sampling,
        "rid": rid,
        **logprob_request(request.params),
        **({"lora_path": request.params.adapter} if request.params.adapter else {}),
        "stream": False,
        **image_fields(request, image_urls),
        **extra,
    }


def native_result(request: GenerationRequest, out: Any) -> GenerationResult:
    """Map SGLang's ``/generate`` answer to a :class:`GenerationResult` (token-exact)."""
    if not isinstance(out, dict) or not isinstance(out.get("output_ids"), list):
        return error_result(request, f"unexpected answer from /generate: {str(out)[:300]}")
    if (problem := expansion_problem(request, out)) is not None:
        return error_result(request, problem)
    result = result_from_output(request, out, source="server")
    for name, values in (("logprobs", result.logprobs), ("top_logprobs", result.top_logprobs)):
        if values is not None and len(values) != len(result.output_ids):
            return error_result(request, f"server returned {len(values)} {name} for {len(result.output_ids)} tokens")
    return result


def openai_payload(
    api: str, model_name: str | None, prompt: str, request: GenerationRequest, extra_body: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """Path and streaming body of an OpenAI completions or chat request for ``prompt`` (a request's LoRA adapter
    is the served model it names)."""
    params = request.params
    body: dict[str, Any] = {
        "model": params.adapter or model_name,
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stream": True,
    }
    if params.top_k > 0:
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["seed"] = params.seed
    body.update(shaping_kwargs(params, {"min_new_tokens": "min_tokens"}))
    if params.stop:
        body["stop"] = list(params.stop)
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        if params.logprobs or params.top_logprobs:
            body["logprobs"] = True
        if params.top_logprobs:
            body["top_logprobs"] = params.top_logprobs
    else:
        body["prompt"] = prompt
        if params.logprobs or params.top_logprobs:
            body["logprobs"] = max(1, params.top_logprobs)
    if params.response_format is not None:
        body.update(openai_response_format(params.response_format))
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    return path, {**body, **extra_body}


def openai_response_format(fmt: ResponseFormat) -> dict[str, Any]:
    """The request fields of a format for an OpenAI-compatible server: a JSON schema as OpenAI's
    ``response_format``; a regex, choice or grammar as vLLM's ``structured_outputs`` (other servers: send
    their own fields in ``extra_body``, or use ``api="sglang"``/``"vllm"``, which map every format natively)."""
    if fmt.kind == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "response", "schema": fmt.schema}}}
    return {"structured_outputs": vllm_structured_outputs(fmt)}


def take_event(event: dict[str, Any], flight: Flight) -> str | None:
    """Add one streamed chunk to ``flight``; return its finish reason, if it has one."""
    choices = event.get("choices") or []
    if not choices:
        return None
    choice = choices[0]
    delta = choice.get("delta") or choice.get("message")  # a stream chunk, or a whole chat answer
    flight.text += (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")
    logprobs = choice.get("logprobs") or {}
    if isinstance(logprobs.get("content"), list):  # chat
        for item in logprobs["content"]:
            flight.tokens.append(item.get("token", ""))
            flight.logprobs.append(float(item.get("logprob", math.nan)))
    elif isinstance(logprobs.get("token_logprobs"), list):  # completions
        flight.tokens += [str(t) for t in logprobs.get("tokens") or []]
        flight.logprobs += [math.nan if x is None else float(x) for x in logprobs["token_logprobs"]]
    flight.matched = choice.get("stop_reason", choice.get("matched_stop", flight.matched))
    flight.top += server_top(logprobs)
    return choice.get("finish_reason")


def with_stop_text(text: str, matched: Any, stop: tuple[str, ...]) -> str:
    """``text`` with the stop string the server matched (and left out, as OpenAI servers do) put back."""
    return text + matched if isinstance(matched, str) and matched in stop and not text.endswith(matched) else text


def apply_limits(
    ids: list[int], logprobs: list[float] | None, reason: FinishReason, request: GenerationRequest
) -> tuple[list[int], list[float] | None, FinishReason]:
    """Cut re-tokenized output at the first stop token (kept) or at ``max_new_tokens``."""
    stops = set(request.params.stop_token_ids)
    cut = next((i + 1 for i, t in enumerate(ids) if t in stops), None)
    if cut is not None and cut <= request.params.max_new_tokens and reason != FinishReason.ERROR:
        reason = FinishReason.STOP
    else:
        cut = len(ids)
    if cut > request.params.max_new_tokens:
        cut = request.params.max_new_tokens
        reason = FinishReason.LENGTH if reason != FinishReason.ERROR else reason
    return ids[:cut], None if logprobs is None else logprobs[:cut], reason
