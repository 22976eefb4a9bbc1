"""The ``simulated`` engine's options and output model: what each request produces.

:func:`plan_output` is a pure function of the prompt ids, the sampling params and
:class:`SimulatedArgs` (see :mod:`daskgen.engines.simulated.engine` for the timing model that decides
when it is delivered).
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from daskgen.engines.args import is_number, require
from daskgen.engines.base import FinishReason, GenerationRequest, SamplingParams, TopLogprobs
from daskgen.engines.continuation import split_prompt

__all__ = ["OutputPlan", "SimulatedArgs", "plan_output", "plan_outputs"]

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
    image_token_time_s:
        Model seconds of the vision encoder per image placeholder token of a request's images, on top of their
        prefill (``0``: images cost only their tokens' prefill).
    prefix_cache_tokens, prefix_cache_block:
        The engine's prefix cache (:mod:`~daskgen.engines.simulated.prefix_cache`): tokens it holds (``0``:
        none) and its block size; cached prompt tokens are not computed again.
    max_model_len:
        The context the engine models: a request's prompt plus ``max_new_tokens`` above it is refused with the
        limit named (``0``: no limit).
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
    image_token_time_s: float = 0.0
    prefix_cache_tokens: int = 0
    prefix_cache_block: int = 16
    max_model_len: int = 0

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
            "image_token_time_s",
        ):
            value = getattr(self, name)
            require("simulated", is_number(value) and value >= 0, name, "a finite number >= 0", value)
        for name in ("prefix_cache_tokens", "prefix_cache_block", "max_model_len"):
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


# Counter-based random numbers: value ``j`` of stream ``stream`` of key ``k`` is a 64-bit mix of
# ``(k, stream, j)`` (the splitmix64 finaliser), so a request's tokens are drawn for all requests of a
# batch in a few array operations, and a shorter cap reads a prefix of the same stream.
_GOLDEN_INT, _STREAM_INT = 0x9E3779B97F4A7C15, 0xD1B54A32D192ED03  # odd 64-bit constants
_GOLDEN, _ONE = np.uint64(_GOLDEN_INT), np.uint64(1)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser of each uint64 (a bijection that spreads every input bit)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _uniform(keys: np.ndarray, stream: int, positions: np.ndarray | int) -> np.ndarray:
    """Uniform numbers in ``[0, 1)``: value ``positions`` of stream ``stream`` of each key."""
    if isinstance(positions, int):  # one value per key: the offset in Python integers (no scalar overflow)
        counter = keys + np.uint64((stream * _STREAM_INT + (positions + 1) * _GOLDEN_INT) & _MASK64)
    else:
        counter = keys + np.uint64(stream * _STREAM_INT & _MASK64) + (positions.astype(np.uint64) + _ONE) * _GOLDEN
    return (_mix(counter) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _normal(keys: np.ndarray, stream: int) -> np.ndarray:
    """One standard normal number per key (Box-Muller of the stream's first two values)."""
    radius = np.sqrt(-2.0 * np.log1p(-_uniform(keys, stream, 0)))
    return radius * np.cos(2 * math.pi * _uniform(keys, stream, 1))


def _seed_code(params: SamplingParams) -> int:
    """What a request's seed adds to its key: 0 for a greedy request (its prompt alone decides), else a distinct
    non-zero code per seed (a random seed when it has none)."""
    if params.temperature == 0:
        return 0
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return (2 * abs(seed) + (seed < 0) + 1) & _MASK64  # 0 only for seeds of magnitude 2**63 and beyond


def _natural_lengths(keys: np.ndarray, digests: np.ndarray, args: SimulatedArgs) -> np.ndarray:
    """Each request's length before any cap (its EOS is its last token)."""
    if args.length_dist == "fixed":
        return np.full(len(keys), max(1, round(args.length_mean)), dtype=np.int64)
    if args.length_dist == "uniform":
        high = max(2, round(2 * args.length_mean))  # lengths 1 .. high - 1
        return 1 + (_uniform(keys, 0, 0) * (high - 1)).astype(np.int64)
    share, sigma = args.length_prompt_share, args.length_sigma
    mu = math.log(args.length_mean) - sigma**2 / 2
    # log-length = mu + a per-prompt part (variance share x sigma^2) + a per-sample part (the rest)
    logs = mu + sigma * math.sqrt(1 - share) * _normal(keys, 0)
    if share:
        logs += sigma * math.sqrt(share) * _normal(digests, 3)
    return np.maximum(1, np.ceil(np.exp(np.minimum(logs, 60.0)))).astype(np.int64)


def plan_output(request: GenerationRequest, args: SimulatedArgs) -> OutputPlan:
    """The deterministic output of ``request`` under ``args`` (seed drawn at random if unset)."""
    return plan_outputs([request], args)[0]


def plan_outputs(requests: Sequence[GenerationRequest], args: SimulatedArgs) -> list[OutputPlan]:
    """:func:`plan_output` of every request, drawn for all of them at once (each plan is the request's own,
    whatever else is in the batch)."""
    if not requests:
        return []
    # a continuation (params.continued = c) is the rest of its sample: drawn from the prompt without the tokens so
    # far, from position c on, so that it equals the uninterrupted sample's tokens
    done = np.fromiter((r.params.continued for r in requests), dtype=np.int64, count=len(requests))
    digests = np.array(
        [_prompt_digest(split_prompt(r.prompt_ids, r.params.continued)[0]) for r in requests], dtype=np.uint64
    )
    codes = np.array([_seed_code(r.params) for r in requests], dtype=np.uint64)
    keys = np.where(codes == 0, digests, digests ^ _mix(codes))  # the splitmix finaliser maps only 0 to 0
    caps = np.fromiter((r.params.max_new_tokens for r in requests), dtype=np.int64, count=len(requests))
    natural = _natural_lengths(keys, digests, args) - done
    lengths = np.maximum(np.minimum(natural, caps), 0)
    owners = np.repeat(keys, lengths)
    positions = np.arange(len(owners)) - np.repeat(np.cumsum(lengths) - lengths - done, lengths)
    tokens = (_uniform(owners, 1, positions) * args.vocab_size).astype(np.int64)
    tokens[tokens == args.eos_token_id] = (args.eos_token_id + 1) % args.vocab_size
    ends = np.cumsum(lengths)
    stopped = natural <= caps
    tokens[ends[stopped & (lengths > 0)] - 1] = args.eos_token_id
    starts = ends - lengths
    cuts = _first_stops(requests, tokens, starts, ends)  # a request ends at its first stop id
    cut = cuts >= 0
    ends[cut], stopped[cut] = cuts[cut] + 1, True
    wants = [bool(r.params.logprobs or r.params.top_logprobs) for r in requests]
    fake = (-5.0 * _uniform(owners, 2, positions)).tolist() if any(wants) else []
    flat, spans = tokens.tolist(), zip(starts.tolist(), ends.tolist(), strict=True)
    out = []
    for k, (request, (a, b)) in enumerate(zip(requests, spans, strict=True)):
        finish = FinishReason.STOP if stopped[k] else FinishReason.LENGTH
        out.append(_finished(request, flat[a:b], finish, fake[a:b] if wants[k] else None, int(keys[k]), args))
    return out


def _first_stops(
    requests: Sequence[GenerationRequest], tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> np.ndarray:
    """For each request, the position in ``tokens`` of the first of its stop ids within its span
    ``[starts[k], ends[k])``, or -1: found with one array search per distinct set of stop ids in the batch."""
    cuts = np.full(len(requests), -1, dtype=np.int64)
    by_stops: dict[tuple[int, ...], list[int]] = {}
    for k, request in enumerate(requests):
        if request.params.stop_token_ids:
            by_stops.setdefault(tuple(request.params.stop_token_ids), []).append(k)
    for stops, members in by_stops.items():
        hits = np.flatnonzero(np.isin(tokens, stops))
        if not len(hits):
            continue
        ks = np.asarray(members, dtype=np.int64)
        first = hits[np.minimum(np.searchsorted(hits, starts[ks]), len(hits) - 1)]
        inside = (first >= starts[ks]) & (first < ends[ks])
        cuts[ks[inside]] = first[inside]
    return cuts


def _finished(
    request: GenerationRequest,
    tokens: list[int],
    finish: FinishReason,
    fake: list[float] | None,
    key: int,
    args: SimulatedArgs,
) -> OutputPlan:
    """A request's plan from its drawn tokens (already cut at its first stop id), with its logprobs as it asked."""
    params = request.params
    if fake is None:
        return OutputPlan(tokens, finish, None)
    k = min(params.top_logprobs, args.vocab_size)
    top = _fake_top_logprobs(tokens, fake, k, args.vocab_size, [key], params.continued) if k else None
    return OutputPlan(tokens, finish, fake if params.logprobs else None, top)


def _fake_top_logprobs(
    tokens: list[int], logprobs: list[float], k: int, vocab: int, key: list[int], offset: int = 0
) -> TopLogprobs:
    """Made-up top-k entries that agree with the made-up logprobs: each sampled token first, with its logprob,
    then ``k - 1`` other distinct random ids with random logprobs below it, most likely first (own streams: a
    shorter cap gives a prefix; a continuation from ``offset`` the rest of the uninterrupted entries)."""
    n = len(tokens)
    steps = np.random.default_rng([*key, 3]).integers(1, max(vocab // k, 1), size=(offset + n, k), endpoint=True)
    gaps = np.random.default_rng([*key, 4]).exponential(1.0, size=(offset + n, k))
    steps, gaps = steps[offset:], gaps[offset:]
    steps[:, 0], gaps[:, 0] = 0, 0.0
    ids = ((np.asarray(tokens)[:, None] + np.cumsum(steps, axis=1)) % vocab).tolist()
    values = (np.asarray(logprobs)[:, None] - np.cumsum(gaps, axis=1)).tolist()
    return [list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]
