"""verl's DataProto field layout of a block: the batch fields, the per-sample numbers and strings.

:func:`to_verl` splits a :class:`~daskgen.formats.block.Block` into the three parts every verl-layout format
writes (:mod:`daskgen.formats.tensordict`, :mod:`daskgen.formats.dataproto`): the :data:`BATCH_KEYS` tensors
(left-padded ``prompts``, right-padded ``responses``, masks, positions, logprobs), the per-sample integers
(:data:`VERL_META`, ``stale``) and the per-sample strings (``prompt_id``, ``uid``, the row's settings, kept input
columns, and the export's decoded text and raw prompt); a store with images adds the prompt's image fields
(:func:`~daskgen.formats.images.verl_image_fields`) and, where built, verl's ``multi_modal_data`` and
``multi_modal_inputs`` (:mod:`daskgen.formats.multimodal`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from daskgen.formats.block import Block
from daskgen.formats.images import verl_image_fields
from daskgen.store.layout import NO_TOKEN, SAMPLE_NUMBERS, STALE_FIELD

#: Keys of the verl DataProto ``batch``.
VERL_KEYS = (
    "prompts",
    "responses",
    "response_mask",
    "input_ids",
    "attention_mask",
    "position_ids",
    "rollout_log_probs",
)
#: The top-k logprob fields (when the run recorded them), per response token: ``(rows, response, k)``, ``-1``
#: and ``-inf`` where there is no entry.
TOP_LOGPROB_KEYS = ("top_logprob_ids", "top_logprobs")
#: Keys of the DataProto ``batch`` daskgen builds: verl's and the top-k logprobs.
BATCH_KEYS = (*VERL_KEYS, *TOP_LOGPROB_KEYS)
#: Per-sample integer fields copied as they are (when the block has them).
VERL_META = (
    *("prompt_index", "sample", "trajectory", "num_turns", "finish_reason", "prompt_length", "response_length"),
    *SAMPLE_NUMBERS,  # stop reasons and the policy versions of the sample's tokens (stores that record them)
)
#: Per-sample strings naming the sample's prompt: its id, and ``uid`` (the same id: verl groups a prompt's samples
#: by it, e.g. for GRPO advantages).
ID_KEYS = ("prompt_id", "uid")


@dataclass
class VerlParts:
    """A block in verl's layout: ``tensors`` (the :data:`BATCH_KEYS` present), ``numbers`` (per-sample integers and
    the ``stale`` flag), ``strings`` (per-sample object arrays of ``str``; ``(rows, max_images)`` for the image
    hashes and modalities) and ``objects`` (per-sample Python objects: verl's ``multi_modal_data`` and
    ``multi_modal_inputs`` dicts, when built)."""

    tensors: dict[str, np.ndarray]
    numbers: dict[str, np.ndarray]
    strings: dict[str, np.ndarray]
    objects: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.strings["prompt_id"])

    @classmethod
    def concat(cls, parts: list[VerlParts]) -> VerlParts:
        """The parts of several blocks (of the same widths) as one."""

        def joined(pick: Callable[[VerlParts], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
            return {k: np.concatenate([pick(p)[k] for p in parts]) for k in pick(parts[0])}

        return cls(
            joined(lambda p: p.tensors),
            joined(lambda p: p.numbers),
            joined(lambda p: p.strings),
            joined(lambda p: p.objects),
        )


def widths(block: Block, pad: str) -> tuple[int, int]:
    """The prompt and response widths of ``pad``: the store's (``store``) or the block's longest (``batch``)."""
    if pad == "store":
        return block.store_widths
    longest = [max(int(block[name].max(initial=0)), 1) for name in ("prompt_length", "response_length")]
    return longest[0], longest[1]


def to_verl(block: Block, width: tuple[int, int]) -> VerlParts:
    """The block in verl's layout (see :class:`VerlParts`), tokens padded to ``width`` (prompt, response)."""
    fields = verl_fields(block, *width)
    ids = np.asarray(block["prompt_id"], dtype=object)
    image_numbers, image_strings = verl_image_fields(block)
    strings = {"prompt_id": ids, "uid": ids.copy()} | image_strings | block.external() | block.texts()
    tensors = {k: v for k, v in fields.items() if k in BATCH_KEYS}
    return VerlParts(tensors, {k: v for k, v in fields.items() if k not in BATCH_KEYS} | image_numbers, strings)


def verl_fields(block: Block, prompt_width: int, response_width: int) -> dict[str, np.ndarray]:
    """verl batch fields of one block: left-padded ``prompts``, right-padded ``responses``, masks, positions.

    ``attention_mask`` is 1 on prompt tokens and on every response token (model or tool), 0 on padding;
    ``response_mask`` is 1 only on model-generated tokens; ``position_ids`` count attended tokens from 0.  Token
    fields are int64 as in verl; ``rollout_log_probs`` is float32, 0 where unset; ``top_logprob_ids``/``top_logprobs``
    (when the block has them) are int64/float32, ``-1``/``-inf`` where unset.  The per-sample integers
    (:data:`VERL_META`) come as int64, ``stale`` as bool.
    """
    plen = np.minimum(block["prompt_length"].astype(np.int64), prompt_width)
    rlen = np.minimum(block["response_length"].astype(np.int64), response_width)
    response_attn = np.arange(response_width)[None, :] < rlen[:, None]
    out = _int64_fields(len(plen), prompt_width, response_width)
    prompts, responses, attention = out["prompts"], out["responses"], out["attention_mask"]
    _left_padded(prompts, block["prompt_ids"][:, :prompt_width], plen, block.pad_token_id)
    responses.fill(block.pad_token_id)
    np.copyto(responses, block["response_ids"][:, :response_width], where=response_attn)
    np.concatenate((prompts, responses), axis=1, out=out["input_ids"])
    np.multiply(block.response_mask()[:, :response_width], response_attn, out=out["response_mask"])
    np.greater_equal(np.arange(prompt_width)[None, :], (prompt_width - plen)[:, None], out=attention[:, :prompt_width])
    attention[:, prompt_width:] = response_attn
    _positions(out["position_ids"], prompt_width - plen, plen + rlen)
    return out | _extras(block, response_attn)


def _left_padded(out: np.ndarray, ids: np.ndarray, lengths: np.ndarray, pad: int) -> None:
    """Each row's first ``lengths`` tokens of ``ids`` at the end of its row of ``out``, ``pad`` before them: row ``i``
    is the window at column ``lengths[i]`` of ``ids`` with a row's width of ``pad`` before it."""
    from numpy.lib.stride_tricks import sliding_window_view

    width = out.shape[1]
    wide = np.full((len(ids), 2 * width), pad, dtype=ids.dtype)
    wide[:, width : width + ids.shape[1]] = ids
    out[...] = sliding_window_view(wide, width, axis=1)[np.arange(len(ids)), lengths]


def _int64_fields(rows: int, prompt_width: int, response_width: int) -> dict[str, np.ndarray]:
    """Uninitialised int64 arrays of the token fields, carved from one allocation: the operating system maps
    fresh memory once for the whole batch (not once per field), which is most of the cost of building it."""
    both = prompt_width + response_width
    sizes = {"prompts": prompt_width, "responses": response_width, "response_mask": response_width}
    sizes |= {"input_ids": both, "attention_mask": both, "position_ids": both}
    buffer = np.empty(rows * sum(sizes.values()), dtype=np.int64)
    offsets = np.cumsum([0, *sizes.values()]) * rows
    return {name: buffer[offsets[i] : offsets[i + 1]].reshape(rows, w) for i, (name, w) in enumerate(sizes.items())}


def _positions(out: np.ndarray, first: np.ndarray, attended: np.ndarray) -> np.ndarray:
    """``position_ids`` (into ``out``) of rows whose ``attended`` tokens are contiguous from column ``first``: 0
    before them, counting from 0 over them, the last position after them (the cumulative sum of the attention
    mask, less 1, clipped at 0)."""
    np.subtract(np.arange(out.shape[1], dtype=np.int64)[None, :], first[:, None], out=out)
    np.minimum(out, (attended - 1)[:, None], out=out)
    return np.maximum(out, 0, out=out)


def _extras(block: Block, response_attn: np.ndarray) -> dict[str, np.ndarray]:
    """``rollout_log_probs`` (when recorded; 0 outside the response), the top-k logprobs and the per-sample
    integers, as verl types."""
    extras = {}
    if block.logprobs:
        logprobs = block["logprobs"][:, : response_attn.shape[1]].astype(np.float32)
        extras["rollout_log_probs"] = np.where(response_attn & np.isfinite(logprobs), logprobs, 0.0).astype(np.float32)
    if "top_logprobs" in block:
        extras |= _top_logprob_fields(block, response_attn)
    for name in VERL_META:
        if name in block:
            extras[name] = block[name].astype(np.int64)
    if STALE_FIELD in block:  # a follower with max_staleness: the sample is too stale
        extras[STALE_FIELD] = block[STALE_FIELD].astype(bool)
    return extras


def _top_logprob_fields(block: Block, response_attn: np.ndarray) -> dict[str, np.ndarray]:
    """``top_logprob_ids`` (int64, ``-1`` where unset) and ``top_logprobs`` (float32, ``-inf`` where unset)."""
    width = response_attn.shape[1]
    ids, values = block["top_logprob_ids"][:, :width], block["top_logprobs"][:, :width]
    have = response_attn[..., None] & (ids != NO_TOKEN)
    return {
        "top_logprob_ids": np.where(have, ids, NO_TOKEN).astype(np.int64),
        "top_logprobs": np.where(have, values, -np.inf).astype(np.float32),
    }
