"""``daskgen.follow``'s formats on the store of a real run: padding to the batch or the store, the rows built
column by column equal to the export's, the verl fields' definitions."""

from __future__ import annotations

import numpy as np
import pytest

import daskgen
from daskgen.errors import FollowError
from daskgen.store import GenerationStore
from tests.conftest import run_cli, simulated_run, write_prompts

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def run_store(tmp_path_factory):
    """A finished run (20 prompts, 2 samples, lognormal lengths, logprobs, top-2 logprobs)."""
    folder = tmp_path_factory.mktemp("formats-run")
    prompts, out = write_prompts(folder / "p.jsonl", 20), folder / "out.zarr"
    args = [
        *simulated_run(max_new_tokens=48),
        "--engine-arg",
        "length_dist=lognormal",
        "--engine-arg",
        "length_mean=12",
    ]
    res = run_cli("run", "--prompts", prompts, "--store", out, *args, "--logprobs", "--top-logprobs", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    return out


def batches(path, fmt: str, **options):
    return list(daskgen.follow(path, batch_prompts=8, wait=False, format=fmt, auto_ack=False, **options))


def test_padding_to_the_batch_keeps_every_token_of_padding_to_the_store(run_store):
    layout = GenerationStore.open(run_store).layout
    padded = batches(run_store, "tensordict"), batches(run_store, "tensordict", pad="batch")
    for store_td, batch_td in zip(*padded, strict=True):
        store_td, batch_td = store_td.data, batch_td.data
        plen, rlen = batch_td["prompt_length"], batch_td["response_length"]
        p, r = int(plen.max()), int(rlen.max())
        assert store_td["prompts"].shape[1] == layout.max_prompt_tokens and store_td["responses"].shape[1] == 48
        assert batch_td["prompts"].shape[1] == p < layout.max_prompt_tokens and batch_td["responses"].shape[1] == r
        assert batch_td["input_ids"].shape[1] == batch_td["position_ids"].shape[1] == p + r
        for name in ("prompts", "responses", "input_ids", "attention_mask", "position_ids"):
            assert batch_td[name].dtype == store_td[name].dtype
        for key in ("prompts",):  # left-padded: the last p columns
            assert store_td[key][:, -p:].tolist() == batch_td[key].tolist()
            assert (store_td["attention_mask"][:, : layout.max_prompt_tokens - p] == 0).all(), "only padding cut"
        for key in ("responses", "response_mask", "rollout_log_probs", "top_logprob_ids", "top_logprobs"):
            assert store_td[key][:, :r].tolist() == batch_td[key].tolist()
            assert (store_td["attention_mask"][:, layout.max_prompt_tokens + r :] == 0).all(), "only padding cut"
        kept = np.r_[layout.max_prompt_tokens - p : layout.max_prompt_tokens + r]
        for key in ("input_ids", "attention_mask", "position_ids"):
            assert store_td[key][:, kept].tolist() == batch_td[key].tolist()


def test_verl_fields_follow_their_definitions(run_store):
    for batch in batches(run_store, "tensordict", pad="batch"):
        td = batch.data
        attention = td["attention_mask"]
        assert td["input_ids"].tolist() == np.concatenate([td["prompts"], td["responses"]], axis=1).tolist()
        assert td["position_ids"].tolist() == np.clip(np.cumsum(attention.numpy(), axis=1) - 1, 0, None).tolist()
        assert attention.sum(axis=1).tolist() == (td["prompt_length"] + td["response_length"]).tolist()
        assert (td["response_mask"].sum(axis=1) == td["response_length"]).all(), "a single-turn run: every token"


def test_rows_equal_the_arrow_rows_of_the_same_samples(run_store):
    read = batches(run_store, "rows")
    tables = batches(run_store, "arrow")
    assert sum(len(b.data) for b in read) == 40
    for rows, table in zip(read, tables, strict=True):
        expected = table.data.to_pylist()
        for record in expected:  # JSON has no NaN: a log-probability not recorded is null
            record["logprobs"] = [None if v != v else v for v in record["logprobs"]]
        assert rows.data == expected
        assert [list(r) for r in rows.data] == [list(r) for r in expected], "the same keys in the same order"


def test_rows_hold_the_stored_response_mask_of_each_sample(run_store):
    """A single-turn store's mask is derived (not read): it equals the stored one, token for token."""
    for rows, ds in zip(batches(run_store, "rows"), batches(run_store, "xarray"), strict=True):
        stored, lengths = ds.data["response_mask"].values, ds.data["response_length"].values
        expected = [
            stored[i, s, : lengths[i, s]].tolist()
            for i in range(len(ds.data.prompt))
            for s in range(stored.shape[1])
            if ds.data["finish_reason"].values[i, s] >= 0
        ]
        assert [r["response_mask"] for r in rows.data] == expected


def test_an_unknown_padding_names_the_choices(run_store):
    with pytest.raises(FollowError, match="pad must be one of store, batch, got 'longest'"):
        daskgen.follow(run_store, pad="longest")
