"""verl's multi-modal fields of a batch, built from the store's images: ``multi_modal_data`` and
``multi_modal_inputs``.

verl keeps per sample, in ``non_tensor_batch``, ``multi_modal_data`` (``{"images": [PIL images]}``, the images
in the order the prompt shows them) and ``multi_modal_inputs`` (``pixel_values``: the image processor's patches
of the sample's images, concatenated; ``image_grid_thw``: one (t, h, w) row per image; ``images_seqlens``: the
patches of each frame).  :class:`StoreImages` builds both from the images a store holds, by hash: each distinct
image is read once (and checked against its hash), decoded once and run through the model's image processor
once, and kept (the ``daskgen.images.cache-items`` tunable: how many); the samples of a prompt, and prompts with
the same images, share one dict of each, holding the same image objects and tensors.  A sample without images
has ``{}`` in both.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from daskgen import tunables
from daskgen.errors import StoreMismatchError
from daskgen.formats.images import MULTI_MODAL_FIELDS, sample_images
from daskgen.store.generation_store import GenerationStore
from daskgen.store.images import image_bytes


class StoreImages:
    """The images of ``store`` as verl's multi-modal fields (see the module docstring).

    Parameters
    ----------
    store:
        The store whose images are read.
    model:
        The model folder whose image processor makes ``pixel_values`` (default: the run's model, as the store
        records it); its processor's class and settings must be those the run recorded.
    keep:
        How many images (and groups of a prompt's images) to keep (default: ``daskgen.images.cache-items``).
    """

    def __init__(
        self, store: GenerationStore, model: str | None = None, *, trust_remote_code: bool = False, keep: int = 0
    ) -> None:
        self.location = store.location
        self.model = str(model or store.attrs.identity.get("model", ""))
        self.recorded = dict(store.attrs.input.get("image_processor") or {})
        self.trust_remote_code = trust_remote_code
        self.keep = keep or int(tunables.get("images.cache-items"))
        self._processing: Any = None
        self._images: OrderedDict[str, tuple[Any, Any, tuple[int, int, int]]] = OrderedDict()
        self._groups: OrderedDict[tuple[str, ...], tuple[dict[str, Any], dict[str, Any]]] = OrderedDict()
        self.processed = 0  # images run through the processor (each distinct image once while kept)

    def image(self, digest: str) -> Any:
        """The stored image ``digest`` as an RGB Pillow image (read once, checked against its hash)."""
        return self._image(digest)[0]

    def pixels(self, digest: str) -> tuple[Any, tuple[int, int, int]]:
        """The processor's ``pixel_values`` of the stored image ``digest`` (a torch tensor) and its grid."""
        _, pixels, grid = self._image(digest)
        return pixels, grid

    @property
    def processing(self) -> Any:
        """The model's image processing, checked against the one the run recorded."""
        if self._processing is None:
            from daskgen.images.processor import ImageProcessing
            from daskgen.input.image_decoding import DECODING

            processing = ImageProcessing(self.model, trust_remote_code=self.trust_remote_code)
            found, recorded = processing.identity(), self.recorded
            if recorded and recorded.get("decoding") != DECODING:
                raise StoreMismatchError(
                    f"the run decoded its images by {recorded.get('decoding', 'an earlier rule')!r}, this daskgen "
                    f"by {DECODING!r}: pixel values made here would not be what the model saw. Read the store "
                    "with the daskgen version that wrote it."
                )
            if recorded and [found.get(k) for k in ("class", "settings")] != [
                recorded.get(k) for k in ("class", "settings")
            ]:
                raise StoreMismatchError(
                    f"the image processor of {self.model!r} ({found.get('class')}) is not the one the run used "
                    f"({recorded.get('class')}, settings {recorded.get('settings')}): its pixel values would not be "
                    "what the model saw. Pass the run's model folder (image_model=PATH)."
                )
            self._processing = processing
        return self._processing

    def _image(self, digest: str) -> tuple[Any, Any, tuple[int, int, int]]:
        """The image ``digest`` decoded, and its pixel values and grid: made once while kept."""
        return _kept(self._images, digest, self.keep, lambda: self._made(digest))

    def _made(self, digest: str) -> tuple[Any, Any, tuple[int, int, int]]:
        import torch

        from daskgen.input.image_decoding import decoded_rgb

        processing = self.processing  # loaded (and checked) before any image is read
        data = image_bytes(self.location, digest)
        out = processing.process(data)
        self.processed += 1
        return decoded_rgb(data), torch.from_numpy(np.ascontiguousarray(out.pixel_values)), out.grid

    def multi_modal(self, hashes: np.ndarray, grids: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """``multi_modal_data`` and ``multi_modal_inputs`` (object arrays, one dict per row) of rows whose images
        are ``hashes`` (``(rows, max_images)`` strings, ``""``: an empty slot); ``grids`` (``(rows, max_images,
        3)``), when given, must equal the processor's grids (:class:`StoreMismatchError` otherwise)."""
        data = np.empty(len(hashes), dtype=object)
        inputs = np.empty(len(hashes), dtype=object)
        for i, row in enumerate(np.asarray(hashes, dtype=object)):
            key = tuple(str(h) for h in row if str(h))
            data[i], inputs[i] = _kept(self._groups, key, self.keep, lambda key=key: self._group(key))
            if grids is not None and key:
                stored = [tuple(int(v) for v in g) for g in np.asarray(grids[i])[: len(key)]]
                made = [tuple(int(v) for v in g) for g in inputs[i]["image_grid_thw"].tolist()]
                if stored != made:
                    raise StoreMismatchError(
                        f"row {i} of the batch: the image processor of {self.model!r} makes grids {made} of the "
                        f"images {list(key)}, the store records {stored}; pass the run's model (image_model=PATH)."
                    )
        return dict(zip(MULTI_MODAL_FIELDS, (data, inputs), strict=True))

    def _group(self, key: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The two dicts of a prompt whose images are ``key`` (``{}``, ``{}`` without images)."""
        if not key:
            return {}, {}
        import torch

        made = [self.pixels(digest) for digest in key]
        pixels = made[0][0] if len(made) == 1 else torch.cat([p for p, _ in made])
        grid = torch.tensor([g for _, g in made], dtype=torch.int64)
        seqlens = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
        images = [self.image(digest) for digest in key]
        return {"images": images}, {"pixel_values": pixels, "image_grid_thw": grid, "images_seqlens": seqlens}

    def fields(self, block: Any) -> dict[str, np.ndarray]:
        """:meth:`multi_modal` of a block's samples: every image of each, the prompt's then its tools'
        (:func:`~daskgen.formats.images.sample_images`); ``{}`` without images."""
        found = sample_images(block)
        if found is None:
            return {}
        return self.multi_modal(*found)


def _kept(cache: OrderedDict[Any, Any], key: Any, keep: int, make: Any) -> Any:
    """``cache[key]``, made with ``make()`` when missing; the ``keep`` most recently used entries are kept."""
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    value = cache[key] = make()
    while len(cache) > keep:
        cache.popitem(last=False)
    return value
