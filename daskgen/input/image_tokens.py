"""The placeholder tokens of images in a prompt: one token per image as the chat template renders it, expanded
to as many as the image's processed size asks for; where each image's span lies; and the position offset that
models with multimodal rotary positions (mRoPE) need.

One token space: the stored ``prompt_ids`` are the expanded ids the model saw, and each image's span
``(offset, length)`` indexes into them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VisionTokens:
    """The model's image placeholder token, and the tokens that open and close an image (``None``: none)."""

    image: int
    start: int | None = None
    end: int | None = None

    @classmethod
    def of(cls, config: Any) -> VisionTokens | None:
        """The tokens a model config names (Qwen-VL's ``image_token_id``, LLaVA's ``image_token_index``), or
        ``None`` for a model without them."""
        image = getattr(config, "image_token_id", None)
        if image is None:
            image = getattr(config, "image_token_index", None)
        if image is None:
            return None
        start, end = getattr(config, "vision_start_token_id", None), getattr(config, "vision_end_token_id", None)
        return cls(int(image), start, end)

    def block(self) -> list[int]:
        """One image as a ``prompt`` row's text is preceded by it: start, placeholder, end."""
        return [t for t in (self.start, self.image, self.end) if t is not None]


def prompt_with_images(text_ids: list[int], tokens: VisionTokens, n_images: int) -> list[int]:
    """A ``prompt`` row's ids: one image block per image, then its text."""
    return [t for _ in range(n_images) for t in tokens.block()] + list(text_ids)


def expand(ids: Sequence[int], image_token: int, counts: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """``ids`` with the ``i``-th placeholder repeated ``counts[i]`` times, and each image's span (offset, length)
    in the result.  :class:`ValueError` when the placeholders are not one per image."""
    found = sum(1 for t in ids if t == image_token)
    if found != len(counts):
        raise ValueError(
            f"the chat template rendered {found} image placeholder(s) (token {image_token}) for {len(counts)} "
            "image(s): the template must render each image content part as the model's image placeholder"
        )
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    for token in ids:
        if token == image_token:
            n = counts[len(spans)]
            spans.append((len(out), n))
            out.extend([image_token] * n)
        else:
            out.append(token)
    return out, spans


def mrope_delta(grids: Sequence[tuple[int, int, int]], merge: int) -> int:
    """How far an mRoPE model's positions after the images are from the token count: each image of ``t*h'*w'``
    tokens (``h' = h / merge``, ``w' = w / merge``) advances the positions by ``max(t, h', w')`` only.  A trainer
    adds it to the position of every token after the prompt's last image (what Qwen2-VL calls ``rope_deltas``)."""
    return sum(max(t, h // merge, w // merge) - t * (h // merge) * (w // merge) for t, h, w in grids)
