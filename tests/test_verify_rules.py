"""The rules ``daskgen verify`` checks, one at a time, on regions built in memory: each invariant of
:mod:`daskgen.store.invariants` (a row breaking exactly that rule) and the chunk expectations of
:mod:`daskgen.store.expected_chunks`."""

from __future__ import annotations

import numpy as np
import pytest

from daskgen import store
from daskgen.store.expected_chunks import RULES, UNDERIVABLE, PartitionRows, expected_chunks
from daskgen.store.invariants import RowRules, broken_rows
from daskgen.store.layout import WORKER_ARRAYS, empty_region

LAYOUT = store.Layout(4, 2, 6, 5, 4, 0)
VOCAB = 100


def _sound_region(layout: store.Layout = LAYOUT) -> dict[str, np.ndarray]:
    """Four done rows of two samples each: a 3-token prompt, a 2-token single-turn response with logprobs."""
    region = empty_region(layout, layout.n_prompts)
    region["prompt_ids"][:, :3] = [5, 6, 7]
    region["prompt_length"][:] = 3
    region["response_ids"][..., :2] = [8, 9]
    region["response_length"][:] = 2
    region["response_mask"][..., :2] = 1
    region["logprobs"][..., :2] = [-0.1, -0.2]
    region["finish_reason"][:] = 0
    region["num_turns"][:] = 1
    region["policy_version"][:] = region["policy_version_end"][:] = 0
    return region


def _rules(single_turn: bool = True) -> RowRules:
    return RowRules(LAYOUT, VOCAB, single_turn, logprobs=True)


def _set(name: str, index: tuple[int, ...], value: float):
    def change(region: dict[str, np.ndarray]) -> None:
        region[name][index] = value

    return change


#: One change per rule that breaks exactly that rule in row 1, and the rule's message.
BREAKS = {
    "unknown finish code": (_set("finish_reason", (1, 0), 7), "a finish_reason code that is not one of -1, 0, 1, 2, 3"),
    "no finish reason": (_set("finish_reason", (1, 0), -1), "a sample without finish_reason"),
    "prompt too long": (_set("prompt_length", (1,), 7), "prompt_length outside 1..max_prompt_tokens"),
    "prompt not padded": (_set("prompt_ids", (1, 4), 9), "prompt_ids not padded after prompt_length"),
    "prompt token outside vocab": (
        _set("prompt_ids", (1, 0), VOCAB),
        f"a prompt token id outside the vocabulary (0..{VOCAB - 1})",
    ),
    "response too long": (_set("response_length", (1, 1), 6), "response_length outside 0..max_new_tokens"),
    "response not padded": (_set("response_ids", (1, 0, 3), 4), "response_ids not padded"),
    "mask after length": (_set("response_mask", (1, 0, 3), 1), "response_mask set after response_length"),
    "mask not 0/1": (_set("response_mask", (1, 0, 0), 2), "response_mask not 0 or 1"),
    "mask 0 in single turn": (_set("response_mask", (1, 0, 1), 0), "response_mask 0 inside a single-turn response"),
    "logprobs after length": (_set("logprobs", (1, 1, 4), -1.0), "logprobs after response_length"),
    "response token outside vocab": (
        _set("response_ids", (1, 1, 0), VOCAB),
        f"a response token id outside the vocabulary (0..{VOCAB - 1})",
    ),
}


def test_a_sound_region_breaks_no_rule():
    assert broken_rows(_sound_region(), np.ones(4, dtype=bool), _rules()) == {}


@pytest.mark.parametrize("case", list(BREAKS))
def test_each_invariant_names_the_row_breaking_it(case):
    change, message = BREAKS[case]
    region = _sound_region()
    change(region)
    assert broken_rows(region, np.ones(4, dtype=bool), _rules()) == {1: message}
    done = np.array([True, False, True, True])
    assert broken_rows(region, done, _rules()) == {}, "rows not done are not checked"


def test_agent_masks_may_be_0_inside_a_response():
    region = _sound_region()
    region["response_mask"][1, 0, 1] = 0  # a tool's token
    assert broken_rows(region, np.ones(4, dtype=bool), _rules(single_turn=False)) == {}


def test_every_worker_array_has_a_chunk_rule_or_a_reason_it_cannot_have_one():
    assert set(WORKER_ARRAYS) == set(RULES) | set(UNDERIVABLE)
    assert not set(RULES) & set(UNDERIVABLE)


def _expected(region, chunks=None, done=None, noted=None, rules=None, start=0):
    specs = LAYOUT.array_specs()
    rows = PartitionRows(
        region,
        np.ones(4, dtype=bool) if done is None else done,
        np.zeros(4, dtype=bool) if noted is None else noted,
        rules or _rules(),
    )
    found = expected_chunks(rows, start, {name: specs[name].chunks for name in region} | (chunks or {}))
    return {(e.array, e.index, e.start, e.stop) for e in found}


def test_a_finished_partition_expects_every_written_chunk_but_the_underivable_ones():
    found = _expected(_sound_region())
    assert {name for name, *_ in found} == set(LAYOUT.data_arrays()) - set(UNDERIVABLE)
    assert ("response_ids", (0, 0, 0), 0, 4) in found
    assert _expected(_sound_region(), done=np.zeros(4, dtype=bool)) == set(), "nothing is expected of pending rows"


def test_chunks_along_the_response_axis_are_expected_where_responses_reach():
    region = _sound_region()
    region["response_length"][0, 0] = 4
    region["response_ids"][0, 0, 2:4] = [3, 4]
    by_two = {name: (4, 2, 2) for name in ("response_ids", "response_mask", "logprobs")}
    found = {(name, index) for name, index, *_ in _expected(region, by_two) if name in by_two}
    assert found == {(name, (0, 0, i)) for name in by_two for i in (0, 1)}, "positions 4.. are padding everywhere"


def test_a_stop_token_alone_may_be_the_pad_id():
    region = _sound_region()
    region["response_ids"][:] = LAYOUT.pad_token_id  # every response is one stop token, equal to the pad id
    region["response_length"][:] = 1
    region["response_mask"][..., 1] = 0
    region["logprobs"][..., 1] = np.nan
    names = {name for name, *_ in _expected(region)}
    assert "response_ids" not in names and {"response_length", "response_mask", "logprobs"} <= names


def test_logprobs_are_expected_only_when_recorded_and_scores_only_without_a_note():
    region = _sound_region()
    region["logprobs"][:] = np.nan
    assert "logprobs" not in {n for n, *_ in _expected(region, rules=RowRules(LAYOUT, VOCAB, True))}
    scored = store.Layout(4, 2, 6, 5, 4, 0, scored=True)
    region = _sound_region(scored)
    region["samples_used"][:] = 2
    specs = scored.array_specs()
    rows = PartitionRows(region, np.ones(4, dtype=bool), np.ones(4, dtype=bool), RowRules(scored, VOCAB, True))
    found = {e.array for e in expected_chunks(rows, 0, {name: specs[name].chunks for name in region})}
    assert "samples_used" in found and "score" not in found, "every row's verifier raised: its scores are NaN"
