"""Plain turns (a partition's engine results kept as they came) store and count exactly what their trajectories
would: every array of the region, the partition's counts and the dashboard meter's report."""

import dataclasses
import random

import numpy as np
import pytest

from daskgen.agents import Trajectory
from daskgen.dashboard.metrics import WorkerMeter
from daskgen.engines.base import FinishReason, GenerationResult, SamplingParams
from daskgen.store.layout import Layout, empty_region
from daskgen.worker.samples.fast_path import PlainTurns, TurnBatch, as_trajectories, is_plain
from daskgen.worker.samples.region import place_samples

PAD = 3


def _layout(**kw):
    base = dict(n_prompts=64, n_samples=3, max_prompt_tokens=4, max_new_tokens=6, partition_size=16, pad_token_id=PAD)
    return Layout(**{**base, **kw})


def _random_turn(rng: random.Random, j: int) -> tuple[SamplingParams, GenerationResult]:
    """A plain result of any length (empty, within the width, beyond it), with or without logprobs asked for or
    returned, with or without a prefix-cache report."""
    n = rng.choice([0, 1, 2, 5, 6, 9])
    asked = rng.random() < 0.5
    returned = [round(-rng.random(), 3) for _ in range(n)] if rng.random() < 0.6 else None
    meta = rng.choice([{}, {"cached_tokens": rng.randrange(40)}, {"cached_tokens": None}, {"prompt_tokens": 4}])
    reason = rng.choice([FinishReason.STOP, FinishReason.LENGTH])
    result = GenerationResult(f"r{j}", [rng.randrange(1000) for _ in range(n)], reason, returned, meta=meta)
    return SamplingParams(max_new_tokens=6, logprobs=asked), result


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        equal = np.array_equal(a[name], b[name], equal_nan=a[name].dtype.kind == "f")
        assert equal, f"{name} differs: {a[name]!r} vs {b[name]!r}"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("layout", [_layout(), _layout(stops=True, scored=True)], ids=["plain", "more-arrays"])
def test_plain_turns_store_what_their_trajectories_store(seed, layout):
    rng = random.Random(seed)
    rows, offsets = [17, 18, 21, 30], [1, 2, 5, 14]  # the partition's pending rows, region rows
    turns = [_random_turn(rng, j) for j in range(len(rows) * layout.n_samples)]
    plain = PlainTurns([r for _, r in turns], [p for p, _ in turns])
    assert all(is_plain(r) for r in plain.results)
    stale = empty_region(layout, 16)  # a region read back from the store: other samples' data in the slots
    for array in stale.values():
        if array.dtype.kind in "if":
            array[...] = rng.randrange(1, 9)
    regions = [{k: v.copy() for k, v in stale.items()} for _ in range(2)]
    counts_plain = place_samples(regions[0], rows, offsets, layout.n_samples, plain, layout)
    counts_traj = place_samples(regions[1], rows, offsets, layout.n_samples, plain.trajectories(), layout)
    _same(regions[0], regions[1])
    assert counts_plain == counts_traj
    assert counts_plain.response_tokens == sum(min(len(r.output_ids), 6) for _, r in turns)


def test_the_meter_counts_plain_turns_as_their_trajectories():
    rng = random.Random(7)
    turns = [_random_turn(rng, j) for j in range(40)]
    by_turns, by_trajectories = WorkerMeter(), WorkerMeter()
    by_turns.record_turns([r for _, r in turns])
    for trajectories in PlainTurns([r for _, r in turns], [p for p, _ in turns]).trajectories():
        by_trajectories.record(trajectories)
    first, second = by_turns.report("w"), by_trajectories.report("w")
    first.pop("time"), second.pop("time")
    assert first == second
    assert first["samples"] == 40 and first["tokens"] == sum(len(r.output_ids) for _, r in turns)


def _result(j, n=2, **kw):
    return GenerationResult(f"r{j}", list(range(n)), FinishReason.STOP, None, **kw)


@pytest.mark.parametrize(
    "odd",
    [
        dict(error="prompt token out of range"),
        dict(finish_reason=FinishReason.ABORT),
        dict(meta={"policy_versions": [(0, 0), (1, 2)]}),
        dict(top_logprobs=[[(5, -0.1)], [(6, -0.2)]]),
        dict(logprobs=[-0.5]),  # fewer logprobs than tokens
    ],
    ids=["error", "abort", "policy-versions", "top-k", "short-logprobs"],
)
def test_a_batch_with_one_result_that_is_not_plain_becomes_trajectories(odd):
    params, asked = SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=6, logprobs=True)
    batch = TurnBatch([asked, params, params, params], [2, 0, 3, 1], plain=True)
    first = _result(0)
    kept, made = batch.add([(0, first), (1, _result(1, n=0))])
    assert len(kept) == 2 and made == []
    odd_result = dataclasses.replace(_result(2), **odd)
    assert not is_plain(odd_result)
    kept, made = batch.add([(2, odd_result), (3, _result(3, n=4))])
    assert kept == [] and [j for j, _ in made] == [2, 3], "from the first odd one on, each result is made a trajectory"
    samples = batch.outcome()
    assert isinstance(samples, list)
    assert [s[0].response_ids for s in samples] == [[], [0, 1, 2, 3], [0, 1], [0, 1]], "row-major, by place"
    assert samples[3] == [Trajectory.of_turn(params, odd_result)]
    assert samples[2] == [Trajectory.of_turn(asked, first)], "a kept result made a trajectory with its own params"
    assert samples[2][0].logprobs is not None and len(samples[2][0].logprobs) == 2


def test_a_plain_batch_keeps_its_results_in_row_major_order():
    asked, plain_params = SamplingParams(max_new_tokens=6, logprobs=True), SamplingParams(max_new_tokens=6)
    batch = TurnBatch([asked, plain_params, asked], [2, 0, 1], plain=True)
    batch.add([(1, _result(1, n=1)), (0, _result(0, n=3))])
    batch.add([(2, _result(2, n=0))])
    samples = batch.outcome()
    assert isinstance(samples, PlainTurns)
    assert [len(r.output_ids) for r in samples.results] == [1, 0, 3]
    assert samples.params == [plain_params, asked, asked]
    assert samples.logprob_lengths([1, 0, 3]) == [0, 0, 3]
    assert [t[0].response_ids for t in as_trajectories(samples)] == [[0], [], [0, 1, 2]]


def test_a_batch_that_may_not_stay_plain_makes_trajectories_at_once():
    batch = TurnBatch([SamplingParams(max_new_tokens=6)] * 2, [0, 1], plain=False)
    kept, made = batch.add([(1, _result(1)), (0, _result(0, n=1))])
    assert kept == [] and [j for j, _ in made] == [1, 0]
    samples = batch.outcome()
    assert isinstance(samples, list) and [s[0].response_ids for s in samples] == [[0], [0, 1]]


def test_an_empty_batch_is_empty_plain_turns_and_places_nothing():
    layout = _layout()
    samples = TurnBatch([], [], plain=True).outcome()
    assert isinstance(samples, PlainTurns) and samples.results == []
    region = empty_region(layout, 16)
    assert place_samples(region, [], [], layout.n_samples, samples, layout).response_tokens == 0
    _same(region, empty_region(layout, 16))
