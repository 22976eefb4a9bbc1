"""Images over SGLang's native ``POST /generate`` (the ``openai`` engine's managed sglang server).

JSON carries no tensors, so a server gets each image as the pixels the worker decoded (a PNG ``data:`` URL in
``image_data``, :attr:`~daskgen.engines.media.ImageInput.png_data_url`: whatever the server's own decoding does with
EXIF orientation or transparency, it reads those pixels) and runs the model's image processor itself. The prompt
goes with one placeholder token per image, each image's expanded span collapsed back
(:func:`~daskgen.engines.media.collapsed_ids`): sglang 0.5.23 expands placeholders itself and does not take expanded
ones beside raw images (such a request never returns). sglang's expansion must give the prompt the store records:
:func:`expansion_problem` compares the server's prompt length with the stored prompt's and fails the request when
they differ. Only a managed server takes images (:func:`managed_refusals` refuses them for a managed server spoken
to by another protocol than the native one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from daskgen.engines.base import GenerationRequest
from daskgen.engines.media import collapsed_ids
from daskgen.engines.sglang.args import lora_refusal
from daskgen.engines.sglang.images import images_refusal

__all__ = ["expansion_problem", "image_fields", "managed_refusals"]

#: The ``api`` values that reach a managed server's native ``/generate`` (the only protocol that sends images).
NATIVE_APIS = ("auto", "sglang")


def image_fields(request: GenerationRequest, urls: Sequence[str]) -> dict[str, Any]:
    """``input_ids`` and ``image_data`` of a ``/generate`` body for a request with images, ``urls`` their
    :func:`~daskgen.engines.media.data_urls` (``{}`` without images)."""
    if not request.params.images:
        return {}
    return {"input_ids": collapsed_ids(request.prompt_ids, request.params.images), "image_data": list(urls)}


def expansion_problem(request: GenerationRequest, out: Mapping[str, Any]) -> str | None:
    """Why the server's answer to a request with images does not hold (it expanded the images to another prompt
    length than the stored one), or ``None``."""
    if not request.params.images:
        return None
    seen = (out.get("meta_info") or {}).get("prompt_tokens")
    if seen == len(request.prompt_ids):
        return None
    return (
        f"the server's image processor expanded the prompt to {seen} tokens, the stored prompt (the worker's "
        f"processor) has {len(request.prompt_ids)}: the server preprocesses images otherwise than the model folder's "
        "image processor; give the server the folder's processor settings"
    )


def managed_refusals(engine_args: Mapping[str, Any], cuda_available: Callable[[], bool]) -> dict[str, str]:
    """What a managed sglang server (``managed: true``) cannot serve with ``engine_args``: LoRA on a CPU device,
    images under server args that turn them off or through another protocol than the native one; ``{}`` for
    someone else's server."""
    if engine_args.get("managed") is not True:
        return {}
    server_args = engine_args.get("server_args") or {}
    refused = {**lora_refusal(server_args, cuda_available), **images_refusal(server_args)}
    api = engine_args.get("api", "auto")
    if api not in NATIVE_APIS:
        refused.setdefault("images", f"api={api!r} sends text; images go only through sglang's native /generate "
                           "(api: sglang or auto)")  # fmt: skip
    return refused
