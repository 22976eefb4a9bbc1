"""Turning the rows of a batch into what a trainer takes: xarray, TensorDict, verl ``DataProto`` or rows.

:func:`read_rows` reads only the delivered rows (contiguous runs of rows as slices, so each data chunk is read once
per batch); :func:`build` shapes them.  The tensor formats use the field layout of ``daskgen export --format
tensordict`` (:mod:`daskgen.analysis.verl`): left-padded ``prompts``, right-padded ``responses``, ``response_mask``,
``input_ids``, ``attention_mask``, ``position_ids``, ``rollout_log_probs`` and ``top_logprob_ids``/``top_logprobs``
(when recorded), one row per generated (prompt, sample).  ``pad="store"`` (the default) pads them to the store's
widths (``max_prompt_tokens``, ``max_new_tokens``): every batch has the same shape, so batches concatenate
(``DataProto.concat``, ``torch.cat``) and a trainer sees one shape; ``pad="batch"`` pads them to the batch's own
longest prompt and response (narrower tensors, a shape per batch).  In stores of single-turn runs the tensor and
row formats derive ``response_mask`` (1 before each length) instead of reading it.
The input's kept columns (``keep_columns``) and the row's settings (``sampling``, ``response_format``: JSON text,
when the run records them) come in every format: as variables of the xarray dataset (``column_<name>`` for a kept
column), and by their own names as row keys, ``DataProto.non_tensor_batch`` entries and ``TensorDict`` non-tensor
entries (one string per sample); ``stop_reason`` (when the run uses stops) and the policy versions of each
sample's tokens (``policy_version``, ``policy_version_end``, ``version_changed_at``) likewise, as integers per
sample.  The ``rows`` and ``arrow`` formats hold the columns of ``daskgen export --format parquet``
(:func:`daskgen.analysis.arrow.arrow_block`); ``daskgen follow`` writes the ``arrow`` batches.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from daskgen.errors import FollowError
from daskgen.store.generation_store import GenerationStore
from daskgen.store.layout import STALE_FIELD, TOP_LOGPROB_ARRAYS, VERSION_ARRAYS

FORMATS = ("xarray", "tensordict", "dataproto", "rows", "arrow")
#: The arrays the tensor and row formats are built from (``logprobs`` too when the run recorded them).
TOKEN_FIELDS = (
    "prompt_ids",
    "prompt_length",
    "response_ids",
    "response_length",
    "response_mask",
    "finish_reason",
    "num_turns",
)


def fields_to_read(store: GenerationStore, fmt: str, fields: tuple[str, ...] | None) -> tuple[str, ...]:
    """The store arrays a batch of format ``fmt`` needs: ``fields`` (default: every data array for xarray; the
    top-k logprob arrays only when the store records them), plus what the tensor and row formats are built from
    (``response_mask`` only when asked for or when the run's responses can hold other tokens than the model's)."""
    if fmt not in FORMATS:
        raise FollowError(f"unknown follow format {fmt!r}; choose one of {', '.join(FORMATS)}.")
    available = tuple(name for name in store.layout.data_arrays() if store.has_array(name))  # older stores lack some
    if fields is not None:  # the top-k logprob arrays are read when the store records them
        fields = tuple(f for f in fields if f in available or f not in TOP_LOGPROB_ARRAYS)
    unknown = [f for f in fields or () if f not in available]
    if unknown:
        raise FollowError(f"unknown field(s) {unknown} of store {store.url!r}; its data arrays are {list(available)}.")
    wanted = list(fields or (available if fmt == "xarray" else ()))
    if fmt != "xarray":
        derived = ("response_mask",) if store.attrs.model_tokens_only else ()
        wanted += [f for f in TOKEN_FIELDS if f not in derived]
        wanted += ["logprobs"] if store.attrs.logprobs_recorded else []
        wanted += store.layout.sample_records()
        wanted += [name for name in VERSION_ARRAYS if name in available]
    return tuple(dict.fromkeys(wanted))


def read_rows(store: GenerationStore, rows: np.ndarray, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """``names`` of the given ``rows`` (in that order), reading each contiguous run of rows as one slice.

    Every array and run is read at once (:meth:`~daskgen.store.generation_store.GenerationStore.read_spans`), so
    each data chunk is read once per batch and chunks are decoded side by side.
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
    """The dimensions of a batch field: its array's, or per sample for the follower's ``stale`` flag."""
    return tuple(specs["response_length" if name == STALE_FIELD else name].dims)


def to_dataset(store: GenerationStore, rows: np.ndarray, prompt_ids: np.ndarray, data: dict[str, np.ndarray]) -> Any:
    """The rows as an ``xarray.Dataset`` with the store's dimension names and coordinates."""
    import xarray as xr

    specs = store.layout.array_specs()
    variables = {name: (dims_of(specs, name), values) for name, values in data.items()}
    coords = {"prompt_index": ("prompt", rows.astype(np.int64)), "prompt_id": ("prompt", strings(prompt_ids))}
    return xr.Dataset(variables, coords=coords)


def build(
    fmt: str, store: GenerationStore, rows: np.ndarray, prompt_ids: np.ndarray, data: dict[str, np.ndarray], pad: str
) -> Any:
    """The batch's data in format ``fmt`` from the arrays ``data`` read for its ``rows`` (see the module docstring)."""
    if fmt == "xarray":
        return to_dataset(store, rows, prompt_ids, data)
    block = flat_block(store, rows, prompt_ids, data, derive_mask=fmt != "rows")  # rows: lists of 1s
    if fmt == "rows":
        from daskgen.analysis.row_dicts import record_dicts

        return record_dicts(block, store.attrs.logprobs_recorded)
    if fmt == "arrow":
        from daskgen.analysis.arrow import arrow_block

        return arrow_block(block, store.attrs.logprobs_recorded)
    tensors, extra = _verl(block, store, pad)
    if fmt == "tensordict":
        return _tensordict(tensors, extra)
    return _dataproto(tensors, extra)


def flat_block(
    store: GenerationStore,
    rows: np.ndarray,
    prompt_ids: np.ndarray,
    data: dict[str, np.ndarray],
    derive_mask: bool = True,
) -> dict[str, np.ndarray]:
    """One entry per generated sample of the rows (:func:`daskgen.analysis.decode.flatten_arrays`), with
    ``response_mask`` derived when it was not read (a single-turn run's: 1 before each length) and ``derive_mask``
    says so."""
    from daskgen.analysis.decode import flatten_arrays

    layout = store.layout
    specs = layout.array_specs()
    variables = {name: (dims_of(specs, name), values) for name, values in data.items()}
    variables |= {"prompt_index": (("prompt",), rows.astype(np.int64)), "prompt_id": (("prompt",), prompt_ids)}
    block = flatten_arrays(variables, dict(zip(specs["finish_reason"].dims, data["finish_reason"].shape, strict=True)))
    if derive_mask and "response_mask" not in block:
        width = np.arange(layout.max_new_tokens)[None, :]
        block["response_mask"] = (width < block["response_length"][:, None]).astype(np.uint8)
    return block


def _verl(
    block: dict[str, np.ndarray], store: GenerationStore, pad: str
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """verl's batch fields (padded as ``pad`` says) and the per-sample extras (ids, metadata) of a flattened block."""
    from daskgen.analysis.decode import text_fields
    from daskgen.analysis.verl import BATCH_KEYS, VERL_META, batch_widths, verl_block

    layout = store.layout
    widths = batch_widths(block) if pad == "batch" else (layout.max_prompt_tokens, layout.max_new_tokens)
    fields = verl_block(block, *widths, layout.pad_token_id, store.attrs.logprobs_recorded)
    tensors = {k: v for k, v in fields.items() if k in BATCH_KEYS}
    extra = {k: fields[k] for k in (*VERL_META, STALE_FIELD) if k in fields}  # into DataProto.non_tensor_batch
    ids = np.asarray(block["prompt_id"], dtype=object)
    extra |= {"prompt_id": ids, "uid": ids.copy()}  # uid: verl groups a prompt's samples by it (GRPO)
    return tensors, extra | text_fields(block)


def _tensordict(tensors: dict[str, np.ndarray], extra: dict[str, np.ndarray]) -> Any:
    """A ``TensorDict`` of the verl fields, the integer metadata (``prompt_index``, ``sample``, ``stop_reason``, ...)
    and the per-row text (the row's settings and the input's kept columns: non-tensor entries).

    The string ids are left out (per-row strings make a ``TensorDict`` slow to build): they are
    :attr:`~daskgen.stream.batches.Batch.prompt_ids`, in the order of ``prompt_index``.
    """
    from daskgen.analysis.verl import attach_non_tensor, tensordict_of

    numeric = {k: v for k, v in extra.items() if v.dtype != object}
    kept = {k: v for k, v in extra.items() if v.dtype == object and k not in ("prompt_id", "uid")}
    return attach_non_tensor(tensordict_of(tensors | numeric, len(extra["prompt_id"])), kept)


def _dataproto(tensors: dict[str, np.ndarray], extra: dict[str, np.ndarray]) -> Any:
    """A verl ``DataProto``: the verl fields as its ``batch``, ids and metadata in ``non_tensor_batch``."""
    from daskgen.analysis.verl import tensordict_of

    try:
        from verl.protocol import DataProto
    except ImportError as exc:
        raise FollowError(
            f"format='dataproto' needs verl ({exc}). Install it with `pip install ray omegaconf` and "
            "`pip install --no-deps verl` (DataProto needs only those), or use format='tensordict'."
        ) from exc
    batch = tensordict_of(tensors, len(extra["prompt_id"]))
    return DataProto(batch=batch, non_tensor_batch={k: np.asarray(v) for k, v in extra.items()})
