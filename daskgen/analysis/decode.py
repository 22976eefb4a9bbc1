"""Turning stored token ids back into text and flat tables: finish labels, decoding, raw prompts."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from daskgen.engines.base import FinishReason
from daskgen.store.layout import TEXT_RECORDS, column_name

#: Labels of the ``finish_reason`` codes, indexed by ``code + 1`` (code -1: the sample was not generated).
FINISH_LABELS: tuple[str, ...] = ("not_generated", *(r.name.lower() for r in FinishReason))


def finish_labels(codes: Any) -> np.ndarray:
    """String labels (``stop``, ``length``, ``abort``, ``error``, ``not_generated``) of finish codes."""
    table = np.array([*FINISH_LABELS, "unknown"])
    idx = np.asarray(codes).astype(np.int64) + 1
    return table[np.where((idx >= 0) & (idx < len(FINISH_LABELS)), idx, len(FINISH_LABELS))]


def decode_many(tokenizer: Any, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
    """Decode token-id sequences to text (batched where the tokenizer supports it)."""
    seqs = [[int(t) for t in s] for s in sequences]
    batch = getattr(tokenizer, "batch_decode", None)
    if batch is not None:
        return list(batch(seqs, skip_special_tokens=skip_special_tokens))
    return [tokenizer.decode(s, skip_special_tokens=skip_special_tokens) for s in seqs]


def iter_raw_prompts(path: str | Path, rows: Iterable[int]) -> Iterator[str]:
    """Stream the JSON of the input's ``messages`` or ``prompt`` for the increasing 0-based ``rows``."""
    from daskgen.input.rows import iter_rows

    wanted = iter(rows)
    target = next(wanted, None)
    for number, row in iter_rows(Path(path)):
        while target is not None and target == number - 1:
            yield json.dumps(row["messages"] if row.get("messages") is not None else row["prompt"], ensure_ascii=False)
            target = next(wanted, None)
        if target is None:
            return


def decode_prompts(tokenizer: Any, sub: xr.Dataset, skip_special_tokens: bool = True) -> list[str]:
    """Decoded prompt of each row of a computed block (``prompt_ids`` cut at ``prompt_length``)."""
    ids, lengths = sub["prompt_ids"].values, sub["prompt_length"].values
    return decode_many(tokenizer, [row[:n] for row, n in zip(ids, lengths, strict=True)], skip_special_tokens)


def flatten_samples(sub: xr.Dataset) -> dict[str, np.ndarray]:
    """Numpy arrays with one entry per (prompt, sample[, trajectory]) of a computed block of rows.

    Per-sample variables are flattened, per-prompt ones (``prompt_ids``, ``prompt_length``,
    ``prompt_index``, ``prompt_id``) repeated; ``sample`` (and ``trajectory`` in schema-v2 stores)
    number the entries.  Only generated entries are kept (``finish_reason >= 0``): samples a verifier
    run never needed and padding trajectories are left out.  Needs ``finish_reason`` in ``sub``.
    """
    lead = ["prompt", "sample", "trajectory"][: 3 if "trajectory" in sub.dims else 2]
    variables = {}
    for name, var in sub.variables.items():
        ordered = var.transpose(*lead, ...) if set(lead) <= set(var.dims) else var
        variables[str(name)] = (ordered.dims, ordered.values)
    return flatten_arrays(variables, dict(sub.sizes))


def flatten_arrays(variables: dict[str, tuple[Any, np.ndarray]], sizes: dict[Any, int]) -> dict[str, np.ndarray]:
    """:func:`flatten_samples` of ``name -> (dims, values)`` (per-sample arrays with their dimensions ``prompt``,
    ``sample`` [, ``trajectory``] first) and the dimension ``sizes``: no copy of a per-sample array when every
    entry was generated."""
    n, s = sizes["prompt"], sizes["sample"]
    t = sizes.get("trajectory", 1)
    lead = ["prompt", "sample", "trajectory"][: 3 if "trajectory" in sizes else 2]
    out: dict[str, np.ndarray] = {}
    for name, (dims, values) in variables.items():
        flat = _flat_values(name, tuple(dims), values, lead, n * s * t, s * t)
        if flat is not None:
            out[name] = flat
    out |= _entry_numbers(n, s, t, "trajectory" in sizes)
    keep = out["finish_reason"] >= 0
    return out if keep.all() else {k: v[keep] for k, v in out.items()}


def text_fields(block: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The per-row text of a flattened block, by name (object arrays of ``str``): what the row asked for
    (:data:`~daskgen.store.layout.TEXT_RECORDS`: ``sampling``, ``response_format`` as JSON text, the ``adapter``
    name) and the input's kept columns by their own names.  Every export and ``daskgen.follow`` format adds these
    fields."""
    out = {}
    for key, values in block.items():
        name = key if key in TEXT_RECORDS else column_name(key)
        if name is not None:
            out[name] = np.array([str(v) for v in values], dtype=object)
    return out


def _flat_values(
    name: str, dims: tuple[Any, ...], values: np.ndarray, lead: list[str], entries: int, per_prompt: int
) -> np.ndarray | None:
    """One variable as one value per entry: per-sample ones flattened over ``lead``, per-prompt ones repeated
    ``per_prompt`` times; ``None`` for other variables (coordinates of other axes, ``num_trajectories``)."""
    if tuple(dims[: len(lead)]) == tuple(lead) and name != "num_trajectories":
        return values.reshape(entries, *values.shape[len(lead) :])
    if dims and dims[0] == "prompt" and "sample" not in dims:
        values = values.astype(object) if values.dtype.kind in "TUO" else values
        return np.repeat(values, per_prompt, axis=0)
    return None


def _entry_numbers(n: int, s: int, t: int, has_trajectories: bool) -> dict[str, np.ndarray]:
    """``sample`` (and ``trajectory``) numbers of the entries of ``n`` prompts x ``s`` samples x ``t`` trajectories."""
    numbers = {"sample": np.tile(np.repeat(np.arange(s), t), n)}
    if has_trajectories:
        numbers["trajectory"] = np.tile(np.arange(t), n * s)
    return numbers
