"""A partition's per-row sampling on the worker: each sample's params, its stop rule, the stored settings.

A run without per-row settings or stops (``task.run_settings is None``) takes none of these paths but
:func:`sample_params`, which then only sets the per-sample seed, as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from daskgen.engines.base import FinishReason, SamplingParams
from daskgen.engines.stops import NO_STOP, settle
from daskgen.input.sampling import canonical_json, row_params

if TYPE_CHECKING:
    from daskgen.agents import Trajectory
    from daskgen.worker.partition import PartitionTask


def sample_seed(seed: int, row: int, sample: int) -> int:
    """Per-sample seed from (run seed, prompt row, sample), stable across runs and machines."""
    state = np.random.SeedSequence([seed, row, sample]).generate_state(1, dtype=np.uint32)[0]
    return int(state) & 0x7FFFFFFF


def row_settings(task: PartitionTask, i: int) -> dict[str, Any] | None:
    """The settings the task's ``i``-th row uses, or ``None`` for a run with neither row settings nor stops."""
    return task.row_settings[i] if task.row_settings is not None else task.run_settings


def sample_params(task: PartitionTask, i: int, s: int) -> SamplingParams:
    """The params of sample ``s`` of the task's ``i``-th row: its row's settings, seeded per sample.

    A row's own ``seed`` replaces the run seed and the row position in the derivation, so that the row
    samples alike wherever it sits in the input.
    """
    settings = task.row_settings[i] if task.row_settings is not None else None
    base = task.params if settings is None else row_params(settings, task.eos_ids, task.params.logprobs)
    if settings is not None and settings.get("seed") is not None:
        seed = sample_seed(settings["seed"], 0, s)
    else:
        seed = sample_seed(task.seed, task.rows[i], s)
    return dataclasses.replace(base, seed=seed)


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


def place_row_settings(region: dict[str, np.ndarray], task: PartitionTask) -> None:
    """Store each pending row's settings (sorted JSON) in the region's ``sampling`` array, when it has one."""
    if "sampling" not in region or task.row_settings is None:
        return
    for row, settings in zip(task.rows, task.row_settings, strict=True):
        region["sampling"][row - task.start] = canonical_json(settings)
