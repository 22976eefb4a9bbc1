"""Requests with images to a vLLM server: vLLM's tokens-in API, ``POST /inference/v1/generate``.

vLLM's ``/v1/completions`` takes no images beside a prompt of token ids; its tokens-in API does (served when ``vllm
serve`` runs with ``--enable-scale-out``). A request goes with its stored prompt's image spans collapsed to one
placeholder each (:func:`~daskgen.engines.media.collapsed_ids`) and each image as ``content_parts`` (a PNG ``data:``
URL of the pixels the worker decoded, :attr:`~daskgen.engines.media.ImageInput.png_data_url`, so the server's image
processor gets exactly those pixels whatever its own decoding does); vLLM's sampling parameters are those the
in-process ``vllm`` engine uses (:func:`~daskgen.engines.vllm.mapping.vllm_sampling_kwargs`). The first streamed chunk
carries the prompt vLLM expanded (``return_token_ids``): it must be the stored prompt, else the request fails
(:class:`ExpansionMismatch`). Each chunk carries the new token ids and, when asked, their logprobs and top-k
alternatives by token id.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from daskgen.engines.base import GenerationRequest
from daskgen.engines.media import collapsed_ids
from daskgen.engines.vllm.images import expansion_problem
from daskgen.engines.vllm.mapping import vllm_sampling_kwargs

__all__ = [
    "GENERATE_PATH",
    "SCALE_OUT_HINT",
    "ExpansionMismatch",
    "first_choice",
    "generate_payload",
    "take_generate_event",
]

#: vLLM's tokens-in endpoint.
GENERATE_PATH = "/inference/v1/generate"
#: What a server that does not serve :data:`GENERATE_PATH` needs.
SCALE_OUT_HINT = (
    f"images go to a vLLM server through {GENERATE_PATH}, which `vllm serve` serves when started with "
    "--enable-scale-out; restart the server with it"
)


class ExpansionMismatch(Exception):
    """vLLM expanded a request's image placeholders to another prompt than the stored one."""


def generate_payload(
    model_name: str | None, request: GenerationRequest, extra_body: dict[str, Any], urls: Sequence[str]
) -> dict[str, Any]:
    """The streaming ``/inference/v1/generate`` body of a request with images, ``urls`` their
    :func:`~daskgen.engines.media.data_urls` (its LoRA adapter is the served model it names); ``extra_body`` goes
    into vLLM's sampling parameters, as it goes into ``/v1/completions`` bodies."""
    return {
        "model": request.params.adapter or model_name,
        "token_ids": collapsed_ids(request.prompt_ids, request.params.images),
        "content_parts": [{"type": "image_url", "url": url} for url in urls],
        "sampling_params": {**vllm_sampling_kwargs(request.params), **extra_body},
        "stream": True,
        "return_token_ids": True,
        "output_mode": "tokens",
    }


def first_choice(event: dict[str, Any]) -> tuple[dict[str, Any] | None, list[int]]:
    """A streamed chunk's first choice and the token ids it adds (vLLM's completions and tokens-in chunks alike)."""
    choices = event.get("choices") or []
    if not choices:
        return None, []
    return choices[0], [int(t) for t in choices[0].get("token_ids") or []]


def take_generate_event(
    request: GenerationRequest,
    event: dict[str, Any],
    ids: list[int],
    logprobs: list[float],
    top: list[list[tuple[str, float]]],
) -> str | None:
    """Add one streamed chunk's token ids (logprobs, top-k alternatives named ``token_id:<id>``) to ``ids``,
    ``logprobs``, ``top``; return its finish reason.  Raises :class:`ExpansionMismatch` when the chunk reports a
    prompt other than the stored one."""
    problem = expansion_problem(request, event.get("prompt_token_ids"))
    if problem is not None:
        raise ExpansionMismatch(problem.replace("vLLM's", "the vLLM server's", 1))
    choice, new = first_choice(event)
    if choice is None:
        return None
    ids += new
    content: Sequence[dict[str, Any]] = (
        ((choice.get("logprobs") or {}).get("content") or [])[-len(new) :] if new else []
    )
    for entry in content:
        logprobs.append(float(entry["logprob"]))
        top.append([(f"token_id:{int(a['token_id'])}", float(a["logprob"])) for a in entry.get("top_logprobs") or []])
    return choice.get("finish_reason")
