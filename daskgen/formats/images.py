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

The images a sample's tools returned (stores of tool-loop runs with ``max_tool_images``: the ``tool_image_*``
arrays, spans into ``response_ids``) come the same way, each name with ``tool_`` before it (``tool_image_key`` too;
no ``rope_delta``).  :func:`sample_image_spans` gives every image of each sample in one token space, the prompt
followed by the response, as the model's position rule (:mod:`daskgen.formats.mrope`) takes them.

The pixels are read from the store by hash (:mod:`daskgen.formats.multimodal`, :func:`daskgen.read_image`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from daskgen.store.images import blob_key
from daskgen.store.layout import TOOL_IMAGE_ARRAYS

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
#: The fields of the rows and Arrow formats of the images a sample's tools returned, in their order.
ROW_TOOL_IMAGE_FIELDS = tuple(f"tool_{name}" for name in ROW_IMAGE_FIELDS if name != "rope_delta")
#: The prefixes of the two kinds of images' arrays: a prompt's, and those its samples' tools returned.
KINDS = ("", "tool_")
#: The fields verl keeps the images of a sample in (:mod:`daskgen.formats.multimodal`).
MULTI_MODAL_FIELDS = ("multi_modal_data", "multi_modal_inputs")
#: The per-sample image fields of the verl layout that are numbers, and those that are strings.
VERL_IMAGE_NUMBERS = ("image_offset", "image_length", "image_grid", "rope_delta")
VERL_IMAGE_STRINGS = ("image_hash", "image_modality")


def image_arrays(layout: Any) -> tuple[str, ...]:
    """The image arrays a block of a store with this layout reads (none for a store without images)."""
    return (IMAGE_ARRAYS if layout.max_images else ()) + (TOOL_IMAGE_ARRAYS if layout.tool_images else ())


def _present(block: Any, prefix: str) -> tuple[np.ndarray, list[int]]:
    """Which image slots hold an image, and how many each sample has."""
    present = np.asarray(block[prefix + "image_hash"] != "", dtype=bool)
    return present, present.sum(axis=1).tolist()


def _split(flat: list[Any], counts: list[int]) -> list[list[Any]]:
    ends = np.cumsum(counts).tolist()
    return [flat[start:end] for start, end in zip([0, *ends][:-1], ends, strict=True)]


def image_lists(block: Any) -> dict[str, list[Any]]:
    """Per sample, its images as lists (see the module docstring); ``{}`` for a block without images."""
    out: dict[str, list[Any]] = {}
    for prefix in (p for p in KINDS if p + "image_hash" in block):
        present, counts = _present(block, prefix)
        hashes = [str(h) for h in block[prefix + "image_hash"][present]]
        out[prefix + "image_hash"] = _split(hashes, counts)
        out[prefix + IMAGE_KEY] = _split([blob_key(h) for h in hashes], counts)
        out[prefix + "image_modality"] = _split([str(m) for m in block[prefix + "image_modality"][present]], counts)
        for name in ("image_offset", "image_length", "image_grid"):
            out[prefix + name] = _split(block[prefix + name][present].tolist(), counts)
    if "rope_delta" in block:
        out["rope_delta"] = block["rope_delta"].tolist()
    return out


def image_columns(block: Any) -> dict[str, Any]:
    """:func:`image_lists` as pyarrow columns (list columns; ``image_grid``: lists of three int32)."""
    import pyarrow as pa

    columns: dict[str, Any] = {}
    for prefix in (p for p in KINDS if p + "image_hash" in block):
        present, counts = _present(block, prefix)
        offsets = pa.array(np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]))
        hashes = [str(h) for h in block[prefix + "image_hash"][present]]
        strings = {
            "image_hash": hashes,
            IMAGE_KEY: [blob_key(h) for h in hashes],
            "image_modality": [str(m) for m in block[prefix + "image_modality"][present]],
        }
        for name, values in strings.items():
            columns[prefix + name] = pa.LargeListArray.from_arrays(offsets, pa.array(values, pa.string()))
        for name in ("image_offset", "image_length"):
            values = pa.array(block[prefix + name][present].astype(np.int32))
            columns[prefix + name] = pa.LargeListArray.from_arrays(offsets, values)
        grids = block[prefix + "image_grid"][present].astype(np.int32).ravel()
        columns[prefix + "image_grid"] = pa.LargeListArray.from_arrays(
            offsets, pa.FixedSizeListArray.from_arrays(pa.array(grids), 3)
        )
    if "rope_delta" in block:
        columns["rope_delta"] = pa.array(block["rope_delta"].astype(np.int32))
    order = (*ROW_IMAGE_FIELDS, *ROW_TOOL_IMAGE_FIELDS)
    return {name: columns[name] for name in order if name in columns}


def verl_image_fields(block: Any) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The image fields of the verl layout (numbers, strings; see the module docstring); empty without images."""
    numbers: dict[str, np.ndarray] = {}
    strings: dict[str, np.ndarray] = {}
    for prefix in (p for p in KINDS if p + "image_hash" in block):
        numbers |= {prefix + n: block[prefix + n].astype(np.int64) for n in VERL_IMAGE_NUMBERS if prefix + n in block}
        strings |= {prefix + n: np.asarray(block[prefix + n], dtype=object) for n in VERL_IMAGE_STRINGS}
    return numbers, strings


def sample_images(block: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """Every image of each sample in the order the model saw them, the prompt's then its tools': their hashes
    ``(rows, slots)`` (``""``: an empty slot) and grids ``(rows, slots, 3)``; ``None`` for a block without images."""
    kinds = [p for p in KINDS if p + "image_hash" in block]
    if not kinds:
        return None
    hashes = np.concatenate([np.asarray(block[p + "image_hash"], dtype=object) for p in kinds], axis=1)
    grids = np.concatenate([np.asarray(block[p + "image_grid"]) for p in kinds], axis=1)
    order = np.argsort(hashes == "", axis=1, kind="stable")  # each row's images first, in order; empty slots last
    return np.take_along_axis(hashes, order, axis=1), np.take_along_axis(grids, order[..., None], axis=1)


def sample_image_spans(block: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Every image of each sample as :func:`daskgen.formats.mrope.mrope_positions` takes them: offsets, lengths
    ``(rows, slots)`` and grids ``(rows, slots, 3)`` in the sample's tokens (its prompt, then its response: a tool
    image's offset is the prompt's length plus its offset in the response); empty slots (length 0) last.
    ``None`` for a block without images."""
    kinds = [p for p in KINDS if p + "image_hash" in block]
    if not kinds:
        return None
    shift = {"": 0, "tool_": np.asarray(block["prompt_length"], dtype=np.int64)[:, None]}
    offsets = np.concatenate([block[p + "image_offset"].astype(np.int64) + shift[p] for p in kinds], axis=1)
    lengths = np.concatenate([block[p + "image_length"].astype(np.int64) for p in kinds], axis=1)
    grids = np.concatenate([np.asarray(block[p + "image_grid"], dtype=np.int64) for p in kinds], axis=1)
    order = np.argsort(lengths == 0, axis=1, kind="stable")
    offsets = np.where(lengths > 0, offsets, -1)
    take = np.take_along_axis
    return take(offsets, order, axis=1), take(lengths, order, axis=1), take(grids, order[..., None], axis=1)


def distinct_hashes(block: Any) -> list[str]:
    """The distinct image hashes of the block's samples (prompts' and tools'), in the order they first appear."""
    found = sample_images(block)
    if found is None:
        return []
    hashes = found[0]
    return [str(h) for h in dict.fromkeys(hashes[hashes != ""].tolist())]
