import json

import numpy as np
import pytest
import xarray as xr

from daskgen import store
from daskgen.errors import StoreError, StoreMismatchError

LAYOUT = store.Layout(n_prompts=10, n_samples=2, max_prompt_tokens=8, max_new_tokens=6, partition_size=4,
                      pad_token_id=0)
ATTRS = {"identity": {"model": "m", "temperature": 1.0}, "input": {"fingerprint": "f", "n_prompts": 10},
         "tokenizer": {"vocab_size": 5}}


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "s.zarr"
    store.create(p, LAYOUT, ATTRS, [f"id{i}" for i in range(10)])
    return p


def test_layout_opens_with_plain_xarray(path):
    ds = xr.open_zarr(path)
    assert ds.sizes == {"prompt": 10, "prompt_position": 8, "sample": 2, "response_position": 6}
    assert ds.response_ids.encoding["chunks"] == (4, 2, 6)
    assert ds.status.encoding["chunks"] == (10,)
    assert list(ds.prompt_id.values[:2]) == ["id0", "id1"]
    assert "prompt_index" in ds.coords
    assert ds.finish_reason.attrs["flag_meanings"] == "stop length abort error"
    assert ds.attrs["daskgen"]["schema_version"] == 1
    assert (ds.status.values == store.PENDING).all()


def test_region_write_then_commit(path):
    region = {"response_length": np.full((4, 2), 3, dtype="int32")}
    store.write_region(path, 4, region)
    store.commit(path, 4, np.array([1, 1, 2, 1], dtype="int8"), ["", "", "boom", ""])
    ds = store.open_store(path)
    assert ds.response_length.values[4:8].tolist() == [[3, 3]] * 4
    assert ds.status.values.tolist() == [0] * 4 + [1, 1, 2, 1] + [0, 0]
    assert ds.error.values[6] == "boom"
    with pytest.raises(StoreError, match="data arrays"):
        store.write_region(path, 0, {"status": np.ones(4, dtype="int8")})


def test_resume_mismatch_names_both_values(path):
    wanted = json.loads(json.dumps(ATTRS))
    wanted["identity"]["temperature"] = 0.5
    with pytest.raises(StoreMismatchError) as err:
        store.check_compatible(path, store.read_attrs(path), wanted)
    assert "temperature: store has 1.0, this run has 0.5" in str(err.value)
    assert "new --store" in str(err.value)
    store.check_compatible(path, store.read_attrs(path), ATTRS)


def test_refuses_file_and_foreign_directory(tmp_path):
    (tmp_path / "f.zarr").write_text("x")
    with pytest.raises(StoreError, match="it is a file"):
        store.create(tmp_path / "f.zarr", LAYOUT, ATTRS, [""] * 10)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data.bin").write_text("x")
    with pytest.raises(StoreError, match="not a daskgen store"):
        store.create(tmp_path / "other", LAYOUT, ATTRS, [""] * 10)
    with pytest.raises(StoreError, match="not a daskgen store"):
        store.open_store(tmp_path / "other")


def test_status_of_a_million_rows_is_coarse_chunked(tmp_path):
    big = store.Layout(1_000_000, 1, 4, 4, 64, 0)
    p = tmp_path / "big.zarr"
    store.create(p, big, ATTRS, [""] * 1_000_000)
    store.commit(p, 0, np.ones(700_000, dtype="int8"), None)
    status = store.read_status(p)
    assert (status == 1).sum() == 700_000
    # the checkpoint must stay a handful of objects (reopen time is measured in benchmarks/)
    assert 1 <= len(list((p / "status" / "c").iterdir())) <= 16
