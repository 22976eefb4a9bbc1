"""Exports of a daskgen store: Parquet, JSONL, TensorDict (verl DataProto field names) and zip.

Rows are the generated (prompt, sample[, trajectory]) entries of prompts that were done when the
export started (the checkpoint mask is read first; data of done rows is final), read block by block
through the one read path of :mod:`daskgen.formats` (:func:`daskgen.formats.read.read_block`), so a store larger
than memory exports in bounded memory, also while a run writes it.  Each format is written by its module of
:mod:`daskgen.formats`, which ``daskgen.follow`` uses too:

* ``parquet`` / ``jsonl``: one record per row (:mod:`daskgen.formats.arrow`, :mod:`daskgen.formats.records`);
* ``tensordict``: verl's DataProto fields (:mod:`daskgen.formats.verl`), saved as a memory-mapped TensorDict folder
  (:mod:`daskgen.formats.tensordict`; :func:`load_tensordict`, :func:`verl_parts`);
* ``zip``: the whole store as one uncompressed zip that ``zarr.storage.ZipStore`` opens.

An export adds what the store does not hold: decoded text (``prompt_text``, ``response_text``, with ``text``) and
the input's ``raw_prompt`` (when the input file is found).  A store with images exports each sample's image
hashes, spans and grids (:mod:`daskgen.formats.images`), never pixels per sample: a Parquet export names each image
by hash and store key (``images="reference"``) or, with ``images="bytes"``, also writes the images' bytes once per
distinct image into a second Parquet file beside it (:func:`image_file`: ``out.parquet`` -> ``out.images.parquet``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from dask.utils import parse_bytes

from daskgen import tunables
from daskgen.analysis.accessor import decode_many, iter_raw_prompts, open_store
from daskgen.analysis.archive import require_wandb, upload_wandb, zip_store
from daskgen.analysis.output import check_output, output_size, staged_output
from daskgen.errors import ExportError
from daskgen.formats.arrow import write_image_table, write_parquet
from daskgen.formats.block import Block
from daskgen.formats.dataproto import dataproto_parts as verl_parts
from daskgen.formats.read import PromptIds, block_fields, read_block, read_rows
from daskgen.formats.records import write_jsonl
from daskgen.formats.tensordict import load_tensordict, write_memmap
from daskgen.formats.tensordict import to_tensordict as parts_tensordict
from daskgen.formats.verl import VERL_KEYS, VerlParts, to_verl
from daskgen.store.attrs import StoreAttrs
from daskgen.store.generation_store import GenerationStore
from daskgen.store.images import image_bytes
from daskgen.store.layout import DONE
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
#: How a Parquet export holds the images: by reference (hash and store key) or their bytes too, in a second file.
IMAGE_MODES = ("reference", "bytes")
#: Suffix of the default output path per format (``out.zarr`` -> ``out.parquet``, ``out.td``, ...).
DEFAULT_SUFFIX = {"parquet": ".parquet", "jsonl": ".jsonl", "tensordict": ".td", "zip": ".zarr.zip"}


@dataclass
class ExportResult:
    """What an export wrote."""

    path: Path
    format: str
    rows: int
    seconds: float
    bytes: int
    images: int = 0  # the distinct images written into the images file (``images="bytes"``)

    def line(self) -> str:
        """One-line summary for the command line."""
        rate = self.rows / self.seconds if self.seconds > 0 else float("inf")
        return (
            f"daskgen: exported {self.rows} samples as {self.format} to {self.path} "
            f"({self.bytes / 2**20:.1f} MiB in {self.seconds:.1f} s, {rate:.0f} samples/s)"
            + (f", {self.images} images to {image_file(self.path)}" if self.images else "")
        )


def image_file(out: str | Path) -> Path:
    """The file beside a Parquet export ``out`` that ``images="bytes"`` writes the images into."""
    out = Path(out)
    return out.with_name(out.name.removesuffix(".parquet") + ".images.parquet")


# -- reading done rows block by block -----------------------------------------------------------
class Source:
    """A store opened for export: the done rows (snapshot), read in blocks, with decoded text and raw prompts."""

    def __init__(
        self,
        path: StoreRef,
        *,
        text: bool = False,
        tokenizer: str | None = None,
        prompts: str | Path | None = None,
        raw: bool = True,
    ) -> None:
        self.store = GenerationStore.open(locate(path))
        self.rows = done_rows(self.store)
        self.ids = PromptIds(self.store)
        accessor = open_store(path).daskgen if text or raw or prompts else None
        self.tokenizer = accessor.tokenizer(tokenizer) if accessor is not None and text else None
        source = accessor.input_path(prompts) if accessor is not None and (raw or prompts) else None
        self.raw = None if source is None else iter_raw_prompts(source, self.rows)  # consumed block by block

    def parts(self) -> list[np.ndarray]:
        """The done rows in chunk-aligned parts of about the ``export.block-bytes`` tunable of store data (whole
        partitions, at least one; one empty part when none is done)."""
        layout = self.store.layout
        arrays = [self.store.array(name) for name in block_fields(self.store)]
        per_row = sum(a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in arrays)
        block_bytes = parse_bytes(tunables.get("export.block-bytes"))
        span = layout.partition_size * max(1, block_bytes // max(per_row * layout.partition_size, 1))
        return np.split(self.rows, np.flatnonzero(np.diff(self.rows // span)) + 1)

    def blocks(self) -> Iterator[Block]:
        """The done rows' blocks, with the decoded text and raw prompts asked for."""
        for part in self.parts():
            yield self._extended(part, read_block(self.store, part, self.ids))

    def _extended(self, rows: np.ndarray, block: Block) -> Block:
        fields, index = block.fields, block["prompt_index"]
        if self.tokenizer is not None:
            starts = np.flatnonzero(np.r_[True, index[1:] != index[:-1]]) if len(index) else np.zeros(0, np.int64)
            prompts = [block["prompt_ids"][i][: block["prompt_length"][i]] for i in starts]
            texts = np.array(decode_many(self.tokenizer, prompts), dtype=object)
            fields["prompt_text"] = np.repeat(texts, np.diff(np.r_[starts, len(index)]))
            pairs = zip(block["response_ids"], block["response_length"], strict=True)
            fields["response_text"] = np.array(decode_many(self.tokenizer, [ids[:n] for ids, n in pairs]), dtype=object)
        if self.raw is not None:
            raw = np.array([next(self.raw) for _ in rows], dtype=object)
            fields["raw_prompt"] = raw[np.searchsorted(rows, index)]
        return block

    def survey(self) -> tuple[int, tuple[int, int]]:
        """The samples the done rows generated, and the longest done prompt and response (at least 1)."""
        total, longest = 0, [1, 1]
        for part in self.parts():
            got = read_rows(self.store, part, ("prompt_length", "response_length", "finish_reason"))
            total += int((got["finish_reason"] >= 0).sum())
            for i, name in enumerate(("prompt_length", "response_length")):
                longest[i] = max(longest[i], int(got[name].max(initial=0)))
        return total, (longest[0], longest[1])


def done_rows(store: GenerationStore) -> np.ndarray:
    """The rows done now (the checkpoint mask read once: data of done rows is final)."""
    return np.flatnonzero(store.read_status() == DONE)


# -- TensorDict (verl DataProto layout) ---------------------------------------------------------
def _verl_blocks(src: Source, width: tuple[int, int]) -> Iterator[VerlParts]:
    return (to_verl(block, width) for block in src.blocks())


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
    ``prompt_id``, ``uid`` (the same id), ``raw_prompt`` (JSON of the input's messages or prompt, when the input
    file is found), the row's settings (``sampling``, ``response_format``: JSON text; ``adapter``: its LoRA
    adapter; when recorded), the input's kept columns (``keep_columns``, by their own names) and, with ``text``,
    decoded text.
    """
    src = Source(path, text=text, tokenizer=tokenizer, prompts=prompts, raw=raw)
    return parts_tensordict(VerlParts.concat(list(_verl_blocks(src, src.survey()[1]))))


def _write(path: StoreRef, tmp: Path, fmt: str, seen: dict[str, None], **options: Any) -> int:
    if fmt == "zip":
        rows = Source(path, raw=False).survey()[0]  # before zipping: at least these rows are complete in it
        zip_store(path, tmp)
        return rows
    src = Source(path, **options)
    if fmt == "parquet":
        return write_parquet(src.blocks(), tmp, seen)
    if fmt == "jsonl":
        return write_jsonl(src.blocks(), tmp)
    total, width = src.survey()
    return write_memmap(_verl_blocks(src, width), tmp, total)


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
    images: str = "reference",
) -> ExportResult:
    """Export a store to ``out`` as ``parquet``, ``jsonl``, ``tensordict`` or ``zip``.

    ``text`` decodes prompts and responses with the store's tokenizer (``tokenizer`` overrides the
    model folder) for parquet/jsonl/tensordict.  ``prompts`` is the run's input file, to include raw
    prompts (by default the recorded input path is used when it still holds the same input; ``raw=False``
    skips that).
    ``wandb_project`` uploads a zip export as a W&B artifact.  ``images`` (parquet): ``"reference"`` names each
    image by its hash and store key; ``"bytes"`` also writes each distinct image once, as stored, into
    :func:`image_file` (columns ``image_hash``, ``image_key``, ``image_bytes``).
    """
    attrs = _checked_request(path, fmt, wandb_project)
    side = _image_output(fmt, images, out)
    for target in (Path(out), *([side] if side else [])):
        check_output(target, overwrite=overwrite, protect=path)
    if wandb_project:
        require_wandb()
    t0 = time.perf_counter()
    seen: dict[str, None] = {}
    with staged_output(out, overwrite=overwrite, protect=path) as tmp:
        rows = _write(path, tmp, fmt, seen, text=text, tokenizer=tokenizer, prompts=prompts, raw=raw)
    written = 0
    if side is not None:
        location = locate(path)
        with staged_output(side, overwrite=overwrite, protect=path) as tmp:
            written = write_image_table(seen, lambda digest: image_bytes(location, digest), tmp)
    result = ExportResult(Path(out), fmt, rows, time.perf_counter() - t0, output_size(Path(out)), written)
    if wandb_project:
        upload_wandb(out, wandb_project, attrs)
    return result


def _image_output(fmt: str, images: str, out: str | Path) -> Path | None:
    """The images file of the export (``images="bytes"``), or ``None``; :class:`ExportError` for a bad choice."""
    if images not in IMAGE_MODES:
        raise ExportError(f"unknown images choice {images!r}; choose one of {', '.join(IMAGE_MODES)}.")
    if images == "bytes" and fmt != "parquet":
        raise ExportError(
            f"images='bytes' writes the images beside a Parquet export; use it with --format parquet, not {fmt!r} "
            "(the other formats name each image by its hash: daskgen.read_image(store, hash) reads it)."
        )
    return image_file(out) if images == "bytes" else None


def _checked_request(path: StoreRef, fmt: str, wandb_project: str | None) -> StoreAttrs:
    """The store's attrs, after checking the format, the W&B option and that ``path`` is a daskgen store."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}.")
    if wandb_project and fmt != "zip":
        raise ExportError("--wandb-project uploads the whole store as a zip; use it with --format zip.")
    return GenerationStore.open(path).attrs
