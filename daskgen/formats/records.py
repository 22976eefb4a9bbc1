"""Records: one dict per generated sample, fit for JSON (``daskgen export --format jsonl``, ``format="rows"``,
``daskgen follow --format jsonl``).

A record holds the columns of :mod:`daskgen.formats.arrow` (same keys, same order, same values) as Python values:
token lists cut to their lengths, the ``finish_reason`` label, ``None`` for a log-probability that was not recorded
(a tool token's).  Each column becomes Python objects in one ``tolist`` of its valid values, cut into per-sample
lists by offset; a prompt's token list is made once and copied for each of its samples.  The cyclic garbage
collector is paused while the records are built: they hold no cycles, and its passes over the growing heap would
cost more than building them.
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from daskgen.formats.block import EXTERNAL_FIELDS, Block
from daskgen.formats.finish import finish_labels
from daskgen.formats.images import image_lists
from daskgen.store.layout import NO_TOKEN, SAMPLE_NUMBERS, STALE_FIELD


def records(block: Block) -> list[dict[str, Any]]:
    """The block's samples as dicts fit for JSON (see the module docstring)."""
    with collector_paused():
        return _records(block)


def json_line(record: dict[str, Any]) -> str:
    """One record as a JSON line (no newline), its ``raw_prompt`` (when present) as the input's own JSON value."""
    if "raw_prompt" in record:
        record = record | {"raw_prompt": json.loads(record["raw_prompt"])}
    return json.dumps(record, ensure_ascii=False)


def write_jsonl(blocks: Iterable[Block], path: Path) -> int:
    """Write the blocks' records into one JSONL file; the rows written."""
    rows = 0
    with path.open("w", encoding="utf-8") as fh:
        for block in blocks:
            for record in records(block):
                fh.write(json_line(record) + "\n")
                rows += 1
    return rows


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (when it runs) while the block runs."""
    running = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if running:
            gc.enable()


def _records(block: Block) -> list[dict[str, Any]]:
    plen, rlen = block["prompt_length"], block["response_length"]
    columns: dict[str, list[Any]] = {
        "prompt_index": block["prompt_index"].tolist(),
        "prompt_id": [str(v) for v in block["prompt_id"]],
        **{name: block[name].tolist() for name in ("sample", "trajectory") if name in block},
        "finish_reason": finish_labels(block["finish_reason"]).tolist(),
        "num_turns": block["num_turns"].tolist(),
        "prompt_length": plen.tolist(),
        "response_length": rlen.tolist(),
        "prompt_ids": per_prompt_lists(block["prompt_ids"], plen, block["prompt_index"]),
        "response_ids": ragged_lists(block["response_ids"], rlen),
        "response_mask": _mask_lists(block, rlen),
    }
    columns |= {name: block[name].tolist() for name in SAMPLE_NUMBERS if name in block}
    if STALE_FIELD in block:  # a follower with max_staleness: the sample is too stale
        columns[STALE_FIELD] = block[STALE_FIELD].astype(bool).tolist()
    if block.logprobs:
        columns["logprobs"] = ragged_lists(block["logprobs"], rlen, nan_as_none=True)
    if "top_logprobs" in block:
        columns |= _top_lists(block)
    columns |= image_lists(block)
    columns |= {name: [str(v) for v in block[name]] for name in EXTERNAL_FIELDS if name in block}
    columns |= {name: values.tolist() for name, values in block.texts().items()}
    keys = list(columns)
    return [dict(zip(keys, values, strict=True)) for values in zip(*columns.values(), strict=True)]


def ragged_lists(values: np.ndarray, lengths: np.ndarray, nan_as_none: bool = False) -> list[list[Any]]:
    """``values[i, :lengths[i]]`` of each row as a list of Python values; with ``nan_as_none``, a NaN (a
    log-probability that was not recorded) becomes ``None``, as in JSON."""
    lengths = np.minimum(lengths.astype(np.int64), values.shape[1])
    valid = values[np.arange(values.shape[1])[None, :] < lengths[:, None]]
    if len(valid) and valid.min() == valid.max():  # one value (a single-turn run's mask): slices of one list
        same = [valid[0].item()] * values.shape[1]
        return [same[:n] for n in lengths.tolist()]
    if nan_as_none and np.isnan(valid).any():
        nan = np.isnan(valid)
        valid = valid.astype(object)
        valid[nan] = None
    return split_list(valid.tolist(), lengths)


def _mask_lists(block: Block, rlen: np.ndarray) -> list[list[Any]]:
    """``response_mask`` per sample; a block without it (a single-turn run's) has 1 on every token."""
    if "response_mask" in block:
        return ragged_lists(block["response_mask"], rlen)
    width = block["response_ids"].shape[1]
    ones = [1] * width
    return [ones[:n] for n in np.minimum(rlen.astype(np.int64), width).tolist()]


def per_prompt_lists(values: np.ndarray, lengths: np.ndarray, prompts: np.ndarray) -> list[list[Any]]:
    """:func:`ragged_lists` of a per-prompt field repeated for each sample: made once per run of equal ``prompts``
    (a prompt's samples are consecutive) and copied for the other samples of the run."""
    starts = np.flatnonzero(np.r_[True, prompts[1:] != prompts[:-1]]) if len(prompts) else np.zeros(0, np.int64)
    if len(starts) == len(prompts):
        return ragged_lists(values, lengths)
    once = ragged_lists(values[starts], lengths[starts])
    runs = np.diff(np.r_[starts, len(prompts)]).tolist()
    return [row.copy() if i else row for row, k in zip(once, runs, strict=True) for i in range(k)]


def split_list(flat: list[Any], counts: np.ndarray) -> list[list[Any]]:
    """``flat`` cut into consecutive lists of ``counts`` items."""
    ends = np.cumsum(counts).tolist()
    return [flat[start:end] for start, end in zip([0, *ends][:-1], ends, strict=True)]


def _top_lists(block: Block) -> dict[str, list[Any]]:
    """``top_logprob_ids``/``top_logprobs``: per sample, per response token, the list of its recorded entries."""
    ids, values = block["top_logprob_ids"], block["top_logprobs"]
    rlen = np.minimum(block["response_length"].astype(np.int64), ids.shape[1])
    inside = np.arange(ids.shape[1])[None, :] < rlen[:, None]
    have = (ids != NO_TOKEN) & inside[..., None]
    per_token = have[inside].sum(axis=-1)
    return {
        name: split_list(split_list(array[have].tolist(), per_token), rlen)
        for name, array in (("top_logprob_ids", ids), ("top_logprobs", values))
    }
