"""What a follower delivers early versus over a whole run, per order (`benchmarks/follow.py --part order`)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


def follow_lengths(store: Path, order: str, window: int | None, batch: int, out: list, t0: float) -> None:
    """Follow ``store`` to its end; append per batch (seconds from ``t0``, mean response length, samples,
    seconds the window's head held prompts back before it)."""
    import daskgen

    cursor = f"{order}-{window or 0}"
    options = {"order": order, "window": window, "batch_prompts": batch, "cursor": cursor, "timeout": 900}
    with daskgen.follow(store, fields=("response_length", "finish_reason"), **options) as follower:
        for b in follower:
            lengths = b.data.response_length.values[b.data.finish_reason.values >= 0]
            out.append((time.time() - t0, float(lengths.mean()), lengths.size, b.head_wait))


def order_row(label: str, repeat: int, batches: list) -> list:
    """One table row: a follower's first-quarter and whole-run mean delivered length, and its head's wait."""
    quarter = batches[: max(1, len(batches) // 4)]
    first, whole = weighted_mean(quarter), weighted_mean(batches)
    waits = [b[3] for b in batches]
    return [label, repeat, len(batches), first, whole, first / whole, quarter[-1][0], sum(waits), max(waits)]


def input_row(store: Path, repeat: int, batch: int) -> list:
    """The reference row: the first 25 % of the prompts by input index, what strict input order delivers first."""
    import zarr

    lengths = np.asarray(zarr.open_array(str(store), path="response_length", mode="r")[:], float)
    generated = np.asarray(zarr.open_array(str(store), path="finish_reason", mode="r")[:]) >= 0
    quarter = max(1, -(-len(lengths) // batch) // 4) * batch
    first, whole = lengths[:quarter][generated[:quarter]].mean(), lengths[generated].mean()
    batches = -(-len(lengths) // batch)
    return ["input order (the first prompts by index)", repeat, batches, first, whole, first / whole, "—", "—", "—"]


def weighted_mean(batches: list) -> float:
    """The mean length over the samples of ``batches``."""
    return sum(b[1] * b[2] for b in batches) / sum(b[2] for b in batches)
