"""Exports: Parquet/JSONL records, the verl-layout TensorDict (tokens reconstructed exactly), the zip store."""

from __future__ import annotations

import importlib.util
import json
import sys
import zipfile

import dask
import numpy as np
import pandas as pd
import pytest
import xarray as xr

from daskgen import store
from daskgen.analysis import export as ex
from daskgen.errors import ExportError, OutputExistsError, StoreError, StoreMismatchError
from daskgen.store.layout import VERSION_ARRAYS
from tests.conftest import run_cli, write_prompts
from tests.test_analysis import build_store


@pytest.fixture
def truth(tmp_path):
    return build_store(tmp_path)


def _sample(truth, key):
    """Store content of one (prompt, sample[, trajectory]): prompt ids, response ids, mask, logprobs, reason."""
    a, i = truth.arrays, key[0]
    plen, rlen = a["prompt_length"][i], a["response_length"][key]
    return (
        a["prompt_ids"][i, :plen],
        a["response_ids"][key][:rlen],
        a["response_mask"][key][:rlen],
        a["logprobs"][key][:rlen],
        int(a["finish_reason"][key]),
    )


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_records_hold_every_done_sample_exactly(truth, tmp_path, fmt):
    out = tmp_path / f"out.{fmt}"
    result = ex.export(truth.path, out, fmt)
    frame = pd.read_parquet(out) if fmt == "parquet" else pd.read_json(out, lines=True)
    assert result.rows == len(frame) == 20
    assert list(zip(frame.prompt_index, frame["sample"], strict=True)) == truth.units()
    for row in frame.itertuples():
        prompt, response, mask, logprobs, reason = _sample(truth, (row.prompt_index, row.sample))
        assert list(row.prompt_ids) == prompt.tolist() and list(row.response_ids) == response.tolist()
        assert list(row.response_mask) == mask.tolist()
        got = np.array([np.nan if v is None else v for v in row.logprobs], dtype=np.float32)
        np.testing.assert_array_equal(got, logprobs)
        assert row.finish_reason == ["stop", "length", "abort", "error"][reason]
        assert row.response_text == truth.response_texts[(row.prompt_index, row.sample)]
        assert row.prompt_text == truth.prompt_texts[row.prompt_index]
        assert row.prompt_id == f"q{row.prompt_index}"
        for name in VERSION_ARRAYS:
            assert getattr(row, name) == truth.arrays[name][row.prompt_index, row.sample], name
    raw = frame.raw_prompt[0]
    assert (json.loads(raw) if fmt == "parquet" else raw) == [{"role": "user", "content": "prompt 0"}]


def _check_verl_rows(td, truth, keys):
    """Every row of a verl-layout export reproduces the store's tokens exactly."""
    assert td.batch_size[0] == len(keys)
    width = td["prompts"].shape[1]
    for n, key in enumerate(keys):
        prompt, response, mask, logprobs, reason = _sample(truth, key)
        attn = td["attention_mask"][n].numpy()
        assert attn[:width].sum() == len(prompt) and (attn[: width - len(prompt)] == 0).all(), "left padding"
        np.testing.assert_array_equal(td["prompts"][n].numpy()[width - len(prompt) :], prompt)
        np.testing.assert_array_equal(td["responses"][n].numpy()[: len(response)], response)
        assert (td["responses"][n].numpy()[len(response) :] == 0).all()
        ids = td["input_ids"][n].numpy()
        np.testing.assert_array_equal(ids[attn == 1], np.concatenate([prompt, response]))
        np.testing.assert_array_equal(td["response_mask"][n].numpy()[: len(response)], mask)
        assert td["response_mask"][n].numpy()[len(response) :].sum() == 0
        np.testing.assert_array_equal(td["position_ids"][n].numpy()[attn == 1], np.arange(attn.sum()))
        lp = td["rollout_log_probs"][n].numpy()[: len(response)]
        np.testing.assert_array_equal(lp[mask == 1], logprobs[mask == 1])
        assert (lp[mask == 0] == 0).all()
        assert int(td["finish_reason"][n]) == reason and int(td["prompt_index"][n]) == key[0]
        assert int(td["sample"][n]) == key[1]


def test_tensordict_in_memory_and_memmap_reconstruct_tokens(truth, tmp_path):
    memory = ex.to_tensordict(truth.path, text=True)
    _check_verl_rows(memory, truth, truth.units())
    import torch

    assert memory["prompts"].dtype == memory["input_ids"].dtype == memory["position_ids"].dtype == torch.int64
    result = ex.export(truth.path, tmp_path / "out.td", "tensordict")
    saved = ex.load_tensordict(result.path)
    _check_verl_rows(saved, truth, truth.units())
    assert saved["prompt_id"].tolist()[:3] == ["q0", "q0", "q0"]
    assert json.loads(saved["raw_prompt"].tolist()[0]) == [{"role": "user", "content": "prompt 0"}]
    assert saved["response_text"].tolist() == [truth.response_texts[k] for k in truth.units()]
    batch, non_tensor = ex.verl_parts(saved)
    assert sorted(batch.keys()) == sorted(ex.VERL_KEYS)
    assert non_tensor["num_turns"].tolist() == [truth.arrays["num_turns"][k] for k in truth.units()]
    assert non_tensor["prompt_id"][0] == "q0"
    for name in VERSION_ARRAYS:
        assert non_tensor[name].tolist() == [truth.arrays[name][k] for k in truth.units()], name
    assert {-1, 2} <= set(non_tensor["version_changed_at"].tolist()), "continued samples are among them"


def test_small_blocks_and_no_logprobs(truth, tmp_path):
    with dask.config.set({"daskgen.export.block-bytes": 1}):  # one partition per block
        _export_small_blocks(tmp_path)


def _export_small_blocks(tmp_path):
    plain = build_store(tmp_path, logprobs=False, name="nolp.zarr")
    ex.export(plain.path, tmp_path / "a.td", "tensordict", text=False)
    td = ex.load_tensordict(tmp_path / "a.td")
    assert not {"rollout_log_probs", "response_text"} & set(td.keys())
    ex.export(plain.path, tmp_path / "a.parquet", "parquet", raw=False)
    columns = pd.read_parquet(tmp_path / "a.parquet").columns
    assert "logprobs" not in columns and "raw_prompt" not in columns and "response_text" in columns


def test_trajectory_store_exports_one_row_per_real_trajectory(tmp_path):
    truth = build_store(tmp_path, trajectories=3)
    td = ex.to_tensordict(truth.path)
    _check_verl_rows(td, truth, truth.units())
    assert [
        (int(a), int(b), int(c)) for a, b, c in zip(td["prompt_index"], td["sample"], td["trajectory"], strict=True)
    ] == truth.units()
    ex.export(truth.path, tmp_path / "t.parquet", "parquet")
    frame = pd.read_parquet(tmp_path / "t.parquet")
    assert [tuple(k) for k in frame[["prompt_index", "sample", "trajectory"]].values] == truth.units()


def test_nothing_done_exports_empty_outputs(tmp_path):
    truth = build_store(tmp_path, done={})
    for fmt, name in (("parquet", "e.parquet"), ("jsonl", "e.jsonl"), ("tensordict", "e.td")):
        assert ex.export(truth.path, tmp_path / name, fmt).rows == 0
    assert len(pd.read_parquet(tmp_path / "e.parquet")) == 0
    assert ex.load_tensordict(tmp_path / "e.td").batch_size[0] == 0


def test_zip_opens_as_the_same_store(truth, tmp_path):
    import zarr

    (truth.path / "daskgen.lock").write_text("{}")  # a live run's lock is not part of the data
    out = tmp_path / "s.zarr.zip"
    assert ex.export(truth.path, out, "zip").rows == 20
    zs = zarr.storage.ZipStore(str(out), mode="r")
    group = zarr.open_group(zs, mode="r")
    assert group.attrs["daskgen"]["input"] == store.read_store_attrs(truth.path).input
    ds = xr.open_zarr(zs)
    for name in ("status", "response_ids", "logprobs", "prompt_ids", "committed_at"):
        np.testing.assert_array_equal(ds[name].values, xr.open_zarr(truth.path)[name].values, err_msg=name)
    assert not any(n.endswith("daskgen.lock") for n in zipfile.ZipFile(out).namelist())
    zs.close()


def test_errors_are_typed_and_clear(truth, tmp_path):
    with pytest.raises(StoreError, match="is not a daskgen store"):
        ex.export(tmp_path, tmp_path / "x.parquet", "parquet")
    with pytest.raises(ExportError, match="unknown export format 'csv'; choose one of parquet, jsonl"):
        ex.export(truth.path, tmp_path / "x.csv", "csv")
    (tmp_path / "x.parquet").write_text("keep me")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        ex.export(truth.path, tmp_path / "x.parquet", "parquet")
    assert (tmp_path / "x.parquet").read_text() == "keep me"
    assert ex.export(truth.path, tmp_path / "x.parquet", "parquet", overwrite=True).rows == 20
    with pytest.raises(ExportError, match="overlaps the store"):
        ex.export(truth.path, truth.path / "inside.parquet", "parquet")
    with pytest.raises(StoreMismatchError, match="fingerprint differs"):
        ex.export(truth.path, tmp_path / "y.parquet", "parquet", prompts=write_prompts(tmp_path / "o.jsonl", 10))
    assert not list(tmp_path.glob(".*.tmp-*")), "no staging leftovers"


def test_wandb_missing_is_reported_before_exporting(truth, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ExportError, match="pip install wandb"):
        ex.export(truth.path, tmp_path / "s.zip", "zip", wandb_project="proj")
    assert not (tmp_path / "s.zip").exists()
    with pytest.raises(ExportError, match="use it with --format zip"):
        ex.export(truth.path, tmp_path / "s.parquet", "parquet", wandb_project="proj")


def test_cli_export_of_a_real_simulated_run(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 12)
    out = tmp_path / "run.zarr"
    res = run_cli(
        "run",
        "--prompts",
        prompts,
        "--engine",
        "simulated",
        "--model",
        "sim",
        "--store",
        out,
        "--engine-arg",
        "vocab_size=259",
        "--engine-arg",
        "time_scale=0",
        "--n-samples",
        "2",
        "--max-new-tokens",
        "16",
        "--partition-size",
        "4",
        "--logprobs",
        "--no-progress",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    res = run_cli("export", out, "--format", "tensordict", "--out", tmp_path / "run.td")
    assert res.returncode == 0 and "exported 24 samples as tensordict" in res.stdout, res.stdout + res.stderr
    td, ds = ex.load_tensordict(tmp_path / "run.td"), xr.open_zarr(out)
    for n in range(24):
        i, s = int(td["prompt_index"][n]), int(td["sample"][n])
        plen, rlen = int(ds.prompt_length[i]), int(ds.response_length[i, s])
        ids = td["input_ids"][n].numpy()[td["attention_mask"][n].numpy() == 1]
        np.testing.assert_array_equal(
            ids, np.concatenate([ds.prompt_ids.values[i, :plen], ds.response_ids.values[i, s, :rlen]])
        )
    again = run_cli("export", out, "--format", "tensordict", "--out", tmp_path / "run.td")
    assert again.returncode == 2 and "exists; pass --overwrite" in again.stderr
    default = run_cli("export", out, "-f", "zip")
    assert default.returncode == 0 and (tmp_path / "run.zarr.zip").is_file(), default.stderr


def test_cli_wandb_not_installed(truth, tmp_path):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here; the missing-package path is covered by the monkeypatched test")
    res = run_cli("export", truth.path, "--format", "zip", "--out", tmp_path / "s.zip", "--wandb-project", "p")
    assert res.returncode == 2 and "pip install wandb" in res.stderr and not (tmp_path / "s.zip").exists()


@pytest.mark.slow
def test_transformers_run_exports_exact_tokens(tmp_path, tiny_model):
    prompts = write_prompts(tmp_path / "p.jsonl", 6)
    out = tmp_path / "tiny.zarr"
    res = run_cli(
        "run",
        "--prompts",
        prompts,
        "--model",
        tiny_model,
        "--store",
        out,
        "--n-samples",
        "2",
        "--max-new-tokens",
        "16",
        "--partition-size",
        "4",
        "--temperature",
        "1.0",
        "--logprobs",
        "--no-progress",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    td = ex.to_tensordict(out, text=True)
    ds = xr.open_zarr(out)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    for n in range(12):
        i, s = int(td["prompt_index"][n]), int(td["sample"][n])
        rlen = int(ds.response_length[i, s])
        response = ds.response_ids.values[i, s, :rlen]
        np.testing.assert_array_equal(td["responses"][n].numpy()[:rlen], response)
        lp = td["rollout_log_probs"][n].numpy()[:rlen]
        np.testing.assert_array_equal(lp, ds.logprobs.values[i, s, :rlen])
        assert td["response_text"].tolist()[n] == tok.decode(response, skip_special_tokens=True)
        assert f"Question {i}:" in td["prompt_text"].tolist()[n]
