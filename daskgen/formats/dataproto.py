"""verl's ``DataProto``: a block in verl's layout as ``DataProto(batch=..., non_tensor_batch=...)``
(``format="dataproto"``), and a TensorDict export split into the same two parts.

``batch`` holds the :data:`~daskgen.formats.verl.BATCH_KEYS` tensors; ``non_tensor_batch`` holds the per-sample
integers and strings (``prompt_id``, ``uid``, ``num_turns``, ``prompt_index``, ``sample``, settings, kept columns,
...) as numpy arrays (object arrays of ``str`` for the strings).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from daskgen.errors import FollowError
from daskgen.formats.tensordict import tensordict_of
from daskgen.formats.verl import BATCH_KEYS, VerlParts


def to_dataproto(parts: VerlParts) -> Any:
    """A verl ``DataProto`` of the parts (see the module docstring); :class:`FollowError` when verl is missing."""
    try:
        from verl.protocol import DataProto
    except ImportError as exc:
        raise FollowError(
            f"format='dataproto' needs verl ({exc}). Install it with `pip install ray omegaconf` and "
            "`pip install --no-deps verl` (DataProto needs only those), or use format='tensordict'."
        ) from exc
    non_tensor = {k: np.asarray(v) for k, v in (parts.numbers | parts.strings | parts.objects).items()}
    return DataProto(batch=tensordict_of(parts.tensors, len(parts)), non_tensor_batch=non_tensor)


def dataproto_parts(td: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """Split a TensorDict export into verl's ``DataProto(batch=..., non_tensor_batch=...)`` parts: the same keys as
    :func:`to_dataproto` gives a batch (``batch``: the :data:`~daskgen.formats.verl.BATCH_KEYS` tensors; the rest as
    numpy arrays, object arrays of ``str`` for the non-tensor fields)."""
    from tensordict import is_non_tensor

    keys = set(td.keys())
    batch = td.select(*[k for k in BATCH_KEYS if k in keys])
    extra = {}
    for key in keys - set(BATCH_KEYS):
        value = td.get(key)
        extra[key] = np.array(value.tolist(), dtype=object) if is_non_tensor(value) else np.asarray(value.numpy())
    return batch, extra
