"""The one read path of every format: rows of a store into a :class:`~daskgen.formats.block.Block`.

:func:`read_rows` reads the named arrays of any rows (each contiguous run of rows as one slice, so each data chunk
is read once per call, through :meth:`~daskgen.store.generation_store.GenerationStore.read_spans`);
:func:`flat_block` flattens what was read; :func:`read_block` does both for the arrays of :func:`block_fields`.
``daskgen export`` reads the done rows block by block this way, ``daskgen.follow`` each batch's rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from daskgen.formats.block import Block, flatten_arrays
from daskgen.formats.images import image_arrays
from daskgen.store.generation_store import GenerationStore
from daskgen.store.layout import FINGERPRINT_ARRAYS, STALE_FIELD, VERSION_ARRAYS

#: The token arrays every block is built from (``response_mask`` only when a response can hold other tokens
#: than the model's; ``logprobs`` too when the run recorded them).
TOKEN_FIELDS = (
    "prompt_ids",
    "prompt_length",
    "response_ids",
    "response_length",
    "response_mask",
    "finish_reason",
    "num_turns",
)


def block_fields(store: GenerationStore) -> tuple[str, ...]:
    """The store arrays a block is built from: the token arrays, ``logprobs`` when recorded, the arrays of
    :meth:`~daskgen.store.layout.Layout.sample_records`, the policy versions and their fingerprints (stores
    that hold them) and the prompt's images (:mod:`daskgen.formats.images`; stores whose rows name images)."""
    derived = ("response_mask",) if store.attrs.model_tokens_only else ()
    wanted = [name for name in TOKEN_FIELDS if name not in derived]
    wanted += ["logprobs"] if store.attrs.logprobs_recorded else []
    wanted += store.layout.sample_records()
    # stores from before versions (or fingerprints) were recorded lack them
    wanted += [name for name in (*VERSION_ARRAYS, *FINGERPRINT_ARRAYS) if store.has_array(name)]
    wanted += image_arrays(store.layout)
    return tuple(dict.fromkeys(wanted))


def read_rows(store: GenerationStore, rows: np.ndarray, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """``names`` of the given ``rows`` (in that order), reading each contiguous run of rows as one slice.

    Every array and run is read at once (:meth:`~daskgen.store.generation_store.GenerationStore.read_spans`), so
    each data chunk is read once per call and chunks are decoded side by side.
    """
    order = np.argsort(rows, kind="stable")
    ranked = rows[order]
    runs = [run for run in np.split(ranked, np.flatnonzero(np.diff(ranked) != 1) + 1) if len(run)]
    if not runs:
        return {name: np.empty((0, *store.array(name).shape[1:]), dtype=store.array(name).dtype) for name in names}
    parts = store.read_spans([(int(run[0]), int(run[-1]) + 1) for run in runs], names)
    if len(runs) == 1 and np.array_equal(order, np.arange(len(order))):
        return {name: values[0] for name, values in parts.items()}
    back = np.empty_like(order)
    back[order] = np.arange(len(order))
    return {name: np.concatenate(values)[back] for name, values in parts.items()}


class PromptIds:
    """The ``prompt_id`` coordinate, read one coarse chunk at a time and kept (ids never change)."""

    def __init__(self, store: GenerationStore, keep: int = 4) -> None:
        self.store, self.keep = store, keep
        self.rows = store.commit_chunk_rows
        self.chunks: dict[int, np.ndarray] = {}

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        """The ids of ``rows`` (an object array of ``str``)."""
        out = np.empty(len(rows), dtype=object)
        for chunk in np.unique(rows // self.rows):
            at = rows // self.rows == chunk
            out[at] = self._chunk(int(chunk))[rows[at] - chunk * self.rows]
        return out

    def _chunk(self, chunk: int) -> np.ndarray:
        if chunk not in self.chunks:
            if len(self.chunks) >= self.keep:
                self.chunks.pop(next(iter(self.chunks)))
            start = chunk * self.rows
            stop = min(start + self.rows, self.store.layout.n_prompts)
            self.chunks[chunk] = strings(self.store.read_region(start, stop, ("prompt_id",))["prompt_id"])
        return self.chunks[chunk]


def strings(values: np.ndarray) -> np.ndarray:
    """``values`` (zarr's string arrays come back as numpy ``StringDType``) as an object array of ``str``."""
    return np.array([str(v) for v in values], dtype=object)


def dims_of(specs: dict[str, Any], name: str) -> tuple[str, ...]:
    """The dimensions of a field read for a block: its array's, or per sample for the follower's ``stale`` flag."""
    return tuple(specs["response_length" if name == STALE_FIELD else name].dims)


def flat_block(store: GenerationStore, rows: np.ndarray, prompt_ids: np.ndarray, data: dict[str, np.ndarray]) -> Block:
    """The arrays ``data`` read for ``rows`` (with their ids) as one :class:`Block` entry per generated sample."""
    layout = store.layout
    specs = layout.array_specs()
    variables = {name: (dims_of(specs, name), values) for name, values in data.items()}
    variables |= {"prompt_index": (("prompt",), rows.astype(np.int64)), "prompt_id": (("prompt",), prompt_ids)}
    sizes = dict(zip(specs["finish_reason"].dims, data["finish_reason"].shape, strict=True))
    return Block(
        flatten_arrays(variables, sizes),
        logprobs=store.attrs.logprobs_recorded,
        pad_token_id=layout.pad_token_id,
        store_widths=(layout.max_prompt_tokens, layout.max_new_tokens),
    )


def read_block(store: GenerationStore, rows: np.ndarray, prompt_ids: PromptIds | None = None) -> Block:
    """The :class:`Block` of ``rows``: the arrays of :func:`block_fields` read and flattened (``prompt_ids``: a
    reader of ids kept across calls)."""
    ids = (prompt_ids or PromptIds(store))(rows)
    return flat_block(store, rows, ids, read_rows(store, rows, block_fields(store)))
