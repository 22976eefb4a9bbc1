"""The images of each sample in the formats: the store's per-image arrays, per sample, never the pixels.

A store whose rows name images (docs/images.md) holds per prompt each image's hash, modality, placeholder span
(offset, length) in ``prompt_ids`` and patch grid, and the prompt's mRoPE delta.  Every format built from a block
carries them with each sample (a prompt's samples share its values); a store without images adds none of them:

* rows and Arrow (:func:`image_lists`, :func:`image_columns`): lists over the prompt's images (empty slots left
  out): ``image_hash``, ``image_key`` (the image's key in the store, ``images/<h[:2]>/<h>``),
  ``image_modality``, ``image_offset``, ``image_length``, ``image_grid`` (one ``[t, h, w]`` per image), and the
  number ``rope_delta``;
* verl's layout (:func:`verl_image_fields`): the store's layout, one row per sample: ``image_offset`` and
  ``image_length`` ``(rows, max_images)``, ``image_grid`` ``(rows, max_images, 3)`` and ``rope_delta`` as int64,
  ``image_hash`` and ``image_modality`` ``(rows, max_images)`` strings (an empty slot: ``""``, ``-1``, ``0``).

The pixels are read from the store by hash (:mod:`daskgen.formats.multimodal`, :func:`daskgen.read_image`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from daskgen.store.images import blob_key

#: The store's per-prompt image arrays (stores whose rows name images), as every format carries them.
IMAGE_ARRAYS = ("image_hash", "image_modality", "image_offset", "image_length", "image_grid", "rope_delta")
#: The field the rows and Arrow formats add: each image's key in the store.
IMAGE_KEY = "image_key"
#: The image fields of the rows and Arrow formats, in their order.
ROW_IMAGE_FIELDS = (
    "image_hash",
    IMAGE_KEY,
    "image_modality",
    "image_offset",
    "image_length",
    "image_grid",
    "rope_delta",
)
#: The fields verl keeps the images of a sample in (:mod:`daskgen.formats.multimodal`).
MULTI_MODAL_FIELDS = ("multi_modal_data", "multi_modal_inputs")
#: The per-sample image fields of the verl layout that are numbers, and those that are strings.
VERL_IMAGE_NUMBERS = ("image_offset", "image_length", "image_grid", "rope_delta")
VERL_IMAGE_STRINGS = ("image_hash", "image_modality")


def image_arrays(layout: Any) -> tuple[str, ...]:
    """The image arrays a block of a store with this layout reads (none for a store without images)."""
    return IMAGE_ARRAYS if layout.max_images else ()


def _present(block: Any) -> tuple[np.ndarray, list[int]]:
    """Which image slots hold an image, and how many each sample has."""
    present = np.asarray(block["image_hash"] != "", dtype=bool)
    return present, present.sum(axis=1).tolist()


def _split(flat: list[Any], counts: list[int]) -> list[list[Any]]:
    ends = np.cumsum(counts).tolist()
    return [flat[start:end] for start, end in zip([0, *ends][:-1], ends, strict=True)]


def image_lists(block: Any) -> dict[str, list[Any]]:
    """Per sample, the prompt's images as lists (see the module docstring); ``{}`` for a block without images."""
    if "image_hash" not in block:
        return {}
    present, counts = _present(block)
    hashes = [str(h) for h in block["image_hash"][present]]
    out: dict[str, list[Any]] = {"image_hash": _split(hashes, counts)}
    out[IMAGE_KEY] = _split([blob_key(h) for h in hashes], counts)
    out["image_modality"] = _split([str(m) for m in block["image_modality"][present]], counts)
    for name in ("image_offset", "image_length", "image_grid"):
        out[name] = _split(block[name][present].tolist(), counts)
    out["rope_delta"] = block["rope_delta"].tolist()
    return out


def image_columns(block: Any) -> dict[str, Any]:
    """:func:`image_lists` as pyarrow columns (list columns; ``image_grid``: lists of three int32)."""
    if "image_hash" not in block:
        return {}
    import pyarrow as pa

    present, counts = _present(block)
    offsets = pa.array(np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]))
    hashes = [str(h) for h in block["image_hash"][present]]
    strings = {
        "image_hash": hashes,
        IMAGE_KEY: [blob_key(h) for h in hashes],
        "image_modality": [str(m) for m in block["image_modality"][present]],
    }
    columns = {name: pa.LargeListArray.from_arrays(offsets, pa.array(v, pa.string())) for name, v in strings.items()}
    for name in ("image_offset", "image_length"):
        columns[name] = pa.LargeListArray.from_arrays(offsets, pa.array(block[name][present].astype(np.int32)))
    grids = pa.FixedSizeListArray.from_arrays(pa.array(block["image_grid"][present].astype(np.int32).ravel()), 3)
    columns["image_grid"] = pa.LargeListArray.from_arrays(offsets, grids)
    columns["rope_delta"] = pa.array(block["rope_delta"].astype(np.int32))
    return {name: columns[name] for name in ROW_IMAGE_FIELDS}


def verl_image_fields(block: Any) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The image fields of the verl layout (numbers, strings; see the module docstring); empty without images."""
    if "image_hash" not in block:
        return {}, {}
    numbers = {name: block[name].astype(np.int64) for name in VERL_IMAGE_NUMBERS}
    strings = {name: np.asarray(block[name], dtype=object) for name in VERL_IMAGE_STRINGS}
    return numbers, strings


def distinct_hashes(block: Any) -> list[str]:
    """The distinct image hashes of the block's samples, in the order they first appear."""
    if "image_hash" not in block:
        return []
    return [str(h) for h in dict.fromkeys(block["image_hash"][np.asarray(block["image_hash"] != "")].tolist())]
