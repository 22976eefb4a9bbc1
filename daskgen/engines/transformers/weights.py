"""Loading a saved checkpoint into the ``transformers`` engine's running model, in place.

:func:`refresh_weights` waits until the continuous-batching manager holds no request, checks the checkpoint
against the model (every saved tensor names a parameter of the same shape; every parameter is saved or tied to
one that is) before changing anything, copies tensor by tensor into the existing parameters (``safetensors``
reads each straight onto the parameter's device: no second copy of the model), then drops the KV blocks the
manager keeps cached for prefix sharing (computed with the old weights).  A checkpoint that does not fit raises
:class:`~daskgen.errors.RefreshError` with the model untouched.  A model that holds LoRA adapters (peft injected
them into its linear layers: the base weight of ``x.q_proj`` is then ``x.q_proj.base_layer.weight``, beside the
adapters' ``lora_A``/``lora_B``) loads the base checkpoint under peft's names and keeps its adapters, which apply
to the new base weights.  Heavy imports happen inside functions only.
"""

from __future__ import annotations

import json
import queue
import threading
from pathlib import Path
from typing import Any

from daskgen.errors import RefreshError

__all__ = ["checkpoint_tensors", "refresh_weights"]

#: The prefix of a ``PeftModel``'s own names for the model it wraps.
PEFT_PREFIX = "base_model.model."
#: How long a refresh waits for the manager to drop the requests the engine cancelled (seconds).
IDLE_TIMEOUT = 60.0


def refresh_weights(model: Any, manager: Any, path: str) -> None:
    """Load the safetensors checkpoint in the folder ``path`` into ``model`` (blocking; no request in flight)."""
    files = _checkpoint_files(Path(path))
    params = _base_parameters(model)
    saved = _saved_shapes(files)
    _check_fits(params, saved, path)
    _wait_idle(manager)
    _copy(files, params)
    cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
    if cache is not None:
        cache.evict_cached_blocks()


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
        processor = getattr(manager, "batch_processor", None)
        pending = processor is not None and processor.has_pending_requests()
        idle = 0 if pending or not (_empty(manager.cancel_queue) and _empty(manager.input_queue)) else idle + 1
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
