"""Images a tool loop's tools return, on the worker: read, kept in the store once, preprocessed, placed and stored.

:class:`ToolImages` is the :class:`~daskgen.agents.base.ToolMedia` a partition gives its tool loop (runs with the
tool loop's ``max_tool_images``): an image a tool returns -- a URL as a prompt's images take them, the image file's
bytes or a Pillow image -- is kept in the store under its hash (:mod:`daskgen.store.images`; bytes without a URL
are always copied) and preprocessed by the worker's :class:`~daskgen.worker.images.ImagePreparer`, in its thread
pool and cache, never on the event loop.  :func:`place_tool_images` writes a sample's tool images (hash, modality,
span in ``response_ids``, grid) into the partition's region.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from daskgen.engines.media import IMAGE, ImageInput
from daskgen.errors import InputError
from daskgen.store.images import COPY
from daskgen.store.layout import TOOL_IMAGE_ARRAYS, Layout
from daskgen.store.objects.image_urls import read_image_bytes
from daskgen.worker.images import ImagePreparer


class ToolImages:
    """A partition's way to prepare the images its tool loop's tools return (see the module docstring)."""

    def __init__(self, preparer: ImagePreparer, location: Any, storage: str = COPY) -> None:
        self.preparer, self.location, self.storage = preparer, location, storage
        self.options = dict(getattr(location, "storage_options", {}) or {})
        self.image_token = preparer.vision.image

    async def prepare(self, source: Any) -> ImageInput:
        """The image ``source`` kept and preprocessed, its ``span`` ``(0, tokens)``; :class:`InputError` naming it
        when it cannot be read or the processor refuses it."""
        digest, data, processed = await self.preparer.in_pool(self._prepared, source)
        return ImageInput(digest, data, processed.pixel_values, processed.grid, (0, processed.tokens), IMAGE)

    def _prepared(self, source: Any) -> Any:
        if isinstance(source, str):
            return self.preparer.kept_and_processed(read_image_bytes(source, self.options), source, self.location,
                                                    self.storage)  # fmt: skip
        return self.preparer.kept_and_processed(_image_bytes(source), "data:", self.location, COPY)


def _image_bytes(source: Any) -> bytes:
    """The bytes of an image given as bytes or as a Pillow image (saved as PNG)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    if hasattr(source, "save"):
        out = io.BytesIO()
        source.save(out, format="PNG")
        return out.getvalue()
    raise InputError(
        f"a tool returned an image as {type(source).__name__}; give a URL or file path, the image file's bytes or "
        "a Pillow image"
    )


def place_tool_images(
    region: dict[str, np.ndarray], at: Sequence[tuple[int, ...]], images: Sequence[Sequence[ImageInput]], layout: Layout
) -> None:
    """Write each sample's (or trajectory's) tool images ``images[i]`` into region slot ``at[i]``, the slot's other
    entries reset to their fill values."""
    fills = {name: spec.fill for name, spec in layout.array_specs().items() if name in TOOL_IMAGE_ARRAYS}
    for index, placed in zip(at, images, strict=True):
        for name, fill in fills.items():
            region[name][index] = fill
        for k, image in enumerate(placed):
            slot = (*index, k)
            region["tool_image_hash"][slot], region["tool_image_modality"][slot] = image.digest, image.modality
            region["tool_image_offset"][slot], region["tool_image_length"][slot] = image.span
            region["tool_image_grid"][slot] = image.grid
