"""The ``simulated`` engine's options and output model: what each request produces.

:func:`plan_output` is a pure function of the prompt ids, the sampling params and
:class:`SimulatedArgs` (see :mod:`daskgen.engines.simulated.engine` for the timing model that decides
when it is delivered).
"""

from __future__ import annotations

import hashlib
import math
import secrets
from dataclasses import dataclass

import numpy as np

from daskgen.engines.args import is_number, require
from daskgen.engines.base import FinishReason, GenerationRequest, TopLogprobs

__all__ = ["OutputPlan", "SimulatedArgs", "plan_output"]

_LENGTH_DISTS = ("fixed", "uniform", "lognormal")


@dataclass
class SimulatedArgs:
    """Options of the ``simulated`` engine (see the module docstring for the timing model).

    Attributes
    ----------
    max_batch:
        Requests running at once; the others queue.
    step_time_base_s, step_time_per_seq_s:
        One decode step costs ``base + per_seq * running`` model seconds.
    time_scale:
        Wall seconds per model second; ``0`` runs instantly.
    length_dist, length_mean, length_sigma:
        Natural output length: ``"fixed"``, ``"uniform"`` or ``"lognormal"`` (sigma in log space).
    length_prompt_share:
        Lognormal only: the share (0..1) of the log-length variance that belongs to the prompt (drawn
        from the prompt alone), the rest to the sample.  ``0``: lengths independent of the prompt; near
        ``1``: all samples of a prompt about as long.
    vocab_size, eos_token_id:
        Token ids are drawn from ``[0, vocab_size)``; prompts must use ids in that range.
    prefill_time_per_token_s:
        Model seconds per prompt token the engine computes (the prefill of the requests joining a step
        delays that step); ``0``: prefill is free.
    prefix_cache_tokens, prefix_cache_block:
        The engine's prefix cache (:mod:`~daskgen.engines.simulated.prefix_cache`): tokens it holds (``0``:
        none) and its block size; cached prompt tokens are not computed again.
    """

    max_batch: int = 256
    step_time_base_s: float = 0.02
    step_time_per_seq_s: float = 0.0002
    time_scale: float = 1.0
    length_dist: str = "lognormal"
    length_mean: float = 256.0
    length_sigma: float = 0.6
    length_prompt_share: float = 0.0
    vocab_size: int = 32000
    eos_token_id: int = 2
    prefill_time_per_token_s: float = 0.0
    prefix_cache_tokens: int = 0
    prefix_cache_block: int = 16

    def __post_init__(self) -> None:
        require(
            "simulated",
            isinstance(self.max_batch, int) and self.max_batch >= 1,
            "max_batch",
            "an integer >= 1",
            self.max_batch,
        )
        for name in (
            "step_time_base_s",
            "step_time_per_seq_s",
            "time_scale",
            "length_sigma",
            "prefill_time_per_token_s",
        ):
            value = getattr(self, name)
            require("simulated", is_number(value) and value >= 0, name, "a finite number >= 0", value)
        for name in ("prefix_cache_tokens", "prefix_cache_block"):
            value = getattr(self, name)
            ok = isinstance(value, int) and value >= (name == "prefix_cache_block")
            require(
                "simulated", ok, name, "an integer >= 1" if name == "prefix_cache_block" else "an integer >= 0", value
            )
        require(
            "simulated",
            is_number(self.length_mean) and self.length_mean >= 1,
            "length_mean",
            "a number >= 1",
            self.length_mean,
        )
        share = self.length_prompt_share
        require("simulated", is_number(share) and 0 <= share <= 1, "length_prompt_share", "a number in [0, 1]", share)
        require(
            "simulated",
            self.length_dist in _LENGTH_DISTS,
            "length_dist",
            f"one of {list(_LENGTH_DISTS)}",
            self.length_dist,
        )
        require(
            "simulated",
            isinstance(self.vocab_size, int) and self.vocab_size >= 2,
            "vocab_size",
            "an integer >= 2",
            self.vocab_size,
        )
        require(
            "simulated",
            isinstance(self.eos_token_id, int) and 0 <= self.eos_token_id < self.vocab_size,
            "eos_token_id",
            f"an integer in [0, vocab_size={self.vocab_size})",
            self.eos_token_id,
        )


# --------------------------------------------------------------------------- outputs


@dataclass
class OutputPlan:
    """What a request will produce: its tokens, finish reason and (fake) logprobs and top-k logprobs."""

    tokens: list[int]
    finish: FinishReason
    logprobs: list[float] | None
    top_logprobs: TopLogprobs | None = None


def _prompt_digest(prompt_ids: list[int]) -> int:
    data = np.asarray(prompt_ids, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _natural_length(rng: np.random.Generator, args: SimulatedArgs, prompt_digest: int) -> int:
    if args.length_dist == "fixed":
        return max(1, round(args.length_mean))
    if args.length_dist == "uniform":
        return int(rng.integers(1, max(2, round(2 * args.length_mean))))
    mu = math.log(args.length_mean) - args.length_sigma**2 / 2
    share = args.length_prompt_share
    if not share:
        return max(1, math.ceil(rng.lognormal(mu, args.length_sigma)))
    # log-length = mu + a per-prompt part (variance share x sigma^2) + a per-sample part (the rest)
    per_prompt = np.random.default_rng([prompt_digest, 3]).normal(0.0, args.length_sigma * math.sqrt(share))
    return max(1, math.ceil(rng.lognormal(mu + per_prompt, args.length_sigma * math.sqrt(1 - share))))


def plan_output(request: GenerationRequest, args: SimulatedArgs) -> OutputPlan:
    """The deterministic output of ``request`` under ``args`` (seed drawn at random if unset)."""
    params = request.params
    digest = _prompt_digest(request.prompt_ids)
    if params.temperature == 0:
        key = [digest, 0]
    else:
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        key = [digest, 1, int(seed < 0), abs(seed)]
    rng = np.random.default_rng(key)
    natural = _natural_length(rng, args, digest)
    n = min(natural, params.max_new_tokens)
    tokens = rng.integers(0, args.vocab_size, size=n)
    tokens[tokens == args.eos_token_id] = (args.eos_token_id + 1) % args.vocab_size
    finish = FinishReason.LENGTH
    if natural <= params.max_new_tokens:
        tokens[-1], finish = args.eos_token_id, FinishReason.STOP
    out = tokens.tolist()
    stops = set(params.stop_token_ids)
    cut = next((i for i, t in enumerate(out) if t in stops), None) if stops else None
    if cut is not None:
        out, finish = out[: cut + 1], FinishReason.STOP
    if not (params.logprobs or params.top_logprobs):
        return OutputPlan(out, finish, None)
    fake = (-5.0 * np.random.default_rng([*key, 2]).random(len(out))).tolist()  # own stream: a shorter cap, a prefix
    k = min(params.top_logprobs, args.vocab_size)
    top = _fake_top_logprobs(out, fake, k, args.vocab_size, key) if k else None
    return OutputPlan(out, finish, fake if params.logprobs else None, top)


def _fake_top_logprobs(tokens: list[int], logprobs: list[float], k: int, vocab: int, key: list[int]) -> TopLogprobs:
    """Made-up top-k entries that agree with the made-up logprobs: each sampled token first, with its logprob,
    then ``k - 1`` other distinct random ids with random logprobs below it, most likely first (own streams: a
    shorter cap gives a prefix)."""
    n = len(tokens)
    steps = np.random.default_rng([*key, 3]).integers(1, max(vocab // k, 1), size=(n, k), endpoint=True)
    gaps = np.random.default_rng([*key, 4]).exponential(1.0, size=(n, k))
    steps[:, 0], gaps[:, 0] = 0, 0.0
    ids = ((np.asarray(tokens)[:, None] + np.cumsum(steps, axis=1)) % vocab).tolist()
    values = (np.asarray(logprobs)[:, None] - np.cumsum(gaps, axis=1)).tolist()
    return [list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]
