"""The conformance checks of continuations: an interrupted sample continued from its tokens so far is the sample.

:class:`ContinuationChecks` is mixed into :class:`~daskgen.testing.conformance.EngineConformance`.  Each case
generates a request uninterrupted, then again as an attempt interrupted after ``k`` tokens (the same request capped
at ``k`` tokens: under greedy decoding exactly the tokens an abort after ``k`` tokens leaves) that is continued the
way the worker continues one (:mod:`daskgen.engines.continuation`: the same request built by
:func:`~daskgen.engines.continuation.continuation_of`, the same restart rule, the same stop rule,
:func:`~daskgen.engines.stops.settle`).  Under greedy decoding the two must be equal token for token, with the same
finish and ``stop_reason``; a case whose feature the engine cannot continue must be restarted, never failed.
Cases run for the features the engine declares; ``min_new_tokens`` above the interruption point, stop ids, a stop
string that begins in the tokens so far, each kind of ``response_format``, penalties, top-k logprobs and seeds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

from daskgen.engines.base import FinishReason, GenerationRequest, GenerationResult
from daskgen.engines.continuation import continuation_of, joined
from daskgen.engines.stops import settle
from daskgen.input.response_format import ResponseFormat

__all__ = ["ContinuationChecks", "Continued"]

#: One format per kind, loose enough for a random model's greedy answer to run past the interruption.
FORMATS: dict[str, dict[str, Any]] = {
    "json_schema": {"json_schema": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}},
    "regex": {"regex": "[a-z]{2,8}( [a-z]{2,8}){3,12}"},
    "choice": {"choice": ["alpha beta gamma delta epsilon", "zeta eta theta iota kappa"]},
    "grammar": {"grammar": 'root ::= "w" [a-z]+ (" w" [a-z]+)*'},
}


@dataclasses.dataclass
class Continued:
    """A sample generated as an interrupted attempt and its continuation, and how it went on."""

    result: GenerationResult
    stop_reason: int
    restarted: bool


class ContinuationChecks:
    """Continuation checks; uses the helpers of :class:`~daskgen.testing.conformance.EngineConformance`."""

    engine_class: ClassVar[Any]
    model: ClassVar[str]
    engine: ClassVar[Any]
    run: Any
    one: Any
    request: Any
    decode: Any
    #: Where the interruption falls (tokens so far) in each case.
    interrupt_after: ClassVar[int] = 6

    def settled(self, request: GenerationRequest, result: GenerationResult) -> tuple[GenerationResult, int]:
        """``result`` under the worker's stop rule: cut after its first stop, with its ``stop_reason``."""
        p = request.params
        if result.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return result, -1
        decode = self.decode if p.stop else str
        keep, reason = settle(
            result.output_ids, result.finish_reason == FinishReason.STOP, p.stop, p.stop_token_ids, decode
        )
        finish = FinishReason.STOP if reason != -1 else result.finish_reason
        cut = dataclasses.replace(
            result,
            output_ids=result.output_ids[:keep],
            finish_reason=finish,
            logprobs=None if result.logprobs is None else result.logprobs[:keep],
            top_logprobs=None if result.top_logprobs is None else result.top_logprobs[:keep],
        )
        return cut, reason

    def interrupted_and_continued(self, request: GenerationRequest, k: int) -> Continued:
        """``request`` generated as an attempt interrupted after ``k`` tokens, then continued as the worker does."""
        p = request.params
        head_params = dataclasses.replace(p, max_new_tokens=k, min_new_tokens=min(k, p.min_new_tokens))
        head = self.run(self.one(GenerationRequest(f"{request.request_id}-head", request.prompt_ids, head_params)))
        assert head.error is None, head
        restarted = False
        if head.finish_reason == FinishReason.LENGTH and k < p.max_new_tokens:
            head.finish_reason = FinishReason.ABORT  # what an abort after these k tokens leaves
        rest = continuation_of(request, head, self.engine.eos_token_ids, self.engine.continues)
        if rest is None:
            result = head
        else:
            tail = self.run(self.one(rest))
            assert tail.error is None, tail
            restarted = rest is request
            result = tail if restarted else joined(head, tail)
        cut, reason = self.settled(request, result)
        return Continued(cut, reason, restarted)

    def running(self, rid: str, first_index: int, **params: Any) -> GenerationRequest:
        """A request with ``params`` whose uninterrupted greedy answer runs past the interruption point (the first
        of 16 prompts from ``first_index`` that does)."""
        for index in range(first_index, first_index + 16):
            request = self.request(rid, index, **params)
            whole, _ = self.settled(request, self.run(self.one(request)))
            if whole.error is None and len(whole.output_ids) > self.interrupt_after + 1:
                return request
        raise AssertionError(f"{rid}: no prompt from index {first_index} answered past {self.interrupt_after + 1}")

    def assert_continues(self, request: GenerationRequest, k: int | None = None) -> Continued:
        """The continued sample of ``request`` equals its uninterrupted sample (tokens, finish, stop reason,
        logprobs and top-k entries); returns it."""
        k = self.interrupt_after if k is None else k
        whole, whole_reason = self.settled(request, self.run(self.one(request)))
        assert whole.error is None, whole
        assert len(whole.output_ids) > k, f"{request.request_id}: the sample ended before token {k}: {whole}"
        continued = self.interrupted_and_continued(request, k)
        got = continued.result
        assert got.output_ids == whole.output_ids, (request.request_id, k, got.output_ids, whole.output_ids)
        assert got.finish_reason == whole.finish_reason, (request.request_id, got, whole)
        assert continued.stop_reason == whole_reason, (request.request_id, continued.stop_reason, whole_reason)
        if whole.logprobs is not None:
            assert got.logprobs is not None and len(got.logprobs) == len(whole.logprobs), got
            assert all(math.isclose(a, b, abs_tol=2e-3) for a, b in zip(got.logprobs, whole.logprobs, strict=True))
        if whole.top_logprobs is not None:
            assert got.top_logprobs is not None, got
            got_ids = [[t for t, _ in row] for row in got.top_logprobs]
            assert got_ids == [[t for t, _ in row] for row in whole.top_logprobs], (got.top_logprobs, whole)
        return continued

    # ------------------------------------------------------------------ the checks

    def test_continuation_plain(self) -> None:
        """A greedy sample interrupted after 1, a few and all but one of its tokens continues to itself."""
        request = self.running("cont-plain", 60, max_new_tokens=24)
        whole = self.run(self.one(request))
        n = len(whole.output_ids)
        assert n > 2, f"the greedy probe stopped after {n} tokens: {whole}"
        for k in sorted({1, n // 2, n - 1}):
            assert not self.assert_continues(request, k).restarted

    def test_continuation_min_new_tokens(self) -> None:
        """``min_new_tokens`` above the interruption point: the continuation asks for what is left of it."""
        self._need("per_row_sampling")
        request = self.running("cont-min", 61, max_new_tokens=24, min_new_tokens=20)
        assert not self.assert_continues(request).restarted

    def test_continuation_stop_token_ids(self) -> None:
        """A stop id met after the interruption ends the continued sample where it ends the uninterrupted one."""
        self._need("stop_token_ids")
        probe = self.running("cont-stop-id", 62, max_new_tokens=24)
        base, k = self.run(self.one(probe)).output_ids, self.interrupt_after
        token = next((t for t in base[k + 1 :] if t not in base[: k + 1]), base[-1])
        params = dataclasses.replace(probe.params, stop_token_ids=(token,))
        self.assert_continues(GenerationRequest(probe.request_id, probe.prompt_ids, params))

    def test_continuation_stop_string_across_the_interruption(self) -> None:
        """A stop string that begins in the tokens so far and ends in the first new token stops the sample there."""
        self._need("stop")
        base = self.run(self.one(self.request("cont-stop-probe", 63, max_new_tokens=32))).output_ids
        for k in range(2, len(base) - 1):
            before, after = self.decode(base[:k]), self.decode(base[: k + 1])
            if not after.startswith(before) or len(after) == len(before) or not before:
                continue
            stop = before[-1] + after[len(before)]
            if stop.isascii() and stop.isalnum() and stop not in before:
                request = self.request("cont-stop", 63, max_new_tokens=32, stop=(stop,))
                continued = self.assert_continues(request, k)
                assert continued.result.finish_reason == FinishReason.STOP and continued.stop_reason == 0, continued
                assert len(continued.result.output_ids) == k + 1, (continued, k)
                return
        raise AssertionError(f"no two ASCII letters or digits span a token boundary of {self.decode(base)!r}")

    def test_continuation_response_format(self) -> None:
        """Each kind of ``response_format`` continues (grammar advanced over the tokens so far) or restarts;
        a response that ended by ``stop`` is valid under its format."""
        self._need("structured_outputs")
        for kind, raw in FORMATS.items():
            fmt = ResponseFormat.parse(raw)
            request = self.request(f"cont-format-{kind}", 64, max_new_tokens=40, response_format=fmt)
            continued = self.assert_continues(request, 2)
            assert continued.restarted == ("structured_outputs" not in self.engine.continues), (kind, continued)
            if continued.result.finish_reason == FinishReason.STOP:
                text = _plain_text(self.model, self.engine_class.name, continued.result.output_ids)
                assert fmt.violation(text) is None, (kind, text, fmt.violation(text))

    def test_continuation_penalties(self) -> None:
        """Penalties counting the response continue where the engine counts the tokens so far, else restart."""
        self._need("per_row_sampling")
        params = {"repetition_penalty": 1.3, "presence_penalty": 0.8, "frequency_penalty": 0.6}
        continued = self.assert_continues(self.running("cont-penalties", 65, max_new_tokens=24, **params))
        assert continued.restarted == ("output_penalties" not in self.engine.continues), continued

    def test_continuation_top_logprobs(self) -> None:
        """Logprobs and top-k entries of the continued sample are those of the uninterrupted one."""
        self._need("top_logprobs")
        self.assert_continues(self.running("cont-top", 66, max_new_tokens=24, logprobs=True, top_logprobs=3))

    def test_continuation_seeded(self) -> None:
        """A seeded sampled sample: token for token on engines that continue seeds, else a finished sample."""
        request = self.running("cont-seed", 67, max_new_tokens=24, temperature=1.0, seed=4321)
        if self.engine.supports_seed and "seed" in self.engine.continues:
            self.assert_continues(request)
            return
        continued = self.interrupted_and_continued(request, self.interrupt_after)
        assert continued.result.error is None, continued
        assert continued.result.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), continued
        assert len(continued.result.output_ids) <= request.params.max_new_tokens, continued

    def _need(self, feature: str) -> None:
        if feature not in self.engine.features:
            import unittest

            raise unittest.SkipTest(f"{self.engine.name} does not declare {feature!r}")


@functools.cache
def _tokenizer(model: str, engine: str) -> Any:
    from daskgen.engines.tokenizer import load_tokenizer

    return load_tokenizer(model, engine)


def _plain_text(model: str, engine: str, ids: list[int]) -> str:
    """The text of ``ids`` without special tokens (the end-of-sequence token a format's text ends before)."""
    return _tokenizer(model, engine).decode(ids, skip_special_tokens=True)
