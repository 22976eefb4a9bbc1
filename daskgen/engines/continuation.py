"""Continuing an interrupted sample from its tokens so far: one rule for every engine and every caller.

Two callers continue samples: a policy refresh under ``continue`` (:mod:`daskgen.worker.refresh`) and a rerun that
finds an aborted sample's tokens in the store (:mod:`daskgen.worker.samples.continuation`).  Both send the prompt
followed by the tokens so far, with the params of :func:`continued_params`:

* ``max_new_tokens``: the tokens the sample had left;
* ``min_new_tokens``: the tokens it still had to make before a stop (0 once it made them);
* ``continued``: how many trailing prompt ids are the sample's own tokens so far
  (:attr:`~daskgen.engines.base.SamplingParams.continued`);
* everything else (stop strings and ids, logprobs, top-k logprobs, the adapter, the seed, per-row sampling) as the
  sample had it.

Some request features keep state over the tokens a sample generated.  An engine continues them exactly only when it
declares them in :attr:`~daskgen.engines.base.Engine.continues` (:data:`CONTINUABLE`); for any other engine
:func:`restart_reason` names the feature and the sample is generated again from its prompt (the run counts it as
regenerated).  Stop strings need no declaration: an engine that does not see the tokens so far may miss a stop string
that begins in them, and the worker's stop rule (:func:`daskgen.engines.stops.settle`) cuts the joined response at
its first stop, so the stored sample is the uninterrupted one.  Greedy samples continue token for token on every
engine.  A seeded sampled sample continues token for token on engines that declare ``seed``; elsewhere its
continuation is a sample of the same distribution, not the same tokens.
"""

from __future__ import annotations

import dataclasses
import logging

from daskgen.engines.base import FinishReason, GenerationRequest, GenerationResult, SamplingParams

__all__ = [
    "CONTINUABLE",
    "continuation_of",
    "continued_params",
    "joined",
    "request_limit",
    "restart_reason",
    "split_prompt",
    "stateful_features",
]

logger = logging.getLogger(__name__)

#: Features whose state a sample's tokens so far carry, with what an engine that continues them exactly does.
CONTINUABLE: dict[str, str] = {
    "structured_outputs": "advances the response format's grammar over the tokens so far",
    "output_penalties": "counts the tokens so far in presence and frequency penalties",
    "seed": "draws the continuation's tokens from the noise of their positions in the whole response",
}


def stateful_features(params: SamplingParams) -> list[str]:
    """The features of ``params`` whose state lives in the tokens generated so far (sorted)."""
    used = []
    if params.presence_penalty or params.frequency_penalty:
        used.append("output_penalties")
    if params.response_format is not None:
        used.append("structured_outputs")
    return used


def restart_reason(params: SamplingParams, continues: frozenset[str]) -> str | None:
    """Why a sample with ``params`` must restart from its prompt on an engine that continues ``continues`` exactly
    (``None``: it can be continued)."""
    missing = [f for f in stateful_features(params) if f not in continues]
    if not missing:
        return None
    return "the engine cannot continue " + " or ".join(missing) + " from a sample's tokens so far"


def request_limit(max_prompt: int) -> int:
    """The largest prompt plus ``max_new_tokens`` of a request whose every continuation fits an engine that takes
    prompts of at most ``max_prompt`` tokens (a continuation's prompt holds all its tokens but the last)."""
    return max_prompt + 1


def split_prompt(prompt_ids: list[int], continued: int) -> tuple[list[int], list[int]]:
    """The ``prompt_ids`` of a request whose params have ``continued`` set, split into the sample's own prompt and
    its tokens so far (the last ``continued`` ids)."""
    cut = len(prompt_ids) - continued
    return prompt_ids[:cut], prompt_ids[cut:]


def continued_params(params: SamplingParams, done: int) -> SamplingParams:
    """The params of the request that generates the rest of a sample with ``params`` whose first ``done`` tokens
    exist (``done`` below ``params.max_new_tokens``)."""
    return dataclasses.replace(
        params,
        max_new_tokens=params.max_new_tokens - done,
        min_new_tokens=max(0, params.min_new_tokens - done),
        continued=params.continued + done,
    )


def continuation_of(
    request: GenerationRequest, partial: GenerationResult, eos: frozenset[int], continues: frozenset[str]
) -> GenerationRequest | None:
    """What goes on from an interrupted ``partial`` result of ``request`` on an engine that continues ``continues``
    exactly (:attr:`~daskgen.engines.base.Engine.continues`):

    * ``None`` when the sample had ended anyway; its finish reason is then set (``stop`` after a stop token,
      ``length`` with no tokens left);
    * ``request`` itself when the sample starts again from its prompt: it has no tokens yet, or the engine cannot
      continue one of its features (:func:`restart_reason`, logged);
    * else the continuation: the prompt followed by the tokens so far, with :func:`continued_params`.
    """
    if partial.finish_reason != FinishReason.ABORT:
        return None
    done, params = partial.output_ids, request.params
    if done and done[-1] in eos | set(params.stop_token_ids):
        partial.finish_reason = FinishReason.STOP
        return None
    if params.max_new_tokens - len(done) <= 0:
        partial.finish_reason = FinishReason.LENGTH
        return None
    if not done:
        return request
    if (why := restart_reason(params, continues)) is not None:
        logger.info("daskgen: sample %s starts again from its prompt: %s", request.request_id, why)
        return request
    return GenerationRequest(request.request_id, [*request.prompt_ids, *done], continued_params(params, len(done)))


def joined(head: GenerationResult, tail: GenerationResult) -> GenerationResult:
    """``head``'s tokens followed by ``tail``'s (logprobs and top-k entries too), ending as ``tail`` ends."""
    n = len(head.output_ids)
    logprobs = None if head.logprobs is None else [*head.logprobs[:n], *(tail.logprobs or [])]
    top = None if head.top_logprobs is None else [*head.top_logprobs[:n], *(tail.top_logprobs or [])]
    return GenerationResult(
        head.request_id,
        [*head.output_ids, *tail.output_ids],
        tail.finish_reason,
        logprobs,
        tail.error,
        {**head.meta, **tail.meta},
        top,
    )
