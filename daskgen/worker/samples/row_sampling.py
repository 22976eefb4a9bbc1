"""A partition's per-row sampling on the worker: each sample's params, its stop rule, the stored settings.

A run without per-row settings or stops takes none of these paths but :func:`sample_params`, which then
only sets the per-sample seed, as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from daskgen.engines.base import FinishReason, SamplingParams
from daskgen.engines.stops import NO_STOP, settle
from daskgen.input.sampling import KEYS, canonical_json

if TYPE_CHECKING:
    from daskgen.agents import Trajectory


def row_params(settings: Mapping[str, Any], eos_ids: tuple[int, ...], base: SamplingParams) -> SamplingParams:
    """The :class:`SamplingParams` of a row's samples: ``base`` (the run-level fields: logprobs, structured
    output, top-k logprobs, adapter) with every key of :data:`daskgen.input.sampling.KEYS` but ``seed`` taken
    from ``settings`` (the per-sample seed is set later).

    ``settings`` are canonical (:func:`daskgen.input.sampling.merged`, :func:`~daskgen.input.sampling.run_settings`);
    lists become tuples, and ``stop_token_ids`` are the row's own ids followed by the tokenizer's end ids
    (``eos_ids``).
    """
    values: dict[str, Any] = {
        key: tuple(settings.get(key) or ()) if spec.kind == "list" else settings[key]
        for key, spec in KEYS.items()
        if key != "seed"
    }
    own = values["stop_token_ids"]
    values["stop_token_ids"] = own + tuple(t for t in eos_ids if t not in own)
    return dataclasses.replace(base, **values)


def sample_seed(seed: int, row: int, sample: int) -> int:
    """Per-sample seed from (run seed, prompt row, sample), stable across runs and machines."""
    state = np.random.SeedSequence([seed, row, sample]).generate_state(1, dtype=np.uint32)[0]
    return int(state) & 0x7FFFFFFF


def sample_params(
    run: SamplingParams, settings: dict[str, Any] | None, eos_ids: tuple[int, ...], seed: int, row: int, s: int
) -> SamplingParams:
    """The params of sample ``s`` of ``row``: the ``run``'s, or those of the row's own ``settings`` (with the
    tokenizer's ``eos_ids``), seeded per sample from the run ``seed``.

    A row's own ``seed`` replaces the run seed and the row position in the derivation, so that the row
    samples alike wherever it sits in the input.
    """
    base = run
    if settings is not None:  # the row's sampling over the run's; what no row sets stays the run's
        base = row_params(settings, eos_ids, run)
    if settings is not None and settings.get("seed") is not None:
        return dataclasses.replace(base, seed=sample_seed(settings["seed"], 0, s))
    return dataclasses.replace(base, seed=sample_seed(seed, row, s))


def apply_stops(trajectories: list[Trajectory], settings: dict[str, Any], decode: Callable[[list[int]], str]) -> None:
    """Give each trajectory its ``stop_reason`` and cut a single-turn response that ran past its first stop
    (:func:`daskgen.engines.stops.settle`); multi-turn trajectories are not cut (tool tokens follow stops)."""
    stop, stop_ids = settings.get("stop") or (), settings.get("stop_token_ids") or ()
    for traj in trajectories:
        if traj.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT):
            traj.stop_reason = NO_STOP
            continue
        keep, traj.stop_reason = settle(
            traj.response_ids, traj.finish_reason == FinishReason.STOP, stop, stop_ids, decode
        )
        if traj.num_turns <= 1 and keep < len(traj.response_ids):
            _cut(traj, keep)
        if traj.stop_reason != NO_STOP:
            traj.finish_reason = FinishReason.STOP


def _cut(traj: Trajectory, keep: int) -> None:
    """Drop the tokens of ``traj`` after the first ``keep``."""
    traj.response_ids = traj.response_ids[:keep]
    traj.response_mask = traj.response_mask[:keep]
    if traj.logprobs is not None:
        traj.logprobs = traj.logprobs[:keep]
    if traj.top_logprobs is not None:
        traj.top_logprobs = traj.top_logprobs[:keep]
    traj.versions = [seg for i, seg in enumerate(traj.versions) if i == 0 or seg[0] < keep]


def place_row_settings(
    region: dict[str, np.ndarray], start: int, rows: list[int], settings: list[dict[str, Any]] | None
) -> None:
    """Store the ``settings`` of each pending row (sorted JSON) in the region's ``sampling`` array, when it has one."""
    if "sampling" not in region or settings is None:
        return
    for row, used in zip(rows, settings, strict=True):
        region["sampling"][row - start] = canonical_json(used)
