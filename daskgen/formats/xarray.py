"""xarray: rows of a store as an ``xarray.Dataset`` over ``prompt`` (``format="xarray"``), unflattened.

The dataset has the store's dimension names, the arrays read (kept input columns as ``column_<name>``) and the
``prompt_index``/``prompt_id`` coordinates: a slice of what :func:`daskgen.open_store` shows of the whole store.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from daskgen.formats.read import dims_of, strings
from daskgen.store.generation_store import GenerationStore


def to_dataset(store: GenerationStore, rows: np.ndarray, prompt_ids: np.ndarray, data: dict[str, np.ndarray]) -> Any:
    """The arrays ``data`` read for ``rows`` as an ``xarray.Dataset`` with the store's dimensions and coordinates."""
    import xarray as xr

    specs = store.layout.array_specs()
    variables = {name: (dims_of(specs, name), values) for name, values in data.items()}
    coords = {"prompt_index": ("prompt", rows.astype(np.int64)), "prompt_id": ("prompt", strings(prompt_ids))}
    return xr.Dataset(variables, coords=coords)
