"""Inputs of the image benchmarks: a vision model folder with a chosen pixel limit, distinct large images, prompts.

The model is the tiny seeded Qwen2-VL of :func:`daskgen.models.build_tiny_vl_model`, copied with its image
processor's ``max_pixels`` set when asked (a larger limit makes preprocessing heavier, as a production
Qwen2-VL's does).  The images are variants of the 2000x1500 JPEG of :mod:`daskgen.testing.images`, each with
its own mark, so their bytes and hashes differ while each costs as much to decode.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

QUESTION = "Describe the image in one word."


def vision_model(folder: Path, max_pixels: int) -> Path:
    """The tiny Qwen2-VL, or a copy of it in ``folder`` whose processor resizes to at most ``max_pixels`` pixels
    (``0``: the model as built, at most 448x448 pixels)."""
    from daskgen.models import build_tiny_vl_model

    source = Path(build_tiny_vl_model())
    if not max_pixels:
        return source
    target = folder / f"tiny-vl-max{max_pixels}"
    shutil.copytree(source, target)
    path = target / "preprocessor_config.json"
    config = json.loads(path.read_text())
    config["max_pixels"] = max_pixels
    config.setdefault("size", {})["longest_edge"] = max_pixels
    path.write_text(json.dumps(config, indent=2))
    return target


def sample_images(folder: Path) -> dict[str, Path]:
    """The sample images of :func:`daskgen.testing.images.sample_image_paths`, by name."""
    from daskgen.testing.images import sample_image_paths

    return sample_image_paths(folder)


def distinct_large_images(folder: Path, count: int) -> list[Path]:
    """``count`` JPEGs of 2000x1500 pixels: the sample ``large`` image, each with a mark of its own (distinct
    bytes, the same decoding work)."""
    from PIL import Image

    base = Image.open(sample_images(folder / "samples")["large"]).convert("RGB")
    out = []
    for i in range(count):
        image = base.copy()
        x, y = 40 + (i * 97) % 1800, 40 + (i * 53) % 1300
        image.paste((i * 37 % 256, i * 91 % 256, i * 151 % 256), (x, y, x + 120, y + 120))
        path = folder / f"large-{i:04d}.jpg"
        image.save(path, quality=90)
        out.append(path)
    return out


def write_prompts(path: Path, images: list[list[Path]]) -> Path:
    """A JSONL prompt file: one ``prompt`` row per entry of ``images``, naming those images."""
    rows: list[dict[str, Any]] = [
        {"id": f"q{i}", "prompt": f"{QUESTION} ({i})", "images": [str(p) for p in row]} for i, row in enumerate(images)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def folder_bytes(folder: Path) -> tuple[int, int]:
    """(files, bytes) of every file under ``folder``."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)
