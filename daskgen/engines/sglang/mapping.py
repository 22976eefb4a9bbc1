"""SGLang's request and output format, written once for both SGLang engines.

The in-process engine (:mod:`daskgen.engines.sglang.engine`, ``sglang.Engine.async_generate``) and the
HTTP engine's native protocol (:mod:`daskgen.engines.openai.protocol`, ``POST /generate``) speak the same
dialect: ``input_ids`` plus a ``sampling_params`` dict in, ``output_ids`` plus ``meta_info``
(``finish_reason.type``, ``output_token_logprobs``, ``output_top_logprobs``, ``prompt_tokens``,
``cached_tokens``) out.
This module maps daskgen's :class:`~daskgen.engines.base.SamplingParams` to that dict and an
output dict back to a :class:`~daskgen.engines.base.GenerationResult`.  Pure functions, no imports
of sglang.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from daskgen.engines.base import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    TopLogprobs,
    finish_from_name,
    shaping_kwargs,
)

if TYPE_CHECKING:
    from daskgen.input.response_format import ResponseFormat

__all__ = [
    "logprob_request",
    "logprobs_of",
    "max_running_requests",
    "result_from_output",
    "sampling_params_for",
    "sglang_constraint",
    "top_logprobs_of",
]

#: ``meta_info`` keys copied into ``GenerationResult.meta``.
META_KEYS = ("prompt_tokens", "cached_tokens")


def sampling_params_for(params: SamplingParams) -> dict[str, Any]:
    """sglang's ``sampling_params`` dict for daskgen's :class:`SamplingParams`.

    ``top_k == 0`` (off) becomes sglang's ``-1``; ``temperature == 0`` is greedy in both.
    """
    out: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = sorted(set(params.stop_token_ids))
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    out.update(shaping_kwargs(params, {}))
    if params.stop:  # matched on sglang's detokenized text; no_stop_trim keeps the stop in the output
        out.update(stop=list(params.stop), no_stop_trim=True)
    if params.response_format is not None:
        out.update(sglang_constraint(params.response_format))
    return out


def sglang_constraint(fmt: ResponseFormat) -> dict[str, str]:
    """sglang's sampling field of a ``response_format``: ``json_schema`` (text), ``regex``, or ``ebnf`` (a grammar,
    or the choices as an EBNF alternation: sglang has no choice field)."""
    if fmt.kind in ("json_schema", "regex"):
        return {fmt.kind: str(fmt.value)}
    return {"ebnf": fmt.ebnf()}


def logprobs_of(meta: Mapping[str, Any]) -> list[float]:
    """The sampled tokens' logprobs from ``meta_info.output_token_logprobs`` (``[logprob, id, text]`` entries)."""
    return [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]


def logprob_request(params: SamplingParams) -> dict[str, Any]:
    """The request fields asking for logprobs: ``return_logprob`` (also needed for top-k) and ``top_logprobs_num``."""
    out: dict[str, Any] = {"return_logprob": params.logprobs or params.top_logprobs > 0}
    if params.top_logprobs:
        out["top_logprobs_num"] = params.top_logprobs
    return out


def top_logprobs_of(meta: Mapping[str, Any]) -> TopLogprobs:
    """Each position's ``(id, logprob)`` pairs from ``meta_info.output_top_logprobs`` (``[logprob, id, text]``
    entries; ``None`` for a position without any)."""
    return [[(int(e[1]), float(e[0])) for e in entries or []] for entries in meta.get("output_top_logprobs") or []]


def result_from_output(
    request: GenerationRequest, output: Mapping[str, Any], source: str = "sglang"
) -> GenerationResult:
    """Turn one SGLang output dict (``async_generate`` or ``/generate``) into a :class:`GenerationResult`.

    ``meta_info.finish_reason.type`` is mapped by :func:`~daskgen.engines.base.finish_from_name`;
    an unknown one gives ``ERROR`` with the message ``f"{source} finished with {kind!r}"``.
    """
    meta = output.get("meta_info") or {}
    raw = meta.get("finish_reason")
    finish, error = finish_from_name(raw.get("type") if isinstance(raw, Mapping) else raw, source)
    tokens = [int(t) for t in output.get("output_ids") or []]
    logprobs = logprobs_of(meta) if request.params.logprobs else None
    top = top_logprobs_of(meta) if request.params.top_logprobs else None
    extra = {k: meta[k] for k in META_KEYS if k in meta}
    return GenerationResult(request.request_id, tokens, finish, logprobs, error=error, meta=extra, top_logprobs=top)


def max_running_requests(state: Any) -> int | None:
    """Requests an SGLang scheduler runs at once, from one entry of its internal states, or ``None``.

    ``effective_max_running_requests_per_dp`` times ``dp_size`` (sglang 0.5.23), as reported by
    ``tokenizer_manager.get_internal_state()`` and by the server's ``GET /get_server_info``
    (``internal_states``); ``None`` for another shape (another version, or not SGLang).
    """
    try:
        return int(state["effective_max_running_requests_per_dp"]) * int(state.get("dp_size") or 1)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
