"""The conformance check of top-k logprobs (``SamplingParams.top_logprobs``), mixed into
:class:`~daskgen.testing.conformance.EngineConformance`."""

from __future__ import annotations

import math
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from daskgen.engines.base import Engine, GenerationRequest, GenerationResult

__all__ = ["TopLogprobsCheck", "check_top_logprobs"]

_T = TypeVar("_T")
#: Tolerance between a sampled token's logprob and its top-k entry (the same number, maybe rounded).
TOLERANCE = 1e-4


class TopLogprobsCheck:
    """``test_top_logprobs``; the suite it is mixed into provides ``engine``, ``run``, ``one`` and ``request``."""

    engine: ClassVar[Engine]
    top_k_checked: ClassVar[int] = 5

    if TYPE_CHECKING:

        def run(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T: ...

        async def one(self, request: GenerationRequest) -> GenerationResult: ...

        def request(self, rid: str, index: int, **params: Any) -> GenerationRequest: ...

    def test_top_logprobs(self) -> None:
        """``top_logprobs = k``: per output token up to k distinct ids (k when token-exact), logprobs <= 0 sorted
        descending; the sampled token's logprob equals its entry whenever it is among them (else is no larger
        than the last); greedy tokens are the most likely; asking does not change greedy tokens."""
        k = self.top_k_checked
        plain = self.run(self.one(self.request("top-off", 4, max_new_tokens=12)))
        greedy = self.run(self.one(self.request("top-greedy", 4, max_new_tokens=12, logprobs=True, top_logprobs=k)))
        assert greedy.output_ids == plain.output_ids, (greedy.output_ids, plain.output_ids)
        check_top_logprobs(greedy, k, exact=not self.engine.retokenized, greedy=True)
        for i in range(3):
            seed = {"seed": 20 + i} if self.engine.supports_seed else {}
            request = self.request(f"top-{i}", 30 + i, max_new_tokens=16, temperature=1.0, logprobs=True, **seed)
            sampled = self.run(
                self.one(GenerationRequest(request.request_id, request.prompt_ids, _with_top(request, k)))
            )
            check_top_logprobs(sampled, k, exact=not self.engine.retokenized)


def _with_top(request: GenerationRequest, k: int) -> Any:
    return request.params.__class__(**{**request.params.__dict__, "top_logprobs": k})


def check_top_logprobs(result: GenerationResult, k: int, *, exact: bool = True, greedy: bool = False) -> None:
    """Assert the top-k contract on ``result`` (asked with ``logprobs`` and ``top_logprobs = k``)."""
    assert result.top_logprobs is not None and result.logprobs is not None, result
    assert len(result.top_logprobs) == len(result.output_ids), result
    for position, (token, logprob, entries) in enumerate(
        zip(result.output_ids, result.logprobs, result.top_logprobs, strict=True)
    ):
        where = f"position {position}: {entries}"
        ids, values = [t for t, _ in entries], [v for _, v in entries]
        assert (len(ids) == k) if exact else (len(ids) <= k), where
        assert len(set(ids)) == len(ids) and all(isinstance(t, int) for t in ids), where
        assert all(math.isfinite(v) and v <= 1e-6 for v in values), where
        assert all(a >= b for a, b in zip(values, values[1:], strict=False)), where
        if token in ids:
            assert abs(values[ids.index(token)] - logprob) <= TOLERANCE, (token, logprob, where)
        elif exact:
            assert logprob <= values[-1] + TOLERANCE, (token, logprob, where)
        if greedy and exact:
            assert abs(values[0] - logprob) <= TOLERANCE, (token, logprob, where)
