"""The Zarr v3 store: its layout, creation, compatibility, region writes, commits.

This module alone owns the layout (``docs/architecture.md``): every array's shape, chunks,
dtype, fill value, dimensions and writer (:class:`ArraySpec`, :meth:`Layout.array_specs`), the
worker-writable arrays derived from it (:meth:`Layout.data_arrays`) and the fill rules
(:func:`empty_region`, :func:`clear_response`).  Opening a store for analysis
(:func:`daskgen.analysis.accessor.open_store`) lives with the xarray accessor.

Workers write whole chunk-aligned regions of the data arrays; only the client writes
``status`` and ``error`` (coarse chunks), after the data landed.  ``status`` is the checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from daskgen import tunables
from daskgen.engines.base import FINISH_FLAG_MEANINGS, FINISH_FLAG_VALUES
from daskgen.errors import StoreError, StoreMismatchError, StoreWriteError
from daskgen.store.location import StoreLocation, locate, write_failures

SCHEMA_VERSION = 1
#: Stores with a ``trajectory`` axis (agent loops that return several trajectories per sample).
SCHEMA_VERSION_TRAJECTORIES = 2
SCHEMA_VERSIONS = (SCHEMA_VERSION, SCHEMA_VERSION_TRAJECTORIES)
PENDING, DONE, FAILED = 0, 1, 2
ATTRS_KEY = "daskgen"
COORDS = "prompt_index prompt_id"
#: A store: a local path, an object-storage URL (``s3://bucket/run.zarr``) or a :class:`StoreLocation`.
Where = str | Path | StoreLocation


def coarse_chunk() -> int:
    """Rows per chunk of the client-written, per-prompt arrays (status, error, coordinates) of new
    stores: the Dask config ``daskgen.coarse-chunk``."""
    return int(tunables.get("coarse-chunk"))


def client_written_arrays() -> frozenset[str]:
    """Names of the arrays only the client writes (coordinates and the commit record), in every layout."""
    layout = Layout(1, 1, 1, 1, 1, 0, n_trajectories=2, scored=True)
    return frozenset(name for name, spec in layout.array_specs().items() if not spec.worker_written)


#: Fill value of ``finish_reason`` for a sample that was not generated.
NOT_GENERATED = -1
#: Who writes an array, by :attr:`ArraySpec.role`: the client (at creation, or when committing) or
#: the workers (one chunk-aligned region per partition).
CLIENT_ROLES = ("coordinate", "commit")
WORKER_ROLES = ("prompt", "response", "sample")


@dataclass(frozen=True)
class ArraySpec:
    """One array of the store layout.

    Attributes
    ----------
    shape, chunks, dtype, fill, dims:
        Zarr shape, chunk shape, dtype (``"str"`` for variable-length strings), fill value and
        dimension names.
    role:
        ``"coordinate"`` (``prompt_index``, ``prompt_id``: written at creation), ``"commit"``
        (``status``, ``error``, ``committed_at``: the client's commit record), ``"prompt"`` (per
        prompt, worker-written), ``"response"`` (one trajectory's response: cleared together, and
        given a ``trajectory`` axis in schema v2) or ``"sample"`` (per-sample extras: verifier
        scores, trajectory counts).
    """

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: str
    fill: Any
    dims: tuple[str, ...]
    role: str

    @property
    def worker_written(self) -> bool:
        """Whether workers write this array (one region per partition); else only the client does."""
        return self.role in WORKER_ROLES


@dataclass(frozen=True)
class Layout:
    """Shape of a store: rows, samples, padded widths, chunk rows, pad id."""

    n_prompts: int
    n_samples: int
    max_prompt_tokens: int
    max_new_tokens: int
    partition_size: int
    pad_token_id: int
    n_trajectories: int = 1
    scored: bool = False

    @property
    def schema_version(self) -> int:
        """1 for the plain layout, 2 when responses carry a ``trajectory`` axis."""
        return SCHEMA_VERSION if self.n_trajectories == 1 else SCHEMA_VERSION_TRAJECTORIES

    def data_arrays(self) -> tuple[str, ...]:
        """Worker-written arrays of this layout (from :meth:`array_specs`)."""
        return tuple(name for name, spec in self.array_specs().items() if spec.worker_written)

    def partitions(self) -> range:
        """Start rows of every partition."""
        return range(0, self.n_prompts, self.partition_size)

    def array_specs(self) -> dict[str, ArraySpec]:
        """Every array of the layout, by name."""
        n, s, p, r, rows = (
            self.n_prompts,
            self.n_samples,
            self.max_prompt_tokens,
            self.max_new_tokens,
            self.partition_size,
        )
        coarse = (min(coarse_chunk(), n),)
        per_prompt, per_sample = ("prompt",), ("prompt", "sample")
        per_token = ("prompt", "sample", "response_position")
        specs = {
            "prompt_index": ArraySpec((n,), coarse, "int64", -1, per_prompt, "coordinate"),
            "prompt_id": ArraySpec((n,), coarse, "str", "", per_prompt, "coordinate"),
            "status": ArraySpec((n,), coarse, "int8", PENDING, per_prompt, "commit"),
            "error": ArraySpec((n,), coarse, "str", "", per_prompt, "commit"),
            "committed_at": ArraySpec((n,), coarse, "float64", float("nan"), per_prompt, "commit"),
            "prompt_ids": ArraySpec(
                (n, p), (rows, p), "int32", self.pad_token_id, ("prompt", "prompt_position"), "prompt"
            ),
            "prompt_length": ArraySpec((n,), (rows,), "int32", 0, per_prompt, "prompt"),
            "response_ids": ArraySpec((n, s, r), (rows, s, r), "int32", self.pad_token_id, per_token, "response"),
            "response_length": ArraySpec((n, s), (rows, s), "int32", 0, per_sample, "response"),
            "response_mask": ArraySpec((n, s, r), (rows, s, r), "uint8", 0, per_token, "response"),
            "logprobs": ArraySpec((n, s, r), (rows, s, r), "float32", float("nan"), per_token, "response"),
            "finish_reason": ArraySpec((n, s), (rows, s), "int8", NOT_GENERATED, per_sample, "response"),
            "num_turns": ArraySpec((n, s), (rows, s), "int16", 0, per_sample, "response"),
            "continued_tokens": ArraySpec((n, s), (rows, s), "int32", 0, per_sample, "response"),
        }
        if self.scored:
            specs["score"] = ArraySpec((n, s), (rows, s), "float32", float("nan"), per_sample, "sample")
            specs["samples_used"] = ArraySpec((n,), (rows,), "int16", 0, per_prompt, "sample")
        return self._with_trajectories(specs) if self.n_trajectories > 1 else specs

    def _with_trajectories(self, specs: dict[str, ArraySpec]) -> dict[str, ArraySpec]:
        """Insert a ``trajectory`` axis after ``sample`` in every response array (schema v2)."""
        t, out = self.n_trajectories, {}
        for name, spec in specs.items():
            if spec.role == "response":
                spec = replace(
                    spec,
                    shape=(*spec.shape[:2], t, *spec.shape[2:]),
                    chunks=(*spec.chunks[:2], t, *spec.chunks[2:]),
                    dims=(*spec.dims[:2], "trajectory", *spec.dims[2:]),
                )
            out[name] = spec
        n, s, rows = self.n_prompts, self.n_samples, self.partition_size
        out["num_trajectories"] = ArraySpec((n, s), (rows, s), "int16", 0, ("prompt", "sample"), "sample")
        return out


#: Worker-written arrays of the plain layout (v1, no verifier).
DATA_ARRAYS = Layout(1, 1, 1, 1, 1, 0).data_arrays()
#: Every array a worker may write, in any layout.
WORKER_ARRAYS = Layout(1, 1, 1, 1, 1, 0, n_trajectories=2, scored=True).data_arrays()
#: Extra worker-written arrays of runs with a verifier.
SCORE_ARRAYS = ("score", "samples_used")


def empty_region(layout: Layout, n_rows: int) -> dict[str, np.ndarray]:
    """Fill-valued arrays for ``n_rows`` rows of every data array."""
    specs = layout.array_specs()
    return {
        name: np.full((n_rows, *specs[name].shape[1:]), specs[name].fill, dtype=specs[name].dtype)
        for name in layout.data_arrays()
    }


def clear_response(region: dict[str, np.ndarray], index: tuple[int, ...], layout: Layout) -> None:
    """Reset one sample's (or trajectory's) response arrays in ``region`` to their fill values."""
    for name, spec in layout.array_specs().items():
        if spec.role == "response":
            region[name][index] = spec.fill


_VARIABLE_ATTRS: dict[str, dict[str, Any]] = {
    "prompt_index": {"long_name": "row number in the input"},
    "prompt_id": {"long_name": "the input's id column"},
    "status": {
        "flag_values": [PENDING, DONE, FAILED],
        "flag_meanings": "pending done failed",
        "long_name": "checkpoint: written by the client after the row's data landed",
    },
    "error": {"long_name": "last error of a failed prompt"},
    "committed_at": {
        "long_name": "when the client committed the row",
        "units": "seconds since 1970-01-01",
        "calendar": "proleptic_gregorian",
    },
    "prompt_ids": {"long_name": "prompt tokens after the chat template, right-padded"},
    "prompt_length": {"long_name": "valid prompt tokens"},
    "response_ids": {"long_name": "response tokens, right-padded"},
    "response_length": {"long_name": "valid response tokens"},
    "response_mask": {"long_name": "1 = token generated by the model"},
    "logprobs": {"long_name": "log-probability of each sampled token (NaN where not requested)"},
    "finish_reason": {
        "flag_values": FINISH_FLAG_VALUES,
        "flag_meanings": FINISH_FLAG_MEANINGS,
        "long_name": "why the sample ended (-1: not generated)",
    },
    "num_turns": {"long_name": "assistant turns in the trajectory"},
    "continued_tokens": {
        "long_name": "response tokens generated by an interrupted earlier attempt and continued "
        "(0: generated in one go)"
    },
    "score": {"long_name": "verifier score of the sample (NaN: not generated, or the verifier raised)"},
    "samples_used": {"long_name": "samples generated for the prompt before it was satisfied"},
    "num_trajectories": {"long_name": "trajectories of the sample (the rest of the trajectory axis is padding)"},
}


def _zarr():
    import zarr

    warnings.filterwarnings("ignore", message=".*Consolidated metadata.*")
    warnings.filterwarnings("ignore", message=".*daskgen.lock is not recognized.*")
    return zarr


def _compressors():
    from zarr.codecs import ZstdCodec

    return [ZstdCodec(level=3)]


def create(path: Where, layout: Layout, attrs: dict[str, Any], prompt_ids: list[str]) -> None:
    """Create an empty store: all arrays, coordinates, attrs and consolidated metadata."""
    zarr = _zarr()
    loc = locate(path)
    if not loc.is_empty():
        kind = (
            "a file"
            if loc.is_local and loc.path.is_file()  # type: ignore[attr-defined]
            else "a non-empty location that is not a daskgen store"
        )
        raise StoreError(f"cannot create a store at {loc.url!r}: it is {kind}. Pass a new --store path.")
    group = zarr.open_group(loc.zarr_store(), mode="w-", zarr_format=3)
    for name, spec in layout.array_specs().items():
        _create_array(group, name, spec)
    group["prompt_index"][:] = np.arange(layout.n_prompts, dtype="int64")
    group["prompt_id"][:] = np.array(prompt_ids, dtype=object).astype(str)
    group.attrs[ATTRS_KEY] = _jsonable(
        {
            **attrs,
            "schema_version": layout.schema_version,
            "layout": asdict(layout),
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        }
    )
    zarr.consolidate_metadata(loc.zarr_store())


def add_missing_arrays(path: Where, layout: Layout) -> list[str]:
    """Create arrays of ``layout`` that an older store lacks (client only, under the lock).

    Stores written before ``continued_tokens`` existed gain it (all zeros) when a run resumes them.
    Returns the names added.
    """
    zarr = _zarr()
    target = locate(path).zarr_store()
    group = zarr.open_group(target, mode="r+")
    missing = [name for name in layout.array_specs() if name not in group]
    for name in missing:
        _create_array(group, name, layout.array_specs()[name])
    if missing:
        zarr.consolidate_metadata(target)
    return missing


def _create_array(group: Any, name: str, spec: ArraySpec) -> None:
    extra = {} if spec.role == "coordinate" else {"coordinates": COORDS}
    group.create_array(
        name,
        shape=spec.shape,
        chunks=spec.chunks,
        dtype=str if spec.dtype == "str" else spec.dtype,
        fill_value=spec.fill,
        dimension_names=list(spec.dims),
        compressors=_compressors(),
        attributes={**_VARIABLE_ATTRS[name], **extra},
    )


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def read_attrs(path: Where) -> dict[str, Any] | None:
    """The store's ``daskgen`` attrs, or ``None`` when the path is not a daskgen store."""
    loc = locate(path)
    try:
        raw = loc.read_bytes("zarr.json")
        if raw is None:
            return None
        doc = json.loads(raw)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StoreError(f"{loc.url + '/zarr.json'!r} is not readable Zarr metadata: {exc}") from exc
    return (doc.get("attributes") or {}).get(ATTRS_KEY)


def layout_of(attrs: dict[str, Any]) -> Layout:
    """The :class:`Layout` recorded in a store's attrs."""
    return Layout(**attrs["layout"])


def check_compatible(path: Where, stored: dict[str, Any], wanted: dict[str, Any]) -> None:
    """Refuse a resume whose identity (settings, input, tokenizer) differs from the store's."""
    if stored.get("schema_version") not in SCHEMA_VERSIONS:
        raise StoreMismatchError(
            f"store {str(locate(path))!r} has schema_version {stored.get('schema_version')!r}; this daskgen reads "
            f"{list(SCHEMA_VERSIONS)}. Use a new --store path (or the daskgen version that wrote it)."
        )
    diffs = []
    for section in ("identity", "input", "tokenizer"):
        old, new = stored.get(section, {}), _jsonable(wanted.get(section, {}))
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                diffs.append(f"{key}: store has {old.get(key)!r}, this run has {new.get(key)!r}")
    if diffs:
        raise StoreMismatchError(
            f"cannot resume {str(locate(path))!r}: this run differs from the one that created the store:\n  "
            + "\n  ".join(diffs)
            + "\nRerun with the store's settings and input to resume, or pass a new --store path to start a new run."
        )
    _check_not_packed(path, stored)


def _check_not_packed(path: Where, stored: dict[str, Any]) -> None:
    """Refuse to resume a packed store with rows left: partitions share its shards (writers would lose data)."""
    if not stored.get("packed"):
        return
    left = int((read_status(path) != DONE).sum())
    if left:
        loc = locate(path)
        raise StoreMismatchError(
            f"cannot resume {loc.url!r}: it is packed (daskgen pack: many partitions share each shard file, and "
            f"workers writing one shard at once lose data), and {left} row(s) are not done. Run `daskgen unpack "
            f"{loc.url}` first (then rerun; pack again when it is finished), or rerun into a new --store."
        )


def _array(path: Where, name: str, mode: str) -> Any:
    """The array ``name`` of the store at ``path``, opened through its location."""
    loc = locate(path)
    return _zarr().open_array(loc.zarr_store(read_only=mode == "r"), path=name, mode=mode)


def read_status(path: Where) -> np.ndarray:
    """The whole checkpoint mask (coarse chunks: fast even for millions of rows)."""
    return np.asarray(_array(path, "status", "r")[:])


def commit(
    path: Where, start: int, status: np.ndarray, errors: list[str] | None, committed_at: np.ndarray | None = None
) -> None:
    """Client-only: record a partition's outcome.  ``error`` and times first, then ``status`` (the commit)."""
    stop = start + len(status)
    with _write_errors(path, f"committing rows {start}..{stop - 1}"):
        if committed_at is not None:
            _array(path, "committed_at", "r+")[start:stop] = committed_at
        if errors is not None:
            values = np.array(errors, dtype=object).astype(str)
            _array(path, "error", "r+")[start:stop] = values
        _array(path, "status", "r+")[start:stop] = status.astype("int8")


class StatusWriter:
    """Client-only: :func:`commit` with the three client-written arrays opened once for a whole run."""

    def __init__(self, path: Where) -> None:
        self.path = path
        self.arrays = {name: _array(path, name, "r+") for name in ("committed_at", "error", "status")}

    @property
    def chunk_rows(self) -> int:
        """Rows per chunk of this store's ``status`` (``daskgen.coarse-chunk`` when it was created)."""
        return int(self.arrays["status"].chunks[0])

    def commit(
        self, start: int, status: np.ndarray, errors: list[str] | None, committed_at: np.ndarray | None = None
    ) -> None:
        """Like :func:`commit`; a range covering whole coarse chunks is written without reading them."""
        stop = start + len(status)
        with _write_errors(self.path, f"committing rows {start}..{stop - 1}"):
            if committed_at is not None:
                self.arrays["committed_at"][start:stop] = committed_at
            if errors is not None:
                self.arrays["error"][start:stop] = np.array(errors, dtype=object).astype(str)
            self.arrays["status"][start:stop] = status.astype("int8")


def write_region(path: Where, start: int, arrays: dict[str, np.ndarray]) -> None:
    """Worker side: overwrite one chunk-aligned row region of each given data array."""
    for name, values in arrays.items():
        if name not in WORKER_ARRAYS:
            raise StoreError(f"workers may only write data arrays {WORKER_ARRAYS}, not {name!r}")
        with _write_errors(path, f"writing {name} rows {start}..{start + len(values) - 1}"):
            _array(path, name, "r+")[start : start + len(values)] = values


@contextlib.contextmanager
def _write_errors(path: Where, what: str) -> Iterator[None]:
    """Turn OS-level write failures into :class:`StoreWriteError` naming the store and the fix."""
    try:
        yield
    except write_failures() as exc:
        raise StoreWriteError(
            f"{what} of store {str(locate(path))!r} failed: {exc}. Finished work is saved (each chunk is replaced "
            "atomically); free disk space, fix permissions (or the object store's credentials or connection), "
            "then rerun the same command to resume."
        ) from exc


def read_region(path: Where, start: int, stop: int, names: tuple[str, ...] = DATA_ARRAYS) -> dict[str, np.ndarray]:
    """Read the rows ``[start, stop)`` of the named arrays (e.g. rows a partition must keep)."""
    return {name: np.asarray(_array(path, name, "r")[start:stop]) for name in names}


def update_attrs(path: Where, **updates: Any) -> None:
    """Merge keys into the ``daskgen`` attrs and re-consolidate metadata (client only)."""
    zarr = _zarr()
    target = locate(path).zarr_store()
    group = zarr.open_group(target, mode="r+")
    attrs = dict(group.attrs.get(ATTRS_KEY, {}))
    attrs.update(_jsonable(updates))
    group.attrs[ATTRS_KEY] = attrs
    zarr.consolidate_metadata(target)


def append_run(path: Where, record: dict[str, Any]) -> None:
    """Append one invocation's summary to the ``runs`` history in the attrs."""
    attrs = read_attrs(path) or {}
    runs = list(attrs.get("runs", []))
    runs.append({**record, "finished": _dt.datetime.now(_dt.timezone.utc).isoformat()})
    update_attrs(path, runs=runs)
