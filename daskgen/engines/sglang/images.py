"""A request's images for sglang: the worker's preprocessed pixels, as one ``processor_output`` item.

daskgen's worker has run the model's image processor on each image and expanded its placeholder tokens in the
prompt ids (:class:`~daskgen.engines.media.ImageInput`: pixel values, grid, span).  sglang (tested with 0.5.23)
takes such a request as it is: given ``input_ids`` and an ``image_data`` list holding one dict with
``format: "processor_output"``, its multimodal processor keeps the ids it was given (no decoding, no second
expansion), neither loads nor resizes an image, and reads the pixel values, each image's grid and the
placeholder offsets from the dict; it computes the mRoPE positions from those ids and grids.  So sglang generates
from exactly the pixels and the expanded prompt the store records.  sglang takes one such item per request:
several images go in one item, their pixel rows concatenated in prompt order with one grid row each, and sglang
splits them by grid.

Some engine args leave sglang without its image path; :func:`images_refusal` names them, so the plan refuses an
image run with such args before any engine starts.  Heavy imports (torch) happen inside functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from daskgen.engines.media import ImageInput

__all__ = ["IMAGE_ARGS_OFF", "image_data", "images_refusal"]

#: Engine args under which sglang takes no images, each with the value that turns images off and why.
IMAGE_ARGS_OFF: dict[str, tuple[Any, str]] = {
    "enable_multimodal": (False, "turns sglang's multimodal processing off"),
    "language_model_only": (True, "loads the language model without its vision encoder"),
    "language_only": (True, "leaves the vision encoder to a separate encoder server"),
}


def images_refusal(engine_args: Mapping[str, Any]) -> dict[str, str]:
    """``{"images": reason}`` when ``engine_args`` turn sglang's image path off (:data:`IMAGE_ARGS_OFF`); else
    ``{}``."""
    off = [
        f"engine arg {name}={value!r} {why}"
        for name, (value, why) in IMAGE_ARGS_OFF.items()
        if name in engine_args and bool(engine_args[name]) == value
    ]
    if not off:
        return {}
    return {"images": "; ".join(off) + ": remove it to run prompts with images on the sglang engine"}


def image_data(images: Sequence[ImageInput]) -> list[dict[str, Any]]:
    """sglang's ``image_data`` for a request's ``images`` (in prompt order): one ``processor_output`` item with the
    concatenated ``pixel_values``, one ``image_grid_thw`` row per image and each image's placeholder ``offsets``
    (first and last token, inclusive, as sglang counts them) in the request's prompt ids."""
    import torch

    pixels = np.concatenate([np.asarray(image.pixel_values, dtype=np.float32) for image in images])
    return [
        {
            "format": "processor_output",
            "modality": "image",
            "pixel_values": torch.from_numpy(pixels),
            "image_grid_thw": torch.tensor([list(image.grid) for image in images], dtype=torch.long),
            "offsets": [(start, start + length - 1) for start, length in (image.span for image in images)],
        }
    ]
