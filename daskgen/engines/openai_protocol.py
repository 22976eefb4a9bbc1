"""Wire formats of the ``openai`` engine: what it sends and how it reads the answers.

* SGLang's native ``POST /generate`` (token ids in and out): :func:`native_payload`,
  :func:`native_result`, both built on :mod:`daskgen.engines.sglang_mapping` (the format the
  in-process sglang engine shares);
* OpenAI ``/v1/completions`` and ``/v1/chat/completions`` (streamed text): :func:`openai_payload`,
  the accumulation of streamed events into a :class:`_Flight`, finish reasons, and the limits
  (stop tokens, ``max_new_tokens``) applied to re-tokenized output (:func:`_apply_limits`).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any

from daskgen.engines.base import FinishReason, GenerationRequest, GenerationResult, error_result
from daskgen.engines.sglang_mapping import FINISH as SGLANG_FINISH
from daskgen.engines.sglang_mapping import result_from_output, sampling_params_for

__all__ = ["native_payload", "native_result", "openai_payload"]

#: OpenAI ``finish_reason`` values (plus SGLang's) and daskgen's reasons.
_FINISH = {
    **SGLANG_FINISH,
    "eos": FinishReason.STOP,
    "tool_calls": FinishReason.STOP,
    "function_call": FinishReason.STOP,
}


@dataclass
class _Flight:
    """One generate() call in progress: what abort() needs and what was streamed so far."""

    rid: str | None = None
    task: asyncio.Task | None = None
    aborted: bool = False
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)

    def reset(self) -> None:
        """Forget partial output (a retry starts over)."""
        self.text, self.logprobs, self.tokens, self.ids = "", [], [], []

    def cancel(self) -> None:
        """Close the connection of the request (the server stops generating)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()


def native_payload(request: GenerationRequest, rid: str, extra_body: dict[str, Any]) -> dict[str, Any]:
    """The body of SGLang's ``POST /generate`` for ``request``."""
    sampling = sampling_params_for(request.params)
    extra = dict(extra_body)
    sampling.update(extra.pop("sampling_params", None) or {})
    return {
        "input_ids": list(request.prompt_ids),
        "sampling_params": sampling,
        "rid": rid,
        "return_logprob": request.params.logprobs,
        "stream": False,
        **extra,
    }


def native_result(request: GenerationRequest, out: Any) -> GenerationResult:
    """Map SGLang's ``/generate`` answer to a :class:`GenerationResult` (token-exact)."""
    if not isinstance(out, dict) or not isinstance(out.get("output_ids"), list):
        return error_result(request, f"unexpected answer from /generate: {str(out)[:300]}")
    result = result_from_output(request, out, error_prefix="server finished with")
    if result.logprobs is not None and len(result.logprobs) != len(result.output_ids):
        return error_result(
            request, f"server returned {len(result.logprobs)} logprobs for {len(result.output_ids)} tokens"
        )
    return result


def openai_payload(
    api: str, model_name: str | None, prompt: str, request: GenerationRequest, extra_body: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """Path and streaming body of an OpenAI completions or chat request for ``prompt``."""
    params = request.params
    body: dict[str, Any] = {
        "model": model_name,
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stream": True,
    }
    if params.top_k > 0:
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["seed"] = params.seed
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        if params.logprobs:
            body["logprobs"] = True
    else:
        body["prompt"] = prompt
        if params.logprobs:
            body["logprobs"] = 1
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    return path, {**body, **extra_body}


def _take_event(event: dict[str, Any], flight: _Flight) -> str | None:
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
    return choice.get("finish_reason")


def _empty_abort(request: GenerationRequest) -> GenerationResult:
    return GenerationResult(request.request_id, [], FinishReason.ABORT, [] if request.params.logprobs else None)


def _finish_reason(finish: str | None) -> tuple[FinishReason, str | None]:
    reason = _FINISH.get(finish or "", FinishReason.ERROR)
    return reason, None if reason != FinishReason.ERROR else f"server finished with {finish!r}"


def _apply_limits(
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
