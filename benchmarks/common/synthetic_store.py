"""A synthetic daskgen store: the layout a run creates, its done partitions filled with random data.

Made without generating anything (``pack.py``, ``export.py`` and ``follow.py`` build theirs with
:func:`build_store`, from parsed arguments with ``prompts``, ``n_samples``, ``max_prompt_tokens``,
``max_new_tokens``, ``partition_size``, ``length_mean`` and ``done_fraction``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

#: The synthetic store of ``export.py`` and ``follow.py``: 4 samples of up to 256 tokens, every partition done.
DEFAULTS = {
    "n_samples": 4,
    "max_new_tokens": 256,
    "max_prompt_tokens": 256,
    "length_mean": 120.0,
    "partition_size": 64,
    "done_fraction": 1.0,
}


def build_store(a: argparse.Namespace, path: Path) -> dict[str, Any]:
    """Create a store of ``a.prompts`` rows and fill the done partitions' data arrays."""
    import zarr

    from daskgen import store

    layout = store.Layout(a.prompts, a.n_samples, a.max_prompt_tokens, a.max_new_tokens, a.partition_size, 0)
    attrs = {
        "identity": {"model": "bench-pack", "engine": "simulated"},
        "input": {"n_prompts": a.prompts},
        "simulated": True,
    }
    t0 = time.perf_counter()
    store.GenerationStore.create(path, store.StoreAttrs(layout, **attrs), [f"r{i}" for i in range(a.prompts)])
    rng = np.random.default_rng(0)
    n_parts = -(-a.prompts // a.partition_size)
    done = rng.random(n_parts) < a.done_fraction
    status = np.repeat(done.astype("int8"), a.partition_size)[: a.prompts]
    arrays = {name: zarr.open_array(str(path), path=name, mode="r+") for name in layout.data_arrays()}
    block = a.partition_size * max(1, 8192 // a.partition_size)
    for start in range(0, a.prompts, block):
        stop = min(start + block, a.prompts)
        rows = np.flatnonzero(status[start:stop]) + start
        if not len(rows):
            continue
        for name, values in partition_data(rng, a, stop - start).items():
            keep = np.zeros(stop - start, dtype=bool)
            keep[rows - start] = True
            fill = arrays[name].fill_value
            values[~keep] = fill  # pending rows stay at the fill value (their chunks are not written)
            arrays[name][start:stop] = values
    zarr.open_array(str(path), path="status", mode="r+")[:] = status
    zarr.open_array(str(path), path="committed_at", mode="r+")[:] = np.where(status == 1, time.time(), np.nan)
    return {"seconds": time.perf_counter() - t0, "done_rows": int(status.sum()), "partitions": n_parts}


def partition_data(rng: np.random.Generator, a: argparse.Namespace, n: int) -> dict[str, np.ndarray]:
    """Random data arrays of ``n`` rows as a run writes them (lognormal lengths; log-probabilities NaN)."""
    s, r, p = a.n_samples, a.max_new_tokens, a.max_prompt_tokens
    lengths = np.clip(rng.lognormal(np.log(a.length_mean), 0.8, size=(n, s)), 1, r).astype("int32")
    positions = np.arange(r)
    mask = positions[None, None, :] < lengths[..., None]
    ids = np.where(mask, rng.integers(1, 32000, size=(n, s, r), dtype="int32"), 0).astype("int32")
    plen = rng.integers(8, p, size=n).astype("int32")
    prompt_ids = np.where(np.arange(p)[None, :] < plen[:, None], rng.integers(1, 32000, size=(n, p)), 0)
    return {
        "prompt_ids": prompt_ids.astype("int32"),
        "prompt_length": plen,
        "response_ids": ids,
        "response_length": lengths,
        "response_mask": mask.astype("uint8"),
        "logprobs": np.full((n, s, r), np.nan, "float32"),
        "finish_reason": np.where(lengths == r, 1, 0).astype("int8"),
        "num_turns": np.ones((n, s), "int16"),
    }


def files_and_bytes(path: Path) -> tuple[int, int]:
    """Files and their bytes under ``path``."""
    sizes = [p.stat().st_size for p in path.rglob("*") if p.is_file()]
    return len(sizes), sum(sizes)
