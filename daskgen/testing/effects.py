"""The conformance checks that a request feature has its effect: penalties change a repeating greedy output, top-k
logprobs are those of a forward pass of the model, and every structured output of a batch is valid.

:class:`EffectChecks` is mixed into :class:`~daskgen.testing.conformance.EngineConformance`; its checks are in
:data:`daskgen.testing.features.CHECKS`, so a suite whose engine does not declare the feature skips them by itself.
The forward pass loads the suite's ``model`` folder with transformers (float32, on the CPU).
"""

from __future__ import annotations

import functools
import math
from typing import Any, ClassVar

from daskgen.engines.base import FinishReason, GenerationRequest, GenerationResult, SamplingParams
from daskgen.input.response_format import ResponseFormat

__all__ = ["FORMATS", "JSON_FORMAT", "EffectChecks", "check_every_format", "forward_top"]

#: One format per kind whose every answer is bounded, so each response ends within
#: :attr:`EffectChecks.format_tokens`.
FORMATS: dict[str, dict[str, Any]] = {
    "choice": {"choice": ["yes", "no", "maybe"]},
    "regex": {"regex": "[0-9]{1,3}"},
    "grammar": {"grammar": 'root ::= "The answer is " ("red" | "green" | "blue") "."'},
}
#: A JSON schema: JSON lets any whitespace between tokens, which a random model may choose without end, so the check
#: asks of it that a response that ends is valid and one that does not says ``length`` (``testing/structured.py``
#: holds every JSON response of an instruct model valid).
JSON_FORMAT: dict[str, Any] = {
    "json_schema": {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
}
#: The penalties, each strong enough to change a greedy output that repeats a token.
PENALTIES: tuple[dict[str, float], ...] = (
    {"repetition_penalty": 2.0},  # sglang takes at most 2
    {"presence_penalty": 2.0},
    {"frequency_penalty": 2.0},
)
#: Tolerance between an engine's top-k logprob and the forward pass's (float32 kernels differ a little).
ATOL = 2e-3


class EffectChecks:
    """Penalties, top-k against a forward pass, every structured output valid; uses the helpers of
    :class:`~daskgen.testing.conformance.EngineConformance`."""

    engine: ClassVar[Any]
    model: ClassVar[str]
    run: Any
    one: Any
    request: Any
    generate_all: Any
    #: ``max_new_tokens`` of the structured requests: enough for every format of :data:`FORMATS` to end.
    format_tokens: ClassVar[int] = 64
    #: Structured requests per kind (greedy, each its own prompt).
    format_samples: ClassVar[int] = 4

    def test_feature_penalties(self) -> None:
        """Greedy with a strong repetition, presence or frequency penalty differs from greedy without, on a prompt
        whose greedy output repeats a token (48 tokens each, EOS held off by ``min_new_tokens``)."""
        n, base, index = 48, None, -1
        for index in range(60, 92):
            request = self.request(f"penalty-probe-{index}", index, max_new_tokens=n, min_new_tokens=n)
            base = self.run(self.one(request))
            if len(set(base.output_ids)) < len(base.output_ids):
                break
        assert base is not None and len(set(base.output_ids)) < len(base.output_ids), "no greedy output repeats"
        requests = [
            self.request(f"penalty-{i}", index, max_new_tokens=n, min_new_tokens=n, **penalty)
            for i, penalty in enumerate(PENALTIES)
        ]
        for penalty, result in zip(PENALTIES, self.run(self.generate_all(requests)), strict=True):
            assert result.error is None, (penalty, result)
            assert result.output_ids != base.output_ids, (penalty, base.output_ids, "the penalty changed nothing")

    def test_top_logprobs_equal_a_forward_pass(self) -> None:
        """Sampled at temperature 1.3, each output token's top-k logprobs are those of the model's untempered
        distribution (log-softmax of a forward pass over prompt and response): the k largest values, each id's
        value its own, no id left out that is more likely than the last one given."""
        k = 5
        seeds = {"seed": 11} if self.engine.supports_seed else {}
        request = self.request("top-forward", 33, max_new_tokens=12, temperature=1.3, logprobs=True, **seeds)
        params = SamplingParams(**{**request.params.__dict__, "top_logprobs": k})
        result = self.run(self.one(GenerationRequest(request.request_id, request.prompt_ids, params)))
        assert result.error is None and result.top_logprobs is not None, result
        forward = forward_top(self.model, request.prompt_ids, result.output_ids)
        assert len(result.top_logprobs) == len(result.output_ids) == len(forward), result
        for position, (entries, logprobs) in enumerate(zip(result.top_logprobs, forward, strict=True)):
            ids, values = [t for t, _ in entries], [v for _, v in entries]
            largest = sorted(logprobs, reverse=True)[:k]
            where = f"position {position}: engine {entries}, forward top {largest}"
            assert len(ids) == k and all(abs(a - b) <= ATOL for a, b in zip(values, largest, strict=True)), where
            assert all(abs(logprobs[t] - v) <= ATOL for t, v in entries), where
            outside = max(v for t, v in enumerate(logprobs) if t not in ids)
            assert outside <= values[-1] + ATOL, where

    def test_feature_structured_outputs(self) -> None:
        """Each kind of ``response_format`` on its own batch (greedy): every response whose format bounds it ends by
        ``stop`` and is valid (a ``length`` response fails the check); a JSON response that ends is valid, one that
        does not says ``length`` with ``max_new_tokens`` tokens."""
        for kind, raw in {**FORMATS, "json_schema": JSON_FORMAT}.items():
            fmt = ResponseFormat.parse(raw)
            requests = [
                self.request(f"format-{kind}-{i}", 80 + i, max_new_tokens=self.format_tokens, response_format=fmt)
                for i in range(self.format_samples)
            ]
            results = self.run(self.generate_all(requests))
            if kind != "json_schema":
                check_every_format(requests, results, self.decode_text)
                continue
            truncated = [r for r in results if r.finish_reason == FinishReason.LENGTH]
            assert all(len(r.output_ids) == self.format_tokens for r in truncated), truncated
            ended = [(q, r) for q, r in zip(requests, results, strict=True) if r not in truncated]
            check_every_format([q for q, _ in ended], [r for _, r in ended], self.decode_text)

    def decode_text(self, ids: list[int]) -> str:
        """The response text as the store's readers decode it (special tokens skipped)."""
        return _tokenizer(self.model).decode(ids, skip_special_tokens=True)


def check_every_format(
    requests: list[GenerationRequest], results: list[GenerationResult], decode: Any
) -> dict[str, list[str]]:
    """Assert every result ended by ``stop`` and is valid under its request's format; a truncated one must say
    ``length`` with exactly its ``max_new_tokens`` tokens, and fails the check too.  Returns each result's
    verdict by request id (for the assertion message)."""
    verdicts: dict[str, list[str]] = {}
    for request, result in zip(requests, results, strict=True):
        fmt = request.params.response_format
        assert fmt is not None and result.error is None, (request.request_id, result)
        text = decode(result.output_ids)
        if result.finish_reason == FinishReason.LENGTH:
            truncated = len(result.output_ids) == request.params.max_new_tokens
            verdicts[request.request_id] = ["length" if truncated else "length before max_new_tokens", text]
            continue
        problem = fmt.violation(text) if result.finish_reason == FinishReason.STOP else result.finish_reason.name
        verdicts[request.request_id] = ["valid" if problem is None else str(problem), text]
    assert all(verdict == "valid" for verdict, _ in verdicts.values()), verdicts
    return verdicts


def forward_top(model: str, prompt: list[int], output: list[int]) -> list[list[float]]:
    """Per output position, the model's log-softmax over its vocabulary (a float32 forward pass on the CPU)."""
    import torch

    with torch.no_grad():
        logits = _model(model)(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    values = torch.log_softmax(logits, dim=-1).tolist()
    assert all(math.isfinite(v) for row in values for v in row[:8])
    return values


@functools.cache
def _model(model: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


@functools.cache
def _tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)
