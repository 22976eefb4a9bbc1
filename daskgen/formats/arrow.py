"""Arrow and Parquet: one row per generated sample as Arrow columns (``daskgen export --format parquet``,
``format="arrow"``, ``daskgen follow --format parquet-dir``).

The columns are those of :mod:`daskgen.formats.records`, in the same order: token lists cut to their lengths
(``logprobs`` keeps NaN where a log-probability was not recorded), the ``finish_reason`` label, the optional fields
as strings.  pyarrow is imported only when a table is built.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from daskgen.formats.block import Block
from daskgen.formats.finish import finish_labels
from daskgen.formats.images import distinct_hashes, image_columns
from daskgen.store.layout import NO_TOKEN, SAMPLE_NUMBERS, STALE_FIELD


def arrow_table(block: Block) -> Any:
    """A pyarrow table of the block: ids, ``finish_reason`` label, lengths, token lists, the optional fields."""
    import pyarrow as pa

    plen, rlen = block["prompt_length"], block["response_length"]
    columns = _index_columns(block)
    columns |= {
        "finish_reason": pa.array(finish_labels(block["finish_reason"]).tolist()),
        "num_turns": pa.array(block["num_turns"]),
        "prompt_length": pa.array(plen),
        "response_length": pa.array(rlen),
        "prompt_ids": _ragged(block["prompt_ids"], plen),
        "response_ids": _ragged(block["response_ids"], rlen),
        "response_mask": _ragged(block.response_mask(), rlen),
    }
    return pa.table(columns | _optional_columns(block))


def write_parquet(blocks: Iterable[Block], path: Path, seen: dict[str, None] | None = None) -> int:
    """Write the blocks' tables into one Parquet file (zstd); the rows written.  ``seen`` collects the hashes of
    the images the rows name (:func:`~daskgen.formats.images.distinct_hashes`), in the order they first appear."""
    import pyarrow.parquet as pq

    rows, writer = 0, None
    try:
        for block in blocks:
            if seen is not None:
                seen.update(dict.fromkeys(distinct_hashes(block)))
            table = arrow_table(block)
            writer = writer or pq.ParquetWriter(path, table.schema, compression="zstd")
            writer.write_table(table)
            rows += table.num_rows
    finally:
        if writer is not None:
            writer.close()
    return rows


def write_image_table(hashes: Iterable[str], read: Any, path: Path) -> int:
    """Write one Parquet row per image (``image_hash``, ``image_key``, ``image_bytes``: the stored bytes, as
    ``read(hash)`` returns them); the images written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from daskgen.store.images import blob_key

    schema = pa.schema([("image_hash", pa.string()), ("image_key", pa.string()), ("image_bytes", pa.large_binary())])
    written = 0
    with pq.ParquetWriter(path, schema) as writer:  # one row group per image: one image in memory at a time
        for digest in hashes:
            data = read(digest)
            writer.write_table(pa.table([[digest], [blob_key(digest)], [data]], schema=schema))
            written += 1
    return written


def _ragged(values: np.ndarray, lengths: np.ndarray) -> Any:
    """A pyarrow list array of ``values[i, :lengths[i]]``."""
    import pyarrow as pa

    valid = np.arange(values.shape[1])[None, :] < lengths[:, None]
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values[valid]))


def _ragged_top(block: Block) -> dict[str, Any]:
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


def _index_columns(block: Block) -> dict[str, Any]:
    """The columns naming each row: ``prompt_index``, ``prompt_id``, ``sample`` and ``trajectory`` if any."""
    import pyarrow as pa

    columns = {"prompt_index": pa.array(block["prompt_index"]), "prompt_id": pa.array(block["prompt_id"].tolist())}
    for name in ("sample", "trajectory") if "trajectory" in block else ("sample",):
        columns[name] = pa.array(block[name].astype(np.int32))
    return columns


def _optional_columns(block: Block) -> dict[str, Any]:
    """The columns a block may lack: ``stop_reason``, the policy versions, ``stale``, ``logprobs`` and top-k
    logprobs (when recorded), the prompt's images (:mod:`daskgen.formats.images`), decoded text, the raw prompt,
    the row's settings and the input's kept columns."""
    import pyarrow as pa

    columns = {name: pa.array(block[name]) for name in SAMPLE_NUMBERS if name in block}
    if STALE_FIELD in block:  # a follower with max_staleness: the sample is too stale
        columns[STALE_FIELD] = pa.array(block[STALE_FIELD].astype(bool))
    if block.logprobs:
        columns["logprobs"] = _ragged(block["logprobs"], block["response_length"])
    if "top_logprobs" in block:
        columns |= _ragged_top(block)
    columns |= image_columns(block)
    for name, values in (block.external() | block.texts()).items():
        columns[name] = pa.array(values.tolist(), type=pa.string())
    return columns
