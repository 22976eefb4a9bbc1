"""The continuation rule (daskgen.engines.continuation), on its own: what goes on from an interrupted sample."""

from __future__ import annotations

import pytest

from daskgen.engines import available_engines, get_engine_class
from daskgen.engines.base import FinishReason, GenerationRequest, GenerationResult, SamplingParams
from daskgen.engines.continuation import CONTINUABLE, continuation_of, request_limit, split_prompt
from daskgen.input.response_format import ResponseFormat

PROMPT = [5, 6, 7]


def _partial(ids: list[int], finish: FinishReason = FinishReason.ABORT) -> GenerationResult:
    return GenerationResult("r", ids, finish)


def _request(**params) -> GenerationRequest:
    return GenerationRequest("r", PROMPT, SamplingParams(**{"max_new_tokens": 10, **params}))


def test_a_continuation_asks_for_what_is_left_and_says_how_many_tokens_are_the_samples_own() -> None:
    request = _request(min_new_tokens=8, stop=("x",), top_logprobs=2, adapter="a", seed=3)
    rest = continuation_of(request, _partial([1, 2, 3]), frozenset({0}), frozenset())
    assert rest is not None and rest is not request
    assert rest.prompt_ids == [*PROMPT, 1, 2, 3]
    assert (rest.params.max_new_tokens, rest.params.min_new_tokens, rest.params.continued) == (7, 5, 3)
    assert (rest.params.stop, rest.params.top_logprobs, rest.params.adapter, rest.params.seed) == (("x",), 2, "a", 3)
    assert split_prompt(rest.prompt_ids, rest.params.continued) == (PROMPT, [1, 2, 3])
    again = continuation_of(rest, _partial([4, 5, 6, 7, 8]), frozenset({0}), frozenset())
    assert again is not None and again.params.continued == 8 and again.params.min_new_tokens == 0


@pytest.mark.parametrize(
    ("params", "feature"),
    [
        ({"presence_penalty": 0.5}, "output_penalties"),
        ({"frequency_penalty": 0.5}, "output_penalties"),
        ({"response_format": ResponseFormat.parse({"regex": "[a-z]+"})}, "structured_outputs"),
    ],
)
def test_a_feature_the_engine_cannot_continue_starts_the_sample_again(params, feature) -> None:
    request = _request(**params)
    assert continuation_of(request, _partial([1, 2]), frozenset(), frozenset()) is request
    continued = continuation_of(request, _partial([1, 2]), frozenset(), frozenset({feature}))
    assert continued is not None and continued is not request and continued.params.continued == 2


def test_nothing_so_far_starts_again_and_an_ended_sample_is_finished() -> None:
    request = _request(stop_token_ids=(9,))
    assert continuation_of(request, _partial([]), frozenset(), frozenset()) is request
    for ids, eos, finish in (([1, 9], frozenset(), FinishReason.STOP), ([1, 0], frozenset({0}), FinishReason.STOP)):
        partial = _partial(ids)
        assert continuation_of(request, partial, eos, frozenset()) is None and partial.finish_reason == finish
    spent = _partial(list(range(10, 20)))
    assert continuation_of(request, spent, frozenset(), frozenset()) is None
    assert spent.finish_reason == FinishReason.LENGTH
    assert continuation_of(request, _partial([1], FinishReason.LENGTH), frozenset(), frozenset()) is None


def test_every_continuation_of_a_request_within_the_limit_fits_the_prompt_limit() -> None:
    max_prompt = 2042
    total = request_limit(max_prompt)
    for new in (1, 16, 300):
        prompt = total - new
        assert prompt + (new - 1) <= max_prompt  # the longest continuation's prompt: all but the last new token


def test_engines_declare_only_known_continuable_features() -> None:
    for name in available_engines():
        engine = get_engine_class(name)
        assert set(engine.continues) <= set(CONTINUABLE), (name, engine.continues)
