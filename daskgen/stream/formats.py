"""What a follower reads and hands out: the store arrays of its ``format`` and ``fields``, and the batch built.

The formats are those of :mod:`daskgen.formats`, read through its one read path
(:func:`daskgen.formats.read.read_rows`, then :func:`daskgen.formats.read.flat_block`), so each carries the fields
of the export of the same name (``rows``: ``daskgen export --format jsonl``; ``arrow``: ``--format parquet``;
``tensordict``: ``--format tensordict``; ``dataproto``: that export split by
:func:`~daskgen.formats.dataproto.dataproto_parts`).
``pad="store"`` (the default) pads the tensor formats to the store's widths (``max_prompt_tokens``,
``max_new_tokens``): every batch has the same shape, so batches concatenate (``DataProto.concat``, ``torch.cat``);
``pad="batch"`` pads them to the batch's own longest prompt and response.  ``xarray`` hands out the rows
unflattened, with every data array by default (``fields=`` chooses them).  Every format of a store with images
carries each sample's image hashes, spans and grids (:mod:`daskgen.formats.images`); the tensor formats also
verl's ``multi_modal_data`` and ``multi_modal_inputs`` (:class:`BatchImages`, unless ``multi_modal=False``).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from daskgen.errors import FollowError
from daskgen.formats import BLOCK_FORMATS, build
from daskgen.formats.read import block_fields, flat_block
from daskgen.formats.xarray import to_dataset
from daskgen.store.generation_store import GenerationStore
from daskgen.store.layout import TOP_LOGPROB_ARRAYS

FORMATS = ("xarray", *BLOCK_FORMATS)
#: The formats that carry verl's multi-modal fields.
MULTI_MODAL_FORMATS = ("tensordict", "dataproto")


class BatchImages:
    """A follower's reader of the stored images for verl's multi-modal fields: one
    :class:`~daskgen.formats.multimodal.StoreImages` per opened store (its images and pixel values kept across
    batches); ``enabled=False``: none."""

    def __init__(self, enabled: bool = True, model: str | None = None) -> None:
        self.enabled, self.model = enabled, model
        self.readers: weakref.WeakKeyDictionary[GenerationStore, Any] = weakref.WeakKeyDictionary()

    def of(self, fmt: str, store: GenerationStore) -> Any:
        """The store's image reader for a batch of format ``fmt`` (``None``: the batch carries no pixels)."""
        if (
            not self.enabled
            or fmt not in MULTI_MODAL_FORMATS
            or not (store.layout.max_images or store.layout.tool_images)
        ):
            return None
        if store not in self.readers:
            from daskgen.formats.multimodal import StoreImages

            self.readers[store] = StoreImages(store, self.model)
        return self.readers[store]


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
    fmt: str,
    store: GenerationStore,
    rows: np.ndarray,
    prompt_ids: np.ndarray,
    data: dict[str, np.ndarray],
    pad: str,
    images: BatchImages | None = None,
) -> Any:
    """The batch in format ``fmt`` from the arrays ``data`` read for its ``rows`` (see the module docstring);
    ``images``: the follower's image reader (the tensor formats' multi-modal fields)."""
    if fmt == "xarray":
        return to_dataset(store, rows, prompt_ids, data)
    reader = None if images is None else images.of(fmt, store)
    return build(fmt, flat_block(store, rows, prompt_ids, data), pad, reader)
