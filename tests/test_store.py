import json

import numpy as np
import pytest
import xarray as xr

from daskgen import store
from daskgen.analysis.accessor import open_store
from daskgen.errors import StoreError, StoreMismatchError
from daskgen.store.resumable import check_resumable

LAYOUT = store.Layout(
    n_prompts=10, n_samples=2, max_prompt_tokens=8, max_new_tokens=6, partition_size=4, pad_token_id=0
)
ATTRS = {
    "identity": {"model": "m", "temperature": 1.0},
    "input": {"fingerprint": "f", "n_prompts": 10},
    "tokenizer": {"vocab_size": 5},
}


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "s.zarr"
    store.GenerationStore.create(p, store.StoreAttrs(LAYOUT, **ATTRS), [f"id{i}" for i in range(10)])
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
    store.GenerationStore.open(path).write_region(4, region)
    store.GenerationStore.open(path).commit(4, np.array([1, 1, 2, 1], dtype="int8"), ["", "", "boom", ""])
    ds = open_store(path)
    assert ds.response_length.values[4:8].tolist() == [[3, 3]] * 4
    assert ds.status.values.tolist() == [0] * 4 + [1, 1, 2, 1] + [0, 0]
    assert ds.error.values[6] == "boom"
    with pytest.raises(StoreError, match="data arrays"):
        store.GenerationStore.open(path).write_region(0, {"status": np.ones(4, dtype="int8")})


def test_a_pickled_store_reads_nothing_until_used_and_refuses_a_replaced_one(path):
    """Dask unpickles tasks in its connections: unpickling a store reads nothing (a store that cannot be reached
    fails the task that uses it, not the connection); its first use refuses a store replaced at its location."""
    import pickle
    import shutil

    replaced = pickle.dumps(store.GenerationStore.open(path))
    shutil.rmtree(path)
    store.GenerationStore.create(path, store.StoreAttrs(LAYOUT, **ATTRS), [f"id{i}" for i in range(10)])
    with pytest.raises(StoreError, match=r"changed while this run used it .*Rerun to resume"):
        pickle.loads(replaced).layout  # noqa: B018 - the first use
    pickled = pickle.dumps(store.GenerationStore.open(path))
    moved = path.with_name("moved.zarr")
    path.rename(moved)
    unpickled = pickle.loads(pickled)  # nothing there: no error yet
    with pytest.raises(StoreError, match=r"no longer holds a daskgen store"):
        unpickled.read_status()
    moved.rename(path)
    assert (pickle.loads(pickled).read_status() == store.PENDING).all()  # found again: the next use reads it
    assert pickle.loads(pickled).layout == LAYOUT


def test_resume_mismatch_names_both_values(path):
    wanted = json.loads(json.dumps(ATTRS))
    wanted["identity"]["temperature"] = 0.5
    with pytest.raises(StoreMismatchError) as err:
        check_resumable(store.GenerationStore.open(path), store.StoreAttrs(LAYOUT, **wanted))
    assert "temperature: store has 1.0, this run has 0.5" in str(err.value)
    assert "new --store" in str(err.value)
    check_resumable(store.GenerationStore.open(path), store.StoreAttrs(LAYOUT, **ATTRS))


def test_refuses_file_and_foreign_directory(tmp_path):
    (tmp_path / "f.zarr").write_text("x")
    with pytest.raises(StoreError, match="it is a file"):
        store.GenerationStore.create(tmp_path / "f.zarr", store.StoreAttrs(LAYOUT, **ATTRS), [""] * 10)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data.bin").write_text("x")
    with pytest.raises(StoreError, match="not a daskgen store"):
        store.GenerationStore.create(tmp_path / "other", store.StoreAttrs(LAYOUT, **ATTRS), [""] * 10)
    with pytest.raises(StoreError, match="not a daskgen store"):
        open_store(tmp_path / "other")


def test_status_of_a_million_rows_is_coarse_chunked(tmp_path):
    big = store.Layout(1_000_000, 1, 4, 4, 64, 0)
    p = tmp_path / "big.zarr"
    store.GenerationStore.create(p, store.StoreAttrs(big, **ATTRS), [""] * 1_000_000)
    store.GenerationStore.open(p).commit(0, np.ones(700_000, dtype="int8"), None)
    status = store.GenerationStore.open(p).read_status()
    assert (status == 1).sum() == 700_000
    # the checkpoint must stay a handful of objects (reopen time is measured in benchmarks/)
    assert 1 <= len(list((p / "status" / "c").iterdir())) <= 16


def test_layout_owns_writers_and_fill_rules():
    v2 = store.Layout(
        n_prompts=10,
        n_samples=2,
        max_prompt_tokens=8,
        max_new_tokens=6,
        partition_size=4,
        pad_token_id=7,
        n_trajectories=3,
        scored=True,
    )
    specs = v2.array_specs()
    assert all(isinstance(spec, store.ArraySpec) for spec in specs.values())
    # the writable list is the layout's worker-written arrays, nothing client-written
    assert set(v2.data_arrays()) == {n for n, s in specs.items() if s.role in store.layout.WORKER_ROLES}
    assert not {"status", "error", "committed_at", "prompt_index", "prompt_id"} & set(v2.data_arrays())
    assert {"score", "samples_used", "num_trajectories"} <= set(v2.data_arrays()) <= set(store.layout.WORKER_ARRAYS)
    assert set(LAYOUT.data_arrays()) == set(store.layout.DATA_ARRAYS)
    # schema v2: response arrays gain the trajectory axis, the per-sample score does not
    assert specs["response_ids"].dims == ("prompt", "sample", "trajectory", "response_position")
    assert specs["response_ids"].shape == (10, 2, 3, 6) and specs["score"].shape == (10, 2)
    region = store.layout.empty_region(v2, 4)
    assert region["response_ids"].shape == (4, 2, 3, 6) and (region["response_ids"] == 7).all()
    assert (region["finish_reason"] == store.layout.NOT_GENERATED).all() and np.isnan(region["logprobs"]).all()
    region["response_ids"][1, 0] = 3
    region["finish_reason"][1, 0] = 0
    region["num_trajectories"][1, 0] = 2
    store.layout.clear_response(region, (1, 0), v2)
    assert (region["response_ids"][1, 0] == 7).all() and (region["finish_reason"][1, 0] == -1).all()
    assert region["num_trajectories"][1, 0] == 2  # not a response array: kept


def test_store_module_does_not_import_analysis():
    import subprocess
    import sys

    code = (
        "import sys, daskgen.store.generation_store; "
        "assert 'daskgen.analysis.accessor' not in sys.modules and 'xarray' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_opening_where_no_store_is_says_what_is_there(tmp_path):
    (tmp_path / "file.zarr").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    cases = {"missing.zarr": "nothing is there", "empty": "nothing is there", "file.zarr": "it is a file",
             "other": "what is there has no zarr.json with daskgen attrs"}  # fmt: skip
    for name, found in cases.items():
        with pytest.raises(StoreError, match=f"is not a daskgen store: {found}. Check the path"):
            store.GenerationStore.open(tmp_path / name)
        with pytest.raises(StoreError, match=f"is not a daskgen store: {found}"):
            open_store(tmp_path / name)
