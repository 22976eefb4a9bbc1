"""Images on a worker: each image of a partition's rows read, stored once, preprocessed, and placed in its prompt.

For each image URL a row names (checked by the client's scan), the worker reads the bytes and keeps the image in
the store under their hash, as its bytes or as a reference to the URL (the run's ``image_storage``), unless this
process or another already did (:mod:`daskgen.store.images`), and runs the
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
from daskgen.images.processor import ImageProcessing, ProcessedImage
from daskgen.input.image_tokens import VisionTokens, expand, mrope_delta
from daskgen.store.images import COPY, image_hash, keep_image
from daskgen.store.objects.image_urls import read_image_bytes


@dataclass(frozen=True)
class RowImages:
    """One row's images, placed in its expanded prompt, and the row's mRoPE position offset."""

    images: tuple[ImageInput, ...]
    rope_delta: int


@dataclass
class ImageCounters:
    """What this worker's preprocessing did: images processed and their seconds, cache hits, images stored, and
    how long partitions waited for their images before their requests could go to the engine."""

    processed: int = 0
    seconds: float = 0.0
    cache_hits: int = 0
    stored: int = 0
    wait_s: float = 0.0


#: The Dask resource of a worker that preprocesses images for the engine workers and runs no engine itself.
PREPROCESS_RESOURCE = "daskgen-preprocess"
#: This process's preparers (one per model), whose counters :func:`image_metrics` sums.
_PREPARERS: list[ImagePreparer] = []


class ImagePreparer:
    """A worker process's image preprocessing for one model (see the module docstring)."""

    def __init__(self, model: str, trust_remote_code: bool = False) -> None:
        self.model, self.trust_remote_code = model, trust_remote_code
        self._processing: ImageProcessing | None = None
        self._lock, self._store_lock = threading.Lock(), threading.Lock()
        self._cache: OrderedDict[str, ProcessedImage] = OrderedDict()
        self._running: dict[str, threading.Event] = {}  # images being processed, by hash
        self._stored: set[tuple[str, str, str]] = set()  # (store, image, form) this process stored or found stored
        self._pool = ThreadPoolExecutor(int(tunables.get("images.preprocess-threads")), "daskgen-images")
        self.counters = ImageCounters()
        _PREPARERS.append(self)

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
        self,
        inputs: Sequence[dict[str, Any]],
        prompts: list[list[int]],
        location: Any,
        given: Any = None,
        storage: str = COPY,
        numbers: Sequence[int] | None = None,
    ) -> tuple[list[list[int]], list[RowImages | None]]:
        """The rows' prompts with their images' placeholders expanded, and each row's images (``None``: none);
        ``location`` is the store's (images are kept there, as ``storage`` asks: ``"copy"`` or ``"reference"``);
        ``given``: each row's images as a preprocessing worker returned them (:func:`preprocess_images`), instead
        of preparing them here; ``numbers``: the rows' indices in the input, for errors (default: from 0)."""
        loop, t0 = asyncio.get_running_loop(), time.perf_counter()
        if given is not None:
            jobs = [[_done(loop, image) for image in row] for row in given]
        else:
            options = dict(getattr(location, "storage_options", {}) or {})
            urls = [row.get("image_urls", ()) for row in inputs]
            image = functools.partial(self._image, location=location, options=options, storage=storage)
            jobs = [[loop.run_in_executor(self._pool, image, url) for url in u] for u in urls]
        out_prompts: list[list[int]] = []
        out_images: list[RowImages | None] = []
        numbers = range(len(prompts)) if numbers is None else numbers
        for number, ids, row_jobs in zip(numbers, prompts, jobs, strict=True):
            if not row_jobs:
                out_prompts.append(ids)
                out_images.append(None)
                continue
            images = [await job for job in row_jobs]
            expanded, row_images = self._placed(ids, images, number)
            out_prompts.append(expanded)
            out_images.append(row_images)
        self.counters.wait_s += time.perf_counter() - t0
        return out_prompts, out_images

    def _placed(self, ids: list[int], images: list[tuple[str, bytes, ProcessedImage]], number: int) -> tuple:
        """``ids`` expanded for ``images`` and the row's :class:`RowImages`."""
        try:
            expanded, spans = expand(ids, self.vision.image, [p.tokens for _, _, p in images])
        except ValueError as exc:
            raise InputError(f"row {number}: {exc}") from exc
        inputs = tuple(
            ImageInput(digest, data, p.pixel_values, p.grid, span, IMAGE)
            for (digest, data, p), span in zip(images, spans, strict=True)
        )
        return expanded, RowImages(inputs, mrope_delta([p.grid for _, _, p in images], self.processing.merge))

    def _image(
        self, url: str, location: Any, options: dict[str, Any], storage: str = COPY
    ) -> tuple[str, bytes, ProcessedImage]:
        """Read, keep in the store (as ``storage`` asks) and preprocess one image (blocking; in the pool)."""
        return self.kept_and_processed(read_image_bytes(url, options), url, location, storage)

    def kept_and_processed(
        self, data: bytes, url: str, location: Any, storage: str = COPY
    ) -> tuple[str, bytes, ProcessedImage]:
        """Keep the image ``data`` (read from ``url``; ``data:`` for bytes without one) in the store as ``storage``
        asks, unless this process did, and preprocess it (cached by hash); blocking.  Returns its hash, bytes and
        processed form."""
        digest = image_hash(data)
        with self._store_lock:  # one writer per process (its temporary file is named by the process)
            if (location.url, digest, storage) not in self._stored:
                if keep_image(location, digest, data, url, storage):
                    self.counters.stored += 1
                self._stored.add((location.url, digest, storage))
        processed = self._processed(digest, data, url)
        return digest, data, processed

    async def in_pool(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in this preparer's thread pool (never on the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _processed(self, digest: str, data: bytes, url: str) -> ProcessedImage:
        """The image ``digest`` preprocessed: from the cache, or by the one thread processing it (single flight)."""
        while True:
            with self._lock:
                cached = self._cache.get(digest)
                if cached is not None:
                    self._cache.move_to_end(digest)
                    self.counters.cache_hits += 1
                    return cached
                running = self._running.get(digest)
                if running is None:
                    self._running[digest] = threading.Event()
                    break
            running.wait()  # another thread processes it; then it is cached (or that thread failed: try again)
        try:
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
            return processed
        finally:
            with self._lock:
                self._running.pop(digest).set()

    def preprocess(
        self, urls: Sequence[Sequence[str]], location: Any, storage: str = COPY
    ) -> list[list[tuple[str, bytes, ProcessedImage]]]:
        """Each row's images read, kept in the store (as ``storage`` asks) and preprocessed (blocking; the images
        of all rows at once in the pool)."""
        options = dict(getattr(location, "storage_options", {}) or {})
        t0 = time.perf_counter()
        jobs = [[self._pool.submit(self._image, url, location, options, storage) for url in row] for row in urls]
        out = [[job.result() for job in row] for row in jobs]
        self.counters.wait_s += time.perf_counter() - t0
        return out


def _done(loop: asyncio.AbstractEventLoop, value: Any) -> asyncio.Future:
    future = loop.create_future()
    future.set_result(value)
    return future


def preprocess_images(
    store: Any, model: str, trust_remote_code: bool, urls: list[list[str]], storage: str = COPY
) -> list[list[tuple[str, bytes, ProcessedImage]]]:
    """Dask task of a preprocessing worker (one with the :data:`PREPROCESS_RESOURCE`): each row's images of one
    partition read, kept in ``store`` (as ``storage`` asks) and preprocessed, for the engine worker that generates
    the partition."""
    return preparer(model, trust_remote_code).preprocess(urls, store.location, storage)


@functools.cache
def preparer(model: str, trust_remote_code: bool = False) -> ImagePreparer:
    """This process's :class:`ImagePreparer` for ``model`` (one per model and process)."""
    return ImagePreparer(model, trust_remote_code)


def image_metrics() -> dict[str, float]:
    """This process's image preprocessing for the dashboard (nothing when no partition named images): images
    preprocessed, their preprocessing seconds, and the seconds partitions waited for their images."""
    if not _PREPARERS:
        return {}
    counters = [p.counters for p in _PREPARERS]
    return {
        "images": sum(c.processed for c in counters),
        "image_seconds": sum(c.seconds for c in counters),
        "image_wait_s": sum(c.wait_s for c in counters),
    }


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
