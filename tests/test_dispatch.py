"""Length-aware dispatch helpers: order of partitions, which ones stay recorded, the tail share."""

from __future__ import annotations

import numpy as np

from daskgen.dispatch import dispatch_order, still_partial, tail_share


def test_partitions_with_partial_responses_go_first_each_group_ascending():
    assert dispatch_order([0, 4, 8, 12, 16], first=[12, 4, 40]) == ([4, 12], [0, 8, 16])
    assert dispatch_order([8, 0, 4], first=[]) == ([], [0, 4, 8])


def test_recorded_partial_partitions_are_those_still_pending():
    assert still_partial(previous=[0, 8], new=[16], pending_starts=[8, 16, 24]) == [8, 16]
    assert still_partial(previous=[], new=[], pending_starts=[0]) == []


def test_tail_share_is_the_time_share_of_the_last_tenth_of_prompts():
    since = 1000.0
    # 90 prompts committed evenly over the first 90 s, the last 10 from 90 s to 190 s: a long tail
    times = np.concatenate([since + np.linspace(1, 90, 90), since + np.linspace(100, 190, 10)])
    share = tail_share(times, since)
    assert 0.5 < share < 0.55  # the last 10% started at ~90 s of 190 s
    even = since + np.linspace(1, 100, 100)
    assert abs(tail_share(even, since) - 0.1) < 0.02
    assert tail_share(np.array([np.nan, since + 1.0]), since) is None  # too few prompts
    before = np.full(20, since - 5.0)  # committed by an earlier run: not part of this one
    assert tail_share(before, since) is None
