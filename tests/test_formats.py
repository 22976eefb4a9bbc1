"""Every format carries the same fields from both entry points: ``daskgen export`` of a finished store and
``daskgen.follow`` (Python and ``daskgen follow``) of the same store, through :mod:`daskgen.formats`."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

import daskgen
from daskgen.analysis import export as ex
from daskgen.formats.block import EXTERNAL_FIELDS
from tests.conftest import run_cli, simulated_run

pytestmark = pytest.mark.timeout(300)
KEY = ["prompt_index", "sample"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run of 12 prompts x 2 samples with logprobs, top-2 logprobs and a kept input column."""
    folder = tmp_path_factory.mktemp("formats")
    prompts, out = folder / "p.jsonl", folder / "out.zarr"
    with prompts.open("w") as fh:
        for i in range(12):
            row = {"messages": [{"role": "user", "content": f"Question {i}?"}], "id": f"q{i}", "answer": str(i)}
            fh.write(json.dumps(row) + "\n")
    args = ("--logprobs", "--top-logprobs", "2", "--keep-columns", "answer")
    res = run_cli("run", "--prompts", prompts, "--store", out, *simulated_run(max_new_tokens=24), *args)
    assert res.returncode == 0, res.stdout + res.stderr
    return out


def followed(store, fmt: str, **options):
    """Every batch's data of a follower reading the finished store once."""
    return [b.data for b in daskgen.follow(store, batch_prompts=5, wait=False, format=fmt, auto_ack=False, **options)]


def exported(store, tmp_path, fmt: str, **options):
    path = tmp_path / f"out.{fmt}"
    assert ex.export(store, path, fmt, text=False, raw=False, **options).rows == 24
    return path


def by_sample(records):
    return sorted(records, key=lambda r: (r["prompt_index"], r["sample"]))


def test_jsonl_export_rows_follow_and_follow_command_give_the_same_records(finished, tmp_path):
    path = exported(finished, tmp_path, "jsonl")
    export_records = [json.loads(line) for line in path.read_text().splitlines()]
    follow_records = [r for data in followed(finished, "rows") for r in data]
    res = run_cli("follow", finished, "--no-wait", "--format", "jsonl", "--cursor", "cli-jsonl")
    assert res.returncode == 0, res.stderr
    command_records = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(export_records) == len(follow_records) == len(command_records) == 24
    keys = list(export_records[0])
    assert {"prompt_id", "logprobs", "top_logprobs", "answer", "response_mask"} <= set(keys)
    for records in (follow_records, command_records):
        assert [list(r) for r in records] == [keys] * 24, "the same fields in the same order"
    expected = by_sample(export_records)
    assert by_sample(json.loads(json.dumps(follow_records))) == expected == by_sample(command_records)


def columns(table) -> tuple[tuple[str, str], ...]:
    """Names and types of a table's columns (Parquet names a list's items ``element``, Arrow ``item``)."""
    return tuple((f.name, str(f.type).replace("element:", "item:")) for f in table.schema)


def test_parquet_export_arrow_follow_and_parquet_dir_give_the_same_columns(finished, tmp_path):
    export_table = pq.read_table(exported(finished, tmp_path, "parquet"))
    follow_tables = followed(finished, "arrow")
    sink = ("--format", "parquet-dir", "--out", tmp_path / "dir")
    res = run_cli("follow", finished, "--no-wait", *sink, "--cursor", "cli-parquet")
    assert res.returncode == 0, res.stderr
    command_tables = [pq.read_table(p) for p in sorted((tmp_path / "dir").glob("batch-*.parquet"))]
    for tables in (follow_tables, command_tables):
        assert {columns(t) for t in tables} == {columns(export_table)}, "the same columns, types and order"
        got = pd.concat([t.to_pandas() for t in tables]).sort_values(KEY, ignore_index=True)
        want = export_table.to_pandas().sort_values(KEY, ignore_index=True)
        assert got.map(repr).equals(want.map(repr)), "the same values"


def test_tensordict_export_and_follow_give_the_same_fields(finished, tmp_path):
    from tensordict import is_non_tensor

    saved = ex.load_tensordict(exported(finished, tmp_path, "tensordict"))
    for td in followed(finished, "tensordict") + followed(finished, "tensordict", pad="batch"):
        assert set(td.keys()) == set(saved.keys())
        assert {"prompt_id", "uid", "answer", "rollout_log_probs", "top_logprobs"} <= set(td.keys())
        for key in sorted(td.keys()):  # iterating a TensorDict walks its rows
            assert is_non_tensor(td.get(key)) == is_non_tensor(saved.get(key)), key
            if not is_non_tensor(td.get(key)):
                assert td[key].dtype == saved[key].dtype, key
        assert td["uid"].tolist() == td["prompt_id"].tolist() == [f"q{i}" for i in td["prompt_index"].tolist()]
    assert saved["uid"].tolist() == saved["prompt_id"].tolist() == [f"q{i}" for i in saved["prompt_index"].tolist()]


def test_dataproto_follow_and_the_split_export_give_the_same_fields(finished, tmp_path):
    pytest.importorskip("verl.protocol", reason="format='dataproto' needs verl (installed in CI's main lane)")
    batch, non_tensor = ex.verl_parts(ex.load_tensordict(exported(finished, tmp_path, "tensordict")))
    protos = followed(finished, "dataproto")
    assert sum(len(p) for p in protos) == 24
    for proto in protos:
        assert set(proto.batch.keys()) == set(batch.keys())
        assert set(proto.non_tensor_batch) == set(non_tensor)
        for key, values in proto.non_tensor_batch.items():
            assert values.dtype.kind == non_tensor[key].dtype.kind, key
        assert proto.non_tensor_batch["uid"].tolist() == proto.non_tensor_batch["prompt_id"].tolist()
    assert {"prompt_id", "uid", "answer", "num_turns"} <= set(non_tensor)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "tensordict"])
def test_the_export_adds_only_text_and_raw_prompts_to_what_follow_gives(finished, tmp_path, fmt):
    plain = exported(finished, tmp_path, fmt)
    full = tmp_path / f"full.{fmt}"
    ex.export(finished, full, fmt, text=True, raw=True)
    if fmt == "jsonl":
        fields = [set(json.loads(p.read_text().splitlines()[0])) for p in (plain, full)]
    elif fmt == "parquet":
        fields = [set(pq.read_schema(p).names) for p in (plain, full)]
    else:
        fields = [set(ex.load_tensordict(p).keys()) for p in (plain, full)]
    assert fields[1] - fields[0] == set(EXTERNAL_FIELDS) and fields[0] <= fields[1]
    np.testing.assert_equal(len(fields[0]) + 3, len(fields[1]))


def test_every_sample_record_of_a_layout_with_every_array_reaches_every_format(tmp_path):
    """A store with every optional array (and a kept column): each array the layout lists for the outputs
    (``sample_records``, the policy versions and their fingerprints, ``logprobs``) is a field of every format, under
    its output name."""
    from daskgen import formats
    from daskgen.formats.read import read_block
    from daskgen.store import GenerationStore, StoreAttrs
    from daskgen.store.layout import FINGERPRINT_ARRAYS, VERSION_ARRAYS, column_name, every_array_layout

    layout = every_array_layout(columns=("answer",))
    identity = {"logprobs": True, "n_samples": layout.n_samples}
    attrs = StoreAttrs(layout, identity=identity, config={"agent": "tool"})
    store = GenerationStore.create(tmp_path / "all.zarr", attrs, ["q0"])
    generated = np.zeros(layout.array_specs()["finish_reason"].shape, dtype=np.int8)
    store.write_region(0, {"finish_reason": generated, "response_length": generated.astype(np.int32) + 1})
    block = read_block(store, np.array([0]))
    assert len(block) == generated.size
    wanted = ("logprobs", *layout.sample_records(), *VERSION_ARRAYS, *FINGERPRINT_ARRAYS)
    names = {column_name(name) or name for name in wanted}
    in_verl = {"rollout_log_probs" if name == "logprobs" else name for name in names}
    assert {"answer", "stop_reason", "top_logprobs", "sampling", "adapter"} <= names
    assert names <= set(formats.build("rows", block)[0])
    assert names <= set(formats.build("arrow", block).column_names)
    assert in_verl <= set(formats.build("tensordict", block).keys())
    pytest.importorskip("verl.protocol", reason="format='dataproto' needs verl (installed in CI's main lane)")
    proto = formats.build("dataproto", block)
    assert in_verl <= {*proto.batch.keys(), *proto.non_tensor_batch}
