"""The row's own columns (``keep_columns``) through to the trainer: a verl ``DataProto`` followed beside a live run
carries each sample's input ``answer``; the store, every export and every follow format hold the kept columns;
bad settings and rows are refused with the row, the column and the fix."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pandas as pd
import pytest

import daskgen
from daskgen.analysis import export as ex
from daskgen.analysis.accessor import open_store
from daskgen.client.plan import prepare
from daskgen.config import RunConfig
from daskgen.errors import ConfigError, InputError, StoreMismatchError
from daskgen.input.rows import scan_prompts
from daskgen.input.tokenizer import ByteTokenizer
from tests.conftest import popen_cli

pytestmark = pytest.mark.timeout(300)

N = 24
KEEP = ("answer", "data_source", "meta")
#: A run slow enough to be followed while it goes (the simulated engine in real time, 4 requests at once).
LIVE = [
    *("--engine", "simulated", "--model", "sim", "--engine-arg", "time_scale=1", "--engine-arg", "max_batch=4"),
    *("--engine-arg", "step_time_base_s=0.05"),
    *("--engine-arg", "length_dist=lognormal", "--engine-arg", "length_mean=10"),
    *("--max-new-tokens", "32", "--max-prompt-tokens", "128", "--partition-size", "4", "--n-samples", "2"),
    *("--n-workers", "1", "--no-progress"),
]


def input_row(i: int) -> dict:
    answer = i if i % 5 == 0 else f"answer {i}"  # not every value is a string: stored as JSON text
    meta = {"level": i % 3, "tags": ["x", "ü"]}
    return {"messages": [{"role": "user", "content": f"What is {i}?"}], "id": f"q{i}", "answer": answer,
            "data_source": f"src{i % 2}", "meta": meta, "unkept": "x"}  # fmt: skip


def stored(i: int) -> dict[str, str]:
    """The text of row ``i``'s kept columns as the store holds them."""
    row = input_row(i)
    return {k: row[k] if isinstance(row[k], str) else json.dumps(row[k], ensure_ascii=False) for k in KEEP}


@pytest.fixture(scope="module")
def followed(tmp_path_factory):
    """A real run keeping three columns, and the DataProto batches a follower took while it ran."""
    import verl.protocol  # noqa: F401 - imported before the run starts, as a trainer has it

    tmp = tmp_path_factory.mktemp("columns")
    prompts, out = tmp / "p.jsonl", str(tmp / "out.zarr")
    prompts.write_text("".join(json.dumps(input_row(i)) + "\n" for i in range(N)))
    run = popen_cli("run", "--prompts", prompts, "--store", out, "--keep-columns", ",".join(KEEP), *LIVE)
    try:  # the follower starts before the run created the store and waits on it
        follower = daskgen.follow(out, batch_prompts=4, format="dataproto", timeout=240)
        batches, live = zip(*((b.data, run.poll() is None) for b in follower), strict=True)
        output, _ = run.communicate(timeout=200)
        assert run.returncode == 0, output
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert live[0], "the first batch came while the run was going"
    return out, list(batches), tmp


def test_a_dataproto_followed_beside_a_run_carries_each_samples_input_columns(followed):
    from verl.protocol import DataProto  # plain import, inside the test: the sglang/vllm lanes collect this module

    _, batches, _ = followed
    merged = DataProto.concat(batches)
    ids = merged.non_tensor_batch["prompt_id"].tolist()
    assert sorted(set(ids)) == sorted(f"q{i}" for i in range(N)) and len(ids) == 2 * N
    for key in KEEP:
        assert merged.non_tensor_batch[key].tolist() == [stored(int(p[1:]))[key] for p in ids]
    assert "unkept" not in merged.non_tensor_batch


def test_the_store_and_every_export_hold_the_kept_columns(followed):
    out, _, tmp = followed
    ds = open_store(out)
    assert ds.daskgen.attrs.layout.columns == KEEP
    assert ds["column_answer"].values.tolist() == [stored(i)["answer"] for i in range(N)]
    assert json.loads(str(ds["column_meta"].values[4])) == input_row(4)["meta"]
    for fmt in ("parquet", "jsonl"):
        path = tmp / f"out.{fmt}"
        ex.export(out, path, fmt, text=False, overwrite=True)
        frame = pd.read_parquet(path) if fmt == "parquet" else pd.read_json(path, lines=True, dtype=False)
        for key in KEEP:
            assert frame[key].tolist() == [stored(int(p[1:]))[key] for p in frame.prompt_id], (fmt, key)
    td = ex.to_tensordict(out, raw=False)
    _, non_tensor = ex.verl_parts(td)
    ids = non_tensor["prompt_id"].tolist()
    assert non_tensor["answer"].tolist() == [stored(int(p[1:]))["answer"] for p in ids]
    ex.export(out, tmp / "out.td", "tensordict", text=False, overwrite=True)
    _, loaded = ex.verl_parts(ex.load_tensordict(tmp / "out.td"))
    assert loaded["data_source"].tolist() == [stored(int(p[1:]))["data_source"] for p in loaded["prompt_id"]]


@pytest.mark.parametrize("fmt", ["rows", "xarray", "tensordict"])
def test_every_follow_format_holds_the_kept_columns(followed, fmt):
    out, _, _ = followed
    batch = next(daskgen.follow(out, batch_prompts=N, wait=False, format=fmt, cursor=f"c-{fmt}"))
    if fmt == "rows":
        assert [r["answer"] for r in batch.data] == [stored(int(r["prompt_id"][1:]))["answer"] for r in batch.data]
    elif fmt == "xarray":
        want = [stored(int(p[1:]))["meta"] for p in batch.data.prompt_id.values]
        assert batch.data["column_meta"].values.tolist() == want
    else:
        rows = batch.data["prompt_index"].tolist()
        assert batch.data["data_source"].tolist() == [stored(r)["data_source"] for r in rows]


def test_missing_columns_and_bad_settings_name_the_row_the_column_and_the_fix(tmp_path):
    rows = [{"prompt": "a", "answer": 1, "x": 2}, {"prompt": "b", "x": 3}, {"prompt": "c", "answer": 2, "y": 1}]
    tok = ByteTokenizer()
    with pytest.raises(InputError, match="row 1: column 'answer' is missing .*add it to every row or leave it out"):
        scan_prompts(rows, tok, max_prompt_tokens=50, keep_columns=("answer",))
    with pytest.raises(InputError) as every:
        scan_prompts(rows, tok, max_prompt_tokens=50, keep_columns="*")
    assert "row 1: column 'answer' is missing" in str(every.value)
    assert "row 2: column 'y' is not in the first row (keep_columns '*' keeps row 0's columns)" in str(every.value)
    scan = scan_prompts([{**r, "answer": 0, "x": 0, "tools": None} for r in rows[:2]], tok, max_prompt_tokens=50,
                        keep_columns="*")  # fmt: skip
    assert scan.columns == ("answer", "x"), "'*' keeps the first row's columns but daskgen's own keys"
    with pytest.raises(ConfigError, match=r"\['response_ids', 'uid'\] are names daskgen uses itself"):
        RunConfig(model="m", store="s", keep_columns=["uid", "response_ids"])
    with pytest.raises(ConfigError, match="must be a list of column names or '\\*'"):
        RunConfig(model="m", store="s", keep_columns=[1])  # type: ignore[list-item]
    assert RunConfig(model="m", store="s", keep_columns="answer, data_source").kept_columns() == KEEP[:2]


def test_a_resume_with_other_kept_columns_is_refused(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(input_row(i)) + "\n" for i in range(4)))
    settings = {"prompts": str(prompts), "store": str(tmp_path / "s.zarr"), "model": "sim", "engine": "simulated"}
    created = prepare(RunConfig(**settings, keep_columns=["answer"]))
    assert created.layout.column_arrays() == ("column_answer",)
    prepare(RunConfig(**settings, keep_columns="answer"))  # the same columns resume
    with pytest.raises(StoreMismatchError, match=r"keep_columns: store has \['answer'\], this run has \['answer', "):
        prepare(RunConfig(**settings, keep_columns=["answer", "meta"]))
    assert np.array_equal(created.store.read_status(), np.zeros(4))
