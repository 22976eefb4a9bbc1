"""Whether an engine can serve a request: the checks every engine makes, with the same messages."""

from __future__ import annotations

import math
from collections.abc import Collection

from daskgen.engines.base import GenerationRequest, SamplingParams


def request_error(
    request: GenerationRequest,
    *,
    vocab_size: int | None = None,
    max_total_tokens: int | None = None,
    adapters: Collection[str] = (),
) -> str | None:
    """Why ``request`` cannot be served, or ``None`` when it is valid.

    Shared by the engines so that they reject the same requests with the same messages.
    ``vocab_size`` bounds the prompt token ids; ``max_total_tokens`` bounds prompt length plus
    ``max_new_tokens`` (the engine's context or cache limit); ``adapters`` are the LoRA adapters the engine
    serves (a request's ``adapter`` must be one).
    """
    prompt, params = request.prompt_ids, request.params
    if params.adapter is not None and params.adapter not in adapters:
        loaded = sorted(adapters)
        return f"request {request.request_id!r}: LoRA adapter {params.adapter!r} is not loaded (loaded: {loaded})"
    if len(prompt) == 0:
        return f"request {request.request_id!r}: prompt_ids is empty; a request needs at least one prompt token"
    upper = vocab_size if vocab_size is not None else 2**31
    plain = set(map(type, prompt)) == {int}  # C-speed checks first: this runs for every request
    bad = None
    if not (plain and min(prompt) >= 0 and max(prompt) < upper):  # int subclasses other than bool pass
        bad = next((t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < upper), None)
    if bad is not None:
        return (
            f"request {request.request_id!r}: prompt token {bad!r} is not an integer id in "
            f"[0, {upper}) (the model's vocabulary)"
        )
    problem = _params_error(params)
    if problem is None and not 0 <= params.continued < len(prompt):
        problem = (
            f"continued must be in [0, {len(prompt) - 1}] (the tokens so far follow at least one prompt token), "
            f"got {params.continued!r}"
        )
    if problem is not None:
        return f"request {request.request_id!r}: {problem}"
    total = len(prompt) + params.max_new_tokens
    if max_total_tokens is not None and total > max_total_tokens:
        return (
            f"request {request.request_id!r}: prompt ({len(prompt)} tokens) + max_new_tokens "
            f"({params.max_new_tokens}) = {total} exceeds the engine's limit of {max_total_tokens} tokens"
        )
    return None


def _params_error(params: SamplingParams) -> str | None:
    """The first invalid field of ``params``, described, or ``None``."""
    if not isinstance(params.max_new_tokens, int) or params.max_new_tokens < 1:
        return f"max_new_tokens must be an integer >= 1, got {params.max_new_tokens!r}"
    if not math.isfinite(params.temperature) or params.temperature < 0:
        return f"temperature must be a finite number >= 0 (0 = greedy), got {params.temperature!r}"
    if not 0 < params.top_p <= 1:
        return f"top_p must be in (0, 1], got {params.top_p!r}"
    if not isinstance(params.top_k, int) or params.top_k < 0:
        return f"top_k must be an integer >= 0 (0 = off), got {params.top_k!r}"
    if not isinstance(params.top_logprobs, int) or params.top_logprobs < 0:
        return f"top_logprobs must be an integer >= 0 (0 = off), got {params.top_logprobs!r}"
    if params.seed is not None and not isinstance(params.seed, int):
        return f"seed must be an integer or None, got {params.seed!r}"
    if any(not isinstance(t, int) or t < 0 for t in params.stop_token_ids):
        return f"stop_token_ids must be non-negative integers, got {params.stop_token_ids!r}"
    if not 0 <= params.min_p <= 1 or params.repetition_penalty <= 0:
        return (
            f"min_p must be in [0, 1] and repetition_penalty > 0, got {params.min_p!r}, {params.repetition_penalty!r}"
        )
    if not 0 <= params.min_new_tokens <= params.max_new_tokens:
        return f"min_new_tokens must be in [0, max_new_tokens], got {params.min_new_tokens!r}"
    return None
