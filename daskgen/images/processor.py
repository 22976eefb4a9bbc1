"""The model's image processor: how many placeholder tokens an image takes, and its pixel values.

:class:`ImageProcessing` loads the processor from the model folder (transformers' ``AutoImageProcessor``) and
answers for the client's scan (:meth:`~ImageProcessing.tokens_for`: the placeholder count from the image's size,
without decoding it) and for the workers (:meth:`~ImageProcessing.process`: decode, resize, normalize).  Its
:meth:`~ImageProcessing.identity` (class, settings, transformers version, :data:`DECODING`) is part of the store's
identity, so a resume with other preprocessing is refused.  Importing this module imports neither Pillow nor
transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from daskgen.errors import ConfigError, InputError
from daskgen.input.image_decoding import DECODING, decoded_rgb
from daskgen.input.image_tokens import VisionTokens


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the model takes it: ``pixel_values`` (the processor's patches), its ``grid`` (t, h, w patches)
    and the number of placeholder ``tokens`` it expands to in the prompt."""

    pixel_values: np.ndarray
    grid: tuple[int, int, int]
    tokens: int


class ImageProcessing:
    """The image processor of the model folder ``model`` (raises :class:`ConfigError` when it has none)."""

    def __init__(self, model: str, trust_remote_code: bool = False) -> None:
        import transformers
        from transformers import AutoImageProcessor

        try:
            self.processor = AutoImageProcessor.from_pretrained(model, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(
                f"model {model!r} has no image processor ({type(exc).__name__}: {exc}); rows with images need a "
                "vision-language model folder (with preprocessor_config.json), such as Qwen2-VL's, or "
                "`daskgen models tiny-vl` for tests."
            ) from exc
        if "image_grid_thw" not in (getattr(self.processor, "model_input_names", None) or ()):
            raise ConfigError(
                f"model {model!r} has an image processor ({type(self.processor).__name__}) that gives no patch grid "
                "per image (image_grid_thw): daskgen places images for vision-language models whose processor "
                "gives one, as Qwen2-VL's does; run this model's image rows with another tool, or its text-only "
                "rows here."
            )
        self.merge = int(getattr(self.processor, "merge_size", 1) or 1)
        self._version = transformers.__version__
        tokens = VisionTokens.of(transformers.AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code))
        if tokens is None:
            raise ConfigError(
                f"model {model!r} has an image processor but its config names no image placeholder token "
                "(image_token_id); rows with images need a vision-language model such as Qwen2-VL."
            )
        self.tokens = tokens

    def identity(self) -> dict[str, Any]:
        """What a resume must share: the processor's class, settings and the transformers version."""
        settings = json.loads(json.dumps(self.processor.to_dict(), sort_keys=True, default=str))
        return {
            "class": type(self.processor).__name__,
            "settings": settings,
            "transformers": self._version,
            "decoding": DECODING,
        }

    def tokens_for(self, width: int, height: int) -> int:
        """Placeholder tokens of an image of ``width`` x ``height`` pixels (after the processor's resizing);
        :class:`InputError` naming the processor's reason when it refuses such an image."""
        counter = getattr(self.processor, "get_number_of_image_patches", None)
        try:
            if counter is not None:
                return int(counter(height, width, {})) // (self.merge * self.merge)
        except ValueError as exc:
            raise self._refused(width, height, exc) from exc
        from PIL import Image

        return self._processed(Image.new("RGB", (width, height))).tokens

    def process(self, data: bytes) -> ProcessedImage:
        """Decode ``data`` and run the processor on it (CPU; blocking)."""
        return self._processed(decoded_rgb(data))

    def _refused(self, width: int, height: int, exc: Exception) -> InputError:
        return InputError(
            f"is {width}x{height} pixels, which the model's image processor ({type(self.processor).__name__}) "
            f"refuses: {exc}; crop, pad or resize the image"
        )

    def _processed(self, image: Any) -> ProcessedImage:
        try:
            out = self.processor(images=[image], return_tensors="np")
        except ValueError as exc:
            width, height = image.size
            raise self._refused(width, height, exc) from exc
        grid = tuple(int(v) for v in np.asarray(out["image_grid_thw"])[0])
        pixels = np.asarray(out["pixel_values"], dtype=np.float32)
        t, h, w = grid
        return ProcessedImage(pixels, (t, h, w), (t * h * w) // (self.merge * self.merge))
