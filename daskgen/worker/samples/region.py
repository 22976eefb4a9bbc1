"""Placing a partition's prompts and finished samples into its region, all samples at once.

The region holds one chunk-aligned block of rows (``[n_rows, n_samples, (n_trajectories,) width]`` per
response array).  Rather than a dozen small numpy assignments per sample, the samples' token lists are
joined once and scattered into the padded arrays with one fancy-indexed assignment per array; the
per-sample scalars (length, finish reason, turns, ...) likewise.  What a sample stores is unchanged:
every placed slot is reset to its fill values first, so a region read back from the store (kept rows)
is overwritten exactly where a pending sample lands.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from daskgen.agents import Trajectory
from daskgen.engines.base import BASE_POLICY_VERSION, FinishReason, GenerationResult
from daskgen.store.fingerprint import NO_FINGERPRINT
from daskgen.store.layout import FINGERPRINT_ARRAYS, VERSION_ARRAYS, Layout, clear_response
from daskgen.worker.samples.fast_path import PlainTurns
from daskgen.worker.samples.top_logprobs import TOP_UNAVAILABLE, lacks_top, place_top_logprobs
from daskgen.worker.tool_images import place_tool_images


@dataclass
class SampleCounts:
    """What the placed samples add to a partition's result (see ``PartitionResult``)."""

    failed: dict[int, str] = field(default_factory=dict)
    aborted: list[int] = field(default_factory=list)
    response_tokens: int = 0
    partial_samples: int = 0
    partial_tokens: int = 0
    carried_tokens: int = 0
    #: Notes of rows that stay done (:data:`~daskgen.worker.samples.top_logprobs.TOP_UNAVAILABLE`), by store row.
    notes: dict[int, str] = field(default_factory=dict)


@dataclass
class _Slots:
    """The trajectories to place, in row, sample, trajectory order: their flat slot, owner and contents."""

    slots: list[int] = field(default_factory=list)
    owners: list[tuple[int, int]] = field(default_factory=list)  # (store row, sample)
    trajectories: list[Trajectory] = field(default_factory=list)


def _rows_view(region: dict[str, np.ndarray], name: str, width: int | None) -> np.ndarray:
    """``region[name]`` as a view of one row per slot (``width`` columns) or a flat vector (``width=None``)."""
    array = region[name]
    if not array.flags.c_contiguous:
        region[name] = array = np.ascontiguousarray(array)
    return array.reshape(-1) if width is None else array.reshape(-1, width)


def scatter(
    region: dict[str, np.ndarray], name: str, slots: np.ndarray, lengths: np.ndarray, values: np.ndarray, fill: Any
) -> None:
    """Reset rows ``slots`` of ``region[name]`` (viewed one row per slot) to ``fill``, then write the joined
    ``values`` there: ``lengths[k]`` of them at the start of slot ``slots[k]``."""
    width = region[name].shape[-1]
    if len(lengths) and int(lengths.max(initial=0)) > width:
        raise ValueError(f"{name}: {int(lengths.max())} values do not fit in its {width} positions")
    rows = _rows_view(region, name, width)
    rows[slots] = fill
    if len(values):
        starts = np.cumsum(lengths) - lengths
        positions = np.repeat(slots * width - starts, lengths) + np.arange(len(values))
        rows.reshape(-1)[positions] = values


def _joined(lists: Sequence[Sequence[Any]], total: int, dtype: Any) -> np.ndarray:
    """The lists one after the other as one array of ``total`` values."""
    return np.fromiter(itertools.chain.from_iterable(lists), dtype=dtype, count=total)


def place_prompts(
    region: dict[str, np.ndarray], offsets: Sequence[int], prompts: Sequence[Sequence[int]], pad: int
) -> int:
    """Store each prompt's ids (padded) and length in region row ``offsets[i]``; returns the prompt tokens."""
    lengths = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
    slots = np.asarray(offsets, dtype=np.int64)
    total = int(lengths.sum())
    scatter(region, "prompt_ids", slots, lengths, _joined(prompts, total, region["prompt_ids"].dtype), pad)
    _rows_view(region, "prompt_length", None)[slots] = lengths
    return total


def _collect(where: Sequence[tuple[int, int, int]], layout: Layout) -> _Slots:
    """Each sample's owner and first flat slot, from its ``(store row, region row, sample)``."""
    out, n_traj, n_samples = _Slots(), layout.n_trajectories, layout.n_samples
    for row, r, s in where:
        out.owners.append((row, s))
        out.slots.append((r * n_samples + s) * n_traj)
    return out


def _expand(
    region: dict[str, np.ndarray], collected: _Slots, samples: Sequence[list[Trajectory]], layout: Layout
) -> _Slots:
    """One entry per stored trajectory (samples with several trajectories, or none, are rare)."""
    if layout.n_trajectories == 1 and all(len(t) == 1 for t in samples):
        collected.trajectories = [t[0] for t in samples]
        return collected
    out, n_samples = _Slots(), layout.n_samples
    for (row, s), base, trajectories in zip(collected.owners, collected.slots, samples, strict=True):
        trajectories = trajectories[: layout.n_trajectories]
        r = base // layout.n_trajectories // n_samples
        if layout.n_trajectories > 1:
            region["num_trajectories"][r, s] = len(trajectories)
        if not trajectories:  # not needed: the verifier was satisfied earlier
            clear_response(region, (r, s), layout)
        for t, traj in enumerate(trajectories):
            out.slots.append(base + t)
            out.owners.append((row, s))
            out.trajectories.append(traj)
    return out


@dataclass
class _Columns:
    """The placed trajectories' contents, one entry per trajectory (token lists cut to the store's width)."""

    ids: list[list[int]] = field(default_factory=list)
    masks: list[list[int]] | None = None  # lists (``count`` checks for all ones); None: model tokens only
    logprobs: list[list[float]] = field(default_factory=list)  # only the non-empty ones
    lengths: list[int] = field(default_factory=list)
    logprob_lengths: list[int] = field(default_factory=list)
    scalars: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def of(cls, trajectories: list[Trajectory], width: int) -> _Columns:
        """Gather what each trajectory stores (its first ``width`` tokens), one list per column."""
        out = cls()
        out.ids = [t.response_ids if len(t.response_ids) <= width else t.response_ids[:width] for t in trajectories]
        out.lengths = lengths = list(map(len, out.ids))
        pairs = list(zip(trajectories, lengths, strict=True))
        out.masks = [t.response_mask if len(t.response_mask) == n else t.response_mask[:n] for t, n in pairs]
        out.logprob_lengths = [0 if t.logprobs is None else min(n, len(t.logprobs)) for t, n in pairs]
        out.logprobs = [
            lps if len(lps) == m else lps[:m]
            for t, m in zip(trajectories, out.logprob_lengths, strict=True)
            if m and (lps := t.logprobs) is not None
        ]
        error = int(FinishReason.ERROR)
        out.scalars = {
            "response_length": lengths,
            "finish_reason": [error if t.error is not None else int(t.finish_reason) for t in trajectories],
            "num_turns": [t.num_turns for t in trajectories],
            "continued_tokens": [min(t.continued, n) for t, n in pairs],
            "stop_reason": [t.stop_reason for t in trajectories],
            "cached_prompt_tokens": [t.cached_prompt_tokens for t in trajectories],
        }
        versions = [versions_of(t, n) for t, n in pairs]
        for k, name in enumerate(VERSION_ARRAYS):
            out.scalars[name] = [v[k] for v in versions]
        for k, name in enumerate(FINGERPRINT_ARRAYS):  # the checked fingerprints of the first and last versions
            out.scalars[name] = [
                t.fingerprints.get(v[k], NO_FINGERPRINT) if t.fingerprints else NO_FINGERPRINT
                for t, v in zip(trajectories, versions, strict=True)
            ]
        return out

    @classmethod
    def of_turns(cls, turns: PlainTurns, width: int) -> _Columns:
        """What :meth:`of` gathers of the trajectories ``turns`` would make (one engine call each, base policy), from
        the engine's results themselves."""
        out, results = cls(), turns.results
        out.ids = [r.output_ids if len(r.output_ids) <= width else r.output_ids[:width] for r in results]
        out.lengths = lengths = list(map(len, out.ids))
        out.logprob_lengths = turns.logprob_lengths(lengths)
        out.logprobs = [
            r.logprobs[:m] if r.logprobs is not None else [math.nan] * m
            for r, m in zip(results, out.logprob_lengths, strict=True)
            if m
        ]
        k, version = len(results), [BASE_POLICY_VERSION if n else -1 for n in lengths]
        out.scalars = {
            "response_length": lengths,
            "finish_reason": [int(r.finish_reason) for r in results],
            "num_turns": [1] * k,
            "continued_tokens": [0] * k,
            "stop_reason": [-1] * k,
            "cached_prompt_tokens": list(map(_cached_tokens, results)),
            **dict(zip(VERSION_ARRAYS, (version, version, [-1] * k), strict=True)),
            **dict.fromkeys(FINGERPRINT_ARRAYS, [NO_FINGERPRINT] * k),
        }
        return out


def _cached_tokens(result: GenerationResult) -> int:
    """Prompt tokens the engine served ``result`` from its prefix cache (-1: it does not say)."""
    cached = result.meta.get("cached_tokens")
    return -1 if cached is None else int(cached)


def versions_of(traj: Trajectory, n: int) -> tuple[int, int, int]:
    """The policy versions of a trajectory's first ``n`` response tokens: of the first token, of the last, and
    the position where the version first changed (-1: no model token, or no change)."""
    if len(traj.versions) == 1:  # one policy version (every run without a refresh): no list to build
        ((position, version),) = traj.versions
        return (version, version, -1) if position < n else (-1, -1, -1)
    versions = [(position, version) for position, version in traj.versions if position < n]
    if not versions:
        return -1, -1, -1
    return versions[0][1], versions[-1][1], versions[1][0] if len(versions) > 1 else -1


def place_samples(
    region: dict[str, np.ndarray],
    rows: Sequence[int],
    offsets: Sequence[int],
    n_samples: int,
    samples: Sequence[list[Trajectory]] | PlainTurns,
    layout: Layout,
) -> SampleCounts:
    """Store every sample of the pending ``rows`` (region rows ``offsets``; ``samples`` row-major) and count them.

    ``samples``: each sample's trajectories, or the partition's plain turns (:func:`place_turns`)."""
    if isinstance(samples, PlainTurns):
        return place_turns(region, offsets, n_samples, samples, layout)
    where = [(row, r, s) for row, r in zip(rows, offsets, strict=True) for s in range(n_samples)]
    placed = _expand(region, _collect(where, layout), samples, layout)
    counts = SampleCounts()
    if not placed.trajectories:
        return counts
    columns = _Columns.of(placed.trajectories, layout.max_new_tokens)
    mask, length = _store_columns(region, np.asarray(placed.slots, dtype=np.int64), columns, layout)
    if "top_logprobs" in region:
        for slot, traj, n, (row, _) in zip(
            placed.slots, placed.trajectories, columns.lengths, placed.owners, strict=True
        ):
            place_top_logprobs(region, _index(slot, layout.n_samples, layout.n_trajectories), traj.top_logprobs, n)
            if lacks_top(traj):
                counts.notes[row] = TOP_UNAVAILABLE
    if layout.tool_images:
        at = [_index(slot, layout.n_samples, layout.n_trajectories) for slot in placed.slots]
        place_tool_images(region, at, [t.images for t in placed.trajectories], layout)
    _count(counts, placed, _segment_sums(mask, length), columns.scalars["finish_reason"])
    return counts


def place_turns(
    region: dict[str, np.ndarray],
    offsets: Sequence[int],
    n_samples: int,
    turns: PlainTurns,
    layout: Layout,
) -> SampleCounts:
    """Store every sample of the pending rows (region rows ``offsets``; ``turns`` row-major) from the engine's
    plain results (:mod:`daskgen.worker.samples.fast_path`): what :func:`place_samples` stores of their trajectories."""
    assert layout.n_trajectories == 1 and "top_logprobs" not in region, "plain turns: one trajectory, no top-k"
    slots = (np.asarray(offsets, dtype=np.int64)[:, None] * n_samples + np.arange(n_samples)).reshape(-1)
    _mask, length = _store_columns(region, slots, _Columns.of_turns(turns, layout.max_new_tokens), layout)
    return SampleCounts(response_tokens=int(length.sum()))


def _store_columns(
    region: dict[str, np.ndarray], slots: np.ndarray, columns: _Columns, layout: Layout
) -> tuple[np.ndarray, np.ndarray]:
    """Write ``columns`` into flat slots ``slots`` of the region: tokens, mask and logprobs scattered, the per-sample
    scalars assigned; returns the joined mask and each slot's length."""
    length = np.asarray(columns.lengths, dtype=np.int64)
    total = int(length.sum())
    ids = _joined(columns.ids, total, region["response_ids"].dtype)
    scatter(region, "response_ids", slots, length, ids, layout.pad_token_id)
    masks = columns.masks
    if masks is None or sum(m.count(1) for m in masks) == total:  # model tokens only: no list to convert
        mask = np.ones(total, dtype=region["response_mask"].dtype)
    else:
        mask = _joined(masks, total, region["response_mask"].dtype)
    scatter(region, "response_mask", slots, length, mask, 0)
    lp_length = np.asarray(columns.logprob_lengths, dtype=np.int64)
    logprobs = _joined(columns.logprobs, int(lp_length.sum()), region["logprobs"].dtype)
    scatter(region, "logprobs", slots, lp_length, logprobs, np.nan)
    for name, values in columns.scalars.items():
        if name in region:
            _rows_view(region, name, None)[slots] = values
    return mask, length


def _segment_sums(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The sum of each consecutive segment of ``values`` (``lengths[k]`` values each, empty segments 0)."""
    bounds = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
    ends = np.cumsum(lengths)
    return bounds[ends] - bounds[ends - lengths]


def _index(slot: int, n_samples: int, n_traj: int) -> tuple[int, ...]:
    """The region index of flat slot ``slot``: ``(row, sample)``, or ``(row, sample, trajectory)``."""
    if n_traj == 1:
        return divmod(slot, n_samples)
    r_s, t = divmod(slot, n_traj)
    return (*divmod(r_s, n_samples), t)


def _count(counts: SampleCounts, placed: _Slots, tokens: np.ndarray, reasons: list[int]) -> None:
    """Add the placed trajectories' tokens, failures, aborted rows and partial samples to ``counts``."""
    carried = np.fromiter((t.carried for t in placed.trajectories), dtype=np.int64, count=len(placed.trajectories))
    kept = np.minimum(carried, tokens)
    counts.response_tokens += int((tokens - kept).sum())
    counts.carried_tokens += int(kept.sum())
    reason = np.asarray(reasons, dtype=np.int64)
    for k in np.flatnonzero((reason == FinishReason.ERROR) | (reason == FinishReason.ABORT)).tolist():
        traj, (row, s) = placed.trajectories[k], placed.owners[k]
        if traj.error is not None:
            counts.failed.setdefault(row, f"sample {s}: {traj.error}")
        if traj.finish_reason == FinishReason.ABORT:
            if row not in counts.aborted:
                counts.aborted.append(row)
            if tokens[k]:
                counts.partial_samples += 1
                counts.partial_tokens += int(tokens[k])
