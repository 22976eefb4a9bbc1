"""Per-row sampling and stop conditions: validation before any engine starts, real runs on the tiny model,
the stored settings and stop reasons, resume refusal, and the plan's capability check."""

from __future__ import annotations

import json
import reprlib
from typing import Any

import numpy as np
import pandas as pd
import pytest
import xarray as xr

import daskgen
from daskgen.analysis import export as ex
from daskgen.analysis.accessor import open_store
from daskgen.config import RunConfig
from daskgen.engines.stops import EOS, NO_STOP, first_stop
from daskgen.engines.tokenizer import load_tokenizer
from daskgen.errors import ConfigError, InputError, StoreMismatchError
from daskgen.input.rows import scan_prompts
from daskgen.input.sampling import KEYS, RowSamplingCheck
from daskgen.store.layout import Layout
from tests.conftest import run_cli

pytestmark = pytest.mark.timeout(300)

PROMPTS = [f"Question {i}: what is {i} plus {i % 7}?" for i in range(4)]


def run_options(model, store, **extra):
    """A greedy run of the tiny model on one local worker, partitions of two rows."""
    options = dict(model=str(model), store=str(store), engine="transformers", n_workers=1, progress=False)
    options.update(max_new_tokens=12, max_prompt_tokens=64, partition_size=2, temperature=0.0)
    options["engine_args"] = ENGINE_ARGS
    return {**options, **extra}


ENGINE_ARGS = {"device": "cpu", "kv_cache_tokens": 2048, "max_batch_tokens": 128}


def greedy_outputs(model, prompts, max_new_tokens):
    """Each prompt's greedy response ids from the transformers engine itself (no run: the reference)."""
    from daskgen.engines.base import GenerationRequest, SamplingParams
    from daskgen.engines.transformers import TransformersEngine
    from daskgen.testing.harness import EventLoopThread, gather

    tokenizer = load_tokenizer(str(model), "transformers")
    engine, loop = TransformersEngine(str(model), **ENGINE_ARGS), EventLoopThread()
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=(tokenizer.eos_token_id,))
    requests = [GenerationRequest(f"r{i}", tokenizer(p)["input_ids"], params) for i, p in enumerate(prompts)]
    try:
        loop.run(engine.start(), 300)
        results = loop.run(gather(*[engine.generate(r) for r in requests]), 120)
    finally:
        loop.run(engine.shutdown(), 60)
        loop.close()
    return [r.output_ids for r in results], tokenizer.decode


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """One run whose rows set their own limits and stops, found in the greedy outputs of the same engine."""
    folder = tmp_path_factory.mktemp("sampling")
    ids, decode = greedy_outputs(tiny_model, PROMPTS, 12)
    rows = [
        {"prompt": PROMPTS[0], "id": "q0"},
        {"prompt": PROMPTS[1], "id": "q1", "sampling": {"max_new_tokens": 3, "min_new_tokens": 3}},
        {"prompt": PROMPTS[2], "id": "q2", "sampling": {"stop": ["\x00never", _stop_text(ids[2], decode)]}},
        {"prompt": PROMPTS[3], "id": "q3", "sampling": {"stop_token_ids": [ids[3][2]]}},
        {"prompt": PROMPTS[0], "id": "q4", "sampling": {"temperature": 0.7, "seed": 5}},
    ]
    daskgen.generate(rows, **run_options(tiny_model, folder / "b"))
    return xr.open_zarr(folder / "b"), ids, rows, decode, folder


def _stop_text(ids, decode):
    """Two ASCII letters or digits ending the text of a prefix of ``ids`` (a stop string in a known output)."""
    for k in range(3, len(ids)):
        text = decode(ids[:k])
        if text[-2:].isascii() and text[-2:].isalnum() and len(text) >= 2:
            return text[-2:]
    raise AssertionError(f"no stop string in {decode(ids)!r}")


@pytest.mark.slow
def test_rows_get_their_own_limits_and_stops(runs):
    ds, ids, rows, decode, _ = runs
    lengths, reasons = ds.response_length.values[:, 0], ds.stop_reason.values[:, 0]
    got = [ds.response_ids.values[i, 0, : lengths[i]].tolist() for i in range(4)]
    assert got[0] == ids[0]  # no settings: the run's
    assert lengths[1] == 3 and got[1] == ids[1][:3] and ds.finish_reason.values[1, 0] == 1 and reasons[1] == NO_STOP
    end, which = first_stop(ids[2], rows[2]["sampling"]["stop"], (), decode)
    assert got[2] == ids[2][:end] and which == 1 and reasons[2] == 1  # stop text kept: the matching token ends it
    assert rows[2]["sampling"]["stop"][1] in decode(got[2])
    cut = ids[3].index(ids[3][2]) + 1
    assert got[3] == ids[3][:cut] and reasons[3] == 0 and ds.finish_reason.values[3, 0] == 0
    assert reasons[0] == (EOS if ds.finish_reason.values[0, 0] == 0 else NO_STOP)
    plain = Layout(4, 1, 64, 12, 2, 0).array_specs()  # a run without row settings or stops: no new arrays
    assert "stop_reason" not in plain and "sampling" not in plain


@pytest.mark.slow
def test_store_records_each_rows_settings(runs):
    ds, _, rows, _, folder = runs
    used = [json.loads(text) for text in ds.sampling.values]
    assert used[1]["max_new_tokens"] == 3 and used[1]["min_new_tokens"] == 3 and used[0]["max_new_tokens"] == 12
    assert (
        used[2]["stop"] == rows[2]["sampling"]["stop"]
        and used[3]["stop_token_ids"] == rows[3]["sampling"]["stop_token_ids"]
    )
    assert all(u["temperature"] == 0.0 for u in used[:4])
    assert used[4]["temperature"] == 0.7 and used[4]["seed"] == 5
    assert len(set(ds.sampling.values.tolist())) == 5  # one group per distinct setting
    frame = open_store(folder / "b").daskgen.settings()  # one row per prompt, one column per key: to group by
    assert frame.loc[4, "temperature"] == 0.7 and frame.loc[2, "stop"] == rows[2]["sampling"]["stop"]
    assert frame.groupby("temperature").size().to_dict() == {0.0: 4, 0.7: 1}


#: Every export and ``daskgen.follow`` format (``follow-cli``: ``daskgen follow``'s JSONL on stdout).
CARRYING_FORMATS = (
    *("parquet", "jsonl", "tensordict", "follow-rows", "follow-arrow", "follow-xarray", "follow-tensordict"),
    *("follow-dataproto", "follow-cli"),
)


def carried(fmt, store, tmp, names=("sampling", "stop_reason")):
    """``(prompt_id, *names)`` of each sample in export or follow format ``fmt`` (per-sample integers as ``int``)."""
    columns = _carried_columns(fmt, store, tmp, ("prompt_id", *names))
    return list(zip(*(_plain(columns[name]) for name in ("prompt_id", *names)), strict=True))


def _carried_columns(fmt, store, tmp, names):
    """``{name: one value per sample}`` read from export or follow format ``fmt``."""
    if fmt in ("parquet", "jsonl", "tensordict"):
        ex.export(store, tmp / f"out.{fmt}", fmt, text=False, raw=False, overwrite=True)
        if fmt == "tensordict":
            return ex.verl_parts(ex.load_tensordict(tmp / f"out.{fmt}"))[1]
        return pd.read_parquet(tmp / "out.parquet") if fmt == "parquet" else pd.read_json(tmp / "out.jsonl", lines=True)
    if fmt == "follow-cli":
        res = run_cli("follow", store, "--no-wait", "--cursor", "cli")
        assert res.returncode == 0, res.stderr
        data = [json.loads(line) for line in res.stdout.splitlines()]
    else:
        batch = next(daskgen.follow(store, batch_prompts=8, wait=False, format=fmt[7:], cursor=fmt))
        data = batch.data
    if fmt in ("follow-rows", "follow-arrow", "follow-cli"):
        data = data.to_pylist() if fmt == "follow-arrow" else data
        return {name: [r[name] for r in data] for name in names}
    if fmt == "follow-xarray":  # per-sample arrays: the first (only) sample
        return {name: data[name].values if data[name].ndim == 1 else data[name].values[:, 0] for name in names}
    if fmt == "follow-tensordict":  # string ids are the batch's prompt_ids, by prompt_index
        ids_of = dict(zip(batch.prompts.tolist(), batch.prompt_ids, strict=True))
        ids = [ids_of[i] for i in data["prompt_index"].tolist()]
        return {name: ids if name == "prompt_id" else data[name] for name in names}
    return data.non_tensor_batch


def _plain(values):
    """A column as a list of plain Python values."""
    return values.tolist() if hasattr(values, "tolist") else list(values)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", CARRYING_FORMATS)
def test_every_export_and_follow_format_carries_each_rows_settings_and_stop_reason(runs, fmt, tmp_path):
    _, _, rows, _, folder = runs
    got = {str(pid): (json.loads(str(text)), int(reason)) for pid, text, reason in carried(fmt, folder / "b", tmp_path)}
    assert sorted(got) == [r["id"] for r in rows]
    assert got["q4"][0]["temperature"] == 0.7 and got["q0"][0]["temperature"] == 0.0  # a row's own, the run's
    assert got["q1"][0]["max_new_tokens"] == 3 and got["q2"][0]["stop"] == rows[2]["sampling"]["stop"]
    assert got["q2"][1] == 1 and got["q3"][1] == 0 and got["q1"][1] == NO_STOP  # the 2nd string, the 1st id, none


@pytest.mark.slow
def test_resume_refused_when_a_rows_settings_changed(runs, tiny_model):
    _, _, rows, _, folder = runs
    changed = [dict(r) for r in rows]
    changed[1] = {**rows[1], "sampling": {"max_new_tokens": 4}}
    with pytest.raises(StoreMismatchError, match="fingerprint"):
        daskgen.generate(changed, **run_options(tiny_model, folder / "b"))
    with pytest.raises(StoreMismatchError, match="stop: store has None, this run has"):
        daskgen.generate(rows, **run_options(tiny_model, folder / "b", stop=["x"]))


def test_bad_row_settings_are_named_with_row_key_range_and_fix(tiny_model):
    rows = [
        {"prompt": "a", "id": "a", "sampling": {"top_p": 1.5}},
        {"prompt": "b", "sampling": {"temprature": 0.5}},
        {"prompt": "c", "id": 7, "sampling": {"max_new_tokens": 99}},
        {"prompt": "d", "sampling": {"stop": ["ok", ""], "seed": -1}},
        {"prompt": "e", "sampling": "greedy"},
    ]
    check = RowSamplingCheck(max_new_tokens=16)
    with pytest.raises(InputError) as info:
        scan_prompts(rows, load_tokenizer(str(tiny_model), "transformers"), max_prompt_tokens=64, check_row=check)
    text = str(info.value)
    assert (
        "row 0: column 'sampling' (id 'a'): key 'top_p' is 1.5; it must be a number in (0, 1] (1 = off). Give" in text
    )
    assert "row 1: column 'sampling': unknown sampling key 'temprature'; valid keys are [" in text
    assert "]. Rename or remove it" in text
    assert "row 2: column 'sampling' (id 7): key 'max_new_tokens' is 99, more than the run's max_new_tokens=16" in text
    assert "key 'stop' is ['ok', '']; it must be a list of at most 32 distinct non-empty strings" in text
    assert "row 3: column 'sampling': key 'seed' is -1; it must be an integer >= 0. Give a value in that range" in text
    assert "row 4: column 'sampling': expected a mapping of sampling settings such as {\"temperature\": 0.7}, " in text
    assert "found str 'greedy'; give an object of keys ['frequency_penalty', " in text
    assert "or leave it out (null) for the run's settings" in text


NAN, INF = float("nan"), float("inf")
#: Per key of ``KEYS``: values a row's ``sampling`` is refused with (the run's ``max_new_tokens`` being 16), and the
#: values at the edges of its range that pass.  A key added to ``KEYS`` fails
#: ``test_every_sampling_key_refuses_values_outside_its_range`` until it is given its own here.
EDGES: dict[str, tuple[list[Any], list[Any]]] = {
    "temperature": ([-1e-9, -1, NAN, INF, -INF, True, False, "0.5", [0.5]], [0, 0.0, 1e-9, 2, 100.0]),
    "top_p": ([0, 0.0, -0.1, 1.0000001, 2, NAN, True, "1"], [1e-9, 0.5, 1, 1.0]),
    "top_k": ([-1, 1.5, 2.0, NAN, True, False, "5"], [0, 1, 50]),
    "min_p": ([-1e-9, 1.0000001, -1, NAN, INF, True, "0"], [0, 0.0, 0.5, 1, 1.0]),
    "max_new_tokens": ([0, -1, 1.0, 4.5, NAN, True, "8"], [1, 15, 16]),
    "min_new_tokens": ([-1, 1.0, NAN, True, "2"], [0, 1, 16]),
    "stop": (
        [[""], "", ["a", "a"], [f"s{i}" for i in range(33)], [1], ["a", None], 5, {"a": 1}],
        ["x", [], ["a", "b"], [f"s{i}" for i in range(32)]],
    ),
    "stop_token_ids": (
        [[-1], [1, 1], [True], [1.0], [NAN], list(range(33)), 5, "1", [None], ["3"]],
        [[], [0], list(range(32))],
    ),
    "repetition_penalty": ([0, 0.0, -1, NAN, INF, True, "1"], [1e-9, 1, 2.5]),
    "presence_penalty": ([-2.0000001, 2.0000001, -3, 3, NAN, INF, True, "0"], [-2, -2.0, 0, 2, 2.0]),
    "frequency_penalty": ([-2.0000001, 2.0000001, -3, 3, NAN, -INF, False, "0"], [-2, -2.0, 0, 2, 2.0]),
    "seed": ([-1, 1.0, 2.5, NAN, True, "7"], [0, 1, 2**63 - 1]),
}
#: Values refused against the run's ``max_new_tokens`` (16) instead of the key's own range: the message each gives.
ABOVE_THE_RUN = {
    "max_new_tokens": (17, "key 'max_new_tokens' is 17, more than the run's max_new_tokens=16 (the store's response "
                       "width); lower it, or raise the run's max_new_tokens"),
    "min_new_tokens": (17, "key 'min_new_tokens' is 17, more than the run's max_new_tokens=16; it must be at most 16: "
                       "lower min_new_tokens, or raise the run's max_new_tokens"),
}  # fmt: skip


def sampling_errors(settings: Any) -> list[str]:
    """The per-row check's messages for a row ``r`` whose ``sampling`` is ``settings`` (the run's limit: 16)."""
    return RowSamplingCheck(max_new_tokens=16)({"prompt": "p", "id": "r", "sampling": settings})


@pytest.mark.parametrize("key", sorted(KEYS))
def test_every_sampling_key_refuses_values_outside_its_range(key):
    """Each key of the table refuses the values just past its range, NaN, infinities, booleans and other types, with a
    message naming the row, the key, the value found, the range expected and the fix; its edge values pass."""
    assert key in EDGES, f"sampling key {key!r} has no refusal cases: add its refused and edge values to EDGES"
    refused, accepted = EDGES[key]
    for value in refused:
        errors = sampling_errors({key: value})
        assert len(errors) == 1, (value, errors)
        (message,) = errors
        assert message.startswith(f"column 'sampling' (id 'r'): key {key!r} is "), message
        assert f" is {reprlib.repr(value)}" in message or f" is dict {reprlib.repr(value)}" in message, message
        assert message.endswith(f"; it must be {KEYS[key].text}. Give a value in that range, or remove the key")
    for value in accepted:
        assert sampling_errors({key: value}) == [], value
    assert sampling_errors({key: None}) == [], "None leaves the run's value"
    if key in ABOVE_THE_RUN:
        value, text = ABOVE_THE_RUN[key]
        assert sampling_errors({key: value}) == [f"column 'sampling' (id 'r'): {text}"]


def test_the_sampling_edge_table_holds_the_keys_of_the_table_only():
    assert sorted(EDGES) == sorted(KEYS)


@pytest.mark.parametrize(
    ("value", "note"),
    [
        (NAN, "nan (not a finite number)"),
        (INF, "inf (not a finite number)"),
        (True, "True (a boolean, not a number)"),
    ],
)
def test_nan_infinities_and_booleans_are_named_as_what_they_are(value, note):
    for key in ("temperature", "top_k", "seed", "presence_penalty"):
        (message,) = sampling_errors({key: value})
        assert f"key {key!r} is {note}; it must be " in message, message


def test_stop_token_id_lists_name_what_is_wrong_with_them():
    notes = {
        "[1, 1] (with repeated entries)": [1, 1],
        "[True] (holding a boolean)": [True],
        "[0, 1, 2, 3, 4, 5, ...] (33 entries)": list(range(33)),
        "[-1]": [-1],
        "'1'": "1",
    }
    for shown, value in notes.items():
        (message,) = sampling_errors({"stop_token_ids": value})
        assert f"key 'stop_token_ids' is {shown}" in message, message
        assert "it must be a list of at most 32 distinct token ids >= 0. Give a value in that range" in message


def test_a_rows_min_new_tokens_above_the_rows_own_max_new_tokens_is_refused():
    (message,) = sampling_errors({"max_new_tokens": 4, "min_new_tokens": 5})
    assert message == (
        "column 'sampling' (id 'r'): key 'min_new_tokens' is 5, more than max_new_tokens=4; it must be at most 4: "
        "lower min_new_tokens, or raise max_new_tokens"
    )
    assert sampling_errors({"max_new_tokens": 4, "min_new_tokens": 4}) == []
    assert sampling_errors({"max_new_tokens": None, "min_new_tokens": 16}) == []  # the run's 16 stands
    # a row limit above the run's: both refused, the floor against the run's limit, the one that stands
    above = sampling_errors({"max_new_tokens": 99, "min_new_tokens": 20})
    assert len(above) == 2 and "more than the run's max_new_tokens=16; it must be at most 16" in above[1], above
    # a bad row limit is named once; the floor is held to the run's limit, which it is within
    assert len(sampling_errors({"max_new_tokens": 0, "min_new_tokens": 8})) == 1


def test_bad_row_settings_are_refused_before_any_store_or_engine(tmp_path):
    """A run whose rows carry NaN and a boolean is refused at the input scan, naming both rows; no store is made."""
    rows = [
        {"prompt": "a", "sampling": {"temperature": NAN}},
        {"prompt": "b", "sampling": {"top_k": True}},
        {"prompt": "c", "sampling": {"max_new_tokens": 2, "min_new_tokens": 3}},
    ]
    options = dict(model="sim", store=str(tmp_path / "s"), engine="simulated", n_workers=1, progress=False)
    with pytest.raises(InputError) as info:
        daskgen.generate(rows, **options, max_new_tokens=8)
    text = str(info.value)
    assert "row 0: column 'sampling': key 'temperature' is nan (not a finite number); it must be a number >= 0" in text
    assert "row 1: column 'sampling': key 'top_k' is True (a boolean, not a number); it must be an integer >= 0" in text
    assert "row 2: column 'sampling': key 'min_new_tokens' is 3, more than max_new_tokens=2" in text
    assert not (tmp_path / "s").exists()


def test_bad_run_settings_are_refused():
    with pytest.raises(ConfigError, match=r"run settings: key 'stop_token_ids' is \[-1\]; it must be a list"):
        RunConfig(stop_token_ids=[-1])
    with pytest.raises(
        ConfigError, match="key 'min_new_tokens' is 20, more than max_new_tokens=10; it must be at most"
    ):
        RunConfig(max_new_tokens=10, min_new_tokens=20)
    with pytest.raises(ConfigError, match=r"key 'temperature' is nan \(not a finite number\); it must be a number"):
        RunConfig(temperature=NAN)
    assert RunConfig(stop="</answer>").stop == "</answer>"  # a single string is a list of one


def test_engine_without_a_feature_is_refused_at_plan_time(tmp_path):
    rows = [{"prompt": "a", "sampling": {"stop": ["\n\n"]}}]
    options = dict(model="sim", store=str(tmp_path / "s"), engine="simulated", n_workers=1, progress=False)
    with pytest.raises(ConfigError) as info:
        daskgen.generate(rows, **options)
    text = str(info.value)
    assert "engine 'simulated' cannot serve" in text and "stop: stop strings" in text
    assert "transformers" in text.split("engines that serve it:")[1]
    assert not (tmp_path / "s").exists()


def test_stop_rule_cuts_overshoot_and_tells_ids_from_strings():
    from daskgen.engines.stops import settle

    decode = lambda ids: "".join(chr(96 + i) for i in ids)  # noqa: E731 - 1 -> "a", 2 -> "b", ...
    assert settle([1, 2, 3, 4, 5], True, ("cd",), (), decode) == (4, 0)
    assert settle([1, 2, 3, 4, 5], False, ("zz", "bc"), (9, 2), decode) == (2, 3)  # id 2 completes before "bc"
    assert settle([1, 2, 3], True, ("zz",), (9,), decode) == (3, EOS)
    assert settle([1, 2, 3], False, (), (), decode) == (3, NO_STOP)
    assert np.int16(EOS) == -2


def test_transformers_penalties_and_min_new_tokens_follow_vllms_definitions():
    import torch

    from daskgen.engines.base import SamplingParams
    from daskgen.engines.transformers.shaping import Shaping

    params = SamplingParams(
        repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, min_new_tokens=4, stop_token_ids=(4,)
    )
    shaping = Shaping.of(params, [0], None, None)
    assert shaping is not None and Shaping.of(SamplingParams(), [0], None, None) is None  # the plain path: none
    for n in range(1, 4):  # the response so far: 1, 1, 2
        shaping.after([1, 1, 2][:n])
    row = torch.tensor([2.0, -1.0, 3.0, 1.0, 5.0])
    # 0: prompt token, 2 / 2; 1: twice in the response, -1 * 2 - 0.5 - 2 * 0.25; 2: once, 3 / 2 - 0.5 - 0.25;
    # 3: unseen; 4: a stop id, masked while fewer than min_new_tokens tokens exist
    assert shaping.adjusted(row, [1, 1, 2]).tolist() == [1.0, -3.0, 0.75, 1.0, float("-inf")]
    assert shaping.adjusted(row, [1, 1, 2, 3])[4] == 5.0


def test_values_an_engine_refuses_per_request_are_refused_at_plan_time(tiny_model, tmp_path):
    """sglang refuses a repetition_penalty above 2 per request, which daskgen's table allows: the run's value and a
    row's are refused before any store or engine (sglang is not imported), naming the engine and its range."""
    from daskgen.client.plan import prepare

    options = {"model": str(tiny_model), "engine": "sglang"}
    rows = [{"prompt": "a"}, {"prompt": "b", "id": "b", "sampling": {"repetition_penalty": 2.5}}]
    with pytest.raises(InputError) as info:
        prepare(RunConfig(**options, store=str(tmp_path / "rows.zarr")), rows)
    text = str(info.value)
    assert "row 1: column 'sampling' (id 'b'): key 'repetition_penalty' is 2.5; engine 'sglang' takes" in text, text
    assert "(0, 2]" in text and not (tmp_path / "rows.zarr").exists()
    with pytest.raises(ConfigError, match=r"the run's settings: key 'repetition_penalty' is 3.0; engine 'sglang'"):
        prepare(RunConfig(**options, repetition_penalty=3.0, store=str(tmp_path / "run.zarr")), rows[:1])
    assert not (tmp_path / "run.zarr").exists()
    accepted = [{"prompt": "b", "sampling": {"repetition_penalty": 2.0}}]
    assert prepare(RunConfig(**options, store=str(tmp_path / "ok.zarr")), accepted).layout.row_sampling
    simulated = RunConfig(model="sim", engine="simulated", repetition_penalty=3.0, store=str(tmp_path / "sim.zarr"))
    assert prepare(simulated, ["a"]) is not None  # an engine without the limit takes it


def test_a_managed_sglang_server_is_refused_what_sglang_refuses_and_any_other_server_is_not(tiny_model, tmp_path):
    """The openai engine with ``managed=true`` starts an sglang server: its ranges are sglang's, refused at plan
    time; someone else's server (``base_url``) is not known here, so the plan leaves the value to it."""
    from daskgen.client.plan import prepare

    managed = {"model": str(tiny_model), "engine": "openai", "engine_args": {"managed": True}}
    with pytest.raises(ConfigError, match=r"key 'repetition_penalty' is 2.5; engine 'openai' takes"):
        prepare(RunConfig(**managed, repetition_penalty=2.5, store=str(tmp_path / "managed.zarr")), ["a"])
    given = {**managed, "engine_args": {"base_url": "http://127.0.0.1:9"}}
    assert prepare(RunConfig(**given, repetition_penalty=2.5, store=str(tmp_path / "given.zarr")), ["a"]) is not None
