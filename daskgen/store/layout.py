"""The store layout: every array's shape, chunks, dtype, fill value, dimensions and writer.

One place defines the arrays (:class:`ArraySpec`, :meth:`Layout.array_specs`); the worker-writable
arrays (:meth:`Layout.data_arrays`), the fill rules (:func:`empty_region`, :func:`clear_response`) and
the CF attributes of each variable (:data:`VARIABLE_ATTRS`) derive from it.  Data arrays are chunked
along ``prompt`` by the partition size; the client-written arrays (coordinates and the commit record
``status``/``error``/``committed_at``/``commit_seq``) use coarse chunks (``daskgen.coarse-chunk``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any

import numpy as np

from daskgen import tunables
from daskgen.engines.base import FINISH_FLAG_MEANINGS, FINISH_FLAG_VALUES

SCHEMA_VERSION = 1
#: Stores with a ``trajectory`` axis (agent loops that return several trajectories per sample).
SCHEMA_VERSION_TRAJECTORIES = 2
SCHEMA_VERSIONS = (SCHEMA_VERSION, SCHEMA_VERSION_TRAJECTORIES)
PENDING, DONE, FAILED = 0, 1, 2
#: The ``coordinates`` attribute of every non-coordinate array (CF conventions, read by xarray).
COORDS = "prompt_index prompt_id"
#: Per-prompt records of what each row asked for (its sampling settings and structured-output format as JSON text,
#: its LoRA adapter's name; ``""``: none, the base model), given by name to every sample in exports and followed
#: batches (in stores that record them).
TEXT_RECORDS = ("sampling", "response_format", "adapter")
#: Per-sample integer records beside ``finish_reason`` (in exports and followed batches as they are).
NUMBER_RECORDS = ("stop_reason",)
#: Prefix of the arrays holding the input's kept columns (``keep_columns``): ``column_answer``.
COLUMN_PREFIX = "column_"


def column_array(name: str) -> str:
    """The store array of the kept input column ``name``."""
    return COLUMN_PREFIX + name


def column_name(array: str) -> str | None:
    """The kept input column an array (or flattened field) holds, or ``None`` when it holds none."""
    return array[len(COLUMN_PREFIX) :] if array.startswith(COLUMN_PREFIX) else None


def coarse_chunk() -> int:
    """Rows per chunk of the client-written, per-prompt arrays (status, error, coordinates) of new
    stores: the Dask config ``daskgen.coarse-chunk``."""
    return int(tunables.get("coarse-chunk"))


def client_written_arrays() -> frozenset[str]:
    """Names of the arrays only the client writes (coordinates and the commit record), in every layout."""
    layout = Layout(1, 1, 1, 1, 1, 0, n_trajectories=2, scored=True, row_sampling=True, stops=True)
    return frozenset(name for name, spec in layout.array_specs().items() if not spec.worker_written)


#: The policy versions of each sample's tokens (:mod:`daskgen.store.policy`): its first and last model token's
#: version and the response position where the version changed (-1 each: no model token, or no change).
VERSION_ARRAYS = ("policy_version", "policy_version_end", "version_changed_at")
#: The fingerprints of the policy versions of each sample's first and last model token: the version's published
#: digest as a signed 64-bit integer (:func:`daskgen.store.fingerprint.digest_number`), stored once the worker
#: checked its engine's loaded weights against it; 0: no model token, version 0 (the run's model), or unchecked.
FINGERPRINT_ARRAYS = ("policy_fingerprint", "policy_fingerprint_end")
#: The per-sample integers every export and followed batch carries as they are (when the store has them).
SAMPLE_NUMBERS = (*NUMBER_RECORDS, *VERSION_ARRAYS, *FINGERPRINT_ARRAYS)
#: Not stored: the per-sample boolean a follower with ``max_staleness`` adds to every format (True: the sample's
#: first token is too many policy versions behind the newest, :mod:`daskgen.stream.staleness`).
STALE_FIELD = "stale"
#: Fill value of ``top_logprob_ids`` where there is no entry.
NO_TOKEN = -1
#: Fill value of ``finish_reason`` for a sample that was not generated.
NOT_GENERATED = -1
#: Roles of the arrays workers write (one chunk-aligned region per partition); the client writes the
#: others (``coordinate`` at creation, ``commit`` when committing).
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
        (``status``, ``error``, ``committed_at``, ``commit_seq``: the client's commit record), ``"prompt"`` (per
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
    columns: tuple[str, ...] = ()
    #: Some row carries its own sampling settings: the per-prompt ``sampling`` array records them.
    row_sampling: bool = False
    #: The run uses stop strings or stop token ids: the per-sample ``stop_reason`` array says which ended it.
    stops: bool = False
    structured: bool = False  # rows carry a ``response_format`` (stored per prompt as JSON text)
    top_logprobs: int = 0
    adapters: bool = False  # the run declares LoRA adapters: each row's adapter name is stored per prompt
    max_images: int = 0  # the most images a prompt has: the width of the per-image arrays (0: none)
    #: The most images a sample's tools may return (the tool loop's ``max_tool_images``): the width of the per-sample
    #: tool-image arrays (0: none).
    tool_images: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", tuple(self.columns))  # a list when read from the attrs

    @property
    def schema_version(self) -> int:
        """1 for the plain layout, 2 when responses carry a ``trajectory`` axis."""
        return SCHEMA_VERSION if self.n_trajectories == 1 else SCHEMA_VERSION_TRAJECTORIES

    def data_arrays(self) -> tuple[str, ...]:
        """Worker-written arrays of this layout (from :meth:`array_specs`)."""
        return tuple(name for name, spec in self.array_specs().items() if spec.worker_written)

    def column_arrays(self) -> tuple[str, ...]:
        """The arrays of the input's kept columns (``keep_columns``), in the order they were listed."""
        return tuple(column_array(name) for name in self.columns)

    def sample_records(self) -> tuple[str, ...]:
        """The arrays every export and followed batch carries beside the token arrays, as far as this layout has
        them: the row's settings (:data:`TEXT_RECORDS`), :data:`NUMBER_RECORDS`, the top-k logprobs and the input's
        kept columns."""
        specs = self.array_specs()
        records = (name for name in (*TEXT_RECORDS, *NUMBER_RECORDS) if name in specs)
        return (*records, *top_logprob_arrays(self), *self.column_arrays())

    def partitions(self) -> range:
        """Start rows of every partition."""
        return range(0, self.n_prompts, self.partition_size)

    def partition_of(self, row: int) -> int:
        """The start row of the partition holding ``row``."""
        return int(row) - int(row) % self.partition_size

    def partitions_of(self, rows: Iterable[int]) -> list[int]:
        """The start rows of the partitions holding any of ``rows``, ascending."""
        return sorted({self.partition_of(r) for r in rows})

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
            "commit_seq": ArraySpec((n,), coarse, "int64", 0, per_prompt, "commit"),
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
            "cached_prompt_tokens": ArraySpec((n, s), (rows, s), "int32", -1, per_sample, "response"),
            **{name: ArraySpec((n, s), (rows, s), "int32", -1, per_sample, "response") for name in VERSION_ARRAYS},
            **{name: ArraySpec((n, s), (rows, s), "int64", 0, per_sample, "response") for name in FINGERPRINT_ARRAYS},
        }
        for name in self.columns:  # the input's kept columns (as text), written with the row's data
            specs[column_array(name)] = ArraySpec((n,), (rows,), "str", "", per_prompt, "prompt")
        if self.row_sampling:
            specs["sampling"] = ArraySpec((n,), (rows,), "str", "", per_prompt, "prompt")
        if self.stops:
            specs["stop_reason"] = ArraySpec((n, s), (rows, s), "int16", -1, per_sample, "response")
        if self.structured:
            specs["response_format"] = ArraySpec((n,), (rows,), "str", "", per_prompt, "prompt")
        if self.adapters:
            specs["adapter"] = ArraySpec((n,), (rows,), "str", "", per_prompt, "prompt")
        if self.top_logprobs:
            specs.update(self._top_logprob_specs())
        if self.max_images:
            specs.update(self._image_specs())
        if self.tool_images:
            specs.update(self._tool_image_specs())
        if self.scored:
            specs["score"] = ArraySpec((n, s), (rows, s), "float32", float("nan"), per_sample, "sample")
            specs["samples_used"] = ArraySpec((n,), (rows,), "int16", 0, per_prompt, "sample")
        return self._with_trajectories(specs) if self.n_trajectories > 1 else specs

    def _top_logprob_specs(self) -> dict[str, ArraySpec]:
        """``top_logprob_ids``/``top_logprobs``: the ``top_logprobs`` most likely tokens at each response position."""
        n, s, r, k, rows = self.n_prompts, self.n_samples, self.max_new_tokens, self.top_logprobs, self.partition_size
        dims = ("prompt", "sample", "response_position", "top_rank")
        return {
            "top_logprob_ids": ArraySpec((n, s, r, k), (rows, s, r, k), "int32", NO_TOKEN, dims, "response"),
            "top_logprobs": ArraySpec((n, s, r, k), (rows, s, r, k), "float32", float("nan"), dims, "response"),
        }

    def _image_specs(self) -> dict[str, ArraySpec]:
        """Each prompt's images (:mod:`daskgen.images`): hash, modality, placeholder span, grid; its mRoPE delta."""
        n, m, rows = self.n_prompts, self.max_images, self.partition_size
        per_image = ("prompt", "image")
        return {
            "image_hash": ArraySpec((n, m), (rows, m), "str", "", per_image, "prompt"),
            "image_modality": ArraySpec((n, m), (rows, m), "str", "", per_image, "prompt"),
            "image_offset": ArraySpec((n, m), (rows, m), "int32", -1, per_image, "prompt"),
            "image_length": ArraySpec((n, m), (rows, m), "int32", 0, per_image, "prompt"),
            "image_grid": ArraySpec((n, m, 3), (rows, m, 3), "int32", 0, (*per_image, "grid_axis"), "prompt"),
            "rope_delta": ArraySpec((n,), (rows,), "int32", 0, ("prompt",), "prompt"),
        }

    def _tool_image_specs(self) -> dict[str, ArraySpec]:
        """Each sample's images returned by its tools (:mod:`daskgen.agents.tool`): hash, modality, placeholder span
        in ``response_ids``, grid (:data:`TOOL_IMAGE_ARRAYS`)."""
        n, s, k, rows = self.n_prompts, self.n_samples, self.tool_images, self.partition_size
        dims = ("prompt", "sample", "tool_image")
        return {
            "tool_image_hash": ArraySpec((n, s, k), (rows, s, k), "str", "", dims, "response"),
            "tool_image_modality": ArraySpec((n, s, k), (rows, s, k), "str", "", dims, "response"),
            "tool_image_offset": ArraySpec((n, s, k), (rows, s, k), "int32", -1, dims, "response"),
            "tool_image_length": ArraySpec((n, s, k), (rows, s, k), "int32", 0, dims, "response"),
            "tool_image_grid": ArraySpec((n, s, k, 3), (rows, s, k, 3), "int32", 0, (*dims, "grid_axis"), "response"),
        }

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


def every_array_layout(columns: tuple[str, ...] = ()) -> Layout:
    """A layout with every array a store can have: each optional field of :class:`Layout` turned on (a flag true,
    a count one above its default: two trajectories, top-1 logprobs) and the kept input ``columns`` (names are per
    store).  A field of another kind raises :class:`TypeError`: a new kind of field is turned on here by hand."""
    changes: dict[str, Any] = {"columns": tuple(columns)}
    for option in fields(Layout):
        if option.name in changes or option.default is MISSING:
            continue
        if isinstance(option.default, bool):
            changes[option.name] = True
        elif isinstance(option.default, int):
            changes[option.name] = option.default + 1
        else:
            raise TypeError(f"Layout field {option.name!r}: every_array_layout does not know how to turn it on")
    return Layout(1, 1, 1, 1, 1, 0, **changes)


#: Worker-written arrays of the plain layout (v1, no verifier).
DATA_ARRAYS = Layout(1, 1, 1, 1, 1, 0).data_arrays()
#: Every array a worker may write, in any layout, but the kept input columns (``column_<name>``: named per store).
WORKER_ARRAYS = every_array_layout().data_arrays()


#: Each sample's tool-returned images (stores of tool-loop runs with ``max_tool_images``), by what they hold: the
#: per-image arrays of a prompt's images with ``tool_`` before their names, spans into ``response_ids``.
TOOL_IMAGE_ARRAYS = (
    "tool_image_hash",
    "tool_image_modality",
    "tool_image_offset",
    "tool_image_length",
    "tool_image_grid",
)


#: The arrays of the top-k logprobs (in stores of runs with ``top_logprobs``).
TOP_LOGPROB_ARRAYS = ("top_logprob_ids", "top_logprobs")


def top_logprob_arrays(layout: Layout) -> tuple[str, ...]:
    """The arrays of the top-k logprobs, when the layout records them."""
    return TOP_LOGPROB_ARRAYS if layout.top_logprobs else ()


def empty_region(layout: Layout, n_rows: int) -> dict[str, np.ndarray]:
    """Fill-valued arrays for ``n_rows`` rows of every data array (string arrays of any length: numpy's
    ``StringDType``, as Zarr reads them)."""
    specs = layout.array_specs()
    return {
        name: np.full((n_rows, *specs[name].shape[1:]), specs[name].fill, dtype=_numpy_dtype(specs[name].dtype))
        for name in layout.data_arrays()
    }


def _numpy_dtype(dtype: str) -> Any:
    """The numpy dtype of a layout dtype (``"str"``: variable-length strings)."""
    return np.dtypes.StringDType() if dtype == "str" else dtype


def clear_response(region: dict[str, np.ndarray], index: tuple[int, ...], layout: Layout) -> None:
    """Reset one sample's (or trajectory's) response arrays in ``region`` to their fill values."""
    for name, spec in layout.array_specs().items():
        if spec.role == "response":
            region[name][index] = spec.fill


#: Each variable's CF ``long_name``.
LONG_NAMES: dict[str, str] = {
    "prompt_index": "row number in the input",
    "prompt_id": "the input's id column",
    "status": "checkpoint: written by the client after the row's data landed",
    "error": "last error of a failed prompt",
    "committed_at": "when the client committed the row",
    "commit_seq": "sequence number of the commit that gave the row its status (0: none, or before commit "
    "sequence numbers were recorded)",
    "prompt_ids": "prompt tokens after the chat template, right-padded",
    "prompt_length": "valid prompt tokens",
    "response_ids": "response tokens, right-padded",
    "response_length": "valid response tokens",
    "response_mask": "1 = token generated by the model",
    "logprobs": "log-probability of each sampled token (NaN where not requested)",
    "top_logprob_ids": "the most likely tokens at each response position, most likely first (-1: none)",
    "top_logprobs": "log-probabilities of top_logprob_ids (NaN: none)",
    "finish_reason": "why the sample ended (-1: not generated)",
    "num_turns": "assistant turns in the trajectory",
    "continued_tokens": "response tokens generated by an interrupted earlier attempt and continued "
    "(0: generated in one go)",
    "cached_prompt_tokens": "prompt tokens the engine served from its prefix cache instead of computing them, summed "
    "over the sample's turns (-1: the engine does not report it)",
    "policy_version": "policy version (daskgen policy publish; 0: the run's model) of the sample's first model "
    "token (-1: no model token)",
    "policy_version_end": "policy version of the sample's last model token (-1: no model token)",
    "version_changed_at": "response position of the first token from another policy version than the first "
    "token's (-1: one version; continued across a refresh otherwise)",
    "policy_fingerprint": "digest of policy_version's published weights as a signed 64-bit integer, stored once "
    "the worker checked its engine's loaded tensors against it (0: version 0, no model token, or unchecked)",
    "policy_fingerprint_end": "digest of policy_version_end's published weights, as policy_fingerprint",
    "response_format": "the row's structured-output format as JSON text ('': none)",
    "adapter": "the name of the LoRA adapter the row was generated with ('': the base model)",
    "image_hash": "SHA-256 of each image's bytes (hex; the image is stored under images/<h[:2]>/<h>; '': no image)",
    "image_modality": "the modality of each item ('image'; '': none)",
    "image_offset": "where each image's placeholder tokens start in prompt_ids (-1: no image)",
    "image_length": "how many placeholder tokens each image has in prompt_ids (0: no image)",
    "image_grid": "each image's grid of patches (t, h, w) as the model's image processor made it",
    "rope_delta": "mRoPE position offset of the tokens after the prompt's images (position = index + rope_delta; "
    "0 without images)",
    "tool_image_hash": "SHA-256 of each image the sample's tools returned (hex; stored as image_hash's are; '': none)",
    "tool_image_modality": "the modality of each tool-returned item ('image'; '': none)",
    "tool_image_offset": "where each tool-returned image's placeholder tokens start in response_ids (-1: none)",
    "tool_image_length": "how many placeholder tokens each tool-returned image has in response_ids (0: none)",
    "tool_image_grid": "each tool-returned image's grid of patches (t, h, w) as the model's image processor made it",
    "score": "verifier score of the sample (NaN: not generated, or the verifier raised)",
    "samples_used": "samples generated for the prompt before it was satisfied",
    "num_trajectories": "trajectories of the sample (the rest of the trajectory axis is padding)",
    "sampling": "the row's own sampling settings as sorted JSON (\"\": the run's settings); the run's "
    "settings fill in the keys it does not set",
    "stop_reason": "which stop ended the sample: index into the row's stop strings then its stop_token_ids; "
    "-2 the model's end-of-sequence token; -1 no stop (see finish_reason)",
}
#: CF attributes beyond the long name: the flags of the coded variables, the units of the commit time.
CODED_ATTRS: dict[str, dict[str, Any]] = {
    "status": {"flag_values": [PENDING, DONE, FAILED], "flag_meanings": "pending done failed"},
    "committed_at": {"units": "seconds since 1970-01-01", "calendar": "proleptic_gregorian"},
    "finish_reason": {"flag_values": FINISH_FLAG_VALUES, "flag_meanings": FINISH_FLAG_MEANINGS},
}
#: Each variable's CF attributes (written into its Zarr attributes when a store is created).
VARIABLE_ATTRS: dict[str, dict[str, Any]] = {
    name: {"long_name": text, **CODED_ATTRS.get(name, {})} for name, text in LONG_NAMES.items()
}


def variable_attrs(name: str) -> dict[str, Any]:
    """The CF attributes of the array ``name`` (a kept input column's name its column)."""
    column = column_name(name)
    if column is not None:
        return {"long_name": f"input column {column!r} (text; JSON for other values; '' until the row is generated)"}
    return VARIABLE_ATTRS[name]
