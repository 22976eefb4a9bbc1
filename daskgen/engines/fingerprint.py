"""Fingerprints of the tensors an engine holds (the engine side of :mod:`daskgen.store.fingerprint`).

:func:`tensor_fingerprint` is the one hash of a tensor; :func:`fingerprint_tensors` hashes torch tensors exactly
as ``publish_policy`` hashes the safetensors files: the safetensors dtype code, the shape and the raw bytes, so a
tensor held with the published values in the published dtype has the published fingerprint.  Engines call it on
their own tensors from :meth:`~daskgen.engines.base.Engine.loaded_fingerprint` (the ``transformers`` engine in its
process, the ``vllm`` engine in each vLLM worker).  torch is imported inside :func:`fingerprint_tensor` only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

#: Bytes of a tensor's hash and of a version's digest.
DIGEST_BYTES = 16
#: Safetensors float dtype codes -> torch dtype names.
FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
#: torch dtype names -> safetensors dtype codes (a dtype not listed is hashed under its torch name, so it never
#: matches a published tensor).
SAFETENSORS_CODES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


def tensor_fingerprint(dtype: str, shape: Iterable[int], data: Iterable[memoryview | bytes]) -> str:
    """The fingerprint of one tensor: ``"<dtype>:<hash>"``, the hash over its safetensors ``dtype`` code, ``shape``
    and raw bytes (given in pieces)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(json.dumps([dtype, [int(n) for n in shape]]).encode())
    for piece in data:
        h.update(piece)
    return f"{dtype}:{h.hexdigest()}"


def fingerprint_tensor(tensor: Any, dtype: str | None = None) -> str:
    """The fingerprint of one torch tensor (copied to the CPU, contiguous, when it is not already), in the
    published safetensors ``dtype`` when both are floats and the tensor holds at least as many bits (an engine may
    hold a bfloat16 checkpoint in float32: converting back is exact).  A tensor held in fewer bits (a float32
    checkpoint served in bfloat16 or float16) is hashed as it is held, to be compared with the published tensor
    cast to that dtype (:func:`daskgen.store.fingerprint.checkpoint_fingerprint` records those casts too)."""
    import torch

    data = tensor.detach()
    wanted = FLOAT_DTYPES.get(dtype or "")
    if wanted is not None and data.is_floating_point():
        target = getattr(torch, wanted)
        if data.element_size() >= target.itemsize:
            data = data.to(target)
    name = str(data.dtype).removeprefix("torch.")
    flat = data.to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy() if flat.numel() else b""
    return tensor_fingerprint(SAFETENSORS_CODES.get(name, name), data.shape, [memoryview(raw)])


def fingerprint_tensors(tensors: Mapping[str, Any], dtypes: Mapping[str, str]) -> dict[str, str]:
    """The fingerprint of each tensor named in ``dtypes`` (name -> published safetensors dtype) found in
    ``tensors`` (name -> torch tensor), in its published dtype (:func:`fingerprint_tensor`); the others are left
    out."""
    return {name: fingerprint_tensor(tensors[name], dtype) for name, dtype in dtypes.items() if name in tensors}
