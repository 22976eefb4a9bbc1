"""A partition's samples placed all at once: what each slot holds, and the counts of the partition's result."""

import math

import numpy as np

from daskgen.agents import Trajectory
from daskgen.engines.base import FinishReason, GenerationResult, SamplingParams
from daskgen.store.layout import Layout, empty_region
from daskgen.worker.samples.region import place_prompts, place_samples

PAD = 7


def _layout(n_trajectories=1):
    return Layout(
        n_prompts=8,
        n_samples=2,
        max_prompt_tokens=4,
        max_new_tokens=5,
        partition_size=4,
        pad_token_id=PAD,
        n_trajectories=n_trajectories,
    )


def test_samples_land_in_their_slots_and_are_counted():
    layout = _layout()
    region = empty_region(layout, 4)
    region["response_ids"][3, 1] = 99  # a stale slot is reset before it is written
    samples = [
        [Trajectory([1, 2], [1, 1], [-0.5, -0.25], FinishReason.STOP, 1)],
        [Trajectory([3, 4, 5, 6, 8, 9, 10], [1] * 7, [-1.0] * 7, FinishReason.LENGTH, 1)],  # longer than the width
        [Trajectory([11], [1], None, FinishReason.ABORT, 1, carried=0)],
        [Trajectory([], [], None, FinishReason.ERROR, 1, error="bad request")],
        [Trajectory([12, 13, 14], [1, 0, 1], [-0.1], FinishReason.ABORT, 2, continued=2, carried=2)],
        [Trajectory([15], [1], [-2.0], FinishReason.STOP, 1, cached_prompt_tokens=48)],
    ]
    counts = place_samples(region, [5, 7, 4], [1, 3, 0], 2, samples, layout)
    assert region["response_ids"][1, 0].tolist() == [1, 2, PAD, PAD, PAD]
    assert region["response_ids"][1, 1].tolist() == [3, 4, 5, 6, 8]
    assert region["response_length"][1].tolist() == [2, 5]
    assert region["finish_reason"][3].tolist() == [FinishReason.ABORT, FinishReason.ERROR]
    assert region["response_ids"][3, 1].tolist() == [PAD] * 5
    assert region["response_mask"][0, 0].tolist() == [1, 0, 1, 0, 0]
    assert region["logprobs"][0, 0, 0] == np.float32(-0.1) and math.isnan(region["logprobs"][0, 0, 1])
    assert region["continued_tokens"][0].tolist() == [2, 0] and region["num_turns"][0].tolist() == [2, 1]
    assert region["cached_prompt_tokens"][0].tolist() == [-1, 48], "-1: the engine did not say"
    assert np.all(region["finish_reason"][2] == empty_region(layout, 1)["finish_reason"][0])  # untouched row
    assert counts.failed == {7: "sample 1: bad request"}
    assert counts.aborted == [7, 4]
    assert (counts.partial_samples, counts.partial_tokens) == (2, 3)
    assert (counts.response_tokens, counts.carried_tokens) == (2 + 5 + 1 + 0 + 1, 2)


def test_trajectories_beyond_the_first_and_empty_samples():
    layout = _layout(n_trajectories=2)
    region = empty_region(layout, 4)
    two = [
        Trajectory([1], [1], [-1.0], FinishReason.STOP, 1),
        Trajectory([2, 3], [1, 1], [-1.0, -2.0], FinishReason.STOP, 2),
    ]
    counts = place_samples(region, [0], [0], 2, [two + two, []], layout)  # the third trajectory is not stored
    assert region["num_trajectories"][0].tolist() == [2, 0]
    assert region["response_ids"][0, 0, 1].tolist() == [2, 3, PAD, PAD, PAD]
    assert counts.response_tokens == 3


def test_prompts_are_padded_per_row():
    layout = _layout()
    region = empty_region(layout, 4)
    assert place_prompts(region, [2, 0], [[5, 6, 8], [9]], PAD) == 4
    assert region["prompt_ids"][2].tolist() == [5, 6, 8, PAD] and region["prompt_ids"][0].tolist() == [9, PAD, PAD, PAD]
    assert region["prompt_length"].tolist()[:3] == [1, 0, 3]


def test_cached_prompt_tokens_sum_over_turns_where_the_engine_reports_them():
    traj = Trajectory.for_params(SamplingParams(max_new_tokens=4))
    traj.add_model_tokens(GenerationResult("r", [1], FinishReason.STOP, None))
    assert traj.cached_prompt_tokens == -1, "no report: unknown"
    traj.add_model_tokens(GenerationResult("r", [2], FinishReason.STOP, None, meta={"cached_tokens": 0}))
    traj.add_model_tokens(GenerationResult("r", [3], FinishReason.STOP, None, meta={"cached_tokens": 30}))
    assert traj.cached_prompt_tokens == 30
