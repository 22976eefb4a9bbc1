"""The ``sglang`` engine's loaded fingerprint: each tensor read back through sglang's ``get_weights_by_name``.

sglang hands a parameter back as float32 values (a nested list, its first ``truncate_size`` rows: daskgen asks for
every row), mapping a checkpoint name it fuses (``q_proj`` into ``qkv_proj``, ``gate_proj`` into ``gate_up_proj``)
to its part of the fused tensor itself, so every checkpoint tensor is compared.  The values are converted back to
the published dtype (exact when the engine holds that dtype: float32 holds every bfloat16 and float16 value) and
hashed as the publisher hashed the file (:func:`daskgen.engines.fingerprint.fingerprint_tensor`).  A name sglang
does not know (it returns nothing) is left out; a non-float dtype is left out too.  sglang cuts ``q_proj``,
``k_proj`` and ``v_proj`` out of the fused tensor with a head width of ``hidden_size / num_attention_heads``: for a
model whose config sets another ``head_dim`` those three are left out (:func:`unsliceable`).  Reading a tensor this way
copies it into Python lists: it costs about as much as loading the model once more.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

#: Rows asked of ``get_weights_by_name`` (its ``truncate_size``): all of them.
ALL_ROWS = sys.maxsize


def fingerprint_of_values(values: Any, dtype: str) -> str | None:
    """The fingerprint of a tensor sglang returned as float32 ``values``, in the published ``dtype`` (``None``:
    no values, or a dtype that is not a float)."""
    import torch

    from daskgen.engines.fingerprint import FLOAT_DTYPES, fingerprint_tensor

    if values is None or dtype not in FLOAT_DTYPES:
        return None
    return fingerprint_tensor(torch.tensor(values, dtype=torch.float32), dtype)


#: The checkpoint names sglang cuts out of its fused ``qkv_proj``.
QKV_PARTS = (".q_proj.", ".k_proj.", ".v_proj.")


def unsliceable(model: str) -> tuple[str, ...]:
    """The name parts sglang cannot cut out of its fused tensors for the model folder ``model``: the q/k/v
    projections when its config sets a ``head_dim`` other than ``hidden_size / num_attention_heads``."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
        head_dim, width = config.get("head_dim"), config["hidden_size"] // config["num_attention_heads"]
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return ()
    return QKV_PARTS if head_dim not in (None, width) else ()
