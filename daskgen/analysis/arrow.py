"""One row per generated sample as Arrow columns, and as JSON records.

The Parquet and JSONL exports (:mod:`daskgen.analysis.export`), ``daskgen follow`` (:mod:`daskgen.stream.sinks`)
and ``daskgen.follow(format="rows")`` (:mod:`daskgen.stream.formats`) all build their rows here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from daskgen.analysis.decode import finish_labels, text_fields
from daskgen.store.layout import NO_TOKEN, SAMPLE_NUMBERS, STALE_FIELD


def _ragged(values: np.ndarray, lengths: np.ndarray) -> Any:
    """A pyarrow list array of ``values[i, :lengths[i]]``."""
    import pyarrow as pa

    valid = np.arange(values.shape[1])[None, :] < lengths[:, None]
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values[valid]))


def _ragged_top(block: dict[str, np.ndarray]) -> dict[str, Any]:
    """``top_logprob_ids``/``top_logprobs`` as lists (one per response token) of each token's entries."""
    import pyarrow as pa

    ids, values, lengths = block["top_logprob_ids"], block["top_logprobs"], block["response_length"]
    inside = np.arange(ids.shape[1])[None, :] < lengths[:, None]
    have = (ids != NO_TOKEN) & inside[..., None]
    outer = pa.array(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]))
    inner = pa.array(np.concatenate([[0], np.cumsum(have[inside].sum(axis=-1), dtype=np.int64)]))
    return {
        name: pa.LargeListArray.from_arrays(outer, pa.LargeListArray.from_arrays(inner, pa.array(array[have])))
        for name, array in (("top_logprob_ids", ids), ("top_logprobs", values))
    }


def arrow_block(block: dict[str, np.ndarray], has_logprobs: bool) -> Any:
    """A pyarrow table: ids, lengths, ``finish_reason`` label, token lists, optional text and raw prompt."""
    import pyarrow as pa

    plen, rlen = block["prompt_length"], block["response_length"]
    columns = _arrow_index_columns(block)
    columns |= {
        "finish_reason": pa.array(finish_labels(block["finish_reason"]).tolist()),
        "num_turns": pa.array(block["num_turns"]),
        "prompt_length": pa.array(plen),
        "response_length": pa.array(rlen),
        "prompt_ids": _ragged(block["prompt_ids"], plen),
        "response_ids": _ragged(block["response_ids"], rlen),
        "response_mask": _ragged(block["response_mask"], rlen),
    }
    return pa.table(columns | _arrow_optional_columns(block, has_logprobs))


def _arrow_index_columns(block: dict[str, np.ndarray]) -> dict[str, Any]:
    """The columns naming each row: ``prompt_index``, ``prompt_id``, ``sample`` and ``trajectory`` if any."""
    import pyarrow as pa

    columns = {"prompt_index": pa.array(block["prompt_index"]), "prompt_id": pa.array(block["prompt_id"].tolist())}
    for name in ("sample", "trajectory") if "trajectory" in block else ("sample",):
        columns[name] = pa.array(block[name].astype(np.int32))
    return columns


def _arrow_optional_columns(block: dict[str, np.ndarray], has_logprobs: bool) -> dict[str, Any]:
    """The columns a block may lack: ``stop_reason``, the policy versions, ``logprobs`` and top-k logprobs (when
    recorded), decoded text, the raw prompt, the row's settings and the input's kept columns (by their own names)."""
    import pyarrow as pa

    columns = {name: pa.array(block[name]) for name in SAMPLE_NUMBERS if name in block}
    if STALE_FIELD in block:  # a follower with max_staleness: the sample is too stale
        columns[STALE_FIELD] = pa.array(block[STALE_FIELD].astype(bool))
    if has_logprobs:
        columns["logprobs"] = _ragged(block["logprobs"], block["response_length"])
    if "top_logprobs" in block:
        columns |= _ragged_top(block)
    for name in ("prompt_text", "response_text", "raw_prompt"):
        if name in block:
            columns[name] = pa.array(block[name].tolist(), type=pa.string())
    for name, values in text_fields(block).items():
        columns[name] = pa.array(values.tolist(), type=pa.string())
    return columns


def json_records(table: Any) -> list[dict[str, Any]]:
    """The rows of an :func:`arrow_block` table as dicts fit for JSON: a ``logprobs`` value that is NaN (not
    recorded for that token) becomes ``None``."""
    records = table.to_pylist()
    for record in records:
        if "logprobs" in record:
            record["logprobs"] = [None if v != v else v for v in record["logprobs"]]  # NaN != NaN
    return records
