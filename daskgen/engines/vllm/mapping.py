"""vLLM's request and output format: daskgen's sampling params in, streamed ``RequestOutput`` deltas out.

:func:`vllm_sampling_kwargs` gives the ``vllm.SamplingParams`` of one sample;
:func:`collect_output` adds a streamed delta to a :class:`CollectedOutput` and
:func:`result_from_collected` turns it into a :class:`~daskgen.engines.base.GenerationResult`.
Pure functions, no imports of vllm.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from daskgen.engines.base import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    TopLogprobs,
    error_result,
    finish_from_name,
    shaping_kwargs,
)

if TYPE_CHECKING:
    from daskgen.input.response_format import ResponseFormat

__all__ = [
    "CollectedOutput",
    "collect_output",
    "result_from_collected",
    "vllm_sampling_kwargs",
    "vllm_structured_outputs",
]


def vllm_sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """``vllm.SamplingParams`` keyword arguments for daskgen's :class:`SamplingParams` (one sample).

    ``top_k == 0`` is off in both; ``temperature == 0`` is greedy in both.  ``logprobs=0`` asks for
    the sampled token's logprob only, ``logprobs=k`` also for the ``k`` most likely tokens'.
    """
    out: dict[str, Any] = {
        "n": 1,
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "seed": params.seed,
        "detokenize": False,
        "logprobs": params.top_logprobs if params.top_logprobs else 0 if params.logprobs else None,
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = sorted(set(params.stop_token_ids))
    out.update(shaping_kwargs(params, {"min_new_tokens": "min_tokens"}))
    if params.stop:  # vLLM matches stop strings on its detokenized text; the stop text stays in the output
        out.update(stop=list(params.stop), include_stop_str_in_output=True, detokenize=True)
    if params.response_format is not None:
        out["structured_outputs"] = vllm_structured_outputs(params.response_format)
    return out


def vllm_structured_outputs(fmt: ResponseFormat) -> dict[str, Any]:
    """The fields of vLLM's ``StructuredOutputsParams`` (and its servers' ``structured_outputs``) for a format."""
    names = {"json_schema": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}
    return {names[fmt.kind]: fmt.as_dict()[fmt.kind]}


@dataclasses.dataclass
class CollectedOutput:
    """What the stream of one request delivered so far."""

    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top: TopLogprobs = dataclasses.field(default_factory=list)
    finish: str | None = None
    cached_tokens: int | None = None


def collect_output(acc: CollectedOutput, output: Any, k: int = 0) -> None:
    """Add one ``RequestOutput`` delta (``outputs[0]``) to ``acc`` (with the ``k`` most likely tokens of each
    position when ``k > 0``)."""
    if getattr(output, "num_cached_tokens", None) is not None:
        acc.cached_tokens = int(output.num_cached_tokens)
    completion = output.outputs[0] if output.outputs else None
    if completion is None:
        return
    new = [int(t) for t in completion.token_ids]
    acc.tokens += new
    if completion.logprobs is not None:
        for token, entry in zip(new, list(completion.logprobs)[-len(new) :] if new else [], strict=True):
            acc.logprobs.append(float(entry[token].logprob))
            if k:
                acc.top.append(_top_entries(entry, k))
    if completion.finish_reason is not None:
        acc.finish = str(completion.finish_reason)


def _top_entries(entry: Any, k: int) -> list[tuple[int, float]]:
    """The ``k`` entries of rank 1..k of one position's ``{token_id: Logprob}`` (vLLM adds the sampled token)."""
    ranked = sorted(
        (lp.rank, int(t), float(lp.logprob)) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k
    )
    return [(t, v) for _, t, v in ranked]


def result_from_collected(request: GenerationRequest, acc: CollectedOutput) -> GenerationResult:
    """The :class:`GenerationResult` of a finished (or aborted) stream."""
    finish, error = finish_from_name(acc.finish, "vllm")
    logprobs = list(acc.logprobs) if request.params.logprobs else None
    top = list(acc.top) if request.params.top_logprobs else None
    for name, values in (("logprobs", logprobs), ("top_logprobs", top)):
        if values is not None and len(values) != len(acc.tokens):
            return error_result(request, f"vllm returned {len(values)} {name} for {len(acc.tokens)} tokens")
    meta = {} if acc.cached_tokens is None else {"cached_tokens": acc.cached_tokens}
    return GenerationResult(
        request.request_id, list(acc.tokens), finish, logprobs, error=error, meta=meta, top_logprobs=top
    )
