"""Rows of a local store's plain arrays read from the chunk files equal Zarr's reads; damage and other codecs."""

import numpy as np
import pytest
import zarr

from daskgen import store
from daskgen.errors import StoreError
from daskgen.store.chunks.chunk_reads import plain_array

LAYOUT = store.Layout(
    n_prompts=10, n_samples=2, max_prompt_tokens=8, max_new_tokens=6, partition_size=4, pad_token_id=0
)
ATTRS = {"identity": {"model": "m"}, "input": {"fingerprint": "f", "n_prompts": 10}}
NAMES = ("prompt_ids", "prompt_length", "response_ids", "response_length", "logprobs", "finish_reason")


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "s.zarr"
    store.GenerationStore.create(p, store.StoreAttrs(LAYOUT, **ATTRS), [f"id{i}" for i in range(10)])
    rng = np.random.default_rng(0)
    opened = store.GenerationStore.open(p)
    for start in (0, 4):  # rows 8-9: their chunks are never written (fill values)
        opened.write_region(
            start,
            {
                "prompt_ids": rng.integers(1, 99, (4, 8), dtype="int32"),
                "prompt_length": rng.integers(1, 8, 4, dtype="int32"),
                "response_ids": rng.integers(1, 99, (4, 2, 6), dtype="int32"),
                "response_length": rng.integers(1, 6, (4, 2), dtype="int32"),
                "logprobs": rng.standard_normal((4, 2, 6)).astype("float32"),
                "finish_reason": rng.integers(0, 2, (4, 2), dtype="int8"),
            },
        )
    return p


def test_spans_read_from_chunk_files_equal_zarr_reads(path):
    opened = store.GenerationStore.open(path)
    assert all(plain_array(path / name, opened.array(name)) is not None for name in NAMES)
    spans = [(0, 10), (1, 3), (3, 9), (9, 10), (4, 8)]
    got = opened.read_spans(spans, (*NAMES, "prompt_id"))  # prompt_id (strings): read through Zarr
    for name in (*NAMES, "prompt_id"):
        for (lo, hi), values in zip(spans, got[name], strict=True):
            expected = np.asarray(zarr.open_array(str(path), path=name, mode="r")[lo:hi])
            assert values.dtype == expected.dtype and values.shape == expected.shape, name
            assert np.array_equal(values, expected, equal_nan=values.dtype.kind == "f"), (name, lo, hi)
    assert (got["response_length"][3] == 0).all(), "an unwritten chunk reads as the fill value"


def test_damaged_chunk_fails_its_checksum(path):
    chunk = path / "response_ids" / "c" / "1" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="CRC32C checksum"):
        store.GenerationStore.open(path).read_spans([(2, 6)], ("response_ids",))


def test_other_codecs_are_left_to_zarr(tmp_path):
    arr = zarr.create_array(str(tmp_path / "a.zarr"), shape=(8, 3), chunks=(4, 3), dtype="int32", compressors=None)
    assert plain_array(tmp_path / "a.zarr", arr) is None
    split = zarr.create_array(str(tmp_path / "b.zarr"), shape=(8, 4), chunks=(4, 2), dtype="int32")
    assert plain_array(tmp_path / "b.zarr", split) is None, "chunked along more than the rows"
