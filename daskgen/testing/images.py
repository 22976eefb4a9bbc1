"""Images for tests and the demo: photographs shipped inside an installed package, and generated patterns.

* :func:`bundled_image_paths` — image files that ship with matplotlib (``mpl-data/sample_data``): a
  photograph (JPEG) and a clip-art picture with an alpha channel (PNG).  Nothing is downloaded.
* :func:`write_generated_images` — deterministic numpy patterns of several sizes and formats (a
  2000x1500 JPEG, a 16x12 PNG smaller than one image patch, a very wide strip, ...), saved with Pillow.
* :func:`sample_image_paths` — both, by name.

matplotlib and Pillow are imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daskgen.errors import DaskgenError

if TYPE_CHECKING:
    import numpy as np

#: The bundled files by name: file name under matplotlib's ``sample_data`` and what it shows.
BUNDLED_IMAGES = {
    "grace_hopper": ("grace_hopper.jpg", "photograph of Grace Hopper, 512x600 RGB JPEG"),
    "present": ("Minduka_Present_Blue_Pack.png", "clip art of a blue present, 128x128 RGBA PNG"),
}

#: The generated images by name: (width, height, file suffix).
GENERATED_IMAGES = {
    "gradient": (320, 240, ".png"),
    "checkerboard": (640, 480, ".jpg"),
    "noise": (224, 224, ".png"),
    "large": (2000, 1500, ".jpg"),
    "tiny": (16, 12, ".png"),
    "wide": (1200, 60, ".png"),
}


def bundled_image_paths() -> dict[str, Path]:
    """The image files shipped with matplotlib, by name (see :data:`BUNDLED_IMAGES`).

    Returns
    -------
    dict[str, Path]
        ``{"grace_hopper": .../grace_hopper.jpg, "present": .../Minduka_Present_Blue_Pack.png}``.

    Raises
    ------
    DaskgenError
        If matplotlib is not installed, or its sample data lacks one of the files.
    """
    try:
        import matplotlib
    except ImportError as exc:
        raise DaskgenError(
            "the bundled sample images ship with matplotlib, which is not installed; "
            "install it with `pip install 'daskgen[analysis]'` (or `pip install matplotlib`)"
        ) from exc
    folder = Path(matplotlib.get_data_path()) / "sample_data"
    paths = {name: folder / file for name, (file, _) in BUNDLED_IMAGES.items()}
    missing = [str(path) for path in paths.values() if not path.is_file()]
    if missing:
        raise DaskgenError(
            f"matplotlib {matplotlib.__version__} lacks the sample images {missing}; "
            "reinstall matplotlib from a wheel that ships mpl-data/sample_data"
        )
    return paths


def _pattern(name: str, width: int, height: int) -> np.ndarray:
    """The RGB pixels (``height x width x 3``, uint8) of the generated image ``name``."""
    import numpy as np

    y, x = np.mgrid[0:height, 0:width]
    u, v = x / max(width - 1, 1), y / max(height - 1, 1)
    if name == "checkerboard":
        on = ((x // 40) + (y // 40)) % 2 == 1
        return np.where(on[..., None], np.array([220, 40, 40]), np.array([30, 30, 200])).astype(np.uint8)
    if name == "noise":
        return np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    if name == "large":  # rings over a gradient: detail at every scale the resize keeps
        rings = 0.5 + 0.5 * np.sin(np.hypot(x - width / 2, y - height / 2) / 12.0)
        return (255 * np.stack([u, rings, 1 - v], axis=-1)).astype(np.uint8)
    # gradient, tiny, wide: red grows left to right, green top to bottom, blue along the diagonal
    return (255 * np.stack([u, v, (u + v) / 2], axis=-1)).astype(np.uint8)


def write_generated_images(folder: str | Path, names: list[str] | None = None) -> dict[str, Path]:
    """Write the generated images into ``folder`` and return their paths by name.

    The pixels are a pure function of the name (the noise image uses a fixed seed), so the PNG files
    are the same bytes on every run; the JPEG files are the same with the same Pillow build.

    Parameters
    ----------
    folder:
        Output folder (created); files named ``<name><suffix>`` in it are overwritten.
    names:
        Which of :data:`GENERATED_IMAGES` to write; default all of them.

    Returns
    -------
    dict[str, Path]
        The written files by name.

    Raises
    ------
    DaskgenError
        If a name is not one of :data:`GENERATED_IMAGES`, or Pillow is not installed.
    """
    chosen = list(GENERATED_IMAGES) if names is None else names
    unknown = [name for name in chosen if name not in GENERATED_IMAGES]
    if unknown:
        raise DaskgenError(f"unknown generated images {unknown}; the names are {sorted(GENERATED_IMAGES)}")
    save = _pillow_saver()
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name in chosen:
        width, height, suffix = GENERATED_IMAGES[name]
        paths[name] = out / f"{name}{suffix}"
        save(_pattern(name, width, height), paths[name])
    return paths


def _pillow_saver() -> Callable[[np.ndarray, Path], None]:
    """A function saving an RGB array as the file its suffix names (JPEG at quality 90), with Pillow."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise DaskgenError(
            "writing the generated images needs Pillow, which is not installed; install it with `pip install pillow`"
        ) from exc

    def save(pixels: np.ndarray, path: Path) -> None:
        options: dict[str, Any] = {"quality": 90} if path.suffix == ".jpg" else {}
        Image.fromarray(pixels).save(path, **options)

    return save


def sample_image_paths(folder: str | Path) -> dict[str, Path]:
    """The bundled images and the generated ones (written into ``folder``), by name.

    Parameters
    ----------
    folder:
        Where :func:`write_generated_images` writes the generated images.

    Returns
    -------
    dict[str, Path]
        The names of :data:`BUNDLED_IMAGES` and :data:`GENERATED_IMAGES` with their files.
    """
    return {**bundled_image_paths(), **write_generated_images(folder)}
