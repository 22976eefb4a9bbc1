"""Multi-round sampling with a verifier: sample in rounds, score, stop a prompt once satisfied.

Per prompt: rounds of ``round_size`` samples; each response is scored by the user's verifier
(``package.module:function`` called as ``fn(response=text, tokens=ids, row=input_row)``,
sync or async, returning a number or bool).  A prompt stops consuming the engine once
``until_correct`` samples scored at least ``correct_threshold`` (or the user predicate
``stop_when(scores) -> bool`` says so), or when ``n_samples`` samples are used.  Truncated
responses (finish reason ``length``) never count as correct unless ``count_truncated``.
Prompts run concurrently: there is no round barrier across prompts.  A verifier exception is
recorded (score NaN, message in ``error``), never fatal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import math
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from daskgen.agents import Trajectory
from daskgen.engines.base import FinishReason
from daskgen.errors import ConfigError
from daskgen.importing import import_object


@dataclass(frozen=True)
class VerifyPolicy:
    """What the run config says about verification (shipped to workers with each task)."""

    verifier: str
    round_size: int = 1
    until_correct: int | None = None
    correct_threshold: float = 1.0
    stop_when: str | None = None
    count_truncated: bool = False

    @classmethod
    def of(cls, options: Any) -> VerifyPolicy | None:
        """The policy of a run's ``options`` (a :class:`~daskgen.config.RunConfig`), checked; ``None`` without a
        verifier (then ``until_correct`` and ``stop_when`` must be unset)."""
        if options.verifier is None:
            if options.until_correct is not None or options.stop_when is not None:
                raise ConfigError("until_correct/stop_when need a verifier: set verifier: 'package.module:function'.")
            return None
        policy = cls(**{f.name: getattr(options, f.name) for f in dataclasses.fields(cls)})
        policy.check(options.n_samples)
        return policy

    def check(self, n_samples: int) -> None:
        """Validate against ``n_samples`` and import the callables (clear errors on the client)."""
        if self.round_size < 1 or n_samples % self.round_size:
            raise ConfigError(
                f"round_size={self.round_size} must be >= 1 and divide n_samples={n_samples} "
                "(n_samples is the maximum number of samples per prompt)."
            )
        load_callable(self.verifier, "verifier")
        if self.stop_when:
            load_callable(self.stop_when, "stop_when")


@dataclass
class RowOutcome:
    """Samples (unused ones are empty), their scores, samples used, verifier problems."""

    samples: list[list[Trajectory]]
    scores: list[float]
    used: int
    notes: list[str] = field(default_factory=list)


@functools.lru_cache(maxsize=16)
def load_callable(target: str, what: str) -> Callable[..., Any]:
    """Import ``package.module:function``."""
    fn = import_object(target, what)
    if not callable(fn):
        raise ConfigError(f"{what} {target!r} must be 'package.module:function' naming a callable")
    return fn


async def score(
    policy: VerifyPolicy, decode: Callable[[list[int]], str], traj: Trajectory, row: dict[str, Any]
) -> tuple[float, str | None]:
    """The verifier's score of one response (NaN and a message when decoding or the verifier raised)."""
    fn = load_callable(policy.verifier, "verifier")
    try:
        text = decode(traj.response_ids)
        if inspect.iscoroutinefunction(fn):
            value = await fn(response=text, tokens=traj.response_ids, row=row)
        else:
            value = await asyncio.to_thread(fn, response=text, tokens=traj.response_ids, row=row)
        return float(value), None
    except Exception as exc:
        return math.nan, f"verifier raised {type(exc).__name__}: {exc}"


def satisfied(policy: VerifyPolicy, scores: list[float], trajs: list[Trajectory]) -> bool:
    """Whether the prompt needs no more rounds."""
    if policy.stop_when:
        return bool(load_callable(policy.stop_when, "stop_when")([s for s in scores if not math.isnan(s)]))
    if policy.until_correct is None:
        return False
    correct = sum(
        1
        for s, t in zip(scores, trajs, strict=True)
        if s >= policy.correct_threshold and (policy.count_truncated or t.finish_reason != FinishReason.LENGTH)
    )
    return correct >= policy.until_correct


async def sample_in_rounds(
    policy: VerifyPolicy,
    n_samples: int,
    row: dict[str, Any],
    decode: Callable[[list[int]], str],
    sample: Callable[[int], Awaitable[list[Trajectory]]],
) -> RowOutcome:
    """Run rounds for one prompt; ``sample(s)`` generates sample ``s``."""
    out = RowOutcome([[] for _ in range(n_samples)], [math.nan] * n_samples, 0)
    firsts: list[Trajectory] = []
    for start in range(0, n_samples, policy.round_size):
        indices = range(start, start + policy.round_size)
        results = await asyncio.gather(*(sample(s) for s in indices))
        await _score_round(policy, decode, row, zip(indices, results, strict=True), out, firsts)
        out.used = start + policy.round_size
        if _round_ends_sampling(policy, out, firsts):
            break
    return out


async def _score_round(
    policy: VerifyPolicy,
    decode: Callable[[list[int]], str],
    row: dict[str, Any],
    results: Iterable[tuple[int, list[Trajectory]]],
    out: RowOutcome,
    firsts: list[Trajectory],
) -> None:
    """Keep and score each sample ``s`` of a round (its last trajectory), noting verifier problems in ``out``."""
    for s, trajs in results:
        out.samples[s] = trajs
        out.scores[s], note = await score(policy, decode, trajs[-1], row)
        if note:
            out.notes.append(f"sample {s}: {note}")
        firsts.append(trajs[-1])


def _round_ends_sampling(policy: VerifyPolicy, out: RowOutcome, firsts: list[Trajectory]) -> bool:
    """Stop after this round: one of its samples was aborted or failed, or the policy is satisfied."""
    if any(t.finish_reason in (FinishReason.ABORT, FinishReason.ERROR) for t in firsts[-policy.round_size :]):
        return True
    return satisfied(policy, out.scores[: out.used], firsts)
