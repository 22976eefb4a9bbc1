"""What a request sends beside its token ids: its images, each already placed in the prompt.

The worker preprocesses each image once (:mod:`daskgen.worker.images`) and every sample of its prompt shares the
one :class:`ImageInput` (no copy per sample).  An engine that takes pixel values reads :attr:`ImageInput.pixel_values`
and :attr:`ImageInput.grid`; one that preprocesses itself reads :attr:`ImageInput.data`, the image's bytes.  Either
way the prompt ids already hold each image's placeholder tokens, expanded (``span``); an engine that expands
placeholders itself gets them collapsed back to one per image (:func:`collapsed_ids`), and the image as the worker
decoded it (:attr:`ImageInput.decoded`, or :attr:`ImageInput.png_data_url` over HTTP), decoded once per image and
shared by every sample and turn of its prompt.  Both are blocking (:func:`data_urls` for a request's images): an
engine computes them off the worker's event loop.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

#: The modality of every :class:`ImageInput` (stored per item, so other modalities can follow).
IMAGE = "image"


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a request.

    Attributes
    ----------
    digest:
        The SHA-256 of its bytes (hex): its name in the store.
    data:
        The image file's bytes (PNG, JPEG, ...).
    pixel_values:
        The model's image processor's output for it (a float32 array), or ``None`` when not preprocessed.
    grid:
        Its grid of patches ``(t, h, w)`` as the processor made it.
    span:
        ``(offset, length)``: where its placeholder tokens lie in the request's prompt ids.
    """

    digest: str
    data: bytes
    pixel_values: Any
    grid: tuple[int, int, int]
    span: tuple[int, int]
    modality: str = IMAGE

    @cached_property
    def decoded(self) -> Any:
        """The RGB Pillow image as the worker's processor got it (:mod:`daskgen.input.image_decoding`); blocking."""
        from daskgen.input.image_decoding import decoded_rgb

        return decoded_rgb(self.data)

    @cached_property
    def png_data_url(self) -> str:
        """A ``data:`` URL of :attr:`decoded` encoded as PNG: a server that decodes files its own way (EXIF
        orientation, transparency) reads exactly the pixels the worker's processor got; blocking."""
        from daskgen.input.image_decoding import rgb_png

        return "data:image/png;base64," + base64.b64encode(rgb_png(self.data)).decode()


def collapsed_ids(prompt_ids: Sequence[int], images: Sequence[ImageInput]) -> list[int]:
    """``prompt_ids`` with each image's span (its expanded placeholders) collapsed to its first token: the prompt an
    engine that expands placeholders itself takes beside the raw images."""
    ids = list(prompt_ids)
    for image in sorted(images, key=lambda image: image.span[0], reverse=True):
        start, length = image.span
        del ids[start + 1 : start + length]
    return ids


def data_urls(images: Sequence[ImageInput]) -> list[str]:
    """Each image's :attr:`~ImageInput.png_data_url` (blocking: run it off the event loop)."""
    return [image.png_data_url for image in images]
