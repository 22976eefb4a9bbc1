"""Loading a saved checkpoint into the ``transformers`` engine's running model, in place.

:func:`refresh_weights` waits until the continuous-batching manager holds no request, checks the checkpoint
against the model (every saved tensor names a parameter of the same shape; every parameter is saved or tied to
one that is) before changing anything, copies tensor by tensor into the existing parameters (``safetensors``
reads each straight onto the parameter's device: no second copy of the model), then drops the KV blocks the
manager keeps cached for prefix sharing (computed with the old weights).  A checkpoint that does not fit raises
:class:`~daskgen.errors.RefreshError` with the model untouched.  A model that holds LoRA adapters (peft injected
them into its linear layers: the base weight of ``x.q_proj`` is then ``x.q_proj.base_layer.weight``, beside the
adapters' ``lora_A``/``lora_B``) loads the base checkpoint under peft's names and keeps its adapters, which apply
to the new base weights.

A refresh can also stage the checkpoint first (:func:`stage`, while the engine generates): every tensor read into
host memory in its parameter's dtype, fingerprinted there (:func:`~daskgen.engines.fingerprint.fingerprint_tensors`,
the function the engine's own check uses).  :func:`apply_staged` then only copies the staged tensors into the
parameters, and :func:`held_fingerprint` proves the model holds exactly them (the bytes compared, a tensor at a
time): a tensor holding the staged bytes has the staged fingerprint, any other is hashed as it is held.  Staging
holds a second copy of the weights in host memory until the check.  Both loads run while the continuous-batching
loop is parked (the manager's ``pause``) holding no request.  Heavy imports happen inside functions only.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daskgen.errors import RefreshError

__all__ = ["StagedCheckpoint", "apply_staged", "checkpoint_tensors", "held_fingerprint", "refresh_weights", "stage"]

#: The prefix of a ``PeftModel``'s own names for the model it wraps.
PEFT_PREFIX = "base_model.model."
#: How long a refresh waits for the manager to drop the requests the engine cancelled (seconds).
IDLE_TIMEOUT = 60.0


@dataclass(frozen=True)
class StagedCheckpoint:
    """A checkpoint read into host memory (:func:`stage`): its tensors by checkpoint name in their parameters'
    dtypes, each tensor's safetensors dtype code in the files, and their fingerprint in those dtypes."""

    path: str
    tensors: dict[str, Any]
    dtypes: dict[str, str]
    fingerprint: dict[str, str]


def refresh_weights(model: Any, manager: Any, path: str) -> None:
    """Load the safetensors checkpoint in the folder ``path`` into ``model`` (blocking; no request in flight)."""
    files = _checkpoint_files(Path(path))
    params = _base_parameters(model)
    _check_fits(params, _saved_shapes(files), path)
    _while_parked(manager, lambda: _copy(files, params))


def stage(model: Any, path: str) -> StagedCheckpoint:
    """Read the checkpoint in the folder ``path`` into host memory in ``model``'s dtypes, and fingerprint it; a
    checkpoint that does not fit the model raises :class:`~daskgen.errors.RefreshError` (the model untouched)."""
    from safetensors import safe_open

    from daskgen.engines.fingerprint import fingerprint_tensors

    files = _checkpoint_files(Path(path))
    params = _base_parameters(model)
    _check_fits(params, _saved_shapes(files), path)
    tensors, dtypes = {}, {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                dtypes[name] = handle.get_slice(name).get_dtype()
                # a copy: the tensor safetensors returns maps the file, whose bytes may change after the hash
                tensors[name] = handle.get_tensor(name).to(params[name].dtype, copy=True).contiguous()
    return StagedCheckpoint(path, tensors, dtypes, fingerprint_tensors(tensors, dtypes))


def apply_staged(model: Any, manager: Any, staged: StagedCheckpoint) -> float:
    """Copy the staged tensors into ``model``'s parameters, in place (blocking; no request in flight); returns the
    seconds spent waiting for the generation loop to park (:func:`_while_parked`)."""
    import torch

    params = _base_parameters(model)

    def copy() -> None:
        with torch.no_grad():
            for name, tensor in staged.tensors.items():
                params[name].copy_(tensor)

    return _while_parked(manager, copy)


def held_fingerprint(model: Any, staged: StagedCheckpoint | None, dtypes: dict[str, str]) -> dict[str, str]:
    """The fingerprint of each tensor named in ``dtypes`` that ``model`` holds: the staged one where the model's
    tensor holds exactly the staged bytes in the same dtype and shape (``staged`` fingerprinted in the same
    published dtype), the hash of the model's tensor otherwise."""
    from daskgen.engines.fingerprint import fingerprint_tensor

    params, out = _base_parameters(model), {}
    for name, dtype in dtypes.items():
        if name not in params:
            continue
        proved = staged is not None and staged.dtypes.get(name) == dtype
        if proved and _same_bytes(params[name], staged.tensors.get(name)):  # type: ignore[union-attr]
            out[name] = staged.fingerprint[name]  # type: ignore[union-attr]
        else:
            out[name] = fingerprint_tensor(params[name], dtype)
    return out


def _same_bytes(held: Any, staged: Any) -> bool:
    """Whether two tensors have the same dtype, shape and bytes (compared as whole machine words where they
    divide: ``-0.0`` differs from ``0.0`` and a NaN equals itself)."""
    import torch

    if staged is None or held.dtype != staged.dtype or held.shape != staged.shape:
        return False
    a, b = (t.detach().reshape(-1).view(torch.uint8) for t in (held, staged.to(held.device)))
    for word in (torch.int64, torch.int32, torch.int16):
        try:
            return bool(torch.equal(a.view(word), b.view(word)))
        except RuntimeError:  # the byte count or the offset does not divide into these words
            continue
    return bool(torch.equal(a, b))


def _while_parked(manager: Any, work: Callable[[], None]) -> float:
    """Run ``work`` while the manager's generation loop is parked holding no request, then drop the KV blocks it
    keeps cached for prefix sharing (computed with the old weights).  Returns the seconds waited before ``work``:
    mostly the generation step in progress running to its end (a forward pass cannot be interrupted).

    The loop takes the queued requests and cancellations at its pause point and applies them after it: a first
    pause waits until it took them, a second until it applied them (the cancelled requests' blocks freed).  A
    manager without ``pause`` is waited for until it looks idle (:func:`_wait_idle`)."""
    pause, asked = getattr(manager, "pause", None), time.monotonic()
    if pause is None:
        _wait_idle(manager)
        waited = time.monotonic() - asked
        work()
        _evict(manager)
        return waited
    while time.monotonic() < asked + IDLE_TIMEOUT:
        with pause():
            pass
        with pause():
            if not _busy(manager):
                waited = time.monotonic() - asked
                work()
                _evict(manager)
                return waited
        time.sleep(0.01)
    raise RefreshError(f"the transformers engine still held requests after {IDLE_TIMEOUT:g} s; weights not loaded")


def _evict(manager: Any) -> None:
    cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
    if cache is not None:
        cache.evict_cached_blocks()


def _busy(manager: Any) -> bool:
    """Whether the manager holds a request, scheduled or queued."""
    processor = getattr(manager, "batch_processor", None)
    pending = processor is not None and processor.has_pending_requests()
    return bool(pending or not (_empty(manager.cancel_queue) and _empty(manager.input_queue)))


def checkpoint_tensors(model: Any) -> dict[str, Any]:
    """The model's tensors by their names in a plain ``save_pretrained`` checkpoint (what a refresh loads into)."""
    return _base_parameters(model)


def _base_parameters(model: Any) -> dict[str, Any]:
    """The model's parameters and buffers by their names in a plain ``save_pretrained`` checkpoint: LoRA adapters'
    tensors (peft's ``lora_*``) left out, peft's ``.base_layer`` and ``base_model.model.`` parts removed."""
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        parts = name.removeprefix(PEFT_PREFIX).split(".")
        if not any(part.startswith("lora_") for part in parts):
            out[".".join(p for p in parts if p != "base_layer")] = tensor
    return out


def _checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a ``save_pretrained`` folder (sharded or not)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / name for name in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise RefreshError(
        f"policy checkpoint {str(folder)!r} holds no model.safetensors (nor a sharded index): save the weights "
        "with model.save_pretrained(folder) (safetensors, the default)."
    )


def _saved_shapes(files: list[Path]) -> dict[str, tuple[tuple[int, ...], Path]]:
    from safetensors import safe_open

    shapes = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                shapes[name] = (tuple(handle.get_slice(name).get_shape()), file)
    return shapes


def _check_fits(params: dict[str, Any], saved: dict[str, tuple[tuple[int, ...], Path]], path: str) -> None:
    """Refuse a checkpoint whose tensors are not this model's (names, shapes, untied parameters left out)."""
    unknown = sorted(set(saved) - set(params))
    wrong = sorted(n for n, (shape, _) in saved.items() if n in params and tuple(params[n].shape) != shape)
    loaded = {params[n].data_ptr() for n in saved if n in params}
    missing = sorted(n for n in set(params) - set(saved) if params[n].data_ptr() not in loaded)
    if unknown or wrong or missing:
        found = f"unknown tensors {unknown[:3]}, wrong shapes {wrong[:3]}, parameters not saved {missing[:3]}"
        raise RefreshError(
            f"policy checkpoint {path!r} does not fit the running model ({found}); the model keeps its weights. "
            "Publish a checkpoint of the same architecture (the trainer's model.save_pretrained)."
        )


def _wait_idle(manager: Any) -> None:
    """Wait until the manager processed every cancellation and holds no request (its thread frees their blocks).

    Idle means empty queues and no scheduled request on a few checks in a row: the manager's thread moves a
    queue's items into its scheduler in one step and gives no signal when it becomes idle."""
    pause, idle = threading.Event(), 0
    for _ in range(int(IDLE_TIMEOUT / 0.01)):
        idle = 0 if _busy(manager) else idle + 1
        if idle >= 3:
            return
        pause.wait(0.01)
    raise RefreshError(f"the transformers engine still held requests after {IDLE_TIMEOUT:g} s; weights not loaded")


def _empty(q: queue.Queue) -> bool:
    return bool(q.empty())


def _copy(files: list[Path], params: dict[str, Any]) -> None:
    """Copy every saved tensor into its parameter (read onto the parameter's device, one tensor at a time)."""
    import torch
    from safetensors import safe_open

    with torch.no_grad():
        for file in files:
            device = str(next(iter(params.values())).device)
            with safe_open(str(file), framework="pt", device=device) as handle:
                for name in handle.keys():  # noqa: SIM118
                    params[name].copy_(handle.get_tensor(name))
