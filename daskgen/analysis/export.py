"""Exports of a daskgen store: Parquet, JSONL, TensorDict (verl DataProto field names) and zip.

Rows are the generated (prompt, sample[, trajectory]) entries of prompts that were done when the
export started (the checkpoint mask is read first; data of done rows is final), streamed block by
block, so a store larger than memory exports in bounded memory, also while a run writes it.

* ``parquet`` / ``jsonl``: one record per row with token lists, finish reason,
  turns, optional decoded text and the raw input prompt (:func:`daskgen.analysis.arrow.arrow_block`).
* ``tensordict``: verl's DataProto batch fields (:func:`daskgen.analysis.verl.verl_block`) plus metadata, saved as a
  memory-mapped TensorDict folder (``TensorDict.load_memmap(path)``; :func:`load_tensordict`).
* ``zip``: the whole store as one uncompressed zip that ``zarr.storage.ZipStore`` opens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from daskgen.analysis.accessor import (
    decode_many,
    decode_prompts,
    flatten_samples,
    iter_raw_prompts,
    open_store,
)
from daskgen.analysis.archive import require_wandb, upload_wandb, zip_store
from daskgen.analysis.arrow import arrow_block
from daskgen.analysis.decode import text_fields
from daskgen.analysis.output import check_output, output_size, staged_output
from daskgen.analysis.row_dicts import record_dicts
from daskgen.analysis.verl import BATCH_KEYS, VERL_KEYS, attach_non_tensor, tensordict_of, verl_block
from daskgen.errors import ExportError, StoreError
from daskgen.store.attrs import StoreAttrs
from daskgen.store.generation_store import GenerationStore
from daskgen.store.layout import VERSION_ARRAYS
from daskgen.store.location import StoreRef, locate

__all__ = [
    "DEFAULT_SUFFIX",
    "FORMATS",
    "VERL_KEYS",
    "ExportResult",
    "check_output",
    "export",
    "load_tensordict",
    "staged_output",
    "to_tensordict",
    "upload_wandb",
    "verl_parts",
    "zip_store",
]

FORMATS = ("parquet", "jsonl", "tensordict", "zip")
#: Suffix of the default output path per format (``out.zarr`` -> ``out.parquet``, ``out.td``, ...).
DEFAULT_SUFFIX = {"parquet": ".parquet", "jsonl": ".jsonl", "tensordict": ".td", "zip": ".zarr.zip"}
_READ = (
    "prompt_ids",
    "prompt_length",
    "response_ids",
    "response_length",
    "response_mask",
    "logprobs",
    "finish_reason",
    "num_turns",
)
_BLOCK_BYTES = 16 * 2**20


@dataclass
class ExportResult:
    """What an export wrote."""

    path: Path
    format: str
    rows: int
    seconds: float
    bytes: int

    def line(self) -> str:
        """One-line summary for the command line."""
        rate = self.rows / self.seconds if self.seconds > 0 else float("inf")
        return (
            f"daskgen: exported {self.rows} samples as {self.format} to {self.path} "
            f"({self.bytes / 2**20:.1f} MiB in {self.seconds:.1f} s, {rate:.0f} samples/s)"
        )


# -- reading done rows block by block -----------------------------------------------------------
class Source:
    """A store opened for export: the dataset, its attrs, the done rows (snapshot) and extras."""

    def __init__(
        self,
        path: StoreRef,
        *,
        text: bool = False,
        tokenizer: str | None = None,
        prompts: str | Path | None = None,
        raw: bool = True,
    ) -> None:
        self.path = locate(path)
        self.ds = open_store(path)
        self.attrs = self.ds.daskgen.attrs
        self.rows = self.ds.daskgen.rows("done")
        self.total = _units(self.ds, self.rows)
        self.pad = self.attrs.layout.pad_token_id
        self.has_logprobs = self.attrs.logprobs_recorded
        versions = tuple(name for name in VERSION_ARRAYS if name in self.ds)  # stores from before versions lack them
        self.read = (*_READ, *versions, *self.attrs.layout.sample_records())
        self.tokenizer = self.ds.daskgen.tokenizer(tokenizer) if text else None
        source = self.ds.daskgen.input_path(prompts) if raw or prompts else None
        self.raw = None if source is None else iter_raw_prompts(source, self.rows)  # consumed block by block

    def blocks(self, block_bytes: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """Per-sample numpy arrays of the done rows, in chunk-aligned blocks of about ``block_bytes``."""
        block_bytes = block_bytes or _BLOCK_BYTES
        chunk = self.attrs.layout.partition_size
        per_row = sum(self.ds[v].dtype.itemsize * int(np.prod(self.ds[v].shape[1:])) for v in self.read)
        span = chunk * max(1, block_bytes // max(per_row * chunk, 1))
        keys = self.rows // span
        for part in np.split(self.rows, np.flatnonzero(np.diff(keys)) + 1):  # one empty part when none is done
            yield self._flatten(part, self.ds[list(self.read)].isel(prompt=part).compute())

    def _flatten(self, rows: np.ndarray, sub: Any) -> dict[str, np.ndarray]:
        out = flatten_samples(sub)
        where = np.searchsorted(sub["prompt_index"].values, out["prompt_index"])
        if self.tokenizer is not None:
            out["prompt_text"] = np.array(decode_prompts(self.tokenizer, sub), dtype=object)[where]
            pairs = zip(out["response_ids"], out["response_length"], strict=True)
            out["response_text"] = np.array(decode_many(self.tokenizer, [ids[:n] for ids, n in pairs]), dtype=object)
        if self.raw is not None:
            out["raw_prompt"] = np.array([next(self.raw) for _ in rows], dtype=object)[where]
        return out


def _units(ds: Any, rows: np.ndarray) -> int:
    """Export rows of the done ``rows``: their generated samples (trajectories), ``finish_reason >= 0``."""
    return int((ds["finish_reason"].isel(prompt=rows) >= 0).sum())


# -- Parquet and JSONL --------------------------------------------------------------------------
def _write_parquet(src: Source, path: Path) -> int:
    import pyarrow.parquet as pq

    rows, writer = 0, None
    try:
        for block in src.blocks():
            table = arrow_block(block, src.has_logprobs)
            writer = writer or pq.ParquetWriter(path, table.schema, compression="zstd")
            writer.write_table(table)
            rows += table.num_rows
    finally:
        if writer is not None:
            writer.close()
    return rows


def _write_jsonl(src: Source, path: Path) -> int:
    rows = 0
    with path.open("w", encoding="utf-8") as fh:
        for block in src.blocks():
            for record in record_dicts(block, src.has_logprobs):
                if "raw_prompt" in record:
                    record["raw_prompt"] = json.loads(record["raw_prompt"])
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
                rows += 1
    return rows


# -- TensorDict (verl DataProto layout) ---------------------------------------------------------
_NON_TENSOR = ("prompt_id", "raw_prompt", "prompt_text", "response_text")


def _widths(src: Source) -> tuple[int, int]:
    """Prompt and response widths: the longest done prompt and response (at least 1)."""
    if not len(src.rows):
        return 1, 1
    done = src.ds[["prompt_length", "response_length"]].isel(prompt=src.rows).max().compute()
    return max(int(done["prompt_length"]), 1), max(int(done["response_length"]), 1)


def _tensor_blocks(src: Source) -> Iterator[tuple[Any, dict[str, list[Any]]]]:
    """(TensorDict of tensor fields, lists of non-tensor fields) per block."""
    width = _widths(src)
    for block in src.blocks():
        tensors = tensordict_of(verl_block(block, *width, src.pad, src.has_logprobs), len(block["sample"]))
        strings = {k: [str(v) for v in block[k]] for k in _NON_TENSOR if k in block}
        yield tensors, strings | {k: v.tolist() for k, v in text_fields(block).items()}


def to_tensordict(
    path: str | Path,
    *,
    text: bool = False,
    tokenizer: str | None = None,
    prompts: str | Path | None = None,
    raw: bool = True,
) -> Any:
    """The done samples of a store as an in-memory ``tensordict.TensorDict`` (verl field names).

    One row per (prompt, sample[, trajectory]) of done prompts: the :data:`VERL_KEYS` batch fields (logprobs only
    when the run recorded them; ``top_logprob_ids``/``top_logprobs`` likewise), int64 metadata (``prompt_index``,
    ``sample``, ``num_turns``, ``finish_reason``, lengths, ``stop_reason`` when the run used stops) and non-tensor
    ``prompt_id``, ``raw_prompt`` (JSON of the input's messages or prompt, when the input file is found), the row's
    settings (``sampling``, ``response_format``: JSON text; ``adapter``: its LoRA adapter; when recorded), the
    input's kept columns (``keep_columns``, by their own names) and, with ``text``, decoded text.
    """
    import torch

    parts = list(_tensor_blocks(Source(path, text=text, tokenizer=tokenizer, prompts=prompts, raw=raw)))
    td = torch.cat([p[0] for p in parts], dim=0)
    return attach_non_tensor(td, {k: [v for p in parts for v in p[1][k]] for k in parts[0][1]})


def _write_tensordict(src: Source, path: Path) -> int:
    """Stream blocks into a memory-mapped TensorDict folder (bounded memory)."""
    total = src.total
    out: Any = None  # the memory-mapped TensorDict, shaped on the first block (there is always one)
    rows = 0
    non_tensor: dict[str, list[str]] = {}
    for tensors, strings in _tensor_blocks(src):
        if out is None:
            out = tensors[:1].expand(total).memmap_like(str(path), num_threads=0) if total else tensors
        if len(tensors):
            out[rows : rows + len(tensors)] = tensors
        rows += len(tensors)
        for key, values in strings.items():
            non_tensor.setdefault(key, []).extend(values)
    out.unlock_()
    attach_non_tensor(out, non_tensor).memmap_(str(path), num_threads=0)
    return rows


def load_tensordict(path: str | Path) -> Any:
    """Open a tensordict export (memory-mapped: nothing is read until used)."""
    from tensordict import TensorDict

    return TensorDict.load_memmap(str(path))


def verl_parts(td: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """Split an export into verl's ``DataProto(batch=..., non_tensor_batch=...)`` parts.

    ``batch`` holds the :data:`VERL_KEYS` tensors (and the top-k logprobs when recorded); ``non_tensor_batch`` holds
    numpy arrays of the per-sample metadata (``num_turns``, ``prompt_index``, ``sample``, ``prompt_id``,
    ``raw_prompt``, ``stop_reason``, ``sampling``, ``adapter``, the input's kept columns, ...): object arrays of
    ``str`` for the non-tensor fields.
    """
    from tensordict import is_non_tensor

    keys = set(td.keys())
    batch = td.select(*[k for k in BATCH_KEYS if k in keys])
    extra = {}
    for key in keys - set(BATCH_KEYS):
        value = td.get(key)
        extra[key] = np.array(value.tolist(), dtype=object) if is_non_tensor(value) else np.asarray(value.numpy())
    return batch, extra


# -- entry point ----------------------------------------------------------------------------------
def export(
    path: StoreRef,
    out: str | Path,
    fmt: str,
    *,
    overwrite: bool = False,
    text: bool = True,
    tokenizer: str | None = None,
    prompts: str | Path | None = None,
    raw: bool = True,
    wandb_project: str | None = None,
) -> ExportResult:
    """Export a store to ``out`` as ``parquet``, ``jsonl``, ``tensordict`` or ``zip``.

    ``text`` decodes prompts and responses with the store's tokenizer (``tokenizer`` overrides the
    model folder) for parquet/jsonl/tensordict.  ``prompts`` is the run's input file, to include raw
    prompts (by default the recorded input path is used when it still holds the same input; ``raw=False``
    skips that).
    ``wandb_project`` uploads a zip export as a W&B artifact.
    """
    attrs = _checked_request(path, fmt, wandb_project)
    check_output(out, overwrite=overwrite, protect=path)
    if wandb_project:
        require_wandb()
    t0 = time.perf_counter()
    with staged_output(out, overwrite=overwrite, protect=path) as tmp:
        rows = _write(path, tmp, fmt, text=text, tokenizer=tokenizer, prompts=prompts, raw=raw)
    result = ExportResult(Path(out), fmt, rows, time.perf_counter() - t0, output_size(Path(out)))
    if wandb_project:
        upload_wandb(out, wandb_project, attrs)
    return result


def _checked_request(path: StoreRef, fmt: str, wandb_project: str | None) -> StoreAttrs:
    """The store's attrs, after checking the format, the W&B option and that ``path`` is a daskgen store."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}.")
    if wandb_project and fmt != "zip":
        raise ExportError("--wandb-project uploads the whole store as a zip; use it with --format zip.")
    store = GenerationStore.open_if_exists(path)
    if store is None:
        raise StoreError(
            f"{str(locate(path))!r} is not a daskgen store (no zarr.json with daskgen attrs); "
            "pass the --store path of a daskgen run."
        )
    return store.attrs


def _write(path: StoreRef, tmp: Path, fmt: str, **options: Any) -> int:
    if fmt == "zip":
        ds = open_store(path)
        rows = _units(ds, ds.daskgen.rows("done"))  # before zipping: at least these rows are complete in it
        zip_store(path, tmp)
        return rows
    src = Source(path, **options)
    writer = {"parquet": _write_parquet, "jsonl": _write_jsonl, "tensordict": _write_tensordict}[fmt]
    return writer(src, tmp)
