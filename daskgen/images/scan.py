"""The input scan's checks of every image, before any engine starts.

:class:`ImageCheck` reads each image a row names once on the client
(:func:`~daskgen.store.objects.image_urls.read_image_bytes`), hashes it, reads its size from its header and checks it
against the limits (``daskgen.images.max-per-prompt`` and ``daskgen.images.max-pixels``): a missing file, bytes
that are no image, too many images or too many pixels is an error naming the row and the image.  Decoding,
resizing and the model's processor run on the workers.  The check also gives the placeholder tokens each image
adds to its prompt's length (from the model's processor) and a digest of every image's hash in input order, which
the store's identity records, so a resume whose images changed is refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from daskgen import tunables
from daskgen.errors import InputError
from daskgen.images.processor import ImageProcessing
from daskgen.input.image_decoding import open_image, oriented_size
from daskgen.input.image_refs import image_refs, resolved
from daskgen.store.images import image_hash
from daskgen.store.objects.image_urls import read_image_bytes


class ImageCheck:
    """Checks the images of one input, row by row (see the module docstring).

    Parameters
    ----------
    processing:
        Called once, at the first image, for the model's :class:`ImageProcessing` (it raises
        :class:`~daskgen.errors.ConfigError` for a model without one).
    storage_options:
        The run's storage options, for images on object storage.
    base:
        The prompt file's folder (relative image paths are read from it), or ``None``.
    """

    def __init__(
        self,
        processing: Callable[[], ImageProcessing],
        storage_options: dict[str, Any] | None = None,
        base: Path | None = None,
    ) -> None:
        self._make_processing = processing
        self._processing: ImageProcessing | None = None
        self.storage_options, self.base = dict(storage_options or {}), base
        self.max_per_prompt = int(tunables.get("images.max-per-prompt"))
        self.max_pixels = int(tunables.get("images.max-pixels"))
        self._digest = hashlib.blake2b(digest_size=16)
        self.n_images = 0
        self.max_images = 0  # the most images one row has

    @property
    def processing(self) -> ImageProcessing:
        """The model's image processing (made at the first image)."""
        if self._processing is None:
            self._processing = self._make_processing()
        return self._processing

    def row(self, row: dict[str, Any]) -> tuple[list[str], int]:
        """The problems of the images of ``row`` (each naming the image) and the placeholder tokens they add to
        its prompt beyond one per image."""
        refs = image_refs(row)
        if not refs:
            return [], 0
        self.max_images = max(self.max_images, len(refs))
        errors, extra = [], 0
        if len(refs) > self.max_per_prompt:
            errors.append(
                f"{len(refs)} images, more than daskgen.images.max-per-prompt={self.max_per_prompt}; split the "
                "prompt or raise the setting (the model must take that many)"
            )
        for ref in refs:
            try:
                extra += self._image(resolved(ref.url, self.base)) - 1
            except InputError as exc:
                errors.append(f"{ref.where}: {exc}")
        return errors, extra

    def _image(self, url: str) -> int:
        """Check one image; its placeholder tokens."""
        data = read_image_bytes(url, self.storage_options)
        self._digest.update(image_hash(data).encode())
        self.n_images += 1
        image = open_image(data)
        try:
            image.verify()  # first after opening, as Pillow requires; it leaves the image unusable
        except Exception as exc:  # Pillow raises several types for a broken file
            raise InputError(f"image {url!r:.100} is damaged ({type(exc).__name__}: {exc})") from exc
        width, height = oriented_size(open_image(data))
        if width * height > self.max_pixels:
            raise InputError(
                f"image {url!r:.100} is {width}x{height} = {width * height} pixels, more than "
                f"daskgen.images.max-pixels={self.max_pixels}; resize it or raise the setting"
            )
        try:
            return self.processing.tokens_for(width, height)
        except InputError as exc:
            raise InputError(f"image {url!r:.100} {exc}") from exc

    def digest(self) -> str:
        """The digest of every image's hash in input order ("" when the input has no images)."""
        return f"blake2b:{self._digest.hexdigest()}:{self.n_images}" if self.n_images else ""
