"""Length-aware dispatch: order of partitions (interrupted, then predicted long by an earlier store), which
ones stay recorded, the tail share."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from daskgen import store
from daskgen.client.dispatch import dispatch_order, long_first, read_length_hints, still_partial
from daskgen.client.plan import pending_tasks, prepare
from daskgen.config import RunConfig
from daskgen.errors import ConfigError
from daskgen.store.location import locate
from daskgen.tail import tail_share
from tests.conftest import run_cli, write_prompts


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


# ----------------------------------------------------------------------------- length hints


def test_long_first_takes_the_partitions_predicted_longest_longest_first():
    predicted = np.array([5, 1, np.nan, np.nan, 9, 2, 3, np.nan, np.nan, np.nan, 4, 40], dtype=float)
    # partitions of 2 rows at 0, 2, 4, 6, 8, 10: maxima 5, unknown, 9, 3, unknown, 40
    assert long_first([0, 2, 4, 6, 8, 10], predicted, 2, limit=3) == ([10, 4, 0], [2, 6, 8])
    assert long_first([0, 2, 4, 6, 8, 10], predicted, 2, limit=10) == ([10, 4, 0, 6], [2, 8])
    assert long_first([0, 2, 4], predicted, 2, limit=0) == ([], [0, 2, 4])


def _config(tmp_path, prompts, name, **extra):
    return RunConfig(
        model="sim",
        engine="simulated",
        prompts=str(prompts),
        store=str(tmp_path / name),
        max_new_tokens=64,
        max_prompt_tokens=64,
        partition_size=4,
        n_samples=2,
        **extra,
    )


def _earlier_store(tmp_path, prompts, lengths: dict[int, list[int]]):
    """A store of ``prompts`` in which row r holds responses of ``lengths[r]`` tokens (other rows: none)."""
    plan = prepare(_config(tmp_path, prompts, "earlier.zarr"))
    layout = plan.layout
    region = store.layout.empty_region(layout, layout.n_prompts)
    for row, sample_lengths in lengths.items():
        region["response_length"][row] = sample_lengths
        region["finish_reason"][row] = 0
    store.GenerationStore.open(plan.settings.location).write_region(
        0, {k: region[k] for k in ("response_length", "finish_reason")}
    )
    return tmp_path / "earlier.zarr"


def test_hints_from_a_store_of_the_same_input_order_the_pending_partitions(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 16)  # partitions at 0, 4, 8, 12
    earlier = _earlier_store(tmp_path, prompts, {1: [3, 50], 6: [7, 7], 13: [60, 2], 14: [9, 9]})
    hints = read_length_hints(locate(str(earlier)), *_scan_of(tmp_path, prompts))
    assert hints[1] == 50 and hints[13] == 60 and hints[6] == 7 and np.isnan(hints[0])
    plan = prepare(_config(tmp_path, prompts, "new.zarr", length_hints=str(earlier)))
    assert [t.start for t in pending_tasks(plan, plan.store.read_status())] == [
        12,
        0,
        4,
        8,
    ]  # 60, 50, 7 first; 8 unknown last
    # every row of every partition is there, prompts read for the right rows
    tasks = list(pending_tasks(plan, plan.store.read_status()))
    assert sorted(r for t in tasks for r in t.rows) == list(range(16))
    assert all(
        t.inputs[i]["messages"][0]["content"].startswith(f"Question {r}:") for t in tasks for i, r in enumerate(t.rows)
    )


def test_interrupted_partitions_still_go_before_the_hinted_ones(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 16)
    earlier = _earlier_store(tmp_path, prompts, {13: [60, 2], 1: [3, 50]})
    plan = prepare(_config(tmp_path, prompts, "new.zarr", length_hints=str(earlier)))
    plan = dataclasses.replace(plan, first_partitions=(8,))
    assert [t.start for t in pending_tasks(plan, plan.store.read_status())] == [8, 12, 0, 4]
    plan.config.max_prompts_in_memory = 8  # room for one predicted-long partition (half the cap)
    assert [t.start for t in pending_tasks(plan, plan.store.read_status())] == [8, 12, 0, 4]
    plan.config.max_prompts_in_memory = 4  # none: plain order after the interrupted ones
    assert [t.start for t in pending_tasks(plan, plan.store.read_status())] == [8, 0, 4, 12]


def test_hints_from_another_input_match_rows_by_id(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 8)
    earlier = _earlier_store(tmp_path, prompts, {2: [30, 1], 5: [4, 4]})
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    shuffled = tmp_path / "q.jsonl"  # same prompts in another order, one new prompt
    shuffled.write_text(
        "".join(json.dumps(r) + "\n" for r in [rows[5], rows[2], *rows[6:], *rows[:2], {**rows[0], "id": "new"}])
    )
    hints = read_length_hints(locate(str(earlier)), *_scan_of(tmp_path, shuffled))
    assert hints[0] == 4 and hints[1] == 30 and np.isnan(hints[2]) and np.isnan(hints[-1])


def test_hints_that_cannot_be_matched_or_are_not_a_store_are_refused(tmp_path):
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"prompt": f"say {i}"}) + "\n" for i in range(8)))
    earlier = _earlier_store(tmp_path, plain, {0: [5, 5]})
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"prompt": f"tell {i}"}) + "\n" for i in range(8)))
    with pytest.raises(ConfigError, match="give every input row an 'id'"):
        prepare(_config(tmp_path, other, "new.zarr", length_hints=str(earlier)))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a daskgen store"):
        prepare(_config(tmp_path, plain, "new2.zarr", length_hints=str(tmp_path / "empty")))


def test_hints_from_a_store_of_agent_trajectories_take_each_row_longest_trajectory(tmp_path):
    layout = store.Layout(4, 2, 8, 16, 2, 0, n_trajectories=3)
    where = locate(str(tmp_path / "agent.zarr"))
    store.GenerationStore.create(
        where, store.StoreAttrs(layout, **{"input": {"fingerprint": "f"}}), ["a", "b", "c", "d"]
    )
    region = store.layout.empty_region(layout, 4)
    region["response_length"][1, 1, 2], region["finish_reason"][1, 1, 2] = 12, 0
    region["response_length"][2, 0, 0], region["finish_reason"][2, 0, 0] = 5, 0
    store.GenerationStore.open(where).write_region(0, {k: region[k] for k in ("response_length", "finish_reason")})
    hints = read_length_hints(where, ["a", "b", "c", "d"], "f", 4)
    assert hints.shape == (4,) and hints[1] == 12 and hints[2] == 5 and np.isnan(hints[[0, 3]]).all()


def _scan_of(tmp_path, prompts):
    plan = prepare(_config(tmp_path, prompts, f"scan-{prompts.stem}.zarr"))
    return plan.prompts.ids, plan.prompts.fingerprint, len(plan.prompts)


@pytest.mark.timeout(300)
def test_cli_run_with_length_hints_starts_the_partitions_longest_in_the_earlier_store(tmp_path):
    """Two real runs (LocalCluster, simulated engine whose lengths belong to the prompt): the second,
    with another seed and ``--length-hints`` the first store, runs its partitions longest first."""
    prompts = write_prompts(tmp_path / "p.jsonl", 24)

    def run(name: str, *extra: str):
        args = [
            "--engine",
            "daskgen.testing.engines:RecordingEngine",
            "--engine-arg",
            "inner=simulated",
            "--engine-arg",
            f"log_path={tmp_path / name}.log",
            "--engine-arg",
            "time_scale=0",
            "--engine-arg",
            "length_prompt_share=1",
            "--engine-arg",
            "length_mean=12",
            "--engine-arg",
            "length_sigma=1.2",
            "--model",
            "sim",
            "--max-new-tokens",
            "200",
            "--max-prompt-tokens",
            "128",
            "--partition-size",
            "4",
            "--n-samples",
            "2",
            "--n-workers",
            "1",
            "--window",
            "1",
            "--no-progress",
            "--prompts",
            prompts,
            "--store",
            tmp_path / f"{name}.zarr",
            *extra,
        ]
        res = run_cli("run", *args, timeout=240)
        assert res.returncode == 0, res.stdout + res.stderr
        return store.GenerationStore.open(locate(str(tmp_path / f"{name}.zarr"))).read_region(
            0, 24, ("response_length",)
        )["response_length"]

    first = run("first")
    second = run("second", "--seed", "7", "--length-hints", tmp_path / "first.zarr")
    assert (first.max(axis=1) == second.max(axis=1)).all()  # lengths belong to the prompt, whatever the seed
    per_partition = first.max(axis=1).reshape(6, 4).max(axis=1)
    expected = sorted(range(0, 24, 4), key=lambda s: (-per_partition[s // 4], s))
    rows = [int(line.split()[0].split("-")[0][1:]) for line in (tmp_path / "second.log").read_text().splitlines()]
    started = list(dict.fromkeys(r - r % 4 for r in rows))  # partitions in the order their requests came
    assert started == expected and expected != sorted(expected)
    attrs = store.read_store_attrs(locate(str(tmp_path / "second.zarr")))
    assert attrs.config["length_hints"] == str(tmp_path / "first.zarr")
