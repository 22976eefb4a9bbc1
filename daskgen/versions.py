"""Versions of the packages that shape a store's content (recorded in its attrs)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

PACKAGES = ("daskgen", "dask", "distributed", "zarr", "numcodecs", "xarray", "numpy", "torch", "transformers", "sglang")


def package_versions() -> dict[str, str]:
    """Installed versions of :data:`PACKAGES` (missing ones are left out)."""
    found = {}
    for name in PACKAGES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found
