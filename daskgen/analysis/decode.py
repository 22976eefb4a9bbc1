"""Turning stored token ids back into text, and reading the input's raw prompts."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import xarray as xr


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
        while target is not None and target == number:
            yield json.dumps(row["messages"] if row.get("messages") is not None else row["prompt"], ensure_ascii=False)
            target = next(wanted, None)
        if target is None:
            return


def decode_prompts(tokenizer: Any, sub: xr.Dataset, skip_special_tokens: bool = True) -> list[str]:
    """Decoded prompt of each row of a computed block (``prompt_ids`` cut at ``prompt_length``)."""
    ids, lengths = sub["prompt_ids"].values, sub["prompt_length"].values
    return decode_many(tokenizer, [row[:n] for row, n in zip(ids, lengths, strict=True)], skip_special_tokens)
