"""The rules ``daskgen verify`` checks, one at a time, on regions built in memory: each invariant of
:mod:`daskgen.store.tools.invariants` (a row breaking exactly that rule) and the chunk expectations of
:mod:`daskgen.store.tools.expected_chunks`."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from daskgen import store
from daskgen.input.rows import fingerprint
from daskgen.store.layout import WORKER_ARRAYS, Layout, empty_region, every_array_layout
from daskgen.store.tools.expected_chunks import (
    FAMILY_RULES,
    NEEDS_INPUT,
    RULES,
    UNDERIVABLE,
    PartitionRows,
    expected_chunks,
    known_texts,
    rule_of,
)
from daskgen.store.tools.invariants import RowRules, broken_rows

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


#: Every array a store can have (two kept columns: each a member of the ``column_`` family).
ARRAYS = every_array_layout(columns=("answer", "data_source")).data_arrays()


def test_the_full_layout_turns_every_optional_layout_field_on():
    full = every_array_layout(columns=("answer",))
    for option in dataclasses.fields(Layout):
        if option.default is not dataclasses.MISSING:
            assert getattr(full, option.name) != option.default, option.name
    assert set(WORKER_ARRAYS) == set(ARRAYS) - {"column_answer", "column_data_source"}


def test_every_array_has_a_chunk_rule_or_a_reason_it_cannot_have_one():
    for name in ARRAYS:
        assert (rule_of(name) is not None) != (name in UNDERIVABLE), name
        assert name not in UNDERIVABLE or UNDERIVABLE[name], f"{name}: the reason is recorded"
    assert set(RULES) | set(UNDERIVABLE) <= set(ARRAYS), "no rule for an array the layout no longer has"
    assert all(any(name.startswith(prefix) for name in ARRAYS) for prefix in FAMILY_RULES)
    assert set(NEEDS_INPUT) <= set(RULES) | set(FAMILY_RULES) and all(NEEDS_INPUT.values())


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


#: Four rows of a store that keeps the column ``answer`` and declares adapters; rows carry their own formats.
TEXTS = Layout(4, 1, 6, 5, 4, 0, columns=("answer",), structured=True, adapters=True)
#: Its input: row 1 names an adapter, row 2 has its own format, rows 0 and 2 answer (3 is stored as "3").
INPUT = [
    {"prompt": "a", "answer": "x"},
    {"prompt": "b", "answer": "", "adapter": "math"},
    {"prompt": "c", "answer": 3, "response_format": {"choice": ["y", "n"]}},
    {"prompt": "d", "answer": "", "adapter": None},
]


def _attrs(tmp_path, rows=INPUT, **identity) -> store.StoreAttrs:
    """Attrs of a store of :data:`TEXTS` made from ``rows``, written to ``p.jsonl``; ``identity``: the run's
    ``adapter``/``response_format``."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return store.StoreAttrs(
        TEXTS,
        identity={"response_format": None, **identity},
        input={"fingerprint": fingerprint(INPUT), "n_prompts": 4},
        config={"prompts": str(path)},
    )


def test_row_adapters_formats_and_kept_columns_are_known_from_the_runs_input_file(tmp_path):
    known = known_texts(_attrs(tmp_path))
    assert known.note is None
    assert {name: rows.tolist() for name, rows in known.rows.items()} == {
        "adapter": [False, True, False, False],
        "response_format": [False, False, True, False],
        "column_answer": [True, False, True, False],
    }
    assert {name: rows.tolist() for name, rows in known.part(2, 4).items()}["adapter"] == [False, False]


def test_a_run_level_adapter_or_format_marks_every_row(tmp_path):
    known = known_texts(_attrs(tmp_path, adapter="math", response_format={"regex": "[0-9]+"}))
    assert known.rows["adapter"].all() and known.rows["response_format"].all()
    assert known.rows["column_answer"].tolist() == [True, False, True, False]
    attrs = _attrs(tmp_path, adapter="math", response_format={"regex": "[0-9]+"})
    known = known_texts(dataclasses.replace(attrs, layout=dataclasses.replace(TEXTS, columns=()), config={}))
    assert set(known.rows) == {"adapter", "response_format"} and known.note is None, "no input needed"


@pytest.mark.parametrize("input_file", ["gone", "changed"])
def test_an_input_file_gone_or_changed_leaves_what_only_it_shows_unknown_and_says_so(input_file, tmp_path):
    changed = [*INPUT[:3], {**INPUT[3], "answer": "z"}]
    attrs = _attrs(tmp_path, changed, adapter="math")
    if input_file == "gone":
        (tmp_path / "p.jsonl").unlink()
    known = known_texts(attrs)
    assert set(known.rows) == {"adapter"}, "the run's adapter is every row's"
    path = str(tmp_path / "p.jsonl")
    assert known.note == (
        f"response_format, column_answer not checked for lost chunks: the run's input file {path!r} is gone or no "
        "longer holds the store's input (its fingerprint); restore it to check them"
    )


def test_a_text_array_is_expected_where_a_done_row_is_known_to_hold_a_value(tmp_path):
    region = _sound_region(TEXTS)
    known = known_texts(_attrs(tmp_path)).rows
    chunks = {name: spec.chunks for name, spec in TEXTS.array_specs().items() if name in region}

    def expected(done, texts):
        rows = PartitionRows(region, np.array(done), np.zeros(4, dtype=bool), RowRules(TEXTS, VOCAB, True), texts)
        return {e.array for e in expected_chunks(rows, 0, chunks)} & {"adapter", "response_format", "column_answer"}

    assert expected([True] * 4, known) == {"adapter", "response_format", "column_answer"}
    assert expected([True, False, False, True], known) == {"column_answer"}, "rows 1 and 2 are not done"
    assert expected([True] * 4, {}) == set(), "nothing known: nothing expected"
