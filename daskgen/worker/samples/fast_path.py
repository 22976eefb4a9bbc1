"""A plain partition's results kept as the engine returned them, placed without a trajectory per sample.

Most partitions are plain: one engine call per sample (the single-turn loop), no stops or per-row settings to
apply, nothing stored to continue, no verifier, no top-k logprobs, and every result finished normally (``stop``
or ``length``, no error, its tokens from the base policy).  For them a :class:`~daskgen.agents.Trajectory` per
sample (its token, mask and logprob lists copied, then read back column by column when the region is placed,
then counted and freed) is pure overhead: the worker keeps the engine's results instead, counts them for the
dashboard from their lengths (:meth:`daskgen.dashboard.metrics.WorkerMeter.record_turns`) and places them
straight into the region (:func:`daskgen.worker.samples.region.place_turns`).  What is stored is the same, array for
array, as the trajectories would store (``tests/test_fast_path.py`` checks it); a partition with any other
result goes the trajectory way as a whole (:meth:`PlainTurns.trajectories`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from daskgen.agents import Trajectory
from daskgen.engines.base import FinishReason, GenerationResult, SamplingParams
from daskgen.engines.batch import Finished

#: Finish reasons of plain results (an abort or an error goes the trajectory way: its row is requeued or failed).
PLAIN_REASONS = (FinishReason.STOP, FinishReason.LENGTH)


def is_plain(result: GenerationResult) -> bool:
    """Whether ``result`` stores as a plain turn: finished normally, no error, no top-k logprobs, no policy
    versions (the base policy's tokens), its logprobs (if any) one per output token."""
    return (
        result.error is None
        and result.finish_reason in PLAIN_REASONS
        and result.top_logprobs is None
        and not result.meta.get("policy_versions")
        and (result.logprobs is None or len(result.logprobs) == len(result.output_ids))
    )


@dataclass
class PlainTurns:
    """The engine results of a partition's samples, row-major (``results[row * n_samples + sample]``).

    Attributes:
        results: one plain result per sample (:func:`is_plain`).
        params: each sample's sampling params (whether it asked for logprobs).
    """

    results: list[GenerationResult]
    params: list[SamplingParams]

    def trajectories(self) -> list[list[Trajectory]]:
        """Each sample's trajectories, as the single-turn loop makes them."""
        return [[Trajectory.of_turn(p, r)] for p, r in zip(self.params, self.results, strict=True)]

    def logprob_lengths(self, lengths: Sequence[int]) -> list[int]:
        """How many logprobs each sample stores of its first ``lengths[k]`` tokens: all of them when it asked for
        logprobs or its engine returned some (NaN where none came), else none."""
        return [
            n if r.logprobs is not None or p.logprobs else 0
            for r, p, n in zip(self.results, self.params, lengths, strict=True)
        ]


class TurnBatch:
    """A batch's results as they finish, kept as plain turns while they all are, else as trajectories.

    Parameters
    ----------
    params:
        Each request's sampling params, in the batch's order.
    places:
        Each request's sample, row-major (``row * n_samples + sample``).
    plain:
        Whether the partition may keep plain turns at all (no stops or per-row settings to apply, one trajectory
        per sample, no top-k logprobs); else every result becomes a trajectory as it comes.
    """

    def __init__(self, params: Sequence[SamplingParams], places: Sequence[int], plain: bool) -> None:
        self.places = list(places)
        self.params: list[SamplingParams] = list(params)  # by place from here on
        for j, place in enumerate(self.places):
            self.params[place] = params[j]
        self.results: list[GenerationResult | None] = [None] * len(self.places)
        self.samples: list[list[Trajectory]] | None = None if plain else [[] for _ in self.places]

    def add(self, group: Finished) -> tuple[list[GenerationResult], list[tuple[int, list[Trajectory]]]]:
        """Keep a finished ``group`` of ``(request index, result)``; returns its plain results and, for the others,
        ``(request index, trajectories)`` (for the caller to cut at stops and count)."""
        plain: list[GenerationResult] = []
        made: list[tuple[int, list[Trajectory]]] = []
        for j, result in group:
            place = self.places[j]
            if self.samples is None and is_plain(result):
                self.results[place] = result
                plain.append(result)
                continue
            if self.samples is None:  # the first result that is not plain: the kept ones become trajectories too
                kept = zip(self.params, self.results, strict=True)
                self.samples = [[] if r is None else [Trajectory.of_turn(p, r)] for p, r in kept]
            trajectories = [Trajectory.of_turn(self.params[place], result)]
            self.samples[place] = trajectories
            made.append((j, trajectories))
        return plain, made

    def outcome(self) -> PlainTurns | list[list[Trajectory]]:
        """Every sample, row-major: plain turns, or each sample's trajectories."""
        if self.samples is not None:
            return self.samples
        assert all(r is not None for r in self.results), "every request of the batch finished"
        return PlainTurns(self.results, self.params)  # type: ignore[arg-type]  # every slot filled (asserted)


#: A partition's samples, row-major, as generation hands them to placement.
Samples = PlainTurns | list[list[Trajectory]]


def as_trajectories(samples: Samples) -> list[list[Trajectory]]:
    """``samples`` as each sample's trajectories (plain turns made into them)."""
    return samples.trajectories() if isinstance(samples, PlainTurns) else samples
