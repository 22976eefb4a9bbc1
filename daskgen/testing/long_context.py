"""The conformance checks at the context limit: prompts and continued samples as long as the engine takes.

:class:`LongContextChecks` is mixed into :class:`~daskgen.testing.conformance.EngineConformance`.  The limit is the
engine's own (:attr:`~daskgen.engines.base.Engine.max_total_tokens`: prompt plus ``max_new_tokens``), or the suite's
``context_tokens`` where the engine does not know it.  The checks send prompts from a few tokens up to the limit minus
``max_new_tokens``, alone and mixed with short prompts in one batch, with a small and a large ``max_new_tokens``
(:attr:`LongContextChecks.context_new_tokens`); greedy output must equal the engine's reference
(:meth:`LongContextChecks.reference_greedy`: by default the same prompt generated alone; a suite overrides it with the
model's own ``generate``).  A prompt one token over the limit fails with the limit named.  A continued sample whose
prompt and tokens so far reach the limit continues to the uninterrupted sample.
"""

from __future__ import annotations

from typing import Any, ClassVar

from daskgen.engines.base import FinishReason, GenerationRequest, GenerationResult, SamplingParams

__all__ = ["LongContextChecks"]


class LongContextChecks:
    """Checks at the context limit; uses the helpers of :class:`~daskgen.testing.conformance.EngineConformance`."""

    engine: ClassVar[Any]
    run: Any
    one: Any
    generate_all: Any
    prompt_vocab: ClassVar[int]
    assert_continues: Any
    #: The context limit where the engine reports none (``None``: the engine's ``max_total_tokens``).
    context_tokens: ClassVar[int | None] = None
    #: The small and the large ``max_new_tokens`` of the long prompts.
    context_new_tokens: ClassVar[tuple[int, int]] = (16, 128)
    #: Longest context the checks use (a cap for engines with very long contexts on a slow machine).
    context_cap: ClassVar[int] = 4096

    def context_limit(self) -> int:
        """Prompt plus ``max_new_tokens`` the checks go up to."""
        limit = self.engine.max_total_tokens or self.context_tokens
        assert limit, f"{self.engine.name} reports no context limit: set context_tokens on the suite"
        return min(int(limit), self.context_cap)

    def long_prompt(self, length: int, index: int) -> list[int]:
        """A deterministic prompt of ``length`` token ids in ``[3, prompt_vocab)``, different for each ``index``."""
        span = self.prompt_vocab - 3
        return [3 + (index * 104723 + j * 7919 + (j * j) % 997) % span for j in range(length)]

    def reference_greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """The engine's reference greedy output of ``prompt``: the prompt generated alone (suites override it)."""
        request = GenerationRequest("reference", prompt, SamplingParams(max_new_tokens=max_new_tokens, temperature=0))
        return self.run(self.one(request)).output_ids

    def _long_requests(self, new: int) -> list[GenerationRequest]:
        limit = self.context_limit()
        lengths = sorted({4, (limit - new) // 2, limit - new - 1, limit - new})
        return [
            GenerationRequest(
                f"ctx-{new}-{n}", self.long_prompt(n, i), SamplingParams(max_new_tokens=new, temperature=0.0)
            )
            for i, n in enumerate(lengths)
        ]

    # ------------------------------------------------------------------ the checks

    def test_long_prompts(self) -> None:
        """Prompts up to the limit minus ``max_new_tokens``: each alone, and all in one batch with short ones, give
        the reference greedy output."""
        for new in self.context_new_tokens:
            longs = self._long_requests(new)
            shorts = [
                GenerationRequest(f"ctx-short-{new}-{i}", self.long_prompt(5 + i, 100 + i), r.params)
                for i, r in enumerate(longs)
            ]
            alone = [self._ok(r, self.run(self.one(r))) for r in longs]
            mixed = self.run(self.generate_all([x for pair in zip(longs, shorts, strict=True) for x in pair]))
            for request, result in zip(longs, mixed[0::2], strict=True):
                self._ok(request, result)
            for request, single, in_batch in zip(longs, alone, mixed[0::2], strict=True):
                reference = self.reference_greedy(request.prompt_ids, new)
                assert single == reference, (request.request_id, single, reference)
                assert in_batch.output_ids == reference, (request.request_id, in_batch.output_ids, reference)

    def test_prompt_over_the_limit(self) -> None:
        """A prompt one token over the limit fails alone, with the limit named; its neighbours finish."""
        limit = self.context_limit()
        if limit < (self.engine.max_total_tokens or limit):
            return self._over_a_capped_limit()
        new = self.context_new_tokens[0]
        over = GenerationRequest("ctx-over", self.long_prompt(limit - new + 1, 7), SamplingParams(max_new_tokens=new))
        ok = GenerationRequest("ctx-neighbour", self.long_prompt(8, 8), SamplingParams(max_new_tokens=4))
        result, neighbour = self.run(self.generate_all([over, ok]))
        assert result.finish_reason == FinishReason.ERROR and result.error, result
        assert str(limit) in result.error, (limit, result.error)
        self._ok(ok, neighbour)
        return None

    def _over_a_capped_limit(self) -> None:
        """With the checks capped below the engine's limit, a prompt over the engine's own limit still fails."""
        limit = int(self.engine.max_total_tokens)
        over = GenerationRequest("ctx-over", self.long_prompt(limit, 7), SamplingParams(max_new_tokens=1))
        result = self.run(self.engine.generate(over))
        assert result.finish_reason == FinishReason.ERROR and str(limit) in (result.error or ""), result

    def test_long_continuation(self) -> None:
        """A sample whose prompt and tokens so far reach the limit continues to the uninterrupted sample, for an
        interruption after its first, middle and last-but-one token."""
        limit, new = self.context_limit(), self.context_new_tokens[0]
        for index in range(8):  # a prompt whose greedy answer runs long enough to be interrupted
            request = GenerationRequest(
                f"ctx-cont-{index}",
                self.long_prompt(limit - new, 200 + index),
                SamplingParams(max_new_tokens=new, temperature=0.0),
            )
            n = len(self.run(self.one(request)).output_ids)
            if n >= 4:
                break
        else:
            raise AssertionError(f"no long greedy prompt ran for 4 tokens (limit {limit}, max_new_tokens {new})")
        for k in sorted({1, n // 2, n - 1}):
            self.assert_continues(request, k)

    def _ok(self, request: GenerationRequest, result: GenerationResult) -> list[int]:
        assert result.error is None, (request.request_id, len(request.prompt_ids), result.error)
        assert result.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), result
        assert 0 < len(result.output_ids) <= request.params.max_new_tokens, result
        return result.output_ids
