"""The formats a store's samples are written in, one module per format, all fed by one flattened block.

* :mod:`~daskgen.formats.read`: the one read path: rows of a store into a :class:`~daskgen.formats.block.Block`;
* :mod:`~daskgen.formats.block`: the flattened block (one entry per generated sample);
* :mod:`~daskgen.formats.finish`: the ``finish_reason`` labels;
* :mod:`~daskgen.formats.records`: dicts fit for JSON (JSONL export, ``format="rows"``, ``daskgen follow``);
* :mod:`~daskgen.formats.arrow`: Arrow tables and Parquet (Parquet export, ``format="arrow"``, ``daskgen follow``);
* :mod:`~daskgen.formats.verl`: verl's field layout (padding, masks, positions; ids, integers and strings);
* :mod:`~daskgen.formats.tensordict`: ``TensorDict`` (the tensordict export, ``format="tensordict"``);
* :mod:`~daskgen.formats.dataproto`: verl ``DataProto`` (``format="dataproto"``, a tensordict export's parts);
* :mod:`~daskgen.formats.xarray`: the unflattened rows as an ``xarray.Dataset`` (``format="xarray"``);
* :mod:`~daskgen.formats.images`: the prompt's image hashes, spans and grids in every format (stores with images);
* :mod:`~daskgen.formats.multimodal`: verl's ``multi_modal_data``/``multi_modal_inputs`` from the stored images.
* :mod:`~daskgen.formats.mrope`: mRoPE positions of samples with images, from their spans and grids.

``daskgen export`` (:mod:`daskgen.analysis.export`) and ``daskgen.follow`` (:mod:`daskgen.stream`) both read
through :mod:`~daskgen.formats.read` and write through :func:`build` (or the file writers of the format modules),
so a format carries the same fields from both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from daskgen.formats.block import EXTERNAL_FIELDS, Block
from daskgen.formats.images import IMAGE_ARRAYS, IMAGE_KEY, MULTI_MODAL_FIELDS, ROW_TOOL_IMAGE_FIELDS
from daskgen.formats.verl import ID_KEYS, VERL_KEYS, VERL_META, to_verl, widths

if TYPE_CHECKING:
    from daskgen.formats.multimodal import StoreImages

__all__ = ["BLOCK_FORMATS", "Block", "build", "output_names"]

#: The formats built from a block (every ``daskgen.follow`` format but ``xarray``).
BLOCK_FORMATS = ("tensordict", "dataproto", "rows", "arrow")


def build(fmt: str, block: Block, width: tuple[int, int] | str = "store", images: StoreImages | None = None) -> Any:
    """The block in format ``fmt`` (one of :data:`BLOCK_FORMATS`); ``width``: the tensor formats' prompt and
    response widths, or how to pad them: ``"store"`` (the store's widths) or ``"batch"`` (the block's longest);
    ``images``: the store's images, which give the tensor formats verl's ``multi_modal_data`` and
    ``multi_modal_inputs`` (:mod:`daskgen.formats.multimodal`; none without)."""
    if fmt == "rows":
        from daskgen.formats.records import records

        return records(block)
    if fmt == "arrow":
        from daskgen.formats.arrow import arrow_table

        return arrow_table(block)
    parts = to_verl(block, widths(block, width) if isinstance(width, str) else width)
    if images is not None:
        parts.objects |= images.fields(block)
    if fmt == "tensordict":
        from daskgen.formats.tensordict import to_tensordict

        return to_tensordict(parts)
    if fmt == "dataproto":
        from daskgen.formats.dataproto import to_dataproto

        return to_dataproto(parts)
    raise ValueError(f"unknown block format {fmt!r}; choose one of {', '.join(BLOCK_FORMATS)}")


def output_names() -> frozenset[str]:
    """Field names the formats write beyond the store's arrays (a kept input column may not take one)."""
    images = (*IMAGE_ARRAYS, IMAGE_KEY, *ROW_TOOL_IMAGE_FIELDS, *MULTI_MODAL_FIELDS)
    return frozenset({*EXTERNAL_FIELDS, "finish_label", *ID_KEYS, *VERL_KEYS, *VERL_META, *images})
