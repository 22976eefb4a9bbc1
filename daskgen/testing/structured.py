"""A structured-outputs check for any engine: chat prompts, one per kind of ``response_format``, sent with their
format; every response must end by ``stop`` and conform to it.

Used by the test suites of the engines that declare ``structured_outputs`` (with a real instruct model, so
that responses end by ``stop`` within :data:`MAX_NEW_TOKENS`).  Imports neither pytest nor torch (transformers
only in :func:`check_engine`, for the model's tokenizer).
"""

from __future__ import annotations

from typing import Any

from daskgen.engines.base import Engine, GenerationRequest, GenerationResult, SamplingParams
from daskgen.input.response_format import ResponseFormat

__all__ = ["CASES", "PERSON", "check_engine", "check_structured", "structured_requests", "structured_run"]

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
#: ``(question, response_format)``: one of each kind.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("Is the sky blue? Answer yes or no.", {"choice": ["yes", "no"]}),
    ("Describe a person as JSON with a name and an age.", {"json_schema": PERSON}),
    ("How many legs does a spider have? Answer with a number.", {"regex": "[0-9]{1,3}"}),
    ("What colour is grass?", {"grammar": 'root ::= "The answer is " ("red" | "green" | "blue") "."'}),
]


#: Enough new tokens for every answer of :data:`CASES` to end.
MAX_NEW_TOKENS = 160


def structured_requests(
    tokenizer: Any, *, n_samples: int = 2, max_new_tokens: int = MAX_NEW_TOKENS, temperature: float = 0.7
) -> list[GenerationRequest]:
    """``n_samples`` requests per case of :data:`CASES`, its question rendered by the tokenizer's chat template."""
    out = []
    for i, (question, raw) in enumerate(CASES):
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        params = SamplingParams(max_new_tokens, temperature, seed=i, response_format=ResponseFormat.parse(raw))
        out += [GenerationRequest(f"structured-{i}-{s}", list(prompt), params) for s in range(n_samples)]
    return out


def check_structured(requests: list[GenerationRequest], results: list[GenerationResult], tokenizer: Any) -> int:
    """Raise :class:`AssertionError` unless every response ended by ``stop`` and is valid under its format (a
    ``length`` one must be reported so, with its ``max_new_tokens`` tokens, and fails the check too); return how
    many responses are valid (all of them)."""
    from daskgen.testing.effects import check_every_format

    verdicts = check_every_format(requests, results, lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    return len(verdicts)


async def structured_run(engine: Engine, tokenizer: Any, **options: Any) -> tuple[int, int]:
    """Send :func:`structured_requests` to a started ``engine`` at once and :func:`check_structured` the results;
    returns ``(valid, sent)``, equal."""
    import asyncio

    requests = structured_requests(tokenizer, **options)
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    return check_structured(requests, list(results), tokenizer), len(requests)


def check_engine(engine: Engine, timeout_s: float = 900.0, **options: Any) -> tuple[int, int]:
    """Start ``engine`` (not started yet) on a loop of its own, :func:`structured_run` it with its model's tokenizer
    and shut it down; returns ``(valid, sent)``, equal."""
    from transformers import AutoTokenizer

    from daskgen.testing.harness import EventLoopThread

    runner = EventLoopThread()
    try:
        runner.run(engine.start(), timeout_s)
        return runner.run(structured_run(engine, AutoTokenizer.from_pretrained(engine.model), **options), timeout_s)
    finally:
        runner.run(engine.shutdown(), 120)
        runner.close()
