"""How daskgen turns an image file into the RGB pixels a model's image processor gets (:data:`DECODING`).

One rule for every place that decodes an image: the client's scan (sizes, read from headers), the workers'
preprocessing, the engines that take decoded images (vLLM) and the trainer-side formats.  An image is turned as
its EXIF orientation says and an image with transparency is blended onto white.  Imports Pillow inside functions.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from daskgen.errors import InputError

__all__ = ["DECODING", "decoded_rgb", "open_image", "oriented_size", "rgb_png"]


def open_image(data: bytes) -> Any:
    """The Pillow image of ``data`` (not decoded yet); :class:`InputError` when it is no image Pillow reads."""
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:  # its header names more pixels than Pillow opens
        raise InputError(f"too large for Pillow to open ({exc}); resize it") from exc
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InputError(f"not an image Pillow can read ({type(exc).__name__}: {exc})") from exc


#: How daskgen turns an image file into the RGB pixels the processor gets; part of the processor's identity, so a
#: store made under another rule is not resumed with this one.
DECODING = "exif-orientation; alpha over white"


def orientation(image: Any) -> int:
    """The EXIF orientation of a Pillow image (1, as stored, when it has none or its EXIF block is damaged)."""
    try:
        value = image.getexif().get(0x0112, 1)
    except Exception:  # a damaged EXIF block: the image is shown as stored
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def oriented_size(image: Any) -> tuple[int, int]:
    """``(width, height)`` of a Pillow image as it is shown: swapped when its EXIF orientation turns it a quarter
    (read from the header, without decoding)."""
    width, height = image.size
    return (height, width) if orientation(image) >= 5 else (width, height)


def decoded_rgb(data: bytes) -> Any:
    """``data`` decoded into an RGB Pillow image (:data:`DECODING`); :class:`InputError` when it cannot be decoded.

    The image is turned as its EXIF orientation says (as a viewer shows it, and as transformers' ``load_image``
    loads it), and an image with transparency is blended onto white, as transformers' image processors blend one
    they are given (text drawn on a transparent background stays readable).
    """
    from PIL import Image

    turns = {
        2: Image.Transpose.FLIP_LEFT_RIGHT,
        3: Image.Transpose.ROTATE_180,
        4: Image.Transpose.FLIP_TOP_BOTTOM,
        5: Image.Transpose.TRANSPOSE,
        6: Image.Transpose.ROTATE_270,
        7: Image.Transpose.TRANSVERSE,
        8: Image.Transpose.ROTATE_90,
    }
    try:
        image = open_image(data)
        turn = turns.get(orientation(image))
        image.load()
        if turn is not None:
            image = image.transpose(turn)
        if image.mode == "RGB":
            return image
        rgba = np.asarray(image.convert("RGBA"), dtype=np.float64)
        alpha = rgba[..., 3:4] / 255.0
        blended = np.round(alpha * rgba[..., :3] + (1.0 - alpha) * 255.0).astype(np.uint8)
        return Image.fromarray(blended, "RGB")
    except (OSError, ValueError, SyntaxError) as exc:
        raise InputError(f"the image cannot be decoded ({type(exc).__name__}: {exc})") from exc


def rgb_png(data: bytes) -> bytes:
    """``data`` decoded by :data:`DECODING` and encoded as PNG (lossless): an image a server that decodes files its
    own way reads as exactly the pixels the worker's processor got."""
    out = io.BytesIO()
    decoded_rgb(data).save(out, "PNG")
    return out.getvalue()
