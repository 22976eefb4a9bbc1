"""What the ``transformers`` engine's sampler does beyond temperature/top-k/min-p/top-p, per request.

Penalties (as vLLM and SGLang define them: ``repetition_penalty`` divides positive and multiplies
negative logits of tokens seen in the prompt or response; ``presence_penalty`` subtracts a constant
and ``frequency_penalty`` a multiple of the count of each token seen in the response),
``min_new_tokens`` (stop token ids masked until then) and stop strings (the shared
:class:`~daskgen.engines.stops.StopMatcher`, which calls ``on_stop`` when the newest token completes
one).  A request without any of these gets no :class:`Shaping` and costs nothing extra.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from daskgen.engines.base import SamplingParams
from daskgen.engines.stops import StopMatcher

if TYPE_CHECKING:
    import torch


@dataclass
class Shaping:
    """Per-request logit adjustments and the stop-string check (see the module docstring)."""

    params: SamplingParams
    prompt: list[int]
    matcher: StopMatcher | None = None
    on_stop: Callable[[], None] | None = None
    stopped: bool = False
    counts: Counter[int] = field(default_factory=Counter)
    carried: list[int] = field(default_factory=list)

    @classmethod
    def of(
        cls,
        params: SamplingParams,
        prompt: list[int],
        decode: Callable[[list[int]], str] | None,
        on_stop: Callable[[], None] | None,
        carried: list[int] | None = None,
    ) -> Shaping | None:
        """The shaping ``params`` ask for, or ``None`` when they ask for none; ``carried`` are a continuation's
        tokens so far, counted as the response's own (penalties, stop strings)."""
        penalties = params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty
        if not (penalties or params.min_new_tokens or params.stop):
            return None
        matcher = StopMatcher(params.stop, decode) if params.stop and decode is not None else None
        return cls(params, list(prompt), matcher, on_stop, counts=Counter(carried or ()), carried=list(carried or ()))

    def adjusted(self, row: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """The logits ``row`` with the penalties applied and stop ids masked before ``min_new_tokens``."""
        import torch

        p = self.params
        scores = row.clone()
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted(set(self.prompt) | set(self.counts)), dtype=torch.long, device=row.device)
            picked = scores[seen]
            scores[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and self.counts:
            ids = torch.tensor(list(self.counts), dtype=torch.long, device=row.device)
            counts = torch.tensor(list(self.counts.values()), dtype=scores.dtype, device=row.device)
            scores[ids] -= p.presence_penalty + p.frequency_penalty * counts
        if len(tokens) < p.min_new_tokens and p.stop_token_ids:
            scores[list(p.stop_token_ids)] = float("-inf")
        return scores

    def after(self, tokens: list[int]) -> None:
        """Count the newest token; call ``on_stop`` (once) when it completes a stop string."""
        self.counts[tokens[-1]] += 1
        if self.matcher is None or self.stopped or len(tokens) <= self.params.min_new_tokens:
            return
        window = self.matcher.window
        if self.matcher.matched(tokens if len(tokens) >= window else self.carried[-window:] + tokens):
            self.stopped = True
            if self.on_stop is not None:
                self.on_stop()
