"""Which data chunks a finished partition must have written, derived per array from the partition's own rows.

Zarr does not write a chunk that holds only its array's fill value, and a chunk that is not there reads back
as fill values without an error.  So a lost chunk file is found only by knowing that it must hold something:
for every worker-written array (:meth:`daskgen.store.layout.Layout.data_arrays`) a rule below marks the
elements of a partition's region that the store's own rules say are not fill values, from the *other* arrays'
values of its finished (``done``) rows; a chunk of that array covering any marked element must exist.

* ``prompt_length`` (at least 1) and ``prompt_ids`` (the tokens before ``prompt_length``, at least one) of
  every done row;
* ``finish_reason`` of every sample that must have been generated (all, or the first ``samples_used`` under a
  verifier; the first ``num_trajectories`` of a trajectory store);
* ``response_length`` of a sample whose tokens, mask, log-probabilities or continued tokens show a response,
  or that finished at ``length``;
* ``response_ids`` before each length, but for a ``stop``-finished sample's last token (a stop token may be
  the pad id);
* ``response_mask`` before each length in single-turn runs (every token is the model's); in agent runs, the
  positions with a log-probability (model tokens);
* ``logprobs`` (when the run recorded them) at the model's tokens before each length, and there the first
  entry of ``top_logprob_ids``/``top_logprobs`` (when the run recorded top-k logprobs);
* ``num_turns`` of a sample with a model token;
* ``sampling`` of every done row (runs whose rows carry their own settings: each row's settings, run defaults
  filled in, never empty); ``stop_reason`` of every generated sample that finished by ``stop`` (a stop string,
  a stop id or the end-of-sequence token, each a value other than the fill -1);
* ``score`` of each sample a verifier scored in a row without a verifier note in ``error``; ``samples_used``
  of every done row of a verified run; ``num_trajectories`` of every generated sample.

``continued_tokens`` has no rule: 0 is the value of every sample generated in one go, so no other value
shows that it must be anything else (:data:`UNDERIVABLE`); nor have the kept input columns (``column_<name>``,
per store), ``response_format`` and ``adapter``: the empty string is a valid value of each.  The expected
chunks are computed on the worker that read the partition; whether their keys exist is checked against one
listing of the store.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from daskgen.engines.base import FinishReason
from daskgen.store.invariants import RowRules, expected_samples

#: Data arrays whose chunks no other value of a row can show to be needed, and why.
UNDERIVABLE = {"continued_tokens": "0 is the value of every sample generated in one go"}


@dataclass(frozen=True)
class PartitionRows:
    """One partition's region (every data array read once) and what its rows say of themselves."""

    region: dict[str, np.ndarray]
    done: np.ndarray  # per row: committed as done
    noted: np.ndarray  # per row: the ``error`` column holds a note (e.g. a verifier that raised)
    rules: RowRules


@dataclass(frozen=True)
class ExpectedChunk:
    """A chunk that must exist: its array, grid index and the store rows ``[start, stop)`` it holds."""

    array: str
    index: tuple[int, ...]
    start: int
    stop: int


def _per_row(flags: np.ndarray, like: np.ndarray) -> np.ndarray:
    """Per-row (or per-sample) ``flags`` broadcast to the shape of ``like`` (trailing axes added)."""
    return np.broadcast_to(flags.reshape(*flags.shape, *([1] * (like.ndim - flags.ndim))), like.shape)


def _generated(rows: PartitionRows) -> np.ndarray:
    """Per sample (and trajectory): generated in a done row."""
    want = expected_samples(rows.region, rows.rules)
    return want & _per_row(rows.done, want)


def _inside(rows: PartitionRows, drop_stop_token: bool = False) -> np.ndarray:
    """Per response position of a done row: before the sample's length (optionally not a ``stop`` finish's last)."""
    lengths = rows.region["response_length"].astype("int64")
    if drop_stop_token:
        lengths = lengths - (rows.region["finish_reason"] == int(FinishReason.STOP))
    inside = np.arange(rows.region["response_ids"].shape[-1]) < lengths[..., None]
    return inside & _per_row(rows.done, inside)


def _model_tokens(rows: PartitionRows) -> np.ndarray:
    """Per response position: a token the model generated (provably: single-turn, or a recorded log-probability)."""
    if rows.rules.model_tokens_only:
        return _inside(rows)
    return _inside(rows) & ~np.isnan(rows.region["logprobs"])


def _prompt_ids(rows: PartitionRows) -> np.ndarray:
    ids = rows.region["prompt_ids"]
    count = np.maximum(rows.region["prompt_length"], 1)
    return (np.arange(ids.shape[1]) < count[:, None]) & rows.done[:, None]


def _response_length(rows: PartitionRows) -> np.ndarray:
    region, pad = rows.region, rows.rules.layout.pad_token_id
    shown = (region["response_ids"] != pad) | (region["response_mask"] != 0)
    if "logprobs" in region:
        shown |= ~np.isnan(region["logprobs"])
    found = shown.any(axis=-1) | (region["continued_tokens"] > 0)
    if rows.rules.layout.max_new_tokens > 0:
        found |= region["finish_reason"] == int(FinishReason.LENGTH)
    return found & _per_row(rows.done, found)


def _logprobs(rows: PartitionRows) -> np.ndarray:
    if not rows.rules.logprobs:
        return np.zeros(rows.region["logprobs"].shape, dtype=bool)
    return _generated_tokens(rows)


def _generated_tokens(rows: PartitionRows) -> np.ndarray:
    """Per response position of a done row: a token the model generated (by the mask)."""
    if rows.rules.model_tokens_only:
        return _inside(rows)
    return _inside(rows) & (rows.region["response_mask"] == 1)


def _top_first(rows: PartitionRows) -> np.ndarray:
    """The first top-k entry (``top_rank`` 0) of every generated token."""
    must = np.zeros(rows.region["top_logprobs"].shape, dtype=bool)
    must[..., 0] = _generated_tokens(rows)
    return must


def _num_turns(rows: PartitionRows) -> np.ndarray:
    return np.asarray(_model_tokens(rows).any(axis=-1))


def _score(rows: PartitionRows) -> np.ndarray:
    score = rows.region["score"]
    used = np.arange(score.shape[1]) < rows.region["samples_used"][:, None]
    return used & (rows.done & ~rows.noted)[:, None]


def _num_trajectories(rows: PartitionRows) -> np.ndarray:
    generated = _generated(rows)
    return generated[..., 0] if generated.ndim > 2 else generated


#: Per data array: the elements of a partition's region that must not hold the array's fill value.
RULES: dict[str, Callable[[PartitionRows], np.ndarray]] = {
    "prompt_ids": _prompt_ids,
    "prompt_length": lambda rows: rows.done,
    "response_ids": lambda rows: _inside(rows, drop_stop_token=True),
    "response_length": _response_length,
    "response_mask": _model_tokens,
    "logprobs": _logprobs,
    "top_logprob_ids": _top_first,
    "top_logprobs": _top_first,
    "finish_reason": _generated,
    "num_turns": _num_turns,
    "sampling": lambda rows: rows.done,
    "stop_reason": lambda rows: _generated(rows) & (rows.region["finish_reason"] == int(FinishReason.STOP)),
    "score": _score,
    "samples_used": lambda rows: rows.done,
    "num_trajectories": _num_trajectories,
}


def expected_chunks(rows: PartitionRows, start: int, chunks: dict[str, tuple[int, ...]]) -> list[ExpectedChunk]:
    """Every chunk of the partition starting at store row ``start`` that must exist.

    ``chunks`` holds each data array's chunk shape (as the store's arrays have it, so an array chunked along
    its token axis too is checked chunk by chunk).
    """
    out = []
    for name, rule in RULES.items():
        if name not in rows.region:
            continue
        must = rule(rows)
        for index, where in _chunks_of(must.shape, chunks[name], start):
            if must[where].any():
                out.append(ExpectedChunk(name, index, start + where[0].start, start + where[0].stop))
    return out


def _chunks_of(
    shape: tuple[int, ...], chunks: tuple[int, ...], start: int
) -> Iterator[tuple[tuple[int, ...], tuple[slice, ...]]]:
    """Each chunk's grid index and its part of a region of ``shape`` whose row 0 is store row ``start``."""
    axes = [
        [
            (i, slice(max(i * chunks[0] - start, 0), min((i + 1) * chunks[0] - start, shape[0])))
            for i in range(start // chunks[0], (start + shape[0] - 1) // chunks[0] + 1)
        ]
    ]
    for size, step in zip(shape[1:], chunks[1:], strict=True):
        axes.append([(j, slice(j * step, min((j + 1) * step, size))) for j in range(-(-size // step))])
    for combo in itertools.product(*axes):
        yield tuple(i for i, _ in combo), tuple(s for _, s in combo)
