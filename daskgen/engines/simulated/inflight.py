"""The simulated engine's requests in flight and its counters (:mod:`daskgen.engines.simulated.engine`)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from daskgen.engines.base import FinishReason, GenerationRequest, GenerationResult
from daskgen.engines.simulated.plan import OutputPlan


@dataclass(eq=False)
class SimRequest:
    """A request in the simulator: its plan, where its result goes (its caller's future or batch) and its timing."""

    request: GenerationRequest
    deliver: Callable[[GenerationResult], None]
    plan: OutputPlan | None = None  # set when it joins the batch
    start_step: int = -1
    done: bool = False
    meta: dict[str, Any] = field(default_factory=lambda: {"simulated": True})  # with the prompt tokens its cache held

    @property
    def finish_step(self) -> int:
        assert self.plan is not None, "a request is planned when it joins the batch"
        return self.start_step + len(self.plan.tokens)

    def resolve(self, tokens_done: int | None = None) -> None:
        """Finish the caller's ``generate``: fully, or as ``ABORT`` after ``tokens_done`` tokens (none when it
        never joined the batch)."""
        request = self.request
        plan = self.plan
        if plan is None:
            params = request.params  # aborted before it joined the batch: no tokens
            plan = OutputPlan([], FinishReason.ABORT, [] if params.logprobs else None)
            plan.top_logprobs = [] if params.top_logprobs else None
        if tokens_done is None:
            result = GenerationResult(
                request.request_id,
                plan.tokens,
                plan.finish,
                plan.logprobs,
                meta=dict(self.meta),
                top_logprobs=plan.top_logprobs,
            )
        else:
            n = max(0, min(tokens_done, len(plan.tokens) - 1))
            logprobs = None if plan.logprobs is None else plan.logprobs[:n]
            top = None if plan.top_logprobs is None else plan.top_logprobs[:n]
            result = GenerationResult(
                request.request_id,
                plan.tokens[:n],
                FinishReason.ABORT,
                logprobs,
                meta=dict(self.meta),
                top_logprobs=top,
            )
        self.done = True
        self.deliver(result)


@dataclass
class SimStats:
    """Counters since start or :meth:`SimulatedEngine.reset_stats`."""

    since: float = field(default_factory=time.perf_counter)
    steps: int = 0
    busy_s: float = 0.0
    batch_steps: Counter = field(default_factory=Counter)
    finished: int = 0
    aborted: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_s: float = 0.0
