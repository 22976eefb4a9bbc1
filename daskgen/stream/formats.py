"""What a follower reads and hands out: the store arrays of its ``format`` and ``fields``, and the batch built.

The formats are those of :mod:`daskgen.formats`, read through its one read path
(:func:`daskgen.formats.read.read_rows`, then :func:`daskgen.formats.read.flat_block`), so each carries the fields
of the export of the same name (``rows``: ``daskgen export --format jsonl``; ``arrow``: ``--format parquet``;
``tensordict``: ``--format tensordict``; ``dataproto``: that export split by
:func:`~daskgen.formats.dataproto.dataproto_parts`).
``pad="store"`` (the default) pads the tensor formats to the store's widths (``max_prompt_tokens``,
``max_new_tokens``): every batch has the same shape, so batches concatenate (``DataProto.concat``, ``torch.cat``);
``pad="batch"`` pads them to the batch's own longest prompt and response.  ``xarray`` hands out the rows
unflattened, with every data array by default (``fields=`` chooses them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from daskgen.errors import FollowError
from daskgen.formats import BLOCK_FORMATS, build
from daskgen.formats.read import block_fields, flat_block
from daskgen.formats.xarray import to_dataset
from daskgen.store.generation_store import GenerationStore
from daskgen.store.layout import TOP_LOGPROB_ARRAYS

FORMATS = ("xarray", *BLOCK_FORMATS)


def fields_to_read(store: GenerationStore, fmt: str, fields: tuple[str, ...] | None) -> tuple[str, ...]:
    """The store arrays a batch of format ``fmt`` needs: ``fields`` (default: every data array for xarray; the
    top-k logprob arrays only when the store records them), plus the arrays a block is built from
    (:func:`~daskgen.formats.read.block_fields`) for the other formats."""
    if fmt not in FORMATS:
        raise FollowError(f"unknown follow format {fmt!r}; choose one of {', '.join(FORMATS)}.")
    available = tuple(name for name in store.layout.data_arrays() if store.has_array(name))  # older stores lack some
    if fields is not None:  # the top-k logprob arrays are read when the store records them
        fields = tuple(f for f in fields if f in available or f not in TOP_LOGPROB_ARRAYS)
    unknown = [f for f in fields or () if f not in available]
    if unknown:
        raise FollowError(f"unknown field(s) {unknown} of store {store.url!r}; its data arrays are {list(available)}.")
    wanted = list(fields or (available if fmt == "xarray" else ()))
    if fmt != "xarray":
        wanted += block_fields(store)
    return tuple(dict.fromkeys(wanted))


def batch_data(
    fmt: str, store: GenerationStore, rows: np.ndarray, prompt_ids: np.ndarray, data: dict[str, np.ndarray], pad: str
) -> Any:
    """The batch in format ``fmt`` from the arrays ``data`` read for its ``rows`` (see the module docstring)."""
    if fmt == "xarray":
        return to_dataset(store, rows, prompt_ids, data)
    return build(fmt, flat_block(store, rows, prompt_ids, data), pad)
