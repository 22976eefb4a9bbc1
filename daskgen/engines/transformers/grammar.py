"""Structured outputs on the ``transformers`` engine, with xgrammar.

The engine's sampler (:mod:`daskgen.engines.transformers.sampler`) is the continuous-batching manager's
logits processor and picks every token itself, so a request's ``response_format`` is applied there: a
:class:`Constraint` (an xgrammar ``GrammarMatcher`` and its token bitmask) masks the tokens the format does
not allow before the pick, and accepts the picked token afterwards.  Once the format is complete only the
request's stop tokens are allowed, so a response that ends with ``stop`` is a complete sentence of the format.
:class:`Grammars` compiles each format once for the model's vocabulary.  Heavy imports (xgrammar, torch,
transformers) happen inside functions only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from daskgen.input.response_format import ResponseFormat

if TYPE_CHECKING:
    import torch

__all__ = ["Constraint", "Grammars"]


class Constraint:
    """One request's grammar state: masks the scores of each step and follows the tokens picked."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import xgrammar

        self.matcher = matcher
        self.vocab_size = vocab_size
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def masked(self, row: torch.Tensor) -> torch.Tensor:
        """A copy of the logits ``row`` with every token the format does not allow next set to ``-inf``."""
        import xgrammar

        self.matcher.fill_next_token_bitmask(self.bitmask)
        scores = row.clone().unsqueeze(0)
        xgrammar.apply_token_bitmask_inplace(scores, self.bitmask.to(scores.device), vocab_size=self.vocab_size)
        return scores[0]

    def advance(self, tokens: list[int]) -> str | None:
        """Advance the grammar over a continuation's tokens so far; what is wrong when the format refuses one."""
        for i, token in enumerate(tokens):
            if not self.matcher.is_terminated() and not self.matcher.accept_token(token):
                return f"token {token} at position {i} of the response so far does not match its format"
        return None

    def accept(self, token: int) -> None:
        """Advance the grammar past the picked ``token`` (a stop token once complete ends it)."""
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token)


class Grammars:
    """The model's compiled response formats (each compiled once, on first use; thread-safe)."""

    def __init__(self, model: str, vocab_size: int, tokenizer_args: dict[str, Any]) -> None:
        self.model, self.vocab_size, self.tokenizer_args = model, vocab_size, tokenizer_args
        self._compiler: Any = None
        self._compiled: dict[ResponseFormat, Any] = {}
        self._lock = threading.Lock()

    def constraint(self, fmt: ResponseFormat, stop_ids: Iterable[int]) -> Constraint:
        """A fresh :class:`Constraint` for one request with format ``fmt`` ending at one of ``stop_ids``."""
        import xgrammar

        with self._lock:
            if fmt not in self._compiled:
                self._compiled[fmt] = _compile(self._grammar_compiler(), fmt)
            compiled = self._compiled[fmt]
        return Constraint(xgrammar.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_ids)), self.vocab_size)

    def _grammar_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model, **self.tokenizer_args)
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler


def _compile(compiler: Any, fmt: ResponseFormat) -> Any:
    """xgrammar's compiled grammar of ``fmt`` (choices as an EBNF alternation)."""
    if fmt.kind == "json_schema":
        return compiler.compile_json_schema(str(fmt.value))
    if fmt.kind == "regex":
        return compiler.compile_regex(str(fmt.value))
    return compiler.compile_grammar(fmt.ebnf())
