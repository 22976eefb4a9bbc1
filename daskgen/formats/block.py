"""The flattened block every format is written from: one entry per generated sample of some rows of a store.

A :class:`Block` holds numpy arrays with one entry per generated (prompt, sample[, trajectory]): per-sample arrays
flattened, per-prompt ones (``prompt_ids``, ``prompt_length``, kept input columns, ...) repeated, plus
``prompt_index``, ``prompt_id``, ``sample`` (and ``trajectory``).  Entries that were never generated
(``finish_reason < 0``: samples a verifier run never needed, padding trajectories) are left out.  The read path
(:mod:`daskgen.formats.read`) builds it from a region of the store; an export may add decoded text and the raw
prompt (``prompt_text``, ``response_text``, ``raw_prompt``) before a format writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from daskgen.store.layout import TEXT_RECORDS, column_name

#: Fields an export adds from outside the store (decoded with the tokenizer, or read from the input file).
EXTERNAL_FIELDS = ("prompt_text", "response_text", "raw_prompt")


@dataclass
class Block:
    """Flattened samples (see the module docstring) and the store facts the formats need to write them.

    Attributes
    ----------
    fields:
        Field name -> one value per sample (the first axis), as read (``response_mask`` may be absent: see
        :meth:`response_mask`).
    logprobs:
        The run recorded per-token log-probabilities (the ``logprobs`` field is then present).
    pad_token_id:
        The token the tensor formats pad with.
    store_widths:
        The store's prompt and response widths (``max_prompt_tokens``, ``max_new_tokens``).
    """

    fields: dict[str, np.ndarray]
    logprobs: bool
    pad_token_id: int
    store_widths: tuple[int, int]

    def __len__(self) -> int:
        return len(self.fields["finish_reason"])

    def __contains__(self, name: object) -> bool:
        return name in self.fields

    def __getitem__(self, name: str) -> np.ndarray:
        return self.fields[name]

    def response_mask(self) -> np.ndarray:
        """``response_mask`` as read, or derived where it was not read (a single-turn run's: every token the
        model's, 1 before each ``response_length``)."""
        if "response_mask" in self.fields:
            return self.fields["response_mask"]
        width = np.arange(self.fields["response_ids"].shape[1])[None, :]
        return (width < self.fields["response_length"][:, None]).astype(np.uint8)

    def texts(self) -> dict[str, np.ndarray]:
        """The per-sample text the store records, by name (object arrays of ``str``): what the row asked for
        (:data:`~daskgen.store.layout.TEXT_RECORDS`: ``sampling``, ``response_format`` as JSON text, the
        ``adapter`` name) and the input's kept columns by their own names."""
        out = {}
        for key, values in self.fields.items():
            name = key if key in TEXT_RECORDS else column_name(key)
            if name is not None:
                out[name] = np.array([str(v) for v in values], dtype=object)
        return out

    def external(self) -> dict[str, np.ndarray]:
        """The fields of :data:`EXTERNAL_FIELDS` the block carries (object arrays of ``str``)."""
        return {
            name: np.array([str(v) for v in self.fields[name]], dtype=object)
            for name in EXTERNAL_FIELDS
            if name in self
        }


def flatten_samples(sub: Any) -> dict[str, np.ndarray]:
    """Numpy arrays with one entry per (prompt, sample[, trajectory]) of a computed ``xarray.Dataset`` of rows.

    Per-sample variables are flattened, per-prompt ones (``prompt_ids``, ``prompt_length``, ``prompt_index``,
    ``prompt_id``) repeated; ``sample`` (and ``trajectory`` in schema-v2 stores) number the entries.  Only
    generated entries are kept (``finish_reason >= 0``).  Needs ``finish_reason`` in ``sub``.
    """
    lead = ["prompt", "sample", "trajectory"][: 3 if "trajectory" in sub.dims else 2]
    variables = {}
    for name, var in sub.variables.items():
        ordered = var.transpose(*lead, ...) if set(lead) <= set(var.dims) else var
        variables[str(name)] = (ordered.dims, ordered.values)
    return flatten_arrays(variables, dict(sub.sizes))


def flatten_arrays(variables: dict[str, tuple[Any, np.ndarray]], sizes: dict[Any, int]) -> dict[str, np.ndarray]:
    """:func:`flatten_samples` of ``name -> (dims, values)`` (per-sample arrays with their dimensions ``prompt``,
    ``sample`` [, ``trajectory``] first) and the dimension ``sizes``: no copy of a per-sample array when every
    entry was generated."""
    n, s = sizes["prompt"], sizes["sample"]
    t = sizes.get("trajectory", 1)
    lead = ["prompt", "sample", "trajectory"][: 3 if "trajectory" in sizes else 2]
    out: dict[str, np.ndarray] = {}
    for name, (dims, values) in variables.items():
        flat = _flat_values(name, tuple(dims), values, lead, n * s * t, s * t)
        if flat is not None:
            out[name] = flat
    out |= _entry_numbers(n, s, t, "trajectory" in sizes)
    keep = out["finish_reason"] >= 0
    return out if keep.all() else {k: v[keep] for k, v in out.items()}


def _flat_values(
    name: str, dims: tuple[Any, ...], values: np.ndarray, lead: list[str], entries: int, per_prompt: int
) -> np.ndarray | None:
    """One variable as one value per entry: per-sample ones flattened over ``lead``, per-prompt ones repeated
    ``per_prompt`` times; ``None`` for other variables (coordinates of other axes, ``num_trajectories``)."""
    if tuple(dims[: len(lead)]) == tuple(lead) and name != "num_trajectories":
        return values.reshape(entries, *values.shape[len(lead) :])
    if dims and dims[0] == "prompt" and "sample" not in dims:
        values = values.astype(object) if values.dtype.kind in "TUO" else values
        return np.repeat(values, per_prompt, axis=0)
    return None


def _entry_numbers(n: int, s: int, t: int, has_trajectories: bool) -> dict[str, np.ndarray]:
    """``sample`` (and ``trajectory``) numbers of the entries of ``n`` prompts x ``s`` samples x ``t`` trajectories."""
    numbers = {"sample": np.tile(np.repeat(np.arange(s), t), n)}
    if has_trajectories:
        numbers["trajectory"] = np.tile(np.arange(t), n * s)
    return numbers
