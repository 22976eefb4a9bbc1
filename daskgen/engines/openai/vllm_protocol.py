"""The ``openai`` engine's token-exact protocol for vLLM servers (``api="vllm"``).

vLLM's OpenAI-compatible ``POST /v1/completions`` takes the prompt as a list of token ids and,
with ``return_token_ids: true``, streams the generated ids (``choices[0].token_ids``, one delta
per chunk) next to the text; with ``logprobs: 1`` each chunk's ``token_logprobs`` line up with
its ``token_ids``, and with ``logprobs: k`` plus ``return_tokens_as_token_ids`` its ``top_logprobs``
name their tokens ``token_id:<id>``.  vLLM-specific sampling fields (``top_k``, ``seed``, ``stop_token_ids``,
``min_tokens``, ``min_p``, ``repetition_penalty``, ``include_stop_str_in_output``) are accepted in the same body.
Nothing is re-tokenized.  A request with images goes through vLLM's tokens-in API instead
(:mod:`daskgen.engines.openai.vllm_images`).  Tested against ``vllm serve`` 0.32.0.

A server is recognised as vLLM by ``GET /version`` answering ``{"version": ...}``.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Any

from daskgen.engines.base import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    error_result,
    finish_from_name,
    shaping_kwargs,
)
from daskgen.engines.media import data_urls
from daskgen.engines.openai.protocol import Flight, WireProtocol
from daskgen.engines.openai.top_logprobs import ServerTop, server_top, token_id_top
from daskgen.engines.openai.vllm_images import (
    GENERATE_PATH,
    SCALE_OUT_HINT,
    ExpansionMismatch,
    first_choice,
    generate_payload,
    take_generate_event,
)
from daskgen.engines.vllm.mapping import vllm_structured_outputs

if TYPE_CHECKING:
    from daskgen.engines.openai.client import HTTPClient

__all__ = ["VLLMProtocol", "is_vllm_version", "take_vllm_event", "vllm_completions_payload", "vllm_result"]


class VLLMProtocol(WireProtocol):
    """vLLM's ``/v1/completions`` with token ids in and ``return_token_ids`` out (token-exact)."""

    name = "vllm"

    async def send(self, http: HTTPClient, request: GenerationRequest, flight: Flight) -> GenerationResult:
        """Stream one request's token ids (and logprobs) into ``flight``."""
        if request.params.images:
            return await self._send_with_images(http, request, flight)
        finish = await http.stream(
            "/v1/completions",
            vllm_completions_payload(self.model_name, request, self.extra_body),
            lambda event: take_vllm_event(event, flight.ids, flight.logprobs, flight.top),
            on_attempt=flight.reset,
        )
        return vllm_result(request, flight.ids, flight.logprobs, finish, top=flight.top)

    async def _send_with_images(self, http: HTTPClient, request: GenerationRequest, flight: Flight) -> GenerationResult:
        from daskgen.engines.openai.client import StatusFailure

        urls = await asyncio.to_thread(data_urls, request.params.images)  # decoded once per image, off the loop
        try:
            finish = await http.stream(
                GENERATE_PATH,
                generate_payload(self.model_name, request, self.extra_body, urls),
                lambda event: take_generate_event(request, event, flight.ids, flight.logprobs, flight.top),
                on_attempt=flight.reset,
            )
        except ExpansionMismatch as exc:
            return error_result(request, str(exc))
        except StatusFailure as exc:
            if exc.status in (403, 404):  # not served: started without --enable-scale-out
                return error_result(request, f"{exc}; {SCALE_OUT_HINT}")
            raise
        return vllm_result(request, flight.ids, flight.logprobs, finish, top=flight.top)

    def aborted(self, request: GenerationRequest, flight: Flight) -> GenerationResult:
        """The tokens streamed before the abort closed the connection."""
        n = len(flight.ids)
        return vllm_result(request, flight.ids, flight.logprobs[:n], None, aborted=True, top=flight.top[:n])


def is_vllm_version(status: int, info: Any) -> bool:
    """Whether ``GET /version`` answered like a vLLM server."""
    return status == 200 and isinstance(info, dict) and isinstance(info.get("version"), str)


def vllm_completions_payload(
    model_name: str | None, request: GenerationRequest, extra_body: dict[str, Any]
) -> dict[str, Any]:
    """The streaming ``/v1/completions`` body for ``request`` (prompt as token ids; its LoRA adapter is the served
    model it names)."""
    params = request.params
    body: dict[str, Any] = {
        "model": params.adapter or model_name,
        "prompt": list(request.prompt_ids),
        "stream": True,
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "return_token_ids": True,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.stop_token_ids:
        body["stop_token_ids"] = sorted(set(params.stop_token_ids))
    body.update(shaping_kwargs(params, {"min_new_tokens": "min_tokens"}))
    if params.stop:
        body.update(stop=list(params.stop), include_stop_str_in_output=True)
    if params.logprobs or params.top_logprobs:
        body["logprobs"] = max(1, params.top_logprobs)
    if params.top_logprobs:
        body["return_tokens_as_token_ids"] = True
    if params.response_format is not None:
        body["structured_outputs"] = vllm_structured_outputs(params.response_format)
    return {**body, **extra_body}


def take_vllm_event(
    event: dict[str, Any], ids: list[int], logprobs: list[float], top: ServerTop | None = None
) -> str | None:
    """Append one streamed chunk's token ids (and logprobs, top logprobs) to ``ids``/``logprobs``/``top``;
    return its finish reason."""
    choice, new = first_choice(event)
    if choice is None:
        return None
    ids += new
    values = (choice.get("logprobs") or {}).get("token_logprobs")
    if isinstance(values, list):
        logprobs += [math.nan if x is None else float(x) for x in values[-len(new) :]] if new else []
    if top is not None and new:
        top += server_top(choice.get("logprobs") or {})[-len(new) :]
    return choice.get("finish_reason")


def vllm_result(
    request: GenerationRequest,
    ids: list[int],
    logprobs: list[float],
    finish: str | None,
    aborted: bool = False,
    top: ServerTop | None = None,
) -> GenerationResult:
    """The :class:`GenerationResult` of a (finished or aborted) vLLM stream."""
    reason, error = (FinishReason.ABORT, None) if aborted else finish_from_name(finish, "server")
    k = request.params.top_logprobs
    lps = list(logprobs) if request.params.logprobs else None
    tops = token_id_top(top or [], k) if k else None
    for name, values in (("logprobs", lps), ("top_logprobs", tops)):
        if values is not None and len(values) != len(ids):
            return error_result(request, f"server returned {len(values)} {name} for {len(ids)} tokens")
    return GenerationResult(request.request_id, list(ids), reason, lps, error=error, top_logprobs=tops)
