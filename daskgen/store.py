"""The Zarr v3 store (layout v1, see DESIGN.md): creation, compatibility, region writes, commits.

Workers write whole chunk-aligned regions of the data arrays; only the client writes
``status`` and ``error`` (coarse chunks), after the data landed.  ``status`` is the checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from daskgen.engines.base import FINISH_FLAG_MEANINGS, FINISH_FLAG_VALUES
from daskgen.errors import StoreError, StoreMismatchError, StoreWriteError

SCHEMA_VERSION = 1
#: Stores with a ``trajectory`` axis (agent loops that return several trajectories per sample).
SCHEMA_VERSION_TRAJECTORIES = 2
SCHEMA_VERSIONS = (SCHEMA_VERSION, SCHEMA_VERSION_TRAJECTORIES)
PENDING, DONE, FAILED = 0, 1, 2
#: Rows per chunk of the client-written, per-prompt arrays (status, error, coordinates).
COARSE_CHUNK = 65536
ATTRS_KEY = "daskgen"
COORDS = "prompt_index prompt_id"

#: Extra worker-written arrays of runs with a verifier.
SCORE_ARRAYS = ("score", "samples_used")
# Arrays written by workers, one region per partition.
DATA_ARRAYS = (
    "prompt_ids",
    "prompt_length",
    "response_ids",
    "response_length",
    "response_mask",
    "logprobs",
    "finish_reason",
    "num_turns",
    "continued_tokens",
)


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
        """Worker-written arrays of this layout."""
        return (DATA_ARRAYS + (("num_trajectories",) if self.n_trajectories > 1 else ())
                + (SCORE_ARRAYS if self.scored else ()))

    def partitions(self) -> range:
        """Start rows of every partition."""
        return range(0, self.n_prompts, self.partition_size)

    def array_specs(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], str, Any, list[str]]]:
        """name -> (shape, chunks, dtype, fill_value, dimension_names)."""
        n, s, p, r, rows = (self.n_prompts, self.n_samples, self.max_prompt_tokens, self.max_new_tokens,
                            self.partition_size)
        coarse = (min(COARSE_CHUNK, n),)
        specs = {
            "prompt_index": ((n,), coarse, "int64", -1, ["prompt"]),
            "prompt_id": ((n,), coarse, "str", "", ["prompt"]),
            "status": ((n,), coarse, "int8", PENDING, ["prompt"]),
            "error": ((n,), coarse, "str", "", ["prompt"]),
            "committed_at": ((n,), coarse, "float64", float("nan"), ["prompt"]),
            "prompt_ids": ((n, p), (rows, p), "int32", self.pad_token_id, ["prompt", "prompt_position"]),
            "prompt_length": ((n,), (rows,), "int32", 0, ["prompt"]),
            "response_ids": ((n, s, r), (rows, s, r), "int32", self.pad_token_id,
                             ["prompt", "sample", "response_position"]),
            "response_length": ((n, s), (rows, s), "int32", 0, ["prompt", "sample"]),
            "response_mask": ((n, s, r), (rows, s, r), "uint8", 0, ["prompt", "sample", "response_position"]),
            "logprobs": ((n, s, r), (rows, s, r), "float32", float("nan"),
                         ["prompt", "sample", "response_position"]),
            "finish_reason": ((n, s), (rows, s), "int8", -1, ["prompt", "sample"]),
            "num_turns": ((n, s), (rows, s), "int16", 0, ["prompt", "sample"]),
            "continued_tokens": ((n, s), (rows, s), "int32", 0, ["prompt", "sample"]),
        }
        if self.scored:
            specs["score"] = ((n, s), (rows, s), "float32", float("nan"), ["prompt", "sample"])
            specs["samples_used"] = ((n,), (rows,), "int16", 0, ["prompt"])
        return self._with_trajectories(specs) if self.n_trajectories > 1 else specs

    def _with_trajectories(self, specs: dict[str, Any]) -> dict[str, Any]:
        """Insert a ``trajectory`` axis after ``sample`` in every per-sample array (schema v2)."""
        t, out = self.n_trajectories, {}
        for name, (shape, chunks, dtype, fill, dims) in specs.items():
            if "sample" in dims and name != "score":
                shape, chunks, dims = (*shape[:2], t, *shape[2:]), (*chunks[:2], t, *chunks[2:]), \
                    [*dims[:2], "trajectory", *dims[2:]]
            out[name] = (shape, chunks, dtype, fill, dims)
        n, s, rows = self.n_prompts, self.n_samples, self.partition_size
        out["num_trajectories"] = ((n, s), (rows, s), "int16", 0, ["prompt", "sample"])
        return out


_VARIABLE_ATTRS: dict[str, dict[str, Any]] = {
    "prompt_index": {"long_name": "row number in the input"},
    "prompt_id": {"long_name": "the input's id column"},
    "status": {"flag_values": [PENDING, DONE, FAILED], "flag_meanings": "pending done failed",
               "long_name": "checkpoint: written by the client after the row's data landed"},
    "error": {"long_name": "last error of a failed prompt"},
    "committed_at": {"long_name": "when the client committed the row", "units": "seconds since 1970-01-01",
                     "calendar": "proleptic_gregorian"},
    "prompt_ids": {"long_name": "prompt tokens after the chat template, right-padded"},
    "prompt_length": {"long_name": "valid prompt tokens"},
    "response_ids": {"long_name": "response tokens, right-padded"},
    "response_length": {"long_name": "valid response tokens"},
    "response_mask": {"long_name": "1 = token generated by the model"},
    "logprobs": {"long_name": "log-probability of each sampled token (NaN where not requested)"},
    "finish_reason": {"flag_values": FINISH_FLAG_VALUES, "flag_meanings": FINISH_FLAG_MEANINGS,
                      "long_name": "why the sample ended (-1: not generated)"},
    "num_turns": {"long_name": "assistant turns in the trajectory"},
    "continued_tokens": {"long_name": "response tokens generated by an interrupted earlier attempt and continued "
                                      "(0: generated in one go)"},
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


def create(path: str | Path, layout: Layout, attrs: dict[str, Any], prompt_ids: list[str]) -> None:
    """Create an empty store: all arrays, coordinates, attrs and consolidated metadata."""
    zarr = _zarr()
    path = Path(path)
    if path.is_file() or (path.is_dir() and any(path.iterdir())):
        kind = "a file" if path.is_file() else "a non-empty directory that is not a daskgen store"
        raise StoreError(f"cannot create a store at {str(path)!r}: it is {kind}. Pass a new --store path.")
    group = zarr.open_group(str(path), mode="w-", zarr_format=3)
    for name, spec in layout.array_specs().items():
        _create_array(group, name, spec)
    group["prompt_index"][:] = np.arange(layout.n_prompts, dtype="int64")
    group["prompt_id"][:] = np.array(prompt_ids, dtype=object).astype(str)
    group.attrs[ATTRS_KEY] = _jsonable({**attrs, "schema_version": layout.schema_version, "layout": asdict(layout),
                                        "created": _dt.datetime.now(_dt.timezone.utc).isoformat()})
    zarr.consolidate_metadata(str(path))


def add_missing_arrays(path: str | Path, layout: Layout) -> list[str]:
    """Create arrays of ``layout`` that an older store lacks (client only, under the lock).

    Stores written before ``continued_tokens`` existed gain it (all zeros) when a run resumes them.
    Returns the names added.
    """
    zarr = _zarr()
    group = zarr.open_group(str(path), mode="r+")
    missing = [name for name in layout.array_specs() if name not in group]
    for name in missing:
        _create_array(group, name, layout.array_specs()[name])
    if missing:
        zarr.consolidate_metadata(str(path))
    return missing


def _create_array(group: Any, name: str, spec: tuple) -> None:
    shape, chunks, dtype, fill, dims = spec
    extra = {} if name in ("prompt_index", "prompt_id") else {"coordinates": COORDS}
    group.create_array(
        name, shape=shape, chunks=chunks, dtype=str if dtype == "str" else dtype, fill_value=fill,
        dimension_names=dims, compressors=_compressors(), attributes={**_VARIABLE_ATTRS[name], **extra},
    )


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def read_attrs(path: str | Path) -> dict[str, Any] | None:
    """The store's ``daskgen`` attrs, or ``None`` when the path is not a daskgen store."""
    meta = Path(path) / "zarr.json"
    if not meta.is_file():
        return None
    try:
        doc = json.loads(meta.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise StoreError(f"{str(meta)!r} is not readable Zarr metadata: {exc}") from exc
    return (doc.get("attributes") or {}).get(ATTRS_KEY)


def layout_of(attrs: dict[str, Any]) -> Layout:
    """The :class:`Layout` recorded in a store's attrs."""
    return Layout(**attrs["layout"])


def check_compatible(path: str | Path, stored: dict[str, Any], wanted: dict[str, Any]) -> None:
    """Refuse a resume whose identity (settings, input, tokenizer) differs from the store's."""
    if stored.get("schema_version") not in SCHEMA_VERSIONS:
        raise StoreMismatchError(
            f"store {str(path)!r} has schema_version {stored.get('schema_version')!r}; this daskgen reads "
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
            f"cannot resume {str(path)!r}: this run differs from the one that created the store:\n  "
            + "\n  ".join(diffs)
            + "\nRerun with the store's settings and input to resume, or pass a new --store path to start a new run."
        )


def read_status(path: str | Path) -> np.ndarray:
    """The whole checkpoint mask (coarse chunks: fast even for millions of rows)."""
    return np.asarray(_zarr().open_array(str(Path(path) / "status"), mode="r")[:])


def commit(path: str | Path, start: int, status: np.ndarray, errors: list[str] | None,
           committed_at: np.ndarray | None = None) -> None:
    """Client-only: record a partition's outcome.  ``error`` and times first, then ``status`` (the commit)."""
    zarr = _zarr()
    stop = start + len(status)
    with _write_errors(path, f"committing rows {start}..{stop - 1}"):
        if committed_at is not None:
            zarr.open_array(str(Path(path) / "committed_at"), mode="r+")[start:stop] = committed_at
        if errors is not None:
            values = np.array(errors, dtype=object).astype(str)
            zarr.open_array(str(Path(path) / "error"), mode="r+")[start:stop] = values
        zarr.open_array(str(Path(path) / "status"), mode="r+")[start:stop] = status.astype("int8")


class StatusWriter:
    """Client-only: :func:`commit` with the three client-written arrays opened once for a whole run."""

    def __init__(self, path: str | Path) -> None:
        zarr = _zarr()
        self.path = path
        self.arrays = {name: zarr.open_array(str(Path(path) / name), mode="r+")
                       for name in ("committed_at", "error", "status")}

    def commit(self, start: int, status: np.ndarray, errors: list[str] | None,
               committed_at: np.ndarray | None = None) -> None:
        """Like :func:`commit`; a range covering whole coarse chunks is written without reading them."""
        stop = start + len(status)
        with _write_errors(self.path, f"committing rows {start}..{stop - 1}"):
            if committed_at is not None:
                self.arrays["committed_at"][start:stop] = committed_at
            if errors is not None:
                self.arrays["error"][start:stop] = np.array(errors, dtype=object).astype(str)
            self.arrays["status"][start:stop] = status.astype("int8")


def write_region(path: str | Path, start: int, arrays: dict[str, np.ndarray]) -> None:
    """Worker side: overwrite one chunk-aligned row region of each given data array."""
    zarr = _zarr()
    for name, values in arrays.items():
        if name not in DATA_ARRAYS + ("num_trajectories",) + SCORE_ARRAYS:
            raise StoreError(f"workers may only write data arrays {DATA_ARRAYS}, not {name!r}")
        with _write_errors(path, f"writing {name} rows {start}..{start + len(values) - 1}"):
            zarr.open_array(str(Path(path) / name), mode="r+")[start : start + len(values)] = values


@contextlib.contextmanager
def _write_errors(path: str | Path, what: str) -> Iterator[None]:
    """Turn OS-level write failures into :class:`StoreWriteError` naming the store and the fix."""
    try:
        yield
    except OSError as exc:
        raise StoreWriteError(
            f"{what} of store {str(path)!r} failed: {exc}. Finished work is saved (each chunk is replaced "
            "atomically); free disk space or fix permissions, then rerun the same command to resume."
        ) from exc


def read_region(path: str | Path, start: int, stop: int,
                names: tuple[str, ...] = DATA_ARRAYS) -> dict[str, np.ndarray]:
    """Read the rows ``[start, stop)`` of the named arrays (e.g. rows a partition must keep)."""
    zarr = _zarr()
    return {name: np.asarray(zarr.open_array(str(Path(path) / name), mode="r")[start:stop]) for name in names}


def update_attrs(path: str | Path, **updates: Any) -> None:
    """Merge keys into the ``daskgen`` attrs and re-consolidate metadata (client only)."""
    zarr = _zarr()
    group = zarr.open_group(str(path), mode="r+")
    attrs = dict(group.attrs.get(ATTRS_KEY, {}))
    attrs.update(_jsonable(updates))
    group.attrs[ATTRS_KEY] = attrs
    zarr.consolidate_metadata(str(path))


def append_run(path: str | Path, record: dict[str, Any]) -> None:
    """Append one invocation's summary to the ``runs`` history in the attrs."""
    attrs = read_attrs(path) or {}
    runs = list(attrs.get("runs", []))
    runs.append({**record, "finished": _dt.datetime.now(_dt.timezone.utc).isoformat()})
    update_attrs(path, runs=runs)


def open_store(path: str | Path):
    """Open a store lazily as an ``xarray.Dataset`` (also while a run is writing it).

    Registers the ``ds.daskgen`` accessor (:mod:`daskgen.analysis`) and adds a lazy ``finish_label``
    variable (``finish_reason`` decoded to ``stop``/``length``/``abort``/``error``/``not_generated``).
    """
    import xarray as xr

    import daskgen.analysis  # noqa: F401 - registers ds.daskgen

    if read_attrs(path) is None:
        raise StoreError(
            f"{str(path)!r} is not a daskgen store (no {ATTRS_KEY!r} attrs in its zarr.json); "
            "pass the --store path of a daskgen run."
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = xr.open_zarr(str(path))
    return ds.daskgen.labelled()
