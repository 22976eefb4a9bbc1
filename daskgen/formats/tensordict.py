"""TensorDict: a block in verl's layout as a ``tensordict.TensorDict`` (``daskgen export --format tensordict``,
``format="tensordict"``), in memory or written block by block into a memory-mapped folder.

The :data:`~daskgen.formats.verl.BATCH_KEYS` fields and the per-sample integers are tensors (indexing keeps them
aligned with the rows); the per-sample strings (``prompt_id``, ``uid``, settings, kept columns, text) are
non-tensor entries.  torch and tensordict are imported only when a TensorDict is built.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from daskgen.formats.verl import VerlParts


def to_tensordict(parts: VerlParts) -> Any:
    """A ``TensorDict`` of the parts: tensors and integers as tensors, strings as non-tensor entries.

    ``uid`` holds the same ids as ``prompt_id``: the one stack of them is set under both names (building a stack
    of per-row strings costs far more than the token fields)."""
    strings = {k: v for k, v in parts.strings.items() if k != "uid"} | parts.objects
    td = attach_non_tensor(tensordict_of(parts.tensors | parts.numbers, len(parts)), strings)
    if len(parts):  # an empty block has no string entries
        td.set("uid", td.get("prompt_id"))
    return td


def write_memmap(parts: Iterable[VerlParts], path: Path, total: int) -> int:
    """Write the parts (``total`` rows in all, at least one part) into a memory-mapped TensorDict folder in bounded
    memory (``TensorDict.load_memmap(path)`` opens it); the rows written."""
    out: Any = None  # the memory-mapped TensorDict, shaped on the first part
    rows = 0
    strings: dict[str, list[str]] = {}
    for part in parts:
        tensors = tensordict_of(part.tensors | part.numbers, len(part))
        if out is None:
            out = tensors[:1].expand(total).memmap_like(str(path), num_threads=0) if total else tensors
        if len(tensors):
            out[rows : rows + len(tensors)] = tensors
        rows += len(tensors)
        for key, values in part.strings.items():
            strings.setdefault(key, []).extend(values.tolist())
    out.unlock_()
    attach_non_tensor(out, strings).memmap_(str(path), num_threads=0)
    return rows


def load_tensordict(path: str | Path) -> Any:
    """Open a tensordict export (memory-mapped: nothing is read until used)."""
    from tensordict import TensorDict

    return TensorDict.load_memmap(str(path))


def tensordict_of(fields: dict[str, np.ndarray], rows: int) -> Any:
    """A ``tensordict.TensorDict`` of ``rows`` rows holding each numpy field as a torch tensor (no copy where the
    array is contiguous)."""
    import torch
    from tensordict import TensorDict

    return TensorDict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in fields.items()}, batch_size=[rows])


def attach_non_tensor(td: Any, non_tensor: dict[str, Any]) -> Any:
    """``td`` with each list of per-row values (strings, lists of strings, dicts) set as a ``NonTensorStack`` (empty
    lists are left out); an array of several dimensions gives each row its list."""
    from tensordict import NonTensorStack

    for key, values in non_tensor.items():
        if len(values):
            rows = values.tolist() if isinstance(values, np.ndarray) and values.ndim > 1 else list(values)
            td.set(key, NonTensorStack.from_list(rows))
    return td
