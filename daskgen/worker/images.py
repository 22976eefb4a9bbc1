"""Images on a worker: each image of a partition's rows read, stored once, preprocessed, and placed in its prompt.

For each image URL a row names (checked by the client's scan), the worker reads the bytes, stores them in the
store under their hash unless this process or another already did (:mod:`daskgen.store.images`), and runs the
model's image processor on them (:class:`~daskgen.images.processor.ImageProcessing`) in a small thread pool
(``daskgen.images.preprocess-threads``), never on the worker's event loop.  Processed images are kept by hash
(``daskgen.images.cache-items``), so a prompt's samples, prompts sharing an image and retried partitions
process it once; every sample of a prompt shares one :class:`~daskgen.engines.media.ImageInput`.  The row's
placeholder tokens are then expanded (:func:`daskgen.input.image_tokens.expand`) and each image's span recorded.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from daskgen import tunables
from daskgen.engines.media import IMAGE, ImageInput
from daskgen.errors import InputError
from daskgen.images.fetch import read_image_bytes
from daskgen.images.processor import ImageProcessing, ProcessedImage
from daskgen.input.image_tokens import VisionTokens, expand, mrope_delta
from daskgen.store.images import image_hash, write_blob


@dataclass(frozen=True)
class RowImages:
    """One row's images, placed in its expanded prompt, and the row's mRoPE position offset."""

    images: tuple[ImageInput, ...]
    rope_delta: int


@dataclass
class ImageCounters:
    """What this worker's preprocessing did: images processed and their seconds, cache hits, images stored."""

    processed: int = 0
    seconds: float = 0.0
    cache_hits: int = 0
    stored: int = 0


class ImagePreparer:
    """A worker process's image preprocessing for one model (see the module docstring)."""

    def __init__(self, model: str, trust_remote_code: bool = False) -> None:
        self.model, self.trust_remote_code = model, trust_remote_code
        self._processing: ImageProcessing | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, ProcessedImage] = OrderedDict()
        self._stored: set[str] = set()
        self._pool = ThreadPoolExecutor(int(tunables.get("images.preprocess-threads")), "daskgen-images")
        self.counters = ImageCounters()

    @property
    def processing(self) -> ImageProcessing:
        """The model's image processing (loaded once)."""
        with self._lock:
            if self._processing is None:
                self._processing = ImageProcessing(self.model, self.trust_remote_code)
            return self._processing

    @property
    def vision(self) -> VisionTokens:
        """The model's image tokens."""
        return self.processing.tokens

    async def prepare(
        self, inputs: Sequence[dict[str, Any]], prompts: list[list[int]], location: Any
    ) -> tuple[list[list[int]], list[RowImages | None]]:
        """The rows' prompts with their images' placeholders expanded, and each row's images (``None``: none);
        ``location`` is the store's (images are stored there)."""
        options = dict(getattr(location, "storage_options", {}) or {})
        loop = asyncio.get_running_loop()
        jobs = [
            [loop.run_in_executor(self._pool, self._image, url, location, options) for url in row.get("image_urls", ())]
            for row in inputs
        ]
        out_prompts: list[list[int]] = []
        out_images: list[RowImages | None] = []
        for number, (ids, row_jobs) in enumerate(zip(prompts, jobs, strict=True)):
            if not row_jobs:
                out_prompts.append(ids)
                out_images.append(None)
                continue
            images = [await job for job in row_jobs]
            expanded, row_images = self._placed(ids, images, number)
            out_prompts.append(expanded)
            out_images.append(row_images)
        return out_prompts, out_images

    def _placed(self, ids: list[int], images: list[tuple[str, bytes, ProcessedImage]], number: int) -> tuple:
        """``ids`` expanded for ``images`` and the row's :class:`RowImages`."""
        try:
            expanded, spans = expand(ids, self.vision.image, [p.tokens for _, _, p in images])
        except ValueError as exc:
            raise InputError(f"row {number + 1} of the partition: {exc}") from exc
        inputs = tuple(
            ImageInput(digest, data, p.pixel_values, p.grid, span, IMAGE)
            for (digest, data, p), span in zip(images, spans, strict=True)
        )
        return expanded, RowImages(inputs, mrope_delta([p.grid for _, _, p in images], self.processing.merge))

    def _image(self, url: str, location: Any, options: dict[str, Any]) -> tuple[str, bytes, ProcessedImage]:
        """Read, store and preprocess one image (blocking; in the pool)."""
        data = read_image_bytes(url, options)
        digest = image_hash(data)
        if digest not in self._stored:
            if write_blob(location, digest, data):
                self.counters.stored += 1
            self._stored.add(digest)
        with self._lock:
            cached = self._cache.get(digest)
            if cached is not None:
                self._cache.move_to_end(digest)
                self.counters.cache_hits += 1
                return digest, data, cached
        t0 = time.perf_counter()
        try:
            processed = self.processing.process(data)
        except InputError as exc:
            raise InputError(f"image {url!r:.100}: {exc}") from exc
        with self._lock:
            self.counters.processed += 1
            self.counters.seconds += time.perf_counter() - t0
            self._cache[digest] = processed
            while len(self._cache) > int(tunables.get("images.cache-items")):
                self._cache.popitem(last=False)
        return digest, data, processed


@functools.cache
def preparer(model: str, trust_remote_code: bool = False) -> ImagePreparer:
    """This process's :class:`ImagePreparer` for ``model`` (one per model and process)."""
    return ImagePreparer(model, trust_remote_code)


def place_images(region: dict[str, np.ndarray], offsets: list[int], rows: Sequence[RowImages | None]) -> None:
    """Write each row's images (hash, modality, span, grid) and mRoPE offset into the partition's region."""
    for r, row in zip(offsets, rows, strict=True):
        if row is None:
            continue
        for k, image in enumerate(row.images):
            region["image_hash"][r, k] = image.digest
            region["image_modality"][r, k] = image.modality
            region["image_offset"][r, k], region["image_length"][r, k] = image.span
            region["image_grid"][r, k] = image.grid
        region["rope_delta"][r] = row.rope_delta
