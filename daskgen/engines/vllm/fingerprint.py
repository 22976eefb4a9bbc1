"""The ``vllm`` engine's loaded fingerprint: read from the model in every vLLM worker process.

vLLM mixes :class:`FingerprintExtension` into its worker class (its ``worker_extension_cls`` engine arg, set by
the engine unless the user set another class); :func:`loaded_fingerprint` calls its
:meth:`~FingerprintExtension.daskgen_fingerprint` on every worker through ``AsyncLLM.collective_rpc`` (by name:
no code is sent to vLLM's processes).  Each worker hashes its model's named parameters and buffers
(:func:`daskgen.engines.fingerprint.fingerprint_tensors`).  vLLM fuses some checkpoint tensors (``qkv_proj``,
``gate_up_proj``): their names are not its own and are left out; a tensor split over tensor-parallel ranks hashes
differently on each rank and is left out too (only a name every rank holds with one hash is kept).  On a CPU, vLLM
packs the weights of its linear layers into its kernels' own layout and leaves their parameters empty: an empty
parameter is left out, so on a CPU the embeddings, the norms and ``lm_head`` are compared.
"""

from __future__ import annotations

from typing import Any

#: The engine arg value that mixes :class:`FingerprintExtension` into vLLM's workers.
EXTENSION = f"{__name__}.FingerprintExtension"


class FingerprintExtension:
    """Mixed into each vLLM worker (``worker_extension_cls``): the fingerprint of the tensors its model holds."""

    def daskgen_fingerprint(self, dtypes: dict[str, str]) -> dict[str, str]:
        """The fingerprint of each tensor named in ``dtypes`` (name -> published dtype) among the worker model's
        parameters and buffers."""
        from daskgen.engines.fingerprint import fingerprint_tensors

        model: Any = self.get_model()  # type: ignore[attr-defined]
        held = {**dict(model.named_buffers()), **dict(model.named_parameters())}
        return fingerprint_tensors({name: t for name, t in held.items() if t.numel()}, dtypes)


def with_extension(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``AsyncLLM`` kwargs with :class:`FingerprintExtension` mixed in (unchanged when the user set a class)."""
    return kwargs if kwargs.get("worker_extension_cls") else {**kwargs, "worker_extension_cls": EXTENSION}


def agreed(per_worker: list[dict[str, str]]) -> dict[str, str]:
    """The fingerprints every worker reports alike (a tensor sharded over ranks differs per rank: left out)."""
    if not per_worker:
        return {}
    first, *others = per_worker
    return {name: value for name, value in first.items() if all(o.get(name) == value for o in others)}
