"""A request's images for vLLM: the decoded images beside the prompt with one placeholder per image.

vLLM's ``TokensPrompt`` takes raw images (``multi_modal_data``) and runs the model's own processor on them in the
engine; for Qwen2-VL it takes no processed pixel values (only vision-tower embeddings), and it expands each image's
placeholder itself, so a prompt whose placeholders are already expanded would be expanded again. The request
therefore goes with its stored prompt's spans collapsed back (:func:`~daskgen.engines.media.collapsed_ids`) and each
image decoded by daskgen's rule (:attr:`~daskgen.engines.media.ImageInput.decoded`: EXIF orientation, alpha over
white, once per image for every sample of its prompt), the pixels the worker's processor saw. vLLM's expansion must
give the stored prompt: :func:`expansion_problem` compares the prompt vLLM reports with the stored one, and a
request whose images vLLM expanded otherwise (another processor setting, e.g. an engine arg ``mm_processor_kwargs``)
fails, naming both lengths.

Some engine args leave vLLM without images; :func:`images_refusal` names them, so the plan refuses an image run
with such args before any engine starts.  Heavy imports (Pillow) happen inside functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from daskgen.engines.base import GenerationRequest
from daskgen.engines.media import collapsed_ids

__all__ = ["expansion_problem", "images_refusal", "multimodal_prompt"]


def images_refusal(engine_args: Mapping[str, Any]) -> dict[str, str]:
    """``{"images": reason}`` when ``engine_args`` turn vLLM's images off (``language_model_only``, or an image
    limit of 0 in ``limit_mm_per_prompt``); else ``{}``."""
    off = []
    if engine_args.get("language_model_only"):
        off.append("engine arg language_model_only=True loads the language model without its vision encoder")
    limit = (engine_args.get("limit_mm_per_prompt") or {}).get("image")
    count = limit.get("count") if isinstance(limit, Mapping) else limit
    if count == 0:
        off.append("engine arg limit_mm_per_prompt allows 0 images per prompt")
    if not off:
        return {}
    return {"images": "; ".join(off) + ": remove it to run prompts with images on the vllm engine"}


def multimodal_prompt(request: GenerationRequest) -> dict[str, Any]:
    """The fields of vLLM's ``TokensPrompt`` for ``request``: its prompt ids, and for a request with images the
    ids with one placeholder per image and the decoded images (``multi_modal_data``); blocking (decodes)."""
    images = request.params.images
    if not images:
        return {"prompt_token_ids": list(request.prompt_ids)}
    return {
        "prompt_token_ids": collapsed_ids(request.prompt_ids, images),
        "multi_modal_data": {"image": [image.decoded for image in images]},
    }


def expansion_problem(request: GenerationRequest, seen: Sequence[int] | None) -> str | None:
    """Why vLLM's prompt ``seen`` (its ``prompt_token_ids``, placeholders expanded) does not hold for a request with
    images (it is not the stored prompt), or ``None``."""
    if not request.params.images or seen is None:
        return None
    stored = list(request.prompt_ids)
    if list(seen) == stored:
        return None
    return (
        f"vLLM's image processor expanded the prompt to {len(seen)} tokens, the stored prompt (the worker's "
        f"processor) has {len(stored)}"
        + (" with other ids" if len(seen) == len(stored) else "")
        + ": vLLM preprocesses images otherwise than the model folder's image processor; drop engine args that "
        "change its processing (mm_processor_kwargs)"
    )
