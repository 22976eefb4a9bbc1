"""The conformance checks of the request features (:data:`daskgen.engines.features.FEATURES`).

:class:`FeatureChecks` is mixed into :class:`~daskgen.testing.conformance.EngineConformance`: one check
per feature an engine declares in its ``features``.  A check of a feature the engine does not declare is
added to the suite's ``not_applicable`` (deselected and reported with the reason), so a suite needs no
declaration of its own for it.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any, ClassVar

from daskgen.engines.base import FinishReason
from daskgen.engines.stops import EOS, first_stop, settle

#: The feature each check proves.
CHECKS: dict[str, str] = {
    "test_feature_per_row_sampling": "per_row_sampling",
    "test_feature_min_p": "per_row_sampling",
    "test_feature_stop_strings": "stop",
    "test_feature_stop_token_ids": "stop_token_ids",
    "test_feature_lora": "lora",
    "test_feature_penalties": "per_row_sampling",
    "test_feature_structured_outputs": "structured_outputs",
    "test_top_logprobs": "top_logprobs",
    "test_top_logprobs_equal_a_forward_pass": "top_logprobs",
    "test_continuation_min_new_tokens": "per_row_sampling",
    "test_continuation_penalties": "per_row_sampling",
    "test_continuation_stop_token_ids": "stop_token_ids",
    "test_continuation_stop_string_across_the_interruption": "stop",
    "test_continuation_response_format": "structured_outputs",
    "test_continuation_top_logprobs": "top_logprobs",
}
#: Text never generated (a stop string that cannot match).
NEVER = "\x00never\x00"


class FeatureChecks:
    """One check per request feature; uses the helpers of :class:`~daskgen.testing.conformance.EngineConformance`."""

    engine_class: ClassVar[Any]
    model: ClassVar[str]
    engine_args: ClassVar[dict[str, Any]]
    not_applicable: ClassVar[dict[str, str]] = {}
    run: Any
    one: Any
    request: Any
    generate_all: Any
    make_engine: Any
    start_timeout_s: ClassVar[float]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        engine = cls.__dict__.get("engine_class") or getattr(cls, "engine_class", None)
        if engine is None:
            return
        lacking = {
            check: f"engine {engine.name!r} does not declare the {feature!r} feature"
            for check, feature in CHECKS.items()
            if feature not in engine.features
        }
        cls.not_applicable = {**lacking, **cls.__dict__.get("not_applicable", cls.not_applicable)}

    def decode(self, ids: list[int]) -> str:
        """The model tokenizer's text of ``ids`` (special tokens kept), as the worker's stop rule reads it."""
        return _tokenizer(self.model, self.engine_class.name).decode(ids, skip_special_tokens=False)

    def test_feature_per_row_sampling(self) -> None:
        """Requests in one batch each get their own token limits: min_new_tokens = max_new_tokens = n gives n tokens."""
        limits = [3, 9, 5]
        requests = [
            self.request(f"rows-{i}", 20 + i, max_new_tokens=n, min_new_tokens=n, temperature=0.7, seed=i)
            for i, n in enumerate(limits)
        ]
        results = self.run(self.generate_all(requests))
        for n, result in zip(limits, results, strict=True):
            assert result.error is None, result
            assert len(result.output_ids) == n and result.finish_reason == FinishReason.LENGTH, (n, result)

    def test_feature_min_p(self) -> None:
        """min_p = 1 keeps only the most likely token: a sampled request then equals the greedy one."""
        greedy = self.run(self.one(self.request("min-p-greedy", 30, max_new_tokens=12)))
        sampled = self.run(self.one(self.request("min-p", 30, max_new_tokens=12, temperature=1.0, seed=7, min_p=1.0)))
        assert sampled.output_ids == greedy.output_ids, (sampled.output_ids, greedy.output_ids)

    def test_feature_stop_strings(self) -> None:
        """A stop string taken from a greedy output ends it at the token completing the stop (kept), with STOP."""
        base, stop = self._stop_text()
        expected = first_stop(base, (NEVER, stop), (), self.decode)
        assert expected is not None and expected[1] == 1, expected
        result = self.run(self.one(self.request("stop-string", 40, max_new_tokens=24, stop=(NEVER, stop))))
        assert result.finish_reason == FinishReason.STOP, result
        assert result.output_ids == base[: expected[0]], (result.output_ids, base, stop)
        assert settle(result.output_ids, True, (NEVER, stop), (), self.decode) == expected

    def test_feature_stop_token_ids(self) -> None:
        """A stop token id ends the output (kept) and is told apart from EOS by the stop rule."""
        base = self.run(self.one(self.request("stop-ids-probe", 41, max_new_tokens=16)))
        token = base.output_ids[min(3, len(base.output_ids) - 1)]
        unused = next(t for t in range(3, 1000) if t not in base.output_ids)
        result = self.run(self.one(self.request("stop-ids", 41, max_new_tokens=16, stop_token_ids=(unused, token))))
        cut = base.output_ids.index(token) + 1
        assert result.output_ids == base.output_ids[:cut] and result.finish_reason == FinishReason.STOP, result
        assert settle(result.output_ids, True, (), (unused, token), self.decode)[1] == 1
        assert settle(result.output_ids, True, (), (), self.decode) == (len(result.output_ids), EOS)

    def test_feature_lora(self) -> None:
        """An engine built with a LoRA adapter (made with peft, non-zero ``lora_B``): in one batch, greedy requests
        with the adapter equal the merged model's greedy output (``merge_and_unload``), those without it the base
        model's, and an unknown adapter name is a per-request error."""
        from daskgen.testing.lora import make_adapter, merged_greedy

        with tempfile.TemporaryDirectory(prefix="daskgen-lora-") as folder:
            adapter = str(make_adapter(self.model, Path(folder) / "adapter", seed=1))
            engine = self.make_engine(adapters={"delta": adapter})
            try:
                self.run(engine.start(), self.start_timeout_s)
                requests = [
                    self.request(f"lora-{i}", 50 + i // 2, max_new_tokens=12, adapter="delta" if i % 2 else None)
                    for i in range(4)
                ]
                unknown = self.request("lora-unknown", 50, max_new_tokens=4, adapter="missing")
                *results, refused = self.run(_generate_all(engine, [*requests, unknown]))
            finally:
                self.run(engine.shutdown())
            eos = sorted(engine.eos_token_ids) or None  # unknown (a server's engine): the model's own
            expected = [
                merged_greedy(self.model, adapter if r.params.adapter else None, r.prompt_ids, 12, eos)
                for r in requests
            ]
        assert refused.error is not None and "missing" in refused.error, refused
        for request, result, merged in zip(requests, results, expected, strict=True):
            assert result.error is None and result.output_ids == merged, (request.params.adapter, result, merged)
        assert results[0].output_ids != results[1].output_ids, "the adapter left the greedy output unchanged"

    def _stop_text(self) -> tuple[list[int], str]:
        """A greedy output of prompt 40 and a stop string in it: two ASCII letters or digits that end the text of
        one of its prefixes (so the engine's detokenizer and the tokenizer's agree on it)."""
        base = self.run(self.one(self.request("stop-string-probe", 40, max_new_tokens=24))).output_ids
        for k in range(3, len(base)):
            text = self.decode(base[:k])
            tail = text[-2:]
            if len(tail) == 2 and tail.isascii() and tail.isalnum() and self.decode(base[: k + 1]).startswith(text):
                return base, tail
        raise AssertionError(f"no stop string found in the greedy output {base!r} ({self.decode(base)!r})")


async def _generate_all(engine: Any, requests: list[Any]) -> list[Any]:
    import asyncio

    return list(await asyncio.gather(*(engine.generate(r) for r in requests)))


@functools.cache
def _tokenizer(model: str, engine: str) -> Any:
    from daskgen.engines.tokenizer import load_tokenizer

    return load_tokenizer(model, engine)
