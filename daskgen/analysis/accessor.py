"""Analysis of daskgen stores: the ``ds.daskgen`` xarray accessor, statistics and decoding.

Importing this module registers the accessor on every :class:`xarray.Dataset`::

    import daskgen
    ds = daskgen.open_store("out.zarr")       # registers ds.daskgen, adds finish_label
    ds.daskgen.counts()                       # {'pending': .., 'done': .., 'failed': .., 'total': ..}
    done = ds.daskgen.done()                  # lazy: the done rows only
    ds.daskgen.length_stats()                 # response lengths per finish reason (pandas)
    ds.daskgen.texts(limit=3)                 # decoded prompts and responses (pandas)
    ds.daskgen.settings()                     # the sampling settings each row used (pandas)

Everything works on stores larger than memory and while a run writes the store: the checkpoint
mask ``status`` (one byte per prompt) is read first and held in memory, so only rows that were
done at that moment count, and their data (written before the mask) is complete.  Statistics
are dask reductions over the chunked arrays; only small results are materialised.

This module imports numpy, pandas, dask and xarray only (no torch, transformers or matplotlib).
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import xarray as xr

from daskgen.analysis.decode import decode_many, decode_prompts, iter_raw_prompts
from daskgen.analysis.stats import (
    bincount,
    epoch_seconds,
    histogram_row,
    nice_bin_seconds,
    pass_at_k,
    per_sample,
)
from daskgen.errors import ConfigError, StoreError, StoreMismatchError
from daskgen.formats.block import flatten_samples
from daskgen.formats.finish import FINISH_LABELS, finish_labels
from daskgen.store.attrs import ATTRS_KEY, StoreAttrs
from daskgen.store.generation_store import GenerationStore
from daskgen.store.images import read_image
from daskgen.store.layout import DONE, FAILED, NUMBER_RECORDS, PENDING
from daskgen.store.location import StoreLocation, StoreRef

__all__ = [
    "FINISH_LABELS",
    "DaskgenAccessor",
    "decode_many",
    "decode_prompts",
    "finish_labels",
    "iter_raw_prompts",
    "flatten_samples",
    "open_store",
]

#: Columns of :meth:`DaskgenAccessor.throughput`.
THROUGHPUT_COLUMNS = ["start", "prompts", "tokens", "prompts_per_min", "tokens_per_min"]
#: The dataset encoding key under which :func:`open_store` records the store's location.
LOCATION_KEY = "daskgen_location"
STATUS_NAMES = {"pending": PENDING, "done": DONE, "failed": FAILED}
#: Tokenizer identity keys that must match the store's for decoding to be trusted.
IDENTITY_KEYS = ("vocab_size", "eos_token_id", "pad_token_id", "chat_template_sha256")


def open_store(path: str | Path | StoreLocation) -> xr.Dataset:
    """Open a store lazily as an ``xarray.Dataset`` (also while a run is writing it).

    ``path`` is a folder, an object-storage URL (``s3://…``) or a
    :class:`~daskgen.store.location.StoreLocation`.  Registers the ``ds.daskgen`` accessor (this module)
    and adds a lazy ``finish_label`` variable (``finish_reason`` decoded to
    ``stop``/``length``/``abort``/``error``/``not_generated``).
    """
    store = GenerationStore.open(path)
    ds = store.dataset().daskgen.labelled()
    ds.encoding[LOCATION_KEY] = store.location  # where ds.daskgen.image reads the images
    return ds


@xr.register_dataset_accessor("daskgen")
class DaskgenAccessor:
    """``ds.daskgen``: selections, statistics and decoding for a daskgen store opened with xarray."""

    def __init__(self, ds: xr.Dataset) -> None:
        self._ds = ds
        self._tokenizer: Any = None

    # -- store identity and selections -------------------------------------------------------
    @property
    def attrs(self) -> StoreAttrs:
        """The store's ``daskgen`` attrs (settings, input fingerprint, tokenizer identity, runs), typed."""
        attrs = self._ds.attrs.get(ATTRS_KEY)
        if not isinstance(attrs, dict):
            raise StoreError(
                f"this dataset has no {ATTRS_KEY!r} attrs; open a daskgen store with "
                "daskgen.open_store(path) or xarray.open_zarr(path)"
            )
        return StoreAttrs.from_json(attrs)

    def status(self) -> np.ndarray:
        """The checkpoint mask as it is on disk now (0 pending, 1 done, 2 failed)."""
        return np.asarray(self._ds["status"].values)

    def counts(self) -> dict[str, int]:
        """Prompts pending, done and failed, and the total."""
        status = self.status()
        out = {name: int((status == code).sum()) for name, code in STATUS_NAMES.items()}
        return {**out, "total": int(status.size)}

    def rows(self, which: str = "done") -> np.ndarray:
        """Positions along ``prompt`` of the rows whose status is ``which`` (pending, done, failed)."""
        if which not in STATUS_NAMES:
            raise ValueError(f"which must be one of {sorted(STATUS_NAMES)}, got {which!r}")
        return np.flatnonzero(self.status() == STATUS_NAMES[which])

    def select(self, which: str = "done") -> xr.Dataset:
        """The rows with status ``which``, lazily (the data is read only when computed)."""
        return self._ds.isel(prompt=self.rows(which))

    def done(self) -> xr.Dataset:
        """The done rows, lazily."""
        return self.select("done")

    def done_mask(self) -> xr.DataArray:
        """Boolean mask over ``prompt`` of the rows done now (held in memory: a consistent snapshot)."""
        return xr.DataArray(self.status() == DONE, dims=("prompt",), name="done")

    def sample_mask(self) -> xr.DataArray:
        """Mask of the generated samples (trajectories) of done rows: ``finish_reason >= 0``, lazily.

        Leaves out samples a verifier run never needed and padding trajectories of schema-v2 stores.
        """
        return self.done_mask() & (self._ds["finish_reason"] >= 0)

    def finish_labels(self) -> xr.DataArray:
        """``finish_reason`` as string labels, lazily (same dims and chunks)."""
        codes = self._ds["finish_reason"]
        labels = xr.apply_ufunc(
            finish_labels, codes, dask="parallelized", output_dtypes=[finish_labels(np.zeros(0)).dtype]
        )
        return labels.rename("finish_label").assign_attrs(long_name="why the sample ended")

    def labelled(self) -> xr.Dataset:
        """The dataset plus a lazy ``finish_label`` variable (``finish_reason`` decoded to labels)."""
        if "finish_reason" not in self._ds:
            return self._ds
        return self._ds.assign(finish_label=self.finish_labels())

    # -- statistics ---------------------------------------------------------------------------
    def length_histogram(self) -> xr.DataArray:
        """Done samples (v2: trajectories) counted by finish reason and response length."""
        width = self._ds.sizes["response_position"] + 1
        labels = len(FINISH_LABELS)
        code = (self._ds["finish_reason"].astype("int64") + 1).clip(0, labels - 1)
        length = self._ds["response_length"].astype("int64").clip(0, width - 1)
        keys = xr.where(self.sample_mask(), code * width + length, labels * width)
        counts = bincount(keys, (labels + 1) * width)[: labels * width].reshape(labels, width)
        return xr.DataArray(
            counts.astype("int64"),
            dims=("finish_reason", "length"),
            name="samples",
            coords={"finish_reason": list(FINISH_LABELS), "length": np.arange(width)},
        )

    def length_stats(self, quantiles: Sequence[float] = (0.5, 0.9, 0.99)) -> pd.DataFrame:
        """Response-length statistics of done samples per finish reason, plus an ``all`` row."""
        hist = self.length_histogram()
        rows = {label: hist.sel(finish_reason=label).values for label in FINISH_LABELS}
        rows = {label: counts for label, counts in rows.items() if counts.sum()}
        if rows:
            rows["all"] = hist.values.sum(axis=0)
        table = {label: histogram_row(counts, quantiles) for label, counts in rows.items()}
        frame = pd.DataFrame.from_dict(table, orient="index")
        if len(frame):
            frame.insert(1, "share", frame["samples"] / frame.loc["all", "samples"])
        frame.index.name = "finish_reason"
        return frame

    def tokens_per_prompt(self) -> xr.DataArray:
        """Response tokens of each prompt (all samples), lazily; NaN for rows not done."""
        return self._prompt_tokens().where(self.done_mask()).rename("response_tokens")

    def _prompt_tokens(self) -> xr.DataArray:
        lengths = self._ds["response_length"]
        return lengths.sum([d for d in lengths.dims if d != "prompt"])

    def totals(self) -> dict[str, int]:
        """Counts, samples (done prompts × n_samples), generated samples/trajectories and tokens of done rows."""
        import dask

        done = self.done_mask()
        prompt = xr.where(done, self._ds["prompt_length"].astype("int64"), 0).sum()
        response = xr.where(done, self._ds["response_length"].astype("int64"), 0).sum()
        prompt, response, generated = dask.compute(prompt, response, self.sample_mask().sum())
        counts = self.counts()
        return {
            **counts,
            "samples": counts["done"] * self._ds.sizes["sample"],
            "generated": int(generated),
            "prompt_tokens": int(prompt),
            "response_tokens": int(response),
        }

    def throughput(self, bin_seconds: float | None = None) -> pd.DataFrame:
        """Done prompts and response tokens per time bin of ``committed_at`` (with per-minute rates).

        ``bin_seconds`` defaults to a round width giving about 30 bins; ``df.attrs['bin_seconds']``
        holds the width used.  Empty when nothing is done.
        """
        import dask

        if "committed_at" not in self._ds:  # stores written before commit times were recorded
            return pd.DataFrame(columns=THROUGHPUT_COLUMNS)
        done = self.done_mask()
        times = epoch_seconds(self._ds["committed_at"]).where(done)
        lo, hi = (float(v) for v in dask.compute(times.min(), times.max()))
        if math.isnan(lo):
            return pd.DataFrame(columns=THROUGHPUT_COLUMNS)
        width = float(bin_seconds) if bin_seconds else nice_bin_seconds(hi - lo)
        return self._binned_rates(times, lo, hi, width)

    def _binned_rates(self, times: xr.DataArray, lo: float, hi: float, width: float) -> pd.DataFrame:
        """Done prompts and their response tokens, and their per-minute rates, per ``width``-second bin of
        ``times`` in ``[lo, hi]``.  Rows without a time (not done) fall into an extra bin past the end, which
        is dropped."""
        nbins = int((hi - lo) // width) + 1
        keys = ((times - lo) // width).fillna(nbins)
        prompts = bincount(keys, nbins + 1)[:nbins]
        token_sums = bincount(keys, nbins + 1, weights=self._prompt_tokens())[:nbins]
        frame = pd.DataFrame(
            {
                "start": pd.to_datetime(lo + width * np.arange(nbins), unit="s", utc=True),
                "prompts": prompts.astype("int64"),
                "tokens": np.rint(token_sums).astype("int64"),
            }
        )
        frame["prompts_per_min"] = frame["prompts"] * 60.0 / width
        frame["tokens_per_min"] = frame["tokens"] * 60.0 / width
        frame.attrs["bin_seconds"] = width
        return frame[THROUGHPUT_COLUMNS]

    def pass_rates(
        self, scores: str | xr.DataArray = "score", *, threshold: float = 0.5, ks: Sequence[int] = (1,)
    ) -> xr.Dataset:
        """Per-prompt pass rate and the unbiased pass@k (Chen et al. 2021) over done prompts.

        ``scores`` names a per-sample variable (a verifier run's ``score``, or one you added:
        ``ds["score"] = (("prompt", "sample"), values)``) or is such a DataArray; a sample passes when
        its score is ``>= threshold`` (booleans as they are).  Only generated samples count (a
        verifier run may stop a prompt early); pass@k uses the prompts with at least k of them.
        """
        scores = self._score_variable(scores)
        n = self._ds.sizes["sample"]
        bad = [k for k in ks if not 1 <= k <= n]
        if bad:
            raise ValueError(f"pass@k needs 1 <= k <= n_samples={n}, got {bad}")
        rows = self.rows("done")
        hits, used = self._hits_and_used(scores, threshold, rows)
        return _pass_dataset(rows, hits, used, ks).assign_attrs(threshold=threshold, done_prompts=len(rows))

    def _score_variable(self, scores: str | xr.DataArray) -> xr.DataArray:
        """The per-sample scores: the dataset variable named ``scores``, or ``scores`` itself."""
        if not isinstance(scores, str):
            return scores
        if scores not in self._ds:
            raise ValueError(
                f"no variable {scores!r} in the dataset; add per-sample scores first, e.g. "
                f"ds[{scores!r}] = (('prompt', 'sample'), values)"
            )
        return self._ds[scores]

    def _hits_and_used(self, scores: xr.DataArray, threshold: float, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per prompt of ``rows``: generated samples that passed, and generated samples (int64 arrays)."""
        import dask

        passed = per_sample(scores if scores.dtype == bool else scores >= threshold).isel(prompt=rows)
        used = per_sample(self._ds["finish_reason"] >= 0).isel(prompt=rows)
        hits, counted = (
            np.asarray(v.values, dtype=np.int64)
            for v in dask.compute((passed & used).sum("sample"), used.sum("sample"))
        )
        return hits, counted

    def settings(self, which: str = "done") -> pd.DataFrame:
        """The sampling settings each row of status ``which`` used, one column per key, indexed by ``prompt_index``
        (group by them: ``ds.daskgen.settings().groupby("temperature")``).  A run whose rows set nothing of their own
        gives the run's settings on every row."""
        from daskgen.input.sampling import run_settings

        rows = self.rows(which)
        texts = self._ds["sampling"].isel(prompt=rows).values if "sampling" in self._ds else [""] * len(rows)
        default = run_settings(self.attrs.config)
        records = [json.loads(str(text)) if str(text) else default for text in texts]
        index = pd.Index(self._ds["prompt_index"].values[rows], name="prompt_index")
        return pd.DataFrame.from_records(records, index=index, columns=sorted({k for r in records for k in r}))

    def image(self, digest: str, store: StoreRef | None = None) -> Any:
        """The stored image with SHA-256 ``digest`` (a value of ``image_hash``) as a Pillow image, its bytes checked
        against the hash (:func:`daskgen.read_image`); ``store``: the store (default: the one :func:`open_store`
        opened)."""
        where = store if store is not None else self._ds.encoding.get(LOCATION_KEY)
        if where is None:
            raise StoreError("this dataset does not name its store; open it with daskgen.open_store or pass store=.")
        from PIL import Image

        image = Image.open(io.BytesIO(read_image(where, str(digest))))
        image.load()
        return image

    # -- decoding -----------------------------------------------------------------------------
    def input_path(self, path: str | Path | None = None) -> Path | None:
        """The run's input file if it still holds the store's input (same fingerprint), else ``None``.

        ``path`` defaults to the recorded ``prompts`` path; a ``path`` you give must match (else
        :class:`StoreMismatchError`).  The file is streamed, never held in memory.
        """
        from daskgen.input.rows import fingerprint, iter_rows

        source = path or self.attrs.config.get("prompts")
        if not source or (path is None and not Path(source).is_file()):
            return None
        if fingerprint(row for _, row in iter_rows(Path(source))) == self.attrs.input.get("fingerprint"):
            return Path(source)
        if path is not None:
            raise StoreMismatchError(
                f"prompt file {str(path)!r} is not the input this store was made from (its "
                "fingerprint differs); pass the run's --prompts file."
            )
        return None

    def raw_prompts(self, rows: Sequence[int] | None = None, path: str | Path | None = None) -> list[str] | None:
        """JSON of the input's ``messages`` or ``prompt`` per row (default: all), ``None`` without the input.

        The input file is found as in :meth:`input_path`; ``rows`` are returned in increasing order.
        """
        source = self.input_path(path)
        if source is None:
            return None
        wanted = range(self._ds.sizes["prompt"]) if rows is None else sorted(int(r) for r in rows)
        return list(iter_raw_prompts(source, wanted))

    def tokenizer(self, path: str | None = None) -> Any:
        """The run's tokenizer (from the model folder in the attrs, or ``path``), checked against the store."""
        if self._tokenizer is not None and path is None:
            return self._tokenizer
        from daskgen.engines.tokenizer import load_tokenizer
        from daskgen.input.tokenizer import tokenizer_identity

        attrs = self.attrs
        identity = attrs.identity
        model = str(path or identity.get("model", ""))
        try:
            tok = load_tokenizer(model, identity.get("engine", ""), attrs.config.get("engine_args"))
        except ConfigError as exc:
            raise StoreError(
                f"cannot load this store's tokenizer: {exc} Pass the model folder as "
                "tokenizer=PATH (--tokenizer PATH), or export without text (--no-text)."
            ) from exc
        _check_identity(tokenizer_identity(tok), attrs.tokenizer, model)
        if path is None:
            self._tokenizer = tok
        return tok

    def texts(
        self,
        rows: Sequence[int] | None = None,
        *,
        limit: int | None = None,
        tokenizer: Any = None,
        skip_special_tokens: bool = True,
    ) -> pd.DataFrame:
        """Decoded prompt and response text per (prompt, sample[, trajectory]) of ``rows`` (default: done rows).

        ``tokenizer`` is a tokenizer object or a model folder; by default the store's own is loaded.
        """
        tok = tokenizer if tokenizer is not None and not isinstance(tokenizer, str) else self.tokenizer(tokenizer)
        picked = self.rows("done") if rows is None else np.asarray(rows, dtype=np.int64)
        picked = picked[:limit] if limit is not None else picked
        names = ["prompt_ids", "prompt_length", "response_ids", "response_length", "finish_reason"]
        names += [name for name in NUMBER_RECORDS if name in self._ds]
        sub = self._ds[names].isel(prompt=picked).compute()
        flat = flatten_samples(sub)
        prompts, responses = _decode_flat(tok, sub, flat, skip_special_tokens)
        return _sample_frame(flat).assign(prompt=prompts, response=responses)


def _pass_dataset(rows: np.ndarray, hits: np.ndarray, used: np.ndarray, ks: Sequence[int]) -> xr.Dataset:
    """Pass rate and generated samples per prompt of ``rows``; pass@k and the prompts it covers per ``k``."""
    with np.errstate(invalid="ignore", divide="ignore"):
        out = xr.Dataset(
            {"pass_rate": ("prompt", hits / used), "samples": ("prompt", used)},
            coords={"prompt_index": ("prompt", rows)},
        )
    out["pass_at_k"] = ("k", [pass_at_k(used, hits, k) for k in ks])
    out["pass_at_k_prompts"] = ("k", [int((used >= k).sum()) for k in ks])
    return out.assign_coords(k=list(ks))


def _sample_frame(flat: dict[str, np.ndarray]) -> pd.DataFrame:
    """One row per flattened sample: its indices, finish label, stop reason (when recorded) and response length."""
    columns = ["prompt_index", "prompt_id", "sample", "trajectory", *NUMBER_RECORDS, "response_length"]
    frame = pd.DataFrame({c: flat[c] for c in columns if c in flat})
    frame.insert(len(frame.columns) - 1, "finish_reason", finish_labels(flat["finish_reason"]))
    return frame


def _decode_flat(
    tok: Any, sub: xr.Dataset, flat: dict[str, np.ndarray], skip_special_tokens: bool
) -> tuple[np.ndarray, list[str]]:
    """Prompt and response text per flattened sample of ``sub`` (the prompt repeated for each of its samples)."""
    prompts = np.array(decode_prompts(tok, sub, skip_special_tokens), dtype=object)
    prompts = prompts[np.searchsorted(sub["prompt_index"].values, flat["prompt_index"])]
    responses = decode_many(
        tok,
        [ids[:n] for ids, n in zip(flat["response_ids"], flat["response_length"], strict=True)],
        skip_special_tokens,
    )
    return prompts, responses


def _check_identity(found: dict[str, Any], stored: dict[str, Any], model: str) -> None:
    diffs = [
        f"{k}: store has {stored.get(k)!r}, tokenizer at {model!r} has {found.get(k)!r}"
        for k in IDENTITY_KEYS
        if k in stored and stored.get(k) != found.get(k)
    ]
    if diffs:
        raise StoreMismatchError(
            "the tokenizer differs from the one the store was made with:\n  "
            + "\n  ".join(diffs)
            + "\nPass the run's model folder as tokenizer=PATH."
        )
